"""The end of a last stage's step, from verification's tokens on: the next step's drafts (drafted from
each line's last accepted row), the StepResult data, and what async scheduling carries to the next
step. One function for the eager path and for the graph that CUDA graphs capture of it, so the two
cannot drift apart."""
from __future__ import annotations

import torch

from pipespec.layout import Carry, StepLayout
from pipespec.model.attention import ForwardContext
from pipespec.plan import StepResult


def finish_step(drafter, ctx: ForwardContext, layout: StepLayout, hidden: torch.Tensor, tokens: torch.Tensor,
                num_sampled: torch.Tensor, k: int, num_reqs: int, carry: Carry | None) -> torch.Tensor:
    """tokens [S, 1 + k] (-1 past the end) and num_sampled [S] of the sampling requests; the result
    data [num_reqs, result_width(k)]. No host sync (graph-capturable)."""
    drafts = None
    if drafter is not None:
        last = num_sampled - 1
        last_rows = layout.verify_rows[:, 0] + last
        last_tokens = tokens.gather(1, last[:, None]).squeeze(1)
        drafts = drafter.propose(ctx, layout, hidden, last_rows, last_tokens, k)
    data = StepResult.from_verification(0, num_reqs, k, layout.sample_rows, tokens, num_sampled, drafts).data
    if carry is not None:
        carry.keep(data, k, layout.req_num_drafts)
    return data
