"""Executors move StepPlans to the stages and StepResults back; they know nothing about models.

`submit` hands a plan over; `receive` returns the oldest outstanding result. Up to `max_in_flight`
plans may be outstanding (1 for a single stage, P for P pipeline stages).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Callable

from pipespec.plan import StepPlan, StepResult
from pipespec.runtime.step import Stage, run_stage_step


def release_device_memory() -> None:
    """Hand cached GPU memory back once a stage is gone, so a later engine can measure and use it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Executor(ABC):
    max_in_flight: int = 1

    @abstractmethod
    def available_kv_blocks(self) -> int:
        """KV blocks every stage can hold (the minimum over stages)."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def submit(self, plan: StepPlan) -> None: ...

    @abstractmethod
    def receive(self, timeout: float) -> StepResult: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class LocalExecutor(Executor):
    """PP = 1: the stage lives in the driver's process; no collective is used."""

    max_in_flight = 1

    def __init__(self, make_stage: Callable[[], Stage], hidden_size: int, num_spec_tokens: int):
        self.stage = make_stage()
        self.hidden_size, self.num_spec_tokens = hidden_size, num_spec_tokens
        self._results: deque[StepResult] = deque()

    def available_kv_blocks(self) -> int:
        return self.stage.available_kv_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.stage.allocate_kv_cache(num_blocks)

    def submit(self, plan: StepPlan) -> None:
        data = run_stage_step(self.stage, 0, True, plan, None, self.hidden_size, self.num_spec_tokens)
        self._results.append(StepResult(plan.step_id, data, plan.num_spec_tokens))

    def receive(self, timeout: float) -> StepResult:
        # runs synchronously in submit, so a result is always ready; the timeout has nothing to wait on
        return self._results.popleft()

    def shutdown(self) -> None:
        if self.stage is not None:
            self.stage.close()
        self.stage = None
        self._results.clear()
        release_device_memory()
