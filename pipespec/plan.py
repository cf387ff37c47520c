"""The two messages of a step: StepPlan (driver -> stages) and StepResult (last stage -> driver),
and the shapes every message of a step has.

A plan carries everything any stage needs for one step and nothing else; a result has a shape that
depends only on the plan and the config (docs/architecture.md, I2), never on what was sampled.

K (`num_spec_tokens`) is the number of draft tokens per request; each plan says its step's K (the
config's, or with adaptive K one in 0..config K), and every shape of the step follows from it. A verifying request runs 1 + K query
rows (its last accepted token, then its drafts); after verification the MTP chain drafts K more
positions past the last accepted one. So a step touches positions up to 2K past a request's last
known token (`position_margin`), and writes MTP KV up to K - 1 slots past a sampling request's last
query row (`draft_chain_overrun`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from pipespec.sampling import SamplingTensors, logprob_width, unpack_logprobs


@dataclass
class StepPlan:
    step_id: int
    input_ids: torch.Tensor       # int64 [T] token ids of all query rows, request after request
    positions: torch.Tensor       # int64 [T]
    slot_mapping: torch.Tensor    # int64 [T] KV slot each query row writes
    query_start_loc: torch.Tensor  # int64 [B+1] row boundaries of each request
    seq_lens: torch.Tensor        # int64 [B] KV length of each request after this step
    block_tables: torch.Tensor    # int64 [B, W] block ids, padded with 0
    sampling_reqs: torch.Tensor     # int64 [S] requests (indices into B) that sample this step
    sampling: SamplingTensors     # parameters of the S sampling requests
    num_draft_rows: torch.Tensor | None = None  # int64 [B] draft rows ending each request's query (None: 0)
    # int64 [B] how many of those rows are real drafts; the rest are dummy rows padding a line to the
    # step's K (so it keeps the shape a CUDA graph replays), which verification never accepts
    num_drafts: torch.Tensor | None = None
    # int64 [B] the known token after each request's last row (a prefill chunk that does not end the
    # prompt), -1 where it is still to be sampled; the MTP drafter's shifted input needs it
    next_token_ids: torch.Tensor | None = None
    # int64 [B] each request's linear-attention state slot (models with Gated DeltaNet layers)
    state_slots: torch.Tensor | None = None
    # int64 [B] after a step that verified drafts: its accepted count, i.e. which row's candidate
    # state every stage commits before running the request again; -1: nothing to commit
    state_commit: torch.Tensor | None = None
    # int64 [B, 2] prefix caching of linear-attention states, per request: the snapshot every stage
    # copies into its state slot before the step (a prefix-cache hit), and the snapshot it copies
    # that slot into after the step (its prefill reached a snapshot boundary); -1: none. None: no
    # request does either (`engine/scheduler.py`, "Linear-attention states")
    state_snapshots: torch.Tensor | None = None
    # int64 [B] async scheduling (one stage): the row of the previous step's result whose sampled
    # token is the request's first input row here, unknown to the driver when it built this plan
    # (input_ids holds a placeholder); -1: input_ids holds it. None: no request carries one
    carried: torch.Tensor | None = None
    # K of this step: each sampling request's verify line is 1 + K rows (its drafts, at most K), the
    # last stage drafts K tokens after verifying, and the result row is result_width(K) wide. The
    # config's K unless adaptive K picked a smaller one (0: plain decoding, the MTP KV still written)
    num_spec_tokens: int = 0
    # False once adaptive K has retired speculation (no K paid): the last stage then runs no drafter,
    # and no MTP KV is kept from this step on
    drafting: bool = True
    # the most logprobs a sampling request asks for (-1: none asks): the result then carries, per
    # verify row, the sampled token's logprob and rank and the top `num_logprobs` (`result_width`)
    num_logprobs: int = -1
    # prompt logprobs: query rows [L] whose next token is a prompt token to score, those tokens [L],
    # and the most top alternatives a request asks for (-1: none); the result has L more rows
    prompt_logprob_rows: torch.Tensor | None = None
    prompt_logprob_ids: torch.Tensor | None = None
    num_prompt_logprobs: int = -1
    # logits processing (`pipespec.sampling.apply_penalties`; None: nothing to do): per sampling line
    # float32 [S, 3] penalties, its tokens' counts int64 [P, 4], per-row biases and bans int64 [Q, 4]
    # with their float32 [Q] values (built by `pipespec.engine.logits_inputs`)
    penalties: torch.Tensor | None = None
    penalty_tokens: torch.Tensor | None = None
    bias_entries: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # structured output (`pipespec.sampling.apply_token_bitmask`; None: no line is constrained): the
    # constrained lines int64 [G] (indices into S) and each one's 1 + K verify rows' token bitmasks,
    # int32 [G * (1 + K), ceil(V / 32)] (built by `pipespec.engine.structured`)
    grammar_lines: torch.Tensor | None = None
    grammar_masks: torch.Tensor | None = None

    @property
    def adjusts_logits(self) -> bool:
        return self.penalties is not None or self.bias_entries is not None or self.grammar_masks is not None

    def __post_init__(self):
        b, device = self.seq_lens.shape[0], self.seq_lens.device
        if self.num_draft_rows is None:
            self.num_draft_rows = torch.zeros(b, dtype=torch.int64, device=device)
        if self.num_drafts is None:
            self.num_drafts = self.num_draft_rows
        if self.next_token_ids is None:
            self.next_token_ids = torch.full((b,), -1, dtype=torch.int64, device=device)
        if self.state_slots is None:
            self.state_slots = torch.arange(b, dtype=torch.int64, device=device)
        if self.state_commit is None:
            self.state_commit = torch.full((b,), -1, dtype=torch.int64, device=device)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def query_lens(self) -> torch.Tensor:
        """int64 [B] query rows of each request."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def max_query_len(self) -> int:
        """The longest request's query rows (a host read when the plan is on a device)."""
        return int(self.query_lens().max()) if self.num_reqs else 0


