"""Per-request states of linear-attention layers (Gated DeltaNet), and a step's view of them.

Per request and layer the state is a conv state (the last `conv_kernel - 1` inputs of the causal
depthwise conv) and a recurrent state S [value heads, key dim, value dim], kept in a slot the driver
allocated (`StepPlan.state_slots`).

Speculative verification runs 1 + K rows that may be rejected, and a recurrent state cannot be
rolled back by position. So for a request that verifies drafts the committed state is left as it
was and the state after each row is kept as a candidate; the next plan names the candidate to commit
(`state_commit`: the accepted count), and every stage commits it before running the request again.

On a GPU the layer's kernels keep the states in place instead of calling `commit_candidates` and
`store` (`kernels/causal_conv.py`, `kernels/delta_rule_recurrent.py`): a request's committed state
is read from the candidate its plan commits, else from its slot, and only lines that commit at once
write the slot. That is the same state because a verify step is always followed, on the request's
next run, by a plan that commits one of its candidates (`Scheduler` sets `state_commit` after every
verify step; a preempted request restarts from zeros or a restored snapshot).

Nothing here reads a device tensor back to the host: what the code must branch on (the widest line,
whether any request verifies, runs plainly or commits) comes from the host plan as `LinearFlags`, so
a steady step, where every request verifies, runs inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class StateShape:
    conv_dim: int
    conv_width: int          # conv_kernel - 1 past inputs
    heads: int
    key_dim: int
    value_dim: int


@dataclass
class LinearState:
    """One layer's states for every slot: committed, and a candidate after each verify row."""

    conv: torch.Tensor        # [slots, conv_width, conv_dim]
    rec: torch.Tensor         # float32 [slots, heads, key_dim, value_dim]
    cand_conv: torch.Tensor   # [slots, rows, conv_width, conv_dim]
    cand_rec: torch.Tensor    # float32 [slots, rows, heads, key_dim, value_dim]


def allocate_states(shapes: list[StateShape], slots: int, rows: int, dtype: torch.dtype, device) -> list[LinearState]:
    # zeros: a slot is reset by its request's first row (position 0) anyway, but zeros keep unused
    # slots finite
    out = []
    for s in shapes:
        out.append(LinearState(
            torch.zeros(slots, s.conv_width, s.conv_dim, dtype=dtype, device=device),
            torch.zeros(slots, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device),
            torch.zeros(slots, rows, s.conv_width, s.conv_dim, dtype=dtype, device=device),
            torch.zeros(slots, rows, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device)))
    return out


def state_bytes(shapes: list[StateShape], slots: int, rows: int, dtype: torch.dtype) -> int:
    """What `allocate_states` takes: committed plus `rows` candidates per slot (rows 0: what
    `StateSnapshots.allocate` takes for `slots` snapshots)."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(slots * (1 + rows) * (s.conv_width * s.conv_dim * item + s.heads * s.key_dim * s.value_dim * 4)
               for s in shapes)


@dataclass
class StateSnapshots:
    """Prefix-cache snapshots of every local linear-attention layer's committed state, in slots the
    driver allocates (`StepPlan.state_snapshots` names them): a request's state at a block-aligned
    prompt position, restored into another request's state slot when its prompt starts the same."""

    conv: list[torch.Tensor]  # per layer [snapshots, conv_width, conv_dim]
    rec: list[torch.Tensor]   # per layer float32 [snapshots, heads, key_dim, value_dim]

    @classmethod
    def allocate(cls, shapes: list[StateShape], n: int, dtype: torch.dtype, device) -> "StateSnapshots":
        return cls([torch.zeros(n, s.conv_width, s.conv_dim, dtype=dtype, device=device) for s in shapes],
                   [torch.zeros(n, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device)
                    for s in shapes])

    def restore(self, states: list[LinearState], snapshots: torch.Tensor, slots: torch.Tensor) -> None:
        """Snapshot snapshots[i] into state slot slots[i] (int64 index tensors on the states' device)."""
        for state, conv, rec in zip(states, self.conv, self.rec):
            state.conv[slots] = conv[snapshots]
            state.rec[slots] = rec[snapshots]

    def save(self, states: list[LinearState], slots: torch.Tensor, snapshots: torch.Tensor) -> None:
        """State slot slots[i]'s committed state into snapshot snapshots[i]."""
        for state, conv, rec in zip(states, self.conv, self.rec):
            conv[snapshots] = state.conv[slots]
            rec[snapshots] = state.rec[slots]


