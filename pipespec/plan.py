"""The two messages of a step: StepPlan (driver -> stages) and StepResult (last stage -> driver).

A plan carries everything any stage needs for one step and nothing else; a result has a shape that
depends only on the plan and the config (DESIGN.md, I2), never on what was sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pipespec.sampling import SamplingTensors


@dataclass
class StepPlan:
    step_id: int
    req_ids: list[str]            # driver bookkeeping only; stages never need it
    input_ids: torch.Tensor       # int64 [T] token ids of all query rows, request after request
    positions: torch.Tensor       # int64 [T]
    slot_mapping: torch.Tensor    # int64 [T] KV slot each query row writes
    query_start_loc: torch.Tensor  # int64 [B+1] row boundaries of each request
    seq_lens: torch.Tensor        # int64 [B] KV length of each request after this step
    block_tables: torch.Tensor    # int64 [B, W] block ids, padded with 0
    sample_rows: torch.Tensor     # int64 [S] requests (indices into B) that sample this step
    sampling: SamplingTensors     # parameters of the S sampling requests
    num_drafts: torch.Tensor | None = None  # int64 [B] draft rows ending each request's query (None: 0)
    # int64 [B] the known token after each request's last row (a prefill chunk that does not end the
    # prompt), -1 where it is still to be sampled; the MTP drafter's shifted input needs it
    next_token_ids: torch.Tensor | None = None

    def __post_init__(self):
        b, device = self.seq_lens.shape[0], self.seq_lens.device
        if self.num_drafts is None:
            self.num_drafts = torch.zeros(b, dtype=torch.int64, device=device)
        if self.next_token_ids is None:
            self.next_token_ids = torch.full((b,), -1, dtype=torch.int64, device=device)

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

    def logits_rows(self) -> torch.Tensor:
        """Flat row index of the last query row of each sampling request."""
        return self.query_start_loc[self.sample_rows + 1] - 1

    def verify_rows(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each sampling request: its last non-draft row followed by its draft rows, [S, width]
        (padded by repeating the last row), and its number of drafts [S]."""
        drafts = self.num_drafts[self.sample_rows]
        first = self.logits_rows() - drafts
        offsets = torch.arange(width, device=first.device)[None, :]
        return first[:, None] + torch.minimum(offsets, drafts[:, None]), drafts

    def to(self, device) -> "StepPlan":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, (torch.Tensor, SamplingTensors)):
                moved[name] = value.to(device)
        return StepPlan(**moved)


def result_width(num_spec_tokens: int) -> int:
    """Columns of a StepResult row: (K+1) sampled tokens | num_sampled | K drafts."""
    return (num_spec_tokens + 1) + 1 + num_spec_tokens


@dataclass
class StepResult:
    step_id: int
    data: torch.Tensor            # int64 [B, result_width(K)] on CPU
    num_spec_tokens: int = 0

    @classmethod
    def build(cls, step_id: int, num_reqs: int, num_spec_tokens: int, sample_rows: torch.Tensor,
              sampled: torch.Tensor) -> "StepResult":
        """One token for each request in `sample_rows`, no drafts."""
        ones = torch.ones_like(sampled)
        return cls.from_verification(step_id, num_reqs, num_spec_tokens, sample_rows, sampled[:, None], ones)

    @classmethod
    def from_verification(cls, step_id: int, num_reqs: int, num_spec_tokens: int, sample_rows: torch.Tensor,
                          tokens: torch.Tensor, num_sampled: torch.Tensor,
                          drafts: torch.Tensor | None = None) -> "StepResult":
        """tokens [S, <=K+1] (-1 padded), num_sampled [S], drafts [S, K] for the sampling requests."""
        k = num_spec_tokens
        data = torch.full((num_reqs, result_width(k)), -1, dtype=torch.int64, device=tokens.device)
        data[:, k + 1] = 0
        data[sample_rows, :tokens.shape[1]] = tokens
        data[sample_rows, k + 1] = num_sampled
        if drafts is not None and k:
            data[sample_rows, k + 2:] = drafts
        return cls(step_id, data.cpu(), k)

    def tokens(self, row: int) -> list[int]:
        k = self.num_spec_tokens
        n = int(self.data[row, k + 1])
        return self.data[row, :n].tolist()

    def drafts(self, row: int) -> list[int]:
        """Draft ids proposed for the request's next step (empty when it did not sample)."""
        k = self.num_spec_tokens
        if not k or int(self.data[row, k + 1]) == 0:
            return []
        return self.data[row, k + 2:].tolist()
