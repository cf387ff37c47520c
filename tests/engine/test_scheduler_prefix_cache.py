"""The scheduler's side of prefix caching on hand-made requests: what it registers and when, what a
new request takes, the last token always computed, the MTP key, references on abort and
preemption, and eviction under pressure."""
from __future__ import annotations

from pipespec.config import SchedulerConfig
from pipespec.engine.request import RequestStatus
from pipespec.engine.scheduler import Scheduler
import torch

from pipespec.plan import StepResult
from tests.engine.test_scheduler import BS, check_plan, prompt, run_to_completion, step
from tests.helpers import make_request


def cached_sched(num_blocks=64, budget=32, max_seqs=8, k=0) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=0)
    return Scheduler(cfg, BS, num_blocks, 256, num_spec_tokens=k, enable_prefix_caching=True)


def spec_step(sched: Scheduler, token: int = 7):
    """One step under MTP with no drafts accepted: each sampling request gets one token."""
    batch = sched.schedule()
    k, rows = batch.plan.num_spec_tokens, batch.plan.sampling_reqs
    result = StepResult.from_verification(batch.plan.step_id, batch.plan.num_reqs, k, rows,
                                          torch.full((len(rows), 1), token), torch.ones(len(rows), dtype=torch.int64))
    sched.complete(batch, result)
    for row in rows.tolist():
        req = batch.requests[row]
        req.token_ids.append(token)
        if req.num_output_tokens >= req.max_tokens:
            sched.finish(req, "length")
    return batch


def run_one(sched: Scheduler, ids: list[int], max_tokens: int = 2, rid: str = "r"):
    req = make_request(rid, ids, max_tokens=max_tokens)
    sched.add(req)
    batches = run_to_completion(sched)
    return req, batches


def test_a_repeated_prefix_is_taken_from_the_cache_and_not_recomputed():
    sched = cached_sched()
    first, _ = run_one(sched, prompt(10), rid="a")          # 10 prompt tokens + 2 sampled
    assert sched.allocator.num_cached == 2                  # tokens 0..7 (the sampled 10, 11 never computed)
    assert sched.allocator.num_free == sched.allocator.num_blocks
    again = make_request("b", prompt(10) + [99, 98], max_tokens=1)
    sched.add(again)
    batch = step(sched)
    check_plan_after_hit = batch.plan.positions.tolist()
    assert check_plan_after_hit == list(range(8, 12)), "the cached 8 tokens must not be recomputed"
    assert batch.plan.input_ids.tolist() == (prompt(10) + [99, 98])[8:]
    # (its own third block, tokens 8..11, is cached once computed)
    assert sched.prefix_cache_stats() == {"queries": 10 + 12, "hits": 8, "hit_rate": 8 / 22, "cached_blocks": 3}
    run_to_completion(sched)


def test_plan_of_a_hit_is_consistent():
    sched = cached_sched()
    run_one(sched, prompt(13), rid="a")
    b = make_request("b", prompt(13) + [5], max_tokens=3)
    sched.add(b)
    batch = sched.schedule()
    # check_plan reads the state before the step
    assert b.num_computed_tokens == 12 and b.num_cached_blocks == 3
    check_plan(batch, sched)
    sched.complete(batch)


def test_a_whole_cached_prompt_still_computes_its_last_token_in_its_own_block():
    sched = cached_sched()
    run_one(sched, prompt(8), rid="a")             # two whole blocks, both cached after the step
    assert sched.allocator.num_cached == 2
    b = make_request("b", prompt(8), max_tokens=1)
    sched.add(b)
    batch = sched.schedule()
    assert batch.plan.positions.tolist() == list(range(4, 8)), "the block holding the last token is recomputed"
    assert batch.plan.sampling_reqs.tolist() == [0]
    shared = b.block_ids[0]
    assert sched.allocator.ref_count(shared) == 1 and b.block_ids[1] not in sched.allocator._cached.values()
    sched.complete(batch)


