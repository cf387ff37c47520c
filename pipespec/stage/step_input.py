"""A stage's inputs for one step: written once from the plan into buffers the stage owns, read as views
by everything the step runs (the eager forward, a CUDA graph's replay, verification, drafting, the
carried-in rows).

`StepBuffers` holds one flat int64 buffer on the host (pinned on a GPU) and its twin on the device
(on the CPU the same memory). `write(plan)` lays the step's integers out in it, packed in a fixed
field order at offsets that depend only on the step's sizes, copies them to the device in one
transfer and returns a `StepInput` of views. A CUDA graph's bucket always has the same sizes, so the
views it captured and the views of every step padded to it are the same memory (`pad_to`).

K (`num_spec_tokens`, the plan's) is a step's draft tokens per request. A sampling request's line is
its 1 + K verify rows: its last non-draft row, then its draft rows (`num_draft_rows`; fewer near
max_model_len, the line then repeats its last row). Of the draft rows, `num_drafts` are real drafts;
the rest are dummy rows the scheduler pads a line with to keep a graph's shape, which verification
never accepts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipespec.plan import StepPlan
from pipespec.sampling import SamplingTensors
from pipespec.speculative.rejection import rejection_sample, verify_greedy

# the flat buffer's fields, in order, as (name, size in units): T rows, B requests, S lines (sampling
# requests), Q = 1 + K rows a line, W block-table columns
_FIELDS = (("input_ids", "T"), ("positions", "T"), ("slot_mapping", "T"),
           ("mtp_input_ids", "T"),   # each row's next token (the drafter's input), where known
           ("row_reqs", "T"),        # each row's request
           ("seq_lens", "B"), ("num_draft_rows", "B"), ("num_drafts", "B"),
           ("state_slots", "B"), ("state_commit", "B"), ("carried", "B"),
           ("query_start_loc", "B+1"),
           ("sampling_reqs", "S"), ("line_drafts", "S"), ("verify_rows", "SQ"),
           ("block_tables", "BW"))


def _sizes(t: int, b: int, s: int, w: int, q: int) -> dict[str, int]:
    return {"T": t, "B": b, "B+1": b + 1, "S": s, "SQ": s * q, "BW": b * w}


@dataclass(frozen=True)
class Padding:
    """What a CUDA graph's padding requests hold: every row in a spare KV block no request owns
    (`block`), a spare linear-attention state slot (`slot`), every draft real (whatever they
    verify is dropped)."""

    block: int
    slot: int
    block_size: int


@dataclass(frozen=True)
class StepInput:
    """One step's inputs: views of the stage's `StepBuffers` (valid until its next `write`), and what
    the host knows of the step's shape."""

    num_spec_tokens: int           # K of this step
    max_query_len: int             # known on the host, so attention metadata needs no device read
    padded: bool                   # the buffers hold a CUDA graph bucket's padding past these views
    # per row [T]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    mtp_input_ids: torch.Tensor    # row t's next token; a line's last row: placeholder until sampled
    row_reqs: torch.Tensor
    # per request [B]
    seq_lens: torch.Tensor         # KV length after this step
    num_draft_rows: torch.Tensor
    num_drafts: torch.Tensor       # real drafts among the draft rows
    state_slots: torch.Tensor      # linear-attention state slot
    state_commit: torch.Tensor     # candidate state to commit before running (-1: none)
    carried: torch.Tensor          # async scheduling: previous result row of its first input (-1: none)
    query_start_loc: torch.Tensor  # [B + 1]
    block_tables: torch.Tensor     # [B, W]
    # per line [S]: the verifier's and drafter's view
    sampling_reqs: torch.Tensor    # request of each line
    line_drafts: torch.Tensor      # real drafts of each line
    verify_rows: torch.Tensor      # [S, 1 + K] the line's rows

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_lines(self) -> int:
        return self.sampling_reqs.shape[0]

    @property
    def draft_ids(self) -> torch.Tensor:
        """[S, K] the ids the lines' draft rows embedded (read after any carry-in wrote them)."""
        if self.padded:              # a graph's lines are consecutive rows: a view, no gather
            s, q = self.num_lines, self.num_spec_tokens + 1
            return self.input_ids[:s * q].view(s, q)[:, 1:]
        return self.input_ids[self.verify_rows[:, 1:]]

    @property
    def first_positions(self) -> torch.Tensor:
        """[S] position of each line's first row (the last accepted token)."""
        return self.positions[self.verify_rows[:, 0]]


