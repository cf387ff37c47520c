"""Async scheduling, the stage's side: what each row of a sampling step's result leaves on the device
(`Carry`), and how the next step, planned before that result reached the host, takes it in
(`carry_in`). The driver's side is the scheduler's (`Scheduler._continues`): it plans a request again
while its previous step is in flight and names the result row it continues (`StepPlan.carried`).

A carried request's line was planned with placeholders: the driver did not yet know the token its
previous step sampled, the drafts it proposed, or how many drafts it accepted (it counted none). The
stage fills them in on the device, so the host never waits, and the driver later records the same
tokens from that step's result: what it records and what the stage embedded never differ.

A penalized request continued this way was planned with the token counts the driver had, which lack
the tokens its step in flight samples: the stage adds them (`Carry.sampled`, `carried_tokens`), so
each verify row's penalties see every token before it, as the synchronous engine's do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.stage.step_input import StepInput


@dataclass(frozen=True)
class Carry:
    """Per row of the last sampling step's result, on the device."""

    tokens: torch.Tensor     # int64 [N] the last token it sampled (after its accepted drafts)
    drafts: torch.Tensor     # int64 [N, K] the drafts it proposed
    shift: torch.Tensor      # int64 [N] drafts it accepted: how far past the host's guess its line ends
    commit: torch.Tensor     # int64 [N] the linear-attention candidate to commit next (-1: none)
    sampled: torch.Tensor    # int64 [N, K+1] every token it sampled (its accepted drafts, then `tokens`; -1 after)

    @classmethod
    def zeros(cls, num_rows: int, num_spec_tokens: int, device: torch.device) -> "Carry":
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(num_rows, **i64), torch.zeros(num_rows, num_spec_tokens, **i64),
                   torch.zeros(num_rows, **i64), torch.full((num_rows,), -1, **i64),
                   torch.full((num_rows, num_spec_tokens + 1), -1, **i64))

    def keep(self, data: torch.Tensor, k: int, num_draft_rows: torch.Tensor) -> None:
        """Keep a result's `data` [B, result_width(k)] (`StepResult`); num_draft_rows [B]: a line with
        some leaves a candidate linear-attention state per row."""
        b = data.shape[0]
        accepted = (data[:, k + 1] - 1).clamp(min=0)           # num_sampled - 1 (0 where none sampled)
        self.tokens[:b].copy_(data.gather(1, accepted[:, None]).squeeze(1))
        self.shift[:b].copy_(accepted)
        self.commit[:b].copy_(torch.where(num_draft_rows > 0, accepted, -1))
        cols = torch.arange(k + 1, device=data.device)
        self.sampled[:b, :k + 1].copy_(torch.where(cols < data[:, k + 1:k + 2], data[:, :k + 1], -1))
        self.sampled[:b, k + 1:] = -1          # (a step of a smaller K than the config's: adaptive K)
        if k:
            self.drafts[:b, :k].copy_(data[:, k + 2:])

    def fill(self, inp: StepInput, block_size: int) -> None:
        """`carry_in`: on a GPU in one kernel (in every steady step's CUDA graph, where its ~30 small
        PyTorch ops would cost more than a small model's layer)."""
        if self.tokens.device.type == "cuda":
            from pipespec.kernels.carry_in import carry_in_rows
            carry_in_rows(inp.input_ids, inp.positions, inp.slot_mapping, inp.mtp_input_ids, inp.seq_lens,
                          inp.state_commit, inp.row_reqs, inp.query_start_loc, inp.carried, inp.num_drafts,
                          inp.block_tables, self.tokens, self.drafts, self.shift, self.commit, block_size)
        else:
            carry_in(inp, self, block_size)


def carried_tokens(inp: StepInput, carry: Carry) -> torch.Tensor:
    """int64 [S, K+1] (K the config's): for each sampling line that carries, the tokens its request's
    step in flight sampled, which the driver's token counts in the plan do not hold yet; -1 elsewhere.
    A fixed shape and no host read (graph-capturable)."""
    src = inp.carried[inp.sampling_reqs]
    return torch.where(src[:, None] >= 0, carry.sampled[src.clamp(min=0)], -1)


def carry_in(inp: StepInput, carry: Carry, block_size: int) -> None:
    """In place on `inp`'s views (no host read): a carrying request's first row becomes the token its
    previous step sampled, its real draft rows the drafts it proposed, and the whole line moves
    `shift` positions on (the drafts it accepted): positions, KV slots, sequence length, the drafter's
    shifted ids and the linear-attention commit follow."""
    line = inp.row_reqs
    has = inp.carried >= 0
    src = inp.carried.clamp(min=0)
    rows = torch.arange(line.shape[0], device=line.device)
    first, end = inp.query_start_loc[:-1][line], inp.query_start_loc[1:][line]
    off, has_r, src_r = rows - first, has[line], src[line]
    ids = torch.where(has_r & (off == 0), carry.tokens[src_r], inp.input_ids)
    k = carry.drafts.shape[1]
    if k:
        real = has_r & (off >= 1) & (off <= inp.num_drafts[line])
        ids = torch.where(real, carry.drafts[src_r, (off - 1).clamp(0, k - 1)], ids)
    inp.input_ids.copy_(ids)
    shift = torch.where(has_r, carry.shift[src_r], 0)
    positions = inp.positions + shift
    inp.positions.copy_(positions)
    width = inp.block_tables.shape[1]
    block = inp.block_tables[line, (positions // block_size).clamp(max=width - 1)]
    inp.slot_mapping.copy_(torch.where(shift > 0, block * block_size + positions % block_size, inp.slot_mapping))
    inp.seq_lens.add_(torch.where(has, carry.shift[src], 0))
    # the drafter's ids: each row's next row within the line (the last row keeps its placeholder)
    after = ids[(rows + 1).clamp(max=line.shape[0] - 1)]
    inp.mtp_input_ids.copy_(torch.where(has_r & (rows < end - 1), after, inp.mtp_input_ids))
    inp.state_commit.copy_(torch.where(has, carry.commit[src], inp.state_commit))
