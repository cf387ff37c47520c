"""Executors move StepPlans to the stages and StepResults back; they know nothing about models.

`submit` hands a plan over; `receive` returns the oldest outstanding result. Up to `max_in_flight`
plans may be outstanding (1 for a single stage, 2 with async scheduling, P for P pipeline stages).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable

import torch

from pipespec.plan import CacheSizes, StepPlan, StepResult
from pipespec.runtime.step import Stage, run_stage_step
from pipespec.runtime.transport import StageError


def release_device_memory() -> None:
    """Hand cached GPU memory back once a stage is gone, so a later engine can measure and use it.
    Only where CUDA ran: a full collection is slow in a process full of objects (RESULTS.md), and the
    host's memory is never measured (reference counting frees a CPU stage's tensors)."""
    import gc

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


class Executor(ABC):
    max_in_flight: int = 1
    async_scheduling: bool = False    # a step may be planned while the last one runs (`stage/carry.py`)

    @abstractmethod
    def available_cache(self) -> CacheSizes:
        """KV blocks and state snapshots every stage can hold (`plan.least_over_stages`)."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, num_snapshots: int = 0) -> None: ...

    @abstractmethod
    def submit(self, plan: StepPlan) -> None: ...

    @abstractmethod
    def receive(self, timeout: float) -> StepResult: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class LocalExecutor(Executor):
    """PP = 1: the stage lives in the driver's process; no collective is used.

    With async scheduling (a stage keeping what each step leaves for the next: `Stage.carry`) two steps may be
    in flight: `submit` only enqueues a step's kernels and its result's copy to the host, so the
    driver plans and submits the next step while the device runs this one, and `receive` waits for
    the copy. On the CPU the step runs inside `submit`; the bookkeeping is the same."""

    def __init__(self, make_stage: Callable[[], Stage], hidden_size: int, num_spec_tokens: int):
        self.stage = make_stage()
        self.hidden_size, self.num_spec_tokens = hidden_size, num_spec_tokens
        self.async_scheduling = self.stage.carry is not None
        self.max_in_flight = 2 if self.async_scheduling else 1
        self._results: deque[_HostCopy] = deque()

    def available_cache(self) -> CacheSizes:
        return self.stage.available_cache()

    def allocate_kv_cache(self, num_blocks: int, num_snapshots: int = 0) -> None:
        self.stage.allocate_kv_cache(num_blocks, num_snapshots)

    def submit(self, plan: StepPlan) -> None:
        data = run_stage_step(self.stage, 0, True, plan, None, self.hidden_size, self.num_spec_tokens)
        self._results.append(_HostCopy(plan, data))

    def receive(self, timeout: float) -> StepResult:
        return self._results.popleft().wait(timeout)

    def shutdown(self) -> None:
        if self.stage is not None:
            self.stage.close()
        self.stage = None
        self._results.clear()
        release_device_memory()


class _HostCopy:
    """A step's result on its way to the host: copied behind the step's kernels into pinned memory,
    so enqueueing it does not wait for them."""

    def __init__(self, plan: StepPlan, data: torch.Tensor):
        self.plan, self.step_id = plan, plan.step_id
        self.done = None
        if data.device.type == "cuda":
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
            data = host
        self.data = data

    def wait(self, timeout: float) -> StepResult:
        """The result, once its copy has landed; a StageError past `timeout` seconds."""
        if self.done is not None:
            deadline = time.monotonic() + timeout
            while not self.done.query():       # polled: a plain sync could not give up
                if time.monotonic() > deadline:
                    raise StageError(f"step {self.step_id} did not finish on the GPU within {timeout:g}s")
                time.sleep(0)
        return StepResult.of(self.plan, self.data)
