"""Async scheduling in the scheduler, with no model: a step is scheduled while the one before it is
still out, and a request of that step may continue in it with its sampled token carried.

`drive` plays the engine and the stage: it keeps up to two steps in flight, substitutes carried
tokens from the previous step's result as the stage does, and checks every row it embeds against the
token the request ends up holding at that position.
"""
from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.scheduler import Scheduler
from pipespec.plan import StepResult
from tests.helpers import make_request

BS = 4


def sched_with(async_scheduling: bool, num_blocks=64, budget=32, max_seqs=8, max_model_len=256,
               k: int = 0, ks=None) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=0)
    choose = None if ks is None else (lambda n, it=itertools.cycle(ks): next(it))
    return Scheduler(cfg, BS, num_blocks, max_model_len, num_spec_tokens=k, choose_k=choose,
                     async_scheduling=async_scheduling)


def sampled_token(req, position: int) -> int:
    """The 'model': a token that depends on the request and the position it will occupy."""
    return 100 + (int(req.request_id[1:]) * 31 + position * 7) % 50


def proposed(req, position: int, k: int) -> list[int]:
    """The 'drafter': drafts for the k positions after `position`, two in three right."""
    return [sampled_token(req, p) if (int(req.request_id[1:]) + p) % 3 else 999
            for p in range(position + 1, position + k + 1)]


def play(plan, requests, carry):
    """The stage: substitutes carried lines (their token, drafts and shift, from `carry`, the
    previous step's per-row (last token, drafts, accepted)), verifies each sampling line against the
    model and drafts anew. Returns the rows computed for good (request, position, id), the
    StepResult and this step's carry."""
    k = plan.num_spec_tokens
    ids, pos = plan.input_ids.tolist(), plan.positions.tolist()
    qsl, real, rows_of = plan.query_start_loc.tolist(), plan.num_drafts.tolist(), plan.num_draft_rows.tolist()
    for row, c in enumerate([] if plan.carried is None else plan.carried.tolist()):
        if c >= 0:
            token, drafts, shift = carry[c]
            assert token >= 0, "carried from a row that did not sample"
            ids[qsl[row]:qsl[row] + 1 + real[row]] = [token] + drafts[:real[row]]
            pos[qsl[row]:qsl[row + 1]] = [p + shift for p in pos[qsl[row]:qsl[row + 1]]]
    samplers = plan.sampling_reqs.tolist()
    computed, tokens, new_carry, drafts = [], [], [], []
    for row, req in enumerate(requests):
        lo, hi = qsl[row], qsl[row + 1]
        # KV room for every row where it really lands, and for a sampling line the MTP chain's K - 1
        # positions past it
        last = pos[hi - 1] + (max(k - 1, 0) if row in samplers else 0)
        assert last // BS < len(req.block_ids), (req.request_id, last)
        if row not in samplers:
            computed += [(req.request_id, pos[i], ids[i]) for i in range(lo, hi)]
            new_carry.append((-1, [], 0))
            continue
        first = hi - 1 - rows_of[row]                 # the last non-draft row
        accepted = 0
        while accepted < real[row] and ids[first + 1 + accepted] == sampled_token(req, pos[first] + 1 + accepted):
            accepted += 1
        end = pos[first] + accepted + 1               # the position of the token sampled
        computed += [(req.request_id, pos[i], ids[i]) for i in range(lo, first + 1 + accepted)]
        tokens.append(ids[first + 1:first + 1 + accepted] + [sampled_token(req, end)] + [-1] * (k - accepted))
        drafts.append(proposed(req, end, k))
        new_carry.append((sampled_token(req, end), drafts[-1], accepted))
    result = StepResult.from_verification(
        plan.step_id, len(requests), k, torch.tensor(samplers, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int64).view(len(samplers), k + 1),
        torch.tensor([sum(t >= 0 for t in line) for line in tokens], dtype=torch.int64),
        torch.tensor(drafts, dtype=torch.int64).view(len(samplers), k) if k else None)
    return computed, result, new_carry


