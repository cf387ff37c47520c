"""StepPlan / StepResult: the messages of a step."""
from __future__ import annotations

import torch

from pipespec.plan import StepResult, result_width


def test_step_result_rows():
    # 3 requests, rows 0 and 2 sample; row 1 is a prefill chunk that does not
    res = StepResult.build(step_id=4, num_reqs=3, num_spec_tokens=0, sample_rows=torch.tensor([0, 2]),
                           sampled=torch.tensor([11, 33]))
    assert res.step_id == 4 and res.data.shape == (3, result_width(0)) == (3, 2)
    assert res.tokens(0) == [11] and res.tokens(1) == [] and res.tokens(2) == [33]
    assert res.data.device.type == "cpu"


def test_plan_logits_rows_and_to():
    from pipespec.config import SchedulerConfig
    from pipespec.engine.scheduler import Scheduler
    from tests.helpers import make_request
    sched = Scheduler(SchedulerConfig(), 16, 8, 128)
    a, b = make_request("a", [5] * 7, arrival=0), make_request("b", [6] * 3, arrival=1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule().plan
    assert plan.num_reqs == 2 and plan.num_tokens == 10
    assert plan.logits_rows().tolist() == [6, 9]
    assert plan.query_lens().tolist() == [7, 3] and plan.max_query_len() == 7
    moved = plan.to("cpu")
    assert torch.equal(moved.input_ids, plan.input_ids) and moved.sampling.all_greedy