class StepBuffers:
    """A stage's step-input buffers, sized once for the largest step the config allows."""

    host_buffers = ("_host", "_host_np")      # the host mirror, by design (`tensors_off_device`)

    def __init__(self, device: torch.device, max_rows: int, max_reqs: int, max_blocks_per_seq: int,
                 num_spec_tokens: int, padding: Padding | None = None):
        q = num_spec_tokens + 1
        self.device, self.max_blocks = device, max_blocks_per_seq
        self.limits = _sizes(max_rows, max_reqs, max_reqs, max_blocks_per_seq, q)
        capacity = sum(self.limits[unit] for _, unit in _FIELDS)
        pin = device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = self._host if device.type == "cpu" else torch.zeros(capacity, dtype=torch.int64, device=device)
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.padding = padding
        self._offsets: dict[tuple, dict[str, tuple[int, int]]] = {}
        self._views: dict[tuple, StepInput] = {}
        self._written: tuple = ({}, 0, 0)       # the last write's layout, K and lines

    def _layout(self, t: int, b: int, s: int, w: int, q: int) -> dict[str, tuple[int, int]]:
        """Each field's (start, end) in the flat buffer for a step of these sizes."""
        key = (t, b, s, w, q)
        if key not in self._offsets:
            sizes, at, out = _sizes(t, b, s, w, q), 0, {}
            for name, unit in _FIELDS:
                out[name] = (at, at + sizes[unit])
                at += sizes[unit]
            self._offsets[key] = out
        return self._offsets[key]

    def write(self, plan: StepPlan, pad_to: int | None = None) -> StepInput:
        """Lay `plan` (on the host) out in the buffers and start its upload. `pad_to`: a CUDA graph
        bucket of that many requests, each of 1 + K rows, with `max_blocks_per_seq` table columns;
        the requests past the plan's are padding."""
        k = plan.num_spec_tokens
        q = k + 1
        qsl = plan.query_start_loc.numpy()
        reqs = plan.sampling_reqs.numpy()
        draft_rows, real = plan.num_draft_rows.numpy(), plan.num_drafts.numpy()
        t, b, s, w = plan.num_tokens, plan.num_reqs, len(reqs), plan.block_tables.shape[1]
        line_rows = draft_rows[reqs]
        if s and line_rows.max() > k:
            raise ValueError(f"step {plan.step_id} verifies {int(line_rows.max())} drafts of a request, more than "
                             f"its K={k}")
        if (real > draft_rows).any() or (real < 0).any():
            raise ValueError(f"step {plan.step_id} has more real drafts than draft rows in a line")
        sizes = (t, b, s, w) if pad_to is None else (pad_to * q, pad_to, pad_to, self.max_blocks)
        for (unit, limit), size in zip((("T", "rows"), ("B", "requests"), ("S", "lines")), sizes):
            if size > self.limits[unit]:
                raise ValueError(f"step {plan.step_id} has {size} {limit}, more than the stage's buffers hold "
                                 f"({self.limits[unit]})")
        if w > self.max_blocks:
            raise ValueError(f"step {plan.step_id}'s block tables are {w} wide, more than max_model_len allows "
                             f"({self.max_blocks})")
        layout = self._layout(*sizes, q)
        if self._uploaded is not None:
            self._uploaded.synchronize()      # the last step's upload has left the host buffer
        h = {name: self._host_np[a:e] for name, (a, e) in layout.items()}
        ids = plan.input_ids.numpy()
        h["input_ids"][:t] = ids
        h["positions"][:t] = plan.positions.numpy()
        h["slot_mapping"][:t] = plan.slot_mapping.numpy()
        lens = qsl[1:] - qsl[:-1]
        h["row_reqs"][:t] = np.repeat(np.arange(b), lens)
        # the drafter's input: row t's next row, or at a request's last row the known next token
        mtp = h["mtp_input_ids"]
        if t:
            mtp[:t - 1] = ids[1:]
            mtp[t - 1] = ids[0]
        ends = qsl[1:] - 1
        nxt = plan.next_token_ids.numpy()
        mtp[ends] = np.where(nxt >= 0, nxt, mtp[ends])
        h["seq_lens"][:b] = plan.seq_lens.numpy()
        h["num_draft_rows"][:b] = draft_rows
        h["num_drafts"][:b] = real
        h["state_slots"][:b] = plan.state_slots.numpy()
        h["state_commit"][:b] = plan.state_commit.numpy()
        h["carried"][:b] = -1 if plan.carried is None else plan.carried.numpy()
        h["query_start_loc"][:b + 1] = qsl
        h["sampling_reqs"][:s] = reqs
        h["line_drafts"][:s] = real[reqs]
        first = qsl[reqs + 1] - 1 - line_rows                      # each line's last non-draft row
        h["verify_rows"][:s * q] = (first[:, None] + np.minimum(np.arange(q)[None, :], line_rows[:, None])).reshape(-1)
        tables = h["block_tables"].reshape(sizes[1], sizes[3])
        tables[:b, :w] = plan.block_tables.numpy()
        if pad_to is not None:
            self._pad(h, tables, t, b, s, pad_to, k)
        self._written = (layout, k, s)
        end = layout["block_tables"][1]
        if self._dev is not self._host:
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            self._uploaded.record()
        return self._step_input((*sizes, q), k, t, b, s, int(lens.max()) if b else 0, pad_to is not None)

    def embedded_drafts(self) -> np.ndarray | None:
        """[S, K] the ids the last step written embeds at its lines' draft rows, -1 where no real
        draft, from the host copy (the I4 trace); None when it has no draft."""
        layout, k, s = self._written
        h = {name: self._host_np[a:e] for name, (a, e) in layout.items()}
        real = h["line_drafts"][:s]
        if not k or not (real > 0).any():
            return None
        rows = h["verify_rows"][:s * (k + 1)].reshape(s, k + 1)[:, 1:]
        return np.where(np.arange(k)[None, :] < real[:, None], h["input_ids"][rows], -1)

    def _pad(self, h: dict, tables: np.ndarray, t: int, b: int, s: int, nb: int, k: int) -> None:
        """Fill a bucket of `nb` requests past the plan's `b` with padding requests."""
        p, q = self.padding, k + 1
        pos = np.tile(np.arange(q), nb - b)
        h["input_ids"][t:] = 0
        h["positions"][t:] = pos
        h["slot_mapping"][t:] = p.block * p.block_size + pos
        h["mtp_input_ids"][t:] = 0
        h["row_reqs"][t:] = np.repeat(np.arange(b, nb), q)
        h["seq_lens"][b:] = q
        h["num_draft_rows"][b:] = k
        h["num_drafts"][b:] = k
        h["state_slots"][b:] = p.slot
        h["state_commit"][b:] = -1
        h["carried"][b:] = -1
        h["query_start_loc"][b + 1:] = (t + np.arange(1, nb - b + 1) * q)
        h["sampling_reqs"][s:] = np.arange(s, nb)
        h["line_drafts"][s:] = k
        h["verify_rows"][s * q:] = np.arange(s * q, nb * q)
        tables[b:] = p.block

    def padding_views(self, nb: int, k: int) -> StepInput:
        """The views a CUDA graph of bucket `nb` captures: filled with padding requests only."""
        plan = StepPlan(step_id=-1, input_ids=torch.zeros(0, dtype=torch.int64),
                        positions=torch.zeros(0, dtype=torch.int64), slot_mapping=torch.zeros(0, dtype=torch.int64),
                        query_start_loc=torch.zeros(1, dtype=torch.int64), seq_lens=torch.zeros(0, dtype=torch.int64),
                        block_tables=torch.zeros(0, self.max_blocks, dtype=torch.int64),
                        sampling_reqs=torch.zeros(0, dtype=torch.int64), sampling=None, num_spec_tokens=k)
        self.write(plan, pad_to=nb)
        q = k + 1
        return self._step_input((nb * q, nb, nb, self.max_blocks, q), k, nb * q, nb, nb, q, True)

    def _step_input(self, sizes: tuple, k: int, t: int, b: int, s: int, max_query_len: int,
                    padded: bool) -> StepInput:
        """Device views of the live part (t rows, b requests, s lines) of a step laid out for `sizes`
        (cached: steady steps repeat theirs)."""
        key = (sizes, t, b, s, max_query_len, padded)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 1024:          # eager steps of ever new sizes: keep the cache bounded
                self._views.clear()
            layout, w = self._layout(*sizes), sizes[3]
            q, d = k + 1, self._dev
            live = {"T": t, "B": b, "B+1": b + 1, "S": s, "SQ": s * q, "BW": b * w}
            f = {name: d[a:a + live[unit]] for (name, unit), (a, _) in zip(_FIELDS, layout.values())}
            f["verify_rows"] = f["verify_rows"].view(s, q)
            f["block_tables"] = f["block_tables"].view(b, w)
            view = self._views[key] = StepInput(num_spec_tokens=k, max_query_len=max_query_len, padded=padded, **f)
        return view


def verify(logits: torch.Tensor, inp: StepInput, sampling: SamplingTensors | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier, the one place a step's lines are verified (eagerly, or inside a CUDA graph's
    forward for greedy steps): each line of 1 + K rows of `inp` (logits [S, 1 + K, V]) against the
    drafts its rows embedded. `sampling`: None or all greedy verifies greedily and reads nothing
    else. Returns tokens [S, 1 + K] (-1 past the end) and num_sampled [S]."""
    if sampling is None or sampling.all_greedy:
        return verify_greedy(logits, inp.draft_ids, inp.line_drafts)
    return rejection_sample(logits, inp.draft_ids, inp.line_drafts, sampling, inp.first_positions + 1)