@dataclass(frozen=True)
class LinearFlags:
    """What the host plan says about a step's lines, so the device is never asked."""

    width: int        # most rows of one request
    verify: bool      # some request verifies drafts: keep a candidate per row
    plain: bool       # some request commits its final state at once (prefill chunk, plain decode)
    commits: bool     # some request adopts a candidate before running

    @classmethod
    def of(cls, max_query_len: int, commit: torch.Tensor, num_drafts: torch.Tensor) -> "LinearFlags":
        """From the host plan's per-request commit and draft counts."""
        drafts = num_drafts.numpy()
        return cls(max_query_len, bool((drafts > 0).any()), bool((drafts == 0).any()),
                   bool((commit.numpy() >= 0).any()))

    @classmethod
    def steady(cls, num_spec_tokens: int, mixed_k: bool = False) -> "LinearFlags":
        """A CUDA graph's step: every request verifies its K drafts and any may commit (a masked
        commit), or, without speculation, every request decodes one row plainly. With adaptive K
        (`mixed_k`) a K = 0 step may follow a verify step, so it may commit too."""
        k = num_spec_tokens
        return cls(1 + k, verify=k > 0, plain=k == 0, commits=k > 0 or mixed_k)


@dataclass
class LinearMeta:
    """A step's requests as padded lines of rows, with their slots: built once per step from the plan."""

    rows: torch.Tensor        # int64 [B, L] flat row of each padded position (pad: 0)
    valid: torch.Tensor       # bool [B, L]
    lengths: torch.Tensor     # int64 [B]
    line: torch.Tensor        # int64 [T] each flat row's line (request), and its place in it:
    offset: torch.Tensor      # int64 [T]   the inverse of `rows`
    slots: torch.Tensor       # int64 [B]
    fresh: torch.Tensor       # bool [B] the request starts here (position 0): zero state
    commit: torch.Tensor      # int64 [B] candidate to commit before running (-1: none)
    candidates: torch.Tensor  # bool [B] the request verifies drafts: keep a candidate per row
    settles: torch.Tensor     # bool [B] its line commits its final state at once (~candidates)
    flags: LinearFlags
    states: list[LinearState]  # per local linear-attention layer

    @classmethod
    def build(cls, query_start_loc, positions, slots, commit, num_drafts, states, flags: LinearFlags) -> "LinearMeta":
        starts, lengths = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
        off = torch.arange(flags.width, device=positions.device)
        valid = off[None, :] < lengths[:, None]
        rows = torch.where(valid, starts[:, None] + off[None, :], torch.zeros_like(valid, dtype=torch.int64))
        line = row_lines(query_start_loc, positions.shape[0])
        offset = torch.arange(positions.shape[0], device=positions.device) - starts[line]
        fresh = positions[starts] == 0
        verifies = num_drafts > 0
        return cls(rows, valid, lengths, line, offset, slots, fresh, commit, verifies, ~verifies, flags, states)

    def _pick(self, verifying: bool):
        """Index of the requests that verify (or not): every request when the flags say all do."""
        f = self.flags
        if verifying:
            return slice(None) if not f.plain else self.candidates
        return slice(None) if not f.verify else ~self.candidates

    def commit_candidates(self, state: LinearState) -> None:
        """Adopt each request's accepted candidate from its last verify step (named by the plan)."""
        if not self.flags.commits:
            return
        adopt, row = self.commit >= 0, self.commit.clamp(min=0)
        s = self.slots
        state.conv[s] = torch.where(adopt[:, None, None], state.cand_conv[s, row], state.conv[s])
        state.rec[s] = torch.where(adopt[:, None, None, None], state.cand_rec[s, row], state.rec[s])

    def store(self, state: LinearState, inputs: torch.Tensor, final: torch.Tensor, after: torch.Tensor | None) -> None:
        """inputs [B, w + L, C]: the conv's past inputs then each line's; final: the recurrent state
        after each line; after [B, L, ...]: after each row (verifying lines)."""
        w = inputs.shape[1] - self.flags.width
        if self.flags.plain:                    # prefill chunks, plain decode: commit at once
            p = self._pick(verifying=False)
            idx = self.lengths[p][:, None] + torch.arange(w, device=inputs.device)[None, :]
            state.conv[self.slots[p]] = inputs[p].gather(1, idx[..., None].expand(-1, -1, inputs.shape[-1]))
            state.rec[self.slots[p]] = final[p]
        if self.flags.verify:                   # verify lines: the state after each row, kept aside
            c = self._pick(verifying=True)
            n = min(after.shape[1], state.cand_rec.shape[1])
            windows = inputs[c].unfold(1, w, 1)[:, 1:n + 1].transpose(-1, -2)   # after row j: inputs j+1 .. j+w
            state.cand_conv[self.slots[c], :n] = windows
            state.cand_rec[self.slots[c], :n] = after[c][:, :n]


def row_lines(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [num_rows]: each flat row's request (line), from the lines' start offsets; no host read."""
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                   output_size=num_rows)
