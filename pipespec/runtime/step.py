"""Calling a stage: the one place where what a stage hands on is checked against the plan (I2).

Every pipeline position, PP = 1 included, runs its step through `run_stage_step`, so a stage whose
output does not have the shape the plan and config give (a result row of the wrong width, say, or a
step asking for more drafts than the stage was configured for) is refused by name before anything reads it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pipespec.plan import CacheSizes, StepPlan, activation_shape, plan_result_shape
from pipespec.runtime.transport import StageError


class Stage(Protocol):
    """What the runtime needs of a stage (it knows no models)."""

    device: torch.device
    dtype: torch.dtype

    def available_cache(self) -> CacheSizes: ...
    def allocate_kv_cache(self, num_blocks: int, num_snapshots: int = 0) -> None: ...
    def step(self, plan: StepPlan, inbound: torch.Tensor | None) -> torch.Tensor: ...
    def close(self) -> None: ...


def expected_outbound(plan: StepPlan, is_last: bool, hidden_size: int) -> tuple[int, ...]:
    return plan_result_shape(plan) if is_last else activation_shape(plan, hidden_size)


def run_stage_step(stage: Stage, rank: int, is_last: bool, plan: StepPlan, inbound: torch.Tensor | None,
                   hidden_size: int, num_spec_tokens: int) -> torch.Tensor:
    """`num_spec_tokens`: the config's K, the most a plan's step may use."""
    if not 0 <= plan.num_spec_tokens <= num_spec_tokens:
        raise StageError(f"step {plan.step_id} asks for K={plan.num_spec_tokens}; stage {rank} is configured "
                         f"for K <= {num_spec_tokens}")
    out = stage.step(plan, inbound)
    want = expected_outbound(plan, is_last, hidden_size)
    if tuple(out.shape) != want:
        what = "a result" if is_last else "activations"
        raise StageError(f"stage {rank} produced {what} of shape {tuple(out.shape)} for step {plan.step_id}; "
                         f"the plan (K={plan.num_spec_tokens}) and config (hidden size {hidden_size}) say {want}")
    return out