def drive(sched: Scheduler, reqs, eos: int | None = None, max_steps: int = 2000) -> dict[str, list[int]]:
    """Run to completion with 1 (sync) or 2 (async) steps in flight; returns each request's tokens."""
    for r in reqs:
        sched.add(r)
    in_flight, embedded = deque(), {}
    prev_step, carry = None, []
    depth = 2 if sched.async_scheduling else 1
    for _ in range(max_steps):
        while len(in_flight) < depth:
            batch = sched.schedule()
            if batch is None:
                break
            if batch.plan.carried is not None:
                assert prev_step == batch.plan.step_id - 1
            computed, result, carry = play(batch.plan, batch.requests, carry)
            for rid, pos, token in computed:
                embedded.setdefault((rid, pos), set()).add(token)
            prev_step = batch.plan.step_id
            in_flight.append((batch, result))
        if not in_flight:
            break
        batch, result = in_flight.popleft()
        sched.complete(batch, result)
        for row, req in enumerate(batch.requests):
            for token in result.tokens(row):
                if req.finished:
                    break
                req.token_ids.append(token)
                if token == eos:
                    sched.finish(req, "stop")
                elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= sched.max_model_len:
                    sched.finish(req, "length")
            if not req.finished:
                req.draft_ids = result.drafts(row)
    assert not sched.has_work() and not in_flight
    assert sched.allocator.num_free == sched.allocator.num_blocks, "KV blocks leaked"
    assert sched.state_slots.num_free == sched.state_slots.num_blocks, "state slots leaked"
    for req in reqs:
        assert req.in_flight == req.num_pending_tokens == req.num_pending_samples == 0
        # every position whose KV was computed for good embedded the token the request holds there,
        # and only it (positions past the end are the dropped rows of a request that stopped meanwhile)
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
    assert second.plan.sampling_reqs.tolist() == [0, 1]
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


def test_async_scheduling_refuses_micro_batches():
    with pytest.raises(ValueError, match="async scheduling"):
        Scheduler(SchedulerConfig(), BS, 8, 64, num_micro_batches=2, async_scheduling=True)


@pytest.mark.parametrize("scenario", ["plain", "small_budget", "preemption", "eos", "model_len"])
@pytest.mark.parametrize("k, ks", [(2, None), (3, None), (2, [2, 2, 0, 0, 1, 2, 0])])
def test_with_drafts_continued_lines_take_their_drafts_and_shift_and_give_the_sync_tokens(scenario, k, ks):
    """Fixed K, and adaptive K moving between 0, 1 and 2: lines continued after a verify step take the
    token and drafts its result carries and move on by the drafts it accepted; the tokens equal
    plain synchronous decoding's and every position computed for good embedded the right token."""
    kw = {"small_budget": dict(budget=9), "preemption": dict(num_blocks=14, budget=16),
          "model_len": dict(max_model_len=30)}.get(scenario, {})
    eos = 109 if scenario == "eos" else None
    want = drive(sched_with(False, **kw), workload(), eos)
    sched = sched_with(True, k=k, ks=ks, **kw)
    assert drive(sched, workload(), eos) == want
    assert sched.num_carried_rows > 0
    if scenario == "preemption":
        assert sched.num_preemptions > 0


def test_after_a_verify_step_a_request_continues_with_its_drafts_from_the_device():
    """Planned before the K = 2 step returns: three rows (the token it samples, its two drafts) as
    placeholders at the positions of no accepted draft, carried from its row, with KV room for the
    two positions the line may move on by."""
    sched = sched_with(True, k=2)
    req = make_request("r0", [1, 2, 3], max_tokens=20)
    sched.add(req)
    sched.schedule()                                  # the prefill: samples one, drafts two
    step = sched.schedule()
    assert step.plan.carried.tolist() == [0] and step.num_drafts == [2] and step.num_draft_rows == [2]
    assert step.plan.input_ids.tolist() == [0, 0, 0] and step.plan.positions.tolist() == [3, 4, 5]
    assert step.plan.num_drafts.tolist() == [2] and step.plan.next_token_ids.tolist() == [-1]
    # KV room: up to position 5 + 2 (the drafts the first step may accept) + 1 (the MTP chain past it)
    assert len(req.block_ids) * BS >= 5 + 2 + 1 + 1
    assert sched.schedule() is None                   # a request is never two steps ahead
