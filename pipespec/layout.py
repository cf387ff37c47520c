"""StepLayout: the geometry of one step, worked out once from the plan and read by every part of a stage.

The target slice reads the query rows; the verifier reads which rows make logits and the draft ids
they check; the drafter reads the ids shifted left by one and each sampling request's block table.
Nothing else in the stage derives rows from the plan, so the verify/draft geometry lives here alone.

K (`num_spec_tokens`) is the number of draft tokens; a verifying request runs 1 + K query rows: its
last accepted token, then its K drafts (fewer near max_model_len, then padded by repeating a row).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np
import torch

from pipespec.plan import StepPlan


@dataclass(frozen=True)
class StepLayout:
    num_spec_tokens: int
    # the query rows, as the target slice reads them
    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    slot_mapping: torch.Tensor     # int64 [T]
    query_start_loc: torch.Tensor  # int64 [B + 1]
    seq_lens: torch.Tensor         # int64 [B]
    block_tables: torch.Tensor     # int64 [B, W]
    max_query_len: int             # known on the host, so attention metadata needs no device read
    # the verifier's view: one line of 1 + K rows per sampling request
    sample_rows: torch.Tensor      # int64 [S] requests (indices into B) that sample
    verify_rows: torch.Tensor      # int64 [S, 1 + K] last non-draft row, then its draft rows
    num_drafts: torch.Tensor       # int64 [S] real drafts in each line
    draft_ids: torch.Tensor        # int64 [S, K] the draft ids those rows embedded
    # the drafter's view
    mtp_input_ids: torch.Tensor    # int64 [T] each row's next token where known (the sampled one is
                                   # filled in after verification)
    # linear-attention layers' view (per request, [B]): state slot, candidate to commit, draft rows
    state_slots: torch.Tensor | None = None
    state_commit: torch.Tensor | None = None
    req_num_drafts: torch.Tensor | None = None
    req_real_drafts: torch.Tensor | None = None    # [B] real drafts among them (CUDA graphs upload it)
    # async scheduling, per request [B]: the previous result's row whose sampled token (and drafts,
    # and accepted count) its line takes (-1: input_ids holds them); None when no request's does (`carry_in`)
    carried: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_samplers(self) -> int:
        return int(self.sample_rows.shape[0])

    @property
    def first_positions(self) -> torch.Tensor:
        """int64 [S] position of each line's first row (the last accepted token)."""
        return self.positions[self.verify_rows[:, 0]]

    @classmethod
    def from_plan(cls, plan: StepPlan, num_spec_tokens: int) -> "StepLayout":
        """The layout of a host plan, on the host (`to` moves it). Worked out with numpy on the
        plan's memory: a step pays this on the host, ~5x less than with torch ops on tiny tensors."""
        k = num_spec_tokens
        qsl, samplers = plan.query_start_loc.numpy(), plan.sample_rows.numpy()
        drafts = plan.num_drafts.numpy()[samplers]                 # draft rows: the geometry
        real = plan.real_drafts.numpy()[samplers]                  # real drafts: what verification reads
        if len(drafts) and drafts.max() > k:
            raise ValueError(f"step {plan.step_id} verifies {int(drafts.max())} drafts of a request, more than "
                             f"its K={k}")
        if (real > drafts).any() or (real < 0).any():
            raise ValueError(f"step {plan.step_id} has more real drafts than draft rows in a line")
        first = qsl[samplers + 1] - 1 - drafts                   # each sampler's last non-draft row
        verify_rows = first[:, None] + np.minimum(np.arange(k + 1)[None, :], drafts[:, None])
        ids = plan.input_ids.numpy()
        return cls(num_spec_tokens=k, input_ids=plan.input_ids, positions=plan.positions,
                   slot_mapping=plan.slot_mapping, query_start_loc=plan.query_start_loc,
                   seq_lens=plan.seq_lens, block_tables=plan.block_tables,
                   max_query_len=int((qsl[1:] - qsl[:-1]).max()) if len(qsl) > 1 else 0,
                   sample_rows=plan.sample_rows, verify_rows=torch.from_numpy(verify_rows),
                   num_drafts=torch.from_numpy(real), draft_ids=torch.from_numpy(ids[verify_rows[:, 1:]]),
                   mtp_input_ids=torch.from_numpy(_shift_left(ids, qsl, plan.next_token_ids.numpy())),
                   state_slots=plan.state_slots, state_commit=plan.state_commit, req_num_drafts=plan.num_drafts,
                   req_real_drafts=plan.real_drafts, carried=plan.carried)

    def to(self, device: torch.device) -> "StepLayout":
        if device.type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return StepLayout(**moved)

    def carried_in(self, carry: "Carry", block_size: int, fill=None) -> "StepLayout":
        """This device layout with `carry_in` (or `fill`, the same in one kernel) applied to copies of
        its tensors (on the CPU `to` keeps the plan's own), and the verifier's draft ids read back
        from the rows it filled."""
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "mtp_input_ids", "state_commit")
        out = dataclasses.replace(self, **{n: getattr(self, n).clone() for n in names if getattr(self, n) is not None})
        (fill or carry_in)(out, carry, row_lines(self.query_start_loc, self.input_ids.shape[0]), block_size)
        return dataclasses.replace(out, draft_ids=out.input_ids[self.verify_rows[:, 1:]])

    def draft_rows_of_input(self) -> torch.Tensor:
        """The ids stage 0 embeds at draft rows, in verify order [S, K] (-1 where no draft): for the
        I4 trace, compared with what the last stage verifies."""
        k = self.num_spec_tokens
        real = torch.arange(k, device=self.draft_ids.device)[None, :] < self.num_drafts[:, None]
        return torch.where(real, self.draft_ids, torch.full_like(self.draft_ids, -1))


