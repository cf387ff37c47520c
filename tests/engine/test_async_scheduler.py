"""Async scheduling in the scheduler, with no model: a step is scheduled while the one before it is
still out, and a request of that step may continue in it with its sampled token carried.

`drive` plays the engine and the stage: it keeps up to two steps in flight, substitutes carried
tokens from the previous step's result as the stage does, and checks every row it embeds against the
token the request ends up holding at that position.
"""
from __future__ import annotations

from collections import deque

import pytest

from pipespec.config import SchedulerConfig
from pipespec.engine.scheduler import Scheduler
from tests.helpers import make_request

BS = 4


def sched_with(async_scheduling: bool, num_blocks=64, budget=32, max_seqs=8, max_model_len=256) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=0)
    return Scheduler(cfg, BS, num_blocks, max_model_len, async_scheduling=async_scheduling)


def sampled_token(req, position: int) -> int:
    """The 'model': a token that depends on the request and the position it will occupy."""
    return 100 + (int(req.request_id[1:]) * 31 + position * 7) % 50


def drive(sched: Scheduler, reqs, eos: int | None = None, max_steps: int = 2000) -> dict[str, list[int]]:
    """Run to completion with 1 (sync) or 2 (async) steps in flight; returns each request's tokens."""
    for r in reqs:
        sched.add(r)
    in_flight, embedded = deque(), {}
    prev_step, prev_tokens = None, []
    depth = 2 if sched.async_scheduling else 1
    for _ in range(max_steps):
        while len(in_flight) < depth:
            batch = sched.schedule()
            if batch is None:
                break
            plan = batch.plan
            ids = plan.input_ids.tolist()
            qsl = plan.query_start_loc.tolist()
            if plan.carried is not None:                  # the stage's substitution
                assert prev_step == plan.step_id - 1
                for row, c in enumerate(plan.carried.tolist()):
                    if c >= 0:
                        assert prev_tokens[c] >= 0, "carried from a row that did not sample"
                        ids[qsl[row]] = prev_tokens[c]
            for row, req in enumerate(batch.requests):
                for i, pos in enumerate(plan.positions[qsl[row]:qsl[row + 1]].tolist()):
                    embedded.setdefault((req.request_id, pos), set()).add(ids[qsl[row] + i])
            samplers = set(plan.sample_rows.tolist())
            prev_tokens = [sampled_token(r, int(plan.seq_lens[row])) if row in samplers else -1
                           for row, r in enumerate(batch.requests)]
            prev_step = plan.step_id
            in_flight.append((batch, prev_tokens))
        if not in_flight:
            break
        batch, tokens = in_flight.popleft()
        sched.complete(batch)
        for req, token in zip(batch.requests, tokens):
            if req.finished or token < 0:
                continue
            req.token_ids.append(token)
            if token == eos:
                sched.finish(req, "stop")
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= sched.max_model_len:
                sched.finish(req, "length")
    assert not sched.has_work() and not in_flight
    assert sched.allocator.num_free == sched.allocator.num_blocks, "KV blocks leaked"
    assert sched.state_slots.num_free == sched.state_slots.num_blocks, "state slots leaked"
    for req in reqs:
        assert req.in_flight == req.num_pending_tokens == req.num_pending_samples == 0
        # every position whose KV was computed embedded the token the request holds there, and only it
        # (positions past the end are the dropped row of a request that stopped meanwhile)
        for p in range(req.num_tokens - 1):
            assert embedded[(req.request_id, p)] == {req.token_ids[p]}, (req.request_id, p)
    return {r.request_id: r.token_ids for r in reqs}


def workload(max_tokens=(6, 1, 9, 3, 12)):
    return [make_request(f"r{i}", [10 + i + j for j in range(5 + 7 * i)], max_tokens=m)
            for i, m in enumerate(max_tokens)]


@pytest.mark.parametrize("scenario", ["plain", "small_budget", "preemption", "eos", "model_len"])
def test_async_scheduling_gives_the_sync_tokens_and_embeds_each_one_where_it_belongs(scenario):
    kw = {"small_budget": dict(budget=7), "preemption": dict(num_blocks=12, budget=16),
          "model_len": dict(max_model_len=30)}.get(scenario, {})
    eos = 109 if scenario == "eos" else None     # r2 samples it third of its 9
    want = drive(sched_with(False, **kw), workload(), eos)
    sched = sched_with(True, **kw)
    assert drive(sched, workload(), eos) == want
    assert sched.num_carried_rows > 0
    if scenario == "preemption":
        assert sched.num_preemptions > 0
    if scenario == "eos":
        assert any(t[-1] == eos and len(t) < len(p) + m for t, p, m in
                   zip(want.values(), [r.token_ids for r in workload()], (6, 1, 9, 3, 12)))