def test_only_computed_blocks_are_cached_during_a_chunked_prefill():
    sched = cached_sched(budget=6)
    req = make_request("a", prompt(20), max_tokens=1)
    sched.add(req)
    step(sched)                                    # tokens 0..5 computed: one full block
    assert req.num_computed_tokens == 6 and sched.allocator.num_cached == 1
    step(sched)                                    # 0..11: three
    assert sched.allocator.num_cached == 3
    run_to_completion(sched)


def test_with_mtp_a_block_key_holds_the_next_token():
    """With MTP the block's last MTP entry depends on the next block's first token."""
    for k, expect in ((0, 8), (2, 4)):
        sched = cached_sched(k=k)
        a = make_request("a", prompt(8) + [1, 2, 3], max_tokens=2)
        sched.add(a)
        while sched.has_work():
            spec_step(sched)
        assert sched.allocator.num_cached == 3      # tokens 0..11 (token 12 known: 11 and 12 sampled)
        b = make_request("b", prompt(8) + [4, 5, 6], max_tokens=1)
        sched.add(b)
        spec_step(sched)
        assert b.num_computed_tokens == 11 and sched.prefix_cache_hits == expect, k


def test_with_mtp_a_block_is_cached_only_once_its_next_token_is_known():
    sched = cached_sched(k=1, budget=8)
    req = make_request("a", prompt(8), max_tokens=4)
    sched.add(req)
    batch = sched.schedule()                       # the whole prompt: computed 8, token 8 still unknown
    sched.complete(batch, StepResult.empty(batch.plan.step_id, 1, batch.plan.num_spec_tokens))
    assert req.num_computed_tokens == 8 and sched.allocator.num_cached == 1
    req.token_ids.append(3)                        # the engine appends the sampled token
    sched.finish(req, "abort")                     # released: now the second block's key is complete
    assert sched.allocator.num_cached == 2


def test_shared_blocks_survive_abort_and_preemption_of_a_sharer():
    sched = cached_sched(num_blocks=10, budget=64)
    run_one(sched, prompt(9), rid="warm")                        # caches blocks of tokens 0..7
    a, c, b = (make_request(x, prompt(9) + [i], max_tokens=20) for i, x in enumerate("acb"))
    for r in (a, c, b):
        sched.add(r)
    step(sched)
    shared = [blk for blk in a.block_ids if blk in b.block_ids and blk in c.block_ids]
    assert len(shared) == 2 and all(sched.allocator.ref_count(x) == 3 for x in shared)
    sched.finish(a, "abort")
    assert all(sched.allocator.ref_count(x) == 2 for x in shared), "b and c still hold them"
    # c and b each need 8 blocks, 2 of them shared: b, the newest, is preempted
    for _ in range(40):
        if b.status is RequestStatus.WAITING:
            break
        step(sched)
    assert sched.num_preemptions == 1 and b.status is RequestStatus.WAITING and not b.block_ids
    assert all(sched.allocator.ref_count(x) == 1 for x in shared), "c holds them"
    hits = sched.prefix_cache_hits
    run_to_completion(sched)
    assert b.num_output_tokens == 20 and c.num_output_tokens == 20
    assert sched.prefix_cache_hits > hits, "b restarts from the cache"
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert all(sched.allocator.ref_count(x) == 0 for x in range(10))


def test_a_workload_larger_than_the_cache_evicts_and_stays_consistent():
    sched = cached_sched(num_blocks=12, budget=32, max_seqs=4)
    reqs = [make_request(f"r{i}", prompt(12, base=100 * i) + prompt(9), max_tokens=4) for i in range(10)]
    for r in reqs:
        sched.add(r)
    for batch in run_to_completion(sched):
        pass
    assert all(r.num_output_tokens == 4 for r in reqs)
    assert sched.allocator.num_cached <= 12 and sched.allocator.num_free == 12
    # the last prompts' blocks are still there; the first one's were evicted
    last = make_request("last", list(reqs[-1].token_ids[:20]), max_tokens=1)
    first = make_request("first", list(reqs[0].token_ids[:20]), max_tokens=1)
    assert sched._cached_prefix(last)[0] and not sched._cached_prefix(first)[0]


def test_caching_off_registers_nothing():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), BS, 16, 256)
    run_one(sched, prompt(10))
    assert sched.allocator.num_cached == 0 and sched.prefix_cache_stats()["queries"] == 0