def row_lines(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [num_rows]: each flat row's request (line), from the lines' start offsets; no host read."""
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                   output_size=num_rows)


@dataclass(frozen=True)
class Carry:
    """Async scheduling: what each row of the last sampling step's result leaves, on the device, for
    the step scheduled before that result reached the host (`carry_in`)."""

    tokens: torch.Tensor     # int64 [N] the last token it sampled (after its accepted drafts)
    drafts: torch.Tensor     # int64 [N, K] the drafts it proposed
    shift: torch.Tensor      # int64 [N] drafts it accepted: how far past the host's guess its line ends
    commit: torch.Tensor     # int64 [N] the linear-attention candidate to commit next (-1: none)

    @classmethod
    def zeros(cls, num_rows: int, num_spec_tokens: int, device: torch.device) -> "Carry":
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(num_rows, **i64), torch.zeros(num_rows, num_spec_tokens, **i64),
                   torch.zeros(num_rows, **i64), torch.full((num_rows,), -1, **i64))

    def keep(self, data: torch.Tensor, k: int, draft_rows: torch.Tensor) -> None:
        """Keep a result's `data` [B, result_width(k)] (`StepResult`); draft_rows [B]: each line's
        draft rows (a line with some verified, so it leaves a candidate state per row)."""
        b = data.shape[0]
        accepted = (data[:, k + 1] - 1).clamp(min=0)           # num_sampled - 1 (0 where none sampled)
        self.tokens[:b].copy_(data.gather(1, accepted[:, None]).squeeze(1))
        self.shift[:b].copy_(accepted)
        self.commit[:b].copy_(torch.where(draft_rows > 0, accepted, -1))
        if k:
            self.drafts[:b, :k].copy_(data[:, k + 2:])


def carry_in(layout: StepLayout, carry: Carry, line: torch.Tensor, block_size: int) -> None:
    """Async scheduling, in place on `layout`'s tensors (on the device, so the host never waits): a
    carrying request's line was planned before its previous step returned. Its first row becomes the
    token that step sampled, its real draft rows the drafts it proposed, and the whole line moves
    `shift` positions on (the drafts it accepted, which the host counted as none): positions, KV slots,
    sequence length, the drafter's shifted ids and the linear-attention commit follow.
    `line` [T]: each row's request."""
    has = layout.carried >= 0
    src = layout.carried.clamp(min=0)
    rows = torch.arange(line.shape[0], device=line.device)
    first, end = layout.query_start_loc[:-1][line], layout.query_start_loc[1:][line]
    off, has_r, src_r = rows - first, has[line], src[line]
    ids = torch.where(has_r & (off == 0), carry.tokens[src_r], layout.input_ids)
    k = carry.drafts.shape[1]
    if k:
        real = has_r & (off >= 1) & (off <= layout.req_real_drafts[line])
        ids = torch.where(real, carry.drafts[src_r, (off - 1).clamp(0, k - 1)], ids)
    layout.input_ids.copy_(ids)
    shift = torch.where(has_r, carry.shift[src_r], 0)
    positions = layout.positions + shift
    layout.positions.copy_(positions)
    width = layout.block_tables.shape[1]
    block = layout.block_tables[line, (positions // block_size).clamp(max=width - 1)]
    layout.slot_mapping.copy_(torch.where(shift > 0, block * block_size + positions % block_size,
                                          layout.slot_mapping))
    layout.seq_lens.add_(torch.where(has, carry.shift[src], 0))
    # the drafter's ids: each row's next row within the line (the last row keeps its placeholder)
    after = ids[(rows + 1).clamp(max=line.shape[0] - 1)]
    layout.mtp_input_ids.copy_(torch.where(has_r & (rows < end - 1), after, layout.mtp_input_ids))
    if layout.state_commit is not None:
        layout.state_commit.copy_(torch.where(has, carry.commit[src], layout.state_commit))


def _shift_left(ids: np.ndarray, qsl: np.ndarray, next_token_ids: np.ndarray) -> np.ndarray:
    """Row t's next token: the row after it, or at a request's last row the known next token (a
    prefill chunk that does not end its prompt). Where that token is still to be sampled the row holds
    a placeholder, which the drafter overwrites with the sampled token after verification."""
    shifted = np.concatenate((ids[1:], ids[:1]))        # np.roll, without its ~10 us of overhead
    ends = qsl[1:] - 1
    shifted[ends] = np.where(next_token_ids >= 0, next_token_ids, shifted[ends])
    return shifted


def shift_left(input_ids: torch.Tensor, query_start_loc: torch.Tensor, next_token_ids: torch.Tensor):
    """`_shift_left` on host tensors."""
    return torch.from_numpy(_shift_left(input_ids.numpy(), query_start_loc.numpy(), next_token_ids.numpy()))