def test_a_decoding_request_continues_in_the_next_step_with_its_token_carried():
    sched = sched_with(True)
    a, b = make_request("r0", [1, 2, 3], max_tokens=5), make_request("r1", [4, 5], max_tokens=5)
    for r in (a, b):
        sched.add(r)
    first = sched.schedule()
    assert first.plan.carried is None and first.samples == [True, True]
    second = sched.schedule()                    # before the first returns
    assert second.requests == [a, b]
    assert second.plan.carried.tolist() == [0, 1]        # the first step's rows
    assert second.plan.positions.tolist() == [3, 2]      # one past each prompt
    assert second.plan.seq_lens.tolist() == [4, 3]
    assert second.plan.sample_rows.tolist() == [0, 1]
    assert second.plan.next_token_ids.tolist() == [-1, -1]
    assert sched.schedule() is None              # a request is never two steps ahead
    assert a.in_flight == 2 and a.num_scheduled_tokens == 4 and a.num_expected_tokens == 5


def test_the_step_that_reaches_max_tokens_is_not_continued():
    sched = sched_with(True)
    done, more = make_request("r0", [1, 2, 3], max_tokens=1), make_request("r1", [4, 5], max_tokens=2)
    sched.add(done)
    sched.add(more)
    sched.schedule()
    assert sched.schedule().requests == [more]


def test_a_prompt_chunk_continues_with_the_known_tokens_of_the_next():
    sched = sched_with(True, budget=4)
    req = make_request("r0", list(range(20, 30)), max_tokens=3)
    sched.add(req)
    sched.schedule()
    nxt = sched.schedule()
    assert nxt.plan.carried is None
    assert nxt.plan.input_ids.tolist() == [24, 25, 26, 27] and nxt.plan.positions.tolist() == [4, 5, 6, 7]


def test_a_request_stopped_while_its_next_step_is_out_frees_its_blocks_when_that_returns():
    sched = sched_with(True)
    req = make_request("r0", [1, 2, 3], max_tokens=8)
    sched.add(req)
    first, second = sched.schedule(), sched.schedule()
    sched.complete(first)
    req.token_ids.append(50)
    sched.finish(req, "stop")                    # a stop token: the second step's row is wasted
    assert req.block_ids and sched.allocator.num_free < sched.allocator.num_blocks
    sched.complete(second)
    assert not req.block_ids and sched.allocator.num_free == sched.allocator.num_blocks
    assert sched.state_slots.num_free == sched.state_slots.num_blocks


def test_async_scheduling_refuses_micro_batches_and_a_fixed_k():
    cfg = SchedulerConfig()
    with pytest.raises(ValueError, match="async scheduling"):
        Scheduler(cfg, BS, 8, 64, num_micro_batches=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async scheduling"):
        Scheduler(cfg, BS, 8, 64, num_spec_tokens=2, async_scheduling=True)


def test_with_adaptive_k_only_a_step_without_drafts_is_continued():
    """After a K = 2 step the next waits for its result (acceptance and new drafts come with it);
    after a K = 0 step a request continues, and verifies none of the drafts it still holds (they are
    an older step's: the one in flight brings its own)."""
    ks = iter([2, 0, 0, 0])
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, long_prefill_token_threshold=0)
    sched = Scheduler(cfg, BS, 64, 256, num_spec_tokens=2, choose_k=lambda n: next(ks), async_scheduling=True)
    req = make_request("r0", [1, 2, 3], max_tokens=8)
    sched.add(req)
    prefill = sched.schedule()                        # K = 2, no drafts yet: samples one, drafts two
    assert prefill.plan.num_spec_tokens == 2 and sched.schedule() is None
    sched.complete(prefill)
    req.token_ids.append(40)
    req.draft_ids = [41, 42]
    verify = sched.schedule()                         # K = 0: the drafts are not verified
    assert verify.num_drafts == [0] and verify.plan.num_spec_tokens == 0
    ahead = sched.schedule()
    assert ahead.requests == [req] and ahead.num_drafts == [0] and ahead.plan.carried.tolist() == [0]
