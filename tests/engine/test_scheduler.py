"""Scheduler logic on hand-made Requests, with no model: the engine's side of a step is simulated."""
from __future__ import annotations

import pytest
import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.request import RequestStatus
from pipespec.engine.scheduler import Scheduler
from pipespec.plan import StepResult
from pipespec.sampling import SamplingParams
from tests.helpers import make_request

BS = 4   # block size


def sched_with(num_blocks=64, budget=32, max_seqs=8, chunked=True, max_model_len=256,
               chunk_limit=0) -> Scheduler:
    """chunk_limit: long_prefill_token_threshold (0 here, unlike the engine's default, so that the
    tests of the budget alone see whole-budget chunks)."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=chunk_limit)
    return Scheduler(cfg, BS, num_blocks, max_model_len)


def prompt(n: int, base: int = 10) -> list[int]:
    return [base + i for i in range(n)]


def check_plan(batch, sched: Scheduler) -> None:
    """The plan is consistent with the requests' state before the step."""
    plan = batch.plan
    qsl = plan.query_start_loc.tolist()
    assert qsl[0] == 0 and qsl[-1] == plan.num_tokens
    assert plan.num_tokens <= sched.config.max_num_batched_tokens
    assert plan.num_reqs == len(batch.requests) <= sched.config.max_num_seqs
    for b, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start = req.num_computed_tokens
        assert qsl[b + 1] - qsl[b] == n >= 1
        rows = slice(qsl[b], qsl[b + 1])
        assert plan.input_ids[rows].tolist() == req.token_ids[start:start + n]
        assert plan.positions[rows].tolist() == list(range(start, start + n))
        assert int(plan.seq_lens[b]) == start + n
        for p, slot in zip(range(start, start + n), plan.slot_mapping[rows].tolist()):
            assert slot == req.block_ids[p // BS] * BS + p % BS
            assert int(plan.block_tables[b, p // BS]) == req.block_ids[p // BS]
        assert len(req.block_ids) * BS >= start + n
        table = plan.block_tables[b].tolist()
        assert table == list(req.block_ids) + [0] * (len(table) - len(req.block_ids)), "padded with 0"
    assert plan.block_tables.shape[1] == max(len(r.block_ids) for r in batch.requests)
    samplers = [b for b, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens))
                if req.num_computed_tokens + n == req.num_tokens]
    assert plan.sampling_reqs.tolist() == samplers
    assert plan.sampling.temperature.shape[0] == len(samplers)


def step(sched: Scheduler, token: int = 7):
    """One engine step: schedule, 'run', complete, append a token to requests that sampled."""
    batch = sched.schedule()
    if batch is None:
        return None
    check_plan(batch, sched)
    sampled = [batch.requests[b] for b in batch.plan.sampling_reqs.tolist()]
    sched.complete(batch)
    for req in sampled:
        req.token_ids.append(token)
        if req.num_output_tokens >= req.max_tokens:
            sched.finish(req, "length")
    return batch


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list:
    batches = []
    for _ in range(max_steps):
        if not sched.has_work():
            return batches
        b = step(sched)
        assert b is not None, "scheduler has work but scheduled nothing"
        batches.append(b)
    raise AssertionError("did not finish")


def test_token_budget_is_respected_and_prefills_are_chunked():
    sched = sched_with(budget=25)
    reqs = [make_request(f"r{i}", prompt(10), max_tokens=3, arrival=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    first = step(sched)
    assert first.plan.num_tokens == 25
    assert [r.request_id for r in first.requests] == ["r0", "r1", "r2"]
    assert first.num_new_tokens == [10, 10, 5]
    assert first.plan.sampling_reqs.tolist() == [0, 1]     # r2's prompt is not done: no sample
    assert reqs[2].num_computed_tokens == 5 and reqs[2].num_output_tokens == 0
    batches = [first] + run_to_completion(sched)
    assert all(b.plan.num_tokens <= 25 for b in batches)
    assert all(r.num_output_tokens == 3 and r.finish_reason == "length" for r in reqs)
    assert sched.allocator.num_free == sched.allocator.num_blocks


def test_chunked_prefill_splits_long_prompt_over_steps():
    sched = sched_with(budget=16)
    req = make_request("long", prompt(40), max_tokens=2)
    sched.add(req)
    chunks = []
    while req.num_output_tokens == 0:
        b = step(sched)
        chunks.append((b.num_new_tokens[0], b.plan.sampling_reqs.tolist()))
    assert chunks == [(16, []), (16, []), (8, [0])]
    b = step(sched)   # the decode step
    assert b.num_new_tokens == [1] and b.plan.positions.tolist() == [40]
    assert req.finished and sched.allocator.num_free == sched.allocator.num_blocks


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = sched_with(budget=16, chunked=False)
    a = make_request("a", prompt(10), max_tokens=2, arrival=0)
    b = make_request("b", prompt(12), max_tokens=2, arrival=1)
    sched.add(a)
    sched.add(b)
    first = step(sched)
    assert first.requests == [a] and first.num_new_tokens == [10]   # b does not fit in 6 tokens
    second = step(sched)
    assert second.requests == [a, b] and second.num_new_tokens == [1, 12]
    run_to_completion(sched)


def test_max_num_seqs_is_respected():
    sched = sched_with(max_seqs=2, budget=64)
    reqs = [make_request(f"r{i}", prompt(3), max_tokens=2 + i, arrival=i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    batches = run_to_completion(sched)
    assert max(b.plan.num_reqs for b in batches) == 2
    assert [r.request_id for r in batches[0].requests] == ["r0", "r1"]
    # a slot frees when r0 finishes, and r2 takes it
    started = {}
    for i, b in enumerate(batches):
        for r in b.requests:
            started.setdefault(r.request_id, i)
    assert started["r2"] > started["r0"] and started["r2"] <= 2
    assert all(r.finished for r in reqs)


def test_preemption_takes_newest_and_requeues_it_first():
    # 6 blocks of 4 tokens; three 4-token prompts take one block each, then decodes need more
    sched = sched_with(num_blocks=6, budget=64, max_model_len=24)
    reqs = [make_request(f"r{i}", prompt(4, base=100 * i), max_tokens=12, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched)
    assert all(len(r.block_ids) == 1 and r.num_output_tokens == 1 for r in reqs)
    step(sched)                                   # each decode crosses into a second block: 6 used
    assert sched.allocator.num_free == 0 and sched.num_preemptions == 0
    for _ in range(3):                            # positions 5..7 stay inside the second block
        step(sched)
    assert sched.num_preemptions == 0
    tokens_before = list(reqs[2].token_ids)
    b = step(sched)                               # position 8: needs a third block each
    assert sched.num_preemptions >= 1
    newest = reqs[2]
    assert newest.status is RequestStatus.WAITING and sched.waiting[0] is newest
    assert newest.num_computed_tokens == 0 and not newest.block_ids
    assert newest.token_ids == tokens_before, "a preempted request keeps its tokens"
    assert newest not in b.requests
    assert reqs[0] in b.requests and reqs[0].status is RequestStatus.RUNNING
    run_to_completion(sched)
    assert all(r.finished and r.num_output_tokens == 12 for r in reqs)
    assert sched.allocator.num_free == sched.allocator.num_blocks


def _add_two(sched: Scheduler, prompt_len: int, max_tokens: int):
    """Requests a, then b, with prompts of their own."""
    a = make_request("a", prompt(prompt_len), max_tokens=max_tokens, arrival=0)
    b = make_request("b", prompt(prompt_len, base=50), max_tokens=max_tokens, arrival=1)
    sched.add(a)
    sched.add(b)
    return a, b


def test_preempted_request_is_recomputed_in_full():
    sched = sched_with(num_blocks=4, budget=64, max_model_len=16)
    a, b = _add_two(sched, 5, 11)
    recompute = []
    while sched.has_work():
        batch = step(sched)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req is b and n > 1 and b.num_output_tokens > 1:
                recompute.append(n)
    assert sched.num_preemptions >= 1
    assert recompute, "b was never recomputed after its preemption"
    assert a.num_output_tokens == b.num_output_tokens == 11
    assert sched.allocator.num_free == 4


def test_preempted_request_comes_back_when_all_its_tokens_fit():
    """Let in again for its next chunk alone, a preempted request grew back into the blocks the
    other one needed and was preempted again (at PP = 2 with hybrid snapshots, for good)."""
    sched = sched_with(num_blocks=6, budget=4, max_model_len=16)   # together a and b need 8 blocks
    a, b = _add_two(sched, 4, 12)
    came_back = []
    while sched.has_work():
        was = b.status
        step(sched)
        if was is RequestStatus.WAITING and b.status is RequestStatus.RUNNING and b.num_output_tokens:
            came_back.append(len(b.block_ids) + sched.allocator.num_free - -(-b.num_tokens // BS))
    assert sched.num_preemptions == 1 and len(came_back) == 1
    assert came_back[0] >= 0, "b came back before all its tokens fit"
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_finish_while_in_flight_frees_blocks_on_complete():
    sched = sched_with()
    req = make_request("x", prompt(9), max_tokens=4)
    sched.add(req)
    batch = sched.schedule()
    assert req.in_flight and len(req.block_ids) == 3
    sched.finish(req, "abort")
    assert req.finished and len(req.block_ids) == 3, "blocks of a request in flight stay until it returns"
    sched.complete(batch)
    assert not req.block_ids and sched.allocator.num_free == sched.allocator.num_blocks
    assert sched.schedule() is None


def test_abort_waiting_request():
    sched = sched_with()
    req = make_request("w", prompt(5))
    sched.add(req)
    sched.finish(req, "abort")
    assert not sched.has_work() and req.finish_reason == "abort"
    assert sched.schedule() is None


def test_sampling_tensors_follow_request_params():
    sched = sched_with()
    greedy = make_request("g", prompt(3), params=SamplingParams(temperature=0.0), seed=5)
    hot = make_request("h", prompt(3), params=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
                       seed=2**40 + 3, arrival=1)
    sched.add(greedy)
    sched.add(hot)
    st = sched.schedule().plan.sampling
    assert st.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert st.top_k.tolist() == [-1, 20]
    assert st.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert st.min_p.tolist() == pytest.approx([0.0, 0.05])
    assert st.seed.tolist() == [5, 2**40 + 3]
    assert st.needs_sort and not st.all_greedy
    assert st.seed.dtype == torch.int64


# -- no head-of-line blocking behind a long prefill -------------------------------------------------


def test_long_prefill_shares_its_steps_with_requests_arriving_after_it():
    sched = sched_with(budget=32, chunk_limit=8, num_blocks=128, max_model_len=512)
    long = make_request("long", prompt(200), max_tokens=2, arrival=0)
    sched.add(long)
    assert step(sched).num_new_tokens == [32]                 # alone in the engine: the whole budget
    short = make_request("short", prompt(3, base=500), max_tokens=3, arrival=1)
    sched.add(short)
    second = step(sched)
    assert second.requests == [long, short] and second.num_new_tokens == [8, 3]
    assert short.num_output_tokens == 1                        # first token one step after arriving
    third = step(sched)
    assert third.requests == [short, long] and third.num_new_tokens == [1, 8]   # decodes first
    step(sched)
    assert short.finished and short.num_output_tokens == 3
    assert step(sched).num_new_tokens == [32]                 # alone again: the whole budget
    run_to_completion(sched)
    assert long.num_output_tokens == 2 and sched.allocator.num_free == sched.allocator.num_blocks


def test_without_a_chunk_limit_a_long_prefill_fills_the_steps():
    """long_prefill_token_threshold=0: the old behaviour, the later request waits for the budget."""
    sched = sched_with(budget=32, chunk_limit=0, num_blocks=128, max_model_len=512)
    long = make_request("long", prompt(200), max_tokens=2, arrival=0)
    short = make_request("short", prompt(3, base=500), max_tokens=3, arrival=1)
    sched.add(long)
    sched.add(short)
    assert step(sched).requests == [long]
    assert step(sched).requests == [long]
    assert short.num_output_tokens == 0
    run_to_completion(sched)


def test_decodes_are_never_starved_by_prefill_chunks():
    sched = sched_with(budget=16, chunk_limit=4, num_blocks=256, max_model_len=512, max_seqs=16)
    decoders = [make_request(f"d{i}", prompt(2, base=100 * i), max_tokens=40, arrival=i) for i in range(6)]
    for r in decoders:
        sched.add(r)
    step(sched)
    prefills = [make_request(f"p{i}", prompt(90, base=1000 + 100 * i), max_tokens=2, arrival=10 + i)
                for i in range(3)]
    for r in prefills:
        sched.add(r)
    for _ in range(10):
        b = step(sched)
        decoding = [r for r in decoders if not r.finished]
        assert b.requests[:len(decoding)] == decoding          # every decode, every step, first
        assert all(n <= 4 for r, n in zip(b.requests, b.num_new_tokens) if r in prefills)
    run_to_completion(sched)
    assert all(r.finished for r in decoders + prefills)


def test_default_chunk_limit_is_a_quarter_of_the_budget():
    assert SchedulerConfig(max_num_batched_tokens=1024).prefill_chunk_limit == 256
    assert SchedulerConfig(max_num_batched_tokens=2).prefill_chunk_limit == 1
    assert SchedulerConfig(long_prefill_token_threshold=100).prefill_chunk_limit == 100
    assert SchedulerConfig(long_prefill_token_threshold=0).prefill_chunk_limit == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("async_", [False, True])
def test_steps_after_a_change_of_k_are_steady_once_it_settled(async_):
    """A step's cost is the interval since the previous result, which with async scheduling the step
    before it (planned at the old K) shares: there the second step at a new K is a transition too."""
    ks = [0, 0, 0, 2, 2, 2, 2, 1, 1, 1]
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, long_prefill_token_threshold=0)
    sched = Scheduler(cfg, BS, 64, 256, num_spec_tokens=2, choose_k=lambda n: ks[sched.num_steps],
                      async_scheduling=async_)
    reqs = [make_request(f"r{i}", [1, 2, 3], max_tokens=40) for i in range(2)]
    for r in reqs:
        sched.add(r)
    steady = []
    for k in ks:
        step = sched.schedule()
        assert step.plan.num_spec_tokens == k
        steady.append(step.steady)
        n = len(step.requests)
        sched.complete(step, StepResult.from_verification(
            step.plan.step_id, n, k, torch.arange(n), torch.tensor([[5] + [-1] * k] * n), torch.ones(n, dtype=torch.int64),
            torch.tensor([[7] * k] * n) if k else None))
        for r in reqs:
            r.token_ids.append(5)
            r.draft_ids = [7] * k
    settle = 1 + async_
    assert sched.k_settle == settle
    # (the first step is a prefill; a K = 2 step after K = 0 verifies no real drafts)
    expected = [False] + [True] * 2 + [False] * max(settle, 1) + [True] * (4 - max(settle, 1)) \
        + [False] * settle + [True] * (3 - settle)
    assert steady == expected


def test_a_line_short_of_drafts_is_padded_to_the_steps_k_within_the_budget():
    """After a K = 0 step a request holds no drafts: at K = 2 its line is padded with two dummy draft
    rows (real drafts 0), so the step keeps a graph's shape; the budget caps the padding. Only steps
    that verify K real drafts at an unchanged K are steady (adaptive K's costs)."""
    for budget, padded in ((32, True), (4, False)):
        ks = iter([0, 2])
        cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, long_prefill_token_threshold=0)
        sched = Scheduler(cfg, BS, 64, 256, num_spec_tokens=2, choose_k=lambda n: next(ks))
        a, b = make_request("r0", [1, 2], max_tokens=8), make_request("r1", [3, 4], max_tokens=8)
        for r in (a, b):
            sched.add(r)
        first = sched.schedule()
        sched.complete(first)
        for r in (a, b):
            r.token_ids.append(9)
        step = sched.schedule()
        assert step.plan.num_spec_tokens == 2 and step.num_drafts == [0, 0]
        if padded:
            # a transition: the same shape as a steady K = 2 step, but not K = 2's cost
            assert step.num_draft_rows == [2, 2] and not step.steady
            assert step.plan.num_draft_rows.tolist() == [2, 2] and step.plan.num_drafts.tolist() == [0, 0]
            assert step.plan.positions.tolist() == [2, 3, 4, 2, 3, 4]
            assert all(len(r.block_ids) * BS >= 5 for r in (a, b))
            # its result brings two drafts each: the next K = 2 step verifies them, the one K costs
            sched.complete(step, StepResult.from_verification(
                step.plan.step_id, 2, 2, torch.tensor([0, 1]), torch.tensor([[5, -1, -1], [6, -1, -1]]),
                torch.tensor([1, 1]), torch.tensor([[7, 8], [7, 8]])))
            for r, t in ((a, 5), (b, 6)):
                r.token_ids.append(t)
                r.draft_ids = [7, 8]
            ks = iter([2, 0, 0])
            step = sched.schedule()
            assert step.num_drafts == [2, 2] and step.steady
            # back to K = 0: the first step after drafts is a transition, the next one steady
            for steady in (False, True):
                sched.complete(step, StepResult.from_verification(
                    step.plan.step_id, 2, step.plan.num_spec_tokens, torch.tensor([0, 1]),
                    torch.tensor([[1] + [-1] * step.plan.num_spec_tokens] * 2), torch.tensor([1, 1])))
                for r in (a, b):
                    r.token_ids.append(1)
                step = sched.schedule()
                assert step.plan.num_spec_tokens == 0 and step.steady is steady
        else:                     # 2 rows of budget left after the two real rows: one line padded
            assert step.num_draft_rows == [2, 0] and not step.steady
