"""LocalExecutor (PP = 1) hands plans to its stage and results back in order."""
from __future__ import annotations

import torch

from pipespec.plan import StepResult
from pipespec.runtime.executor import LocalExecutor


class FakeStage:
    def __init__(self):
        self.allocated = None
        self.seen = []

    def available_kv_blocks(self):
        return 7

    def allocate_kv_cache(self, n):
        self.allocated = n

    def execute(self, plan):
        self.seen.append(plan)
        return StepResult.build(plan, 1, 0, torch.tensor([0]), torch.tensor([100 + plan]))


def test_local_executor_round_trip():
    ex = LocalExecutor(FakeStage)
    assert ex.max_in_flight == 1
    assert ex.available_kv_blocks() == 7
    ex.allocate_kv_cache(5)
    assert ex.stage.allocated == 5
    for step in (1, 2):
        ex.submit(step)
        res = ex.receive(timeout=1.0)
        assert res.step_id == step and res.tokens(0) == [100 + step]
    assert ex.stage.seen == [1, 2]
    ex.shutdown()