def position_margin(num_spec_tokens: int) -> int:
    """Positions past a request's last known token that a step may touch: K verify rows, then up to
    K more drafted by the MTP chain (rotary tables and block tables are sized with it)."""
    return 2 * num_spec_tokens


def draft_chain_overrun(num_spec_tokens: int) -> int:
    """KV slots the MTP chain writes past a sampling request's last query row (steps 1..K-1)."""
    return max(num_spec_tokens - 1, 0)


def activation_shape(plan: StepPlan, hidden_size: int) -> tuple[int, int, int]:
    """Stage r -> r + 1: hidden and residual of every query row."""
    return (2, plan.num_tokens, hidden_size)


def result_shape(num_reqs: int, num_spec_tokens: int, num_logprobs: int = -1) -> tuple[int, int]:
    """Last stage -> driver: one StepResult row per request (a plan without prompt logprobs)."""
    return (num_reqs, result_width(num_spec_tokens, num_logprobs))


def plan_result_shape(plan: StepPlan) -> tuple[int, int]:
    """The result of `plan`: a row per request, then a row per prompt-logprob row (`prompt_rows`)."""
    rows, width = result_shape(plan.num_reqs, plan.num_spec_tokens, plan.num_logprobs)
    if plan.num_prompt_logprobs < 0:
        return rows, width
    return rows + plan.prompt_logprob_rows.shape[0], max(width, logprob_width(plan.num_prompt_logprobs))


def result_width(num_spec_tokens: int, num_logprobs: int = -1) -> int:
    """Columns of a StepResult row: (K+1) sampled tokens | num_sampled | K drafts, then with
    `num_logprobs` >= 0 the packed logprobs of each of the K+1 verify rows (`logprob_columns`)."""
    return (num_spec_tokens + 1) + 1 + num_spec_tokens + (num_spec_tokens + 1) * logprob_width(num_logprobs)


class CacheSizes(NamedTuple):
    """What a stage's memory holds (`Stage.available_cache`), or what every stage allocates: KV
    blocks, and prefix-cache snapshots of linear-attention states (None: a stage without such layers)."""
    kv_blocks: int
    state_snapshots: int | None = None


def least_over_stages(sizes: list[CacheSizes]) -> CacheSizes:
    """What every stage can hold: the least of each count over the stages that have it."""
    snapshots = [s.state_snapshots for s in sizes if s.state_snapshots is not None]
    return CacheSizes(min(s.kv_blocks for s in sizes), min(snapshots) if snapshots else None)


