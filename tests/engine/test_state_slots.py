"""Linear-attention state slots (Qwen3.5 / Qwen3-Next) on the driver side, with no model: the
scheduler gives each running request a slot beside its KV blocks, frees it on finish, abort and
preemption, and carries slots and the accepted count of the last verify step in the plan."""
from __future__ import annotations

import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.scheduler import Scheduler
from pipespec.plan import StepResult
from tests.helpers import make_request


def _sched(max_seqs=4, num_blocks=64, k=0) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs, long_prefill_token_threshold=0)
    return Scheduler(cfg, 4, num_blocks, 64, num_spec_tokens=k)


def test_each_running_request_has_its_own_slot_until_it_finishes():
    sched = _sched(max_seqs=2)
    a, b, c = (make_request(x, [5, 6, 7]) for x in "abc")
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule()
    assert batch.requests == [a, b] and sorted(batch.plan.state_slots.tolist()) == [0, 1]
    sched.finish(a, "abort")                  # in flight: its slot stays until the batch returns
    assert a.state_slot is not None and sched.schedule() is None
    sched.complete(batch)
    assert a.state_slot is None and sched.state_slots.num_free == 1
    batch = sched.schedule()
    assert c in batch.requests and c.state_slot == 0
    assert batch.plan.state_slots.tolist() == [r.state_slot for r in batch.requests]


def test_preemption_frees_the_slot_and_the_request_restarts_at_position_zero():
    sched = _sched(num_blocks=3)              # 4-token prompts take a block each; decodes need a second
    a, b = make_request("a", [3, 4, 5, 6]), make_request("b", [7, 8, 9, 10])
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        batch = sched.schedule()
        sched.complete(batch)
        for row in batch.plan.sampling_reqs.tolist():
            batch.requests[row].token_ids.append(11)
    assert b.state_slot is None and b.num_computed_tokens == 0 and a.state_slot is not None
    assert sched.state_slots.num_free == sched.state_slots.num_blocks - 1
    batch = sched.schedule()
    while b not in batch.requests:
        sched.complete(batch)
        sched.finish(a, "length")
        batch = sched.schedule()
    row = batch.requests.index(b)
    assert b.state_slot is not None and int(batch.plan.state_slots[row]) == b.state_slot
    assert int(batch.plan.positions[batch.plan.query_start_loc[row]]) == 0    # the stage starts it afresh


def test_the_next_plan_carries_the_accepted_count_of_a_verify_step():
    sched = _sched(k=2)
    req = make_request("r", [5, 6, 7], max_tokens=8)
    sched.add(req)
    batch = sched.schedule()
    assert batch.plan.state_commit.tolist() == [-1]
    sched.complete(batch)
    req.token_ids.append(9)
    req.draft_ids = [10, 11]
    batch = sched.schedule()                  # verifies 2 drafts: 3 rows
    assert batch.num_drafts == [2] and batch.plan.state_commit.tolist() == [-1]
    # one draft accepted: tokens [10, 20] (the accepted draft, then the correction)
    result = StepResult.from_verification(batch.plan.step_id, 1, 2, torch.tensor([0]), torch.tensor([[10, 20, -1]]),
                                          torch.tensor([2]), torch.tensor([[30, 31]]))
    sched.complete(batch, result)
    req.token_ids += [10, 20]
    req.draft_ids = []
    batch = sched.schedule()
    assert batch.plan.state_commit.tolist() == [1]      # the state after row 1 (the accepted draft)
    # no drafts held: dummy rows pad the line to K (a verify line still, whose row 0 is the real one)
    assert batch.num_drafts == [0] and batch.num_draft_rows == [2] and batch.plan.num_drafts.tolist() == [0]
    sched.complete(batch, StepResult.from_verification(batch.plan.step_id, 1, 2, torch.tensor([0]),
                                                       torch.tensor([[40, -1, -1]]), torch.tensor([1])))
    req.token_ids.append(40)
    batch = sched.schedule()
    assert batch.plan.state_commit.tolist() == [0]      # the state after the real row
