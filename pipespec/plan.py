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

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def logits_rows(self) -> torch.Tensor:
        """Flat row index of the last query row of each sampling request."""
        return self.query_start_loc[self.sample_rows + 1] - 1

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
        """Result for non-speculative steps: one token for each request in `sample_rows`."""
        k = num_spec_tokens
        data = torch.full((num_reqs, result_width(k)), -1, dtype=torch.int64, device=sampled.device)
        data[:, k + 1] = 0
        data[sample_rows, 0] = sampled
        data[sample_rows, k + 1] = 1
        return cls(step_id, data.cpu(), k)

    def tokens(self, row: int) -> list[int]:
        k = self.num_spec_tokens
        n = int(self.data[row, k + 1])
        return self.data[row, :n].tolist()