@dataclass
class StepResult:
    step_id: int
    data: torch.Tensor            # int64 [B, result_width(K)] (on the host once the driver holds it)
    num_spec_tokens: int = 0
    # the plan's num_logprobs (None: read from the width, for a result without prompt logprobs)
    num_logprobs_asked: int | None = None
    # a plan with prompt logprobs: its requests' rows come first, its prompt-logprob rows after them
    num_reqs: int | None = None
    num_prompt_logprobs: int = -1

    @classmethod
    def of(cls, plan: StepPlan, data: torch.Tensor) -> "StepResult":
        """`plan`'s result, its `data` received (`plan_result_shape`)."""
        return cls(plan.step_id, data, plan.num_spec_tokens, plan.num_logprobs, plan.num_reqs,
                   plan.num_prompt_logprobs)

    @classmethod
    def empty(cls, step_id: int, num_reqs: int, num_spec_tokens: int) -> "StepResult":
        """A step where no request samples."""
        data = torch.full((num_reqs, result_width(num_spec_tokens)), -1, dtype=torch.int64)
        data[:, num_spec_tokens + 1] = 0
        return cls(step_id, data, num_spec_tokens)

    @classmethod
    def from_verification(cls, step_id: int, num_reqs: int, num_spec_tokens: int, sampling_reqs: torch.Tensor,
                          tokens: torch.Tensor, num_sampled: torch.Tensor,
                          drafts: torch.Tensor | None = None) -> "StepResult":
        """tokens [S, <=K+1] (-1 padded), num_sampled [S], drafts [S, K] for the sampling requests."""
        k = num_spec_tokens
        data = torch.full((num_reqs, result_width(k)), -1, dtype=torch.int64, device=tokens.device)
        data[:, k + 1] = 0
        data[sampling_reqs, :tokens.shape[1]] = tokens
        data[sampling_reqs, k + 1] = num_sampled
        if drafts is not None and k:
            data[sampling_reqs, k + 2:] = drafts
        return cls(step_id, data, k)     # on the stage's device: the runtime moves it to the host

    @cached_property
    def rows(self) -> list[list[int]]:
        """The rows as Python lists, converted once: the driver reads every row of every step, and
        one `tolist` costs less than two tensor reads per row. Only the token columns: the logprob
        columns are copied out as bytes (`logprob_records`)."""
        return self.data[:, :result_width(self.num_spec_tokens)].tolist()

    def tokens(self, row: int) -> list[int]:
        k = self.num_spec_tokens
        r = self.rows[row]
        return r[:r[k + 1]]

    @property
    def num_logprobs(self) -> int:
        """The plan's `num_logprobs`, from the width (-1: the result carries none)."""
        if self.num_logprobs_asked is not None:
            return self.num_logprobs_asked
        k = self.num_spec_tokens
        extra = self.data.shape[1] - result_width(k)
        return -1 if extra == 0 else (extra // (k + 1) - 2) // 2

    def prompt_logprobs(self, first: int, count: int) -> list[tuple[float, int, list[int], list[float]]]:
        """(logprob, rank, top ids, top logprobs) of prompt-logprob rows first..first+count-1 of
        the plan (`StepPlan.prompt_logprob_rows`), in its order."""
        n, at = self.num_prompt_logprobs, self.num_reqs + first
        w = logprob_width(n)
        return [unpack_logprobs(r[:w], 1, n)[0] for r in self.data[at:at + count].tolist()]

    def logprob_records(self, row: int, count: int, num_logprobs: int) -> bytes:
        """The packed logprob columns of the first `count` tokens `tokens(row)` gives, each token's
        cut to `num_logprobs` top ids and logprobs (`outputs.LogprobRecords`), as int64 bytes."""
        n, base = self.num_logprobs, result_width(self.num_spec_tokens)
        w = logprob_width(n)
        if num_logprobs != n:
            m = num_logprobs
            tokens = self.data[row, base:base + count * w].numpy().reshape(count, w)
            return np.concatenate((tokens[:, :2 + m], tokens[:, 2 + n:2 + n + m]), axis=1).tobytes()
        at = 8 * (row * self.data.shape[1] + base)         # (the common case: one bytes slice)
        return self._bytes[at:at + 8 * count * w]

    @cached_property
    def _bytes(self) -> bytes:
        """The data as bytes, copied once (a row's slice of them then costs no tensor op)."""
        return self.data.contiguous().numpy().tobytes()

    def drafts(self, row: int) -> list[int]:
        """Draft ids proposed for the request's next step (empty when it did not sample)."""
        k = self.num_spec_tokens
        r = self.rows[row]
        return r[k + 2:2 * k + 2] if k and r[k + 1] else []
