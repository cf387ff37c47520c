"""The scheduler's snapshots of linear-attention states (prefix caching of hybrid models) on hand-made
requests: where a prefill is cut and a snapshot saved, what the plan names, which snapshot a new
request restores, their LRU under pressure, no slot leaked on abort, reset."""
from __future__ import annotations

from pipespec.config import SchedulerConfig
from pipespec.engine.block_allocator import ROOT, BlockAllocator
from pipespec.engine.scheduler import Scheduler
from tests.engine.test_scheduler import BS, prompt, run_to_completion, step
from tests.helpers import make_request


def snap_sched(snapshots=4, num_blocks=64, budget=32, k=0) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, long_prefill_token_threshold=0)
    return Scheduler(cfg, BS, num_blocks, 256, num_spec_tokens=k, enable_prefix_caching=True,
                     num_state_snapshots=snapshots)


def snapshots_of(batch) -> list[list[int]]:
    """Per line: [snapshot restored before the step, snapshot saved after it] (-1: none)."""
    s = batch.plan.state_snapshots
    return [[-1, -1]] * batch.plan.num_reqs if s is None else s.tolist()


def test_prefill_is_cut_at_the_last_block_boundary_and_saved_there():
    sched = snap_sched()
    req = make_request("a", prompt(10), max_tokens=2)
    sched.add(req)
    first = step(sched)
    # one step could take all 10 tokens; it stops at 8, the last block boundary before the last token
    assert first.plan.positions.tolist() == list(range(8))
    [[restore, save]] = snapshots_of(first)
    assert restore == -1 and save >= 0
    assert sched.state_snapshots.find(req.cache_parent) == save and sched.num_snapshot_saves == 1
    second = step(sched)
    assert second.plan.positions.tolist() == [8, 9] and second.plan.state_snapshots is None
    run_to_completion(sched)
    assert sched.state_snapshots.num_free == sched.state_snapshots.num_blocks   # cached, none held


def test_a_hit_restores_the_snapshot_where_the_reused_blocks_end():
    sched = snap_sched()
    sched.add(make_request("a", prompt(10), max_tokens=2))
    saved = snapshots_of(step(sched))[0][1]
    run_to_completion(sched)
    b = make_request("b", prompt(10) + [99, 98, 97], max_tokens=1)
    sched.add(b)
    batch = step(sched)
    assert batch.plan.positions.tolist()[0] == 8, "blocks 0..1 come from the cache"
    assert snapshots_of(batch)[0][0] == saved
    assert sched.num_snapshot_restores == 1 and sched.prefix_cache_hits == 8
    run_to_completion(sched)


def test_without_a_snapshot_the_cached_kv_alone_is_not_used():
    """A hybrid prefix needs its states too: KV blocks cached with no snapshot where they end are
    recomputed from position 0 (zero state), and a snapshot is taken where they end this time."""
    sched = snap_sched()
    system = prompt(8, base=50)
    sched.add(make_request("a", system + prompt(5), max_tokens=1))     # saves at 12 only
    run_to_completion(sched)
    b = make_request("b", system + prompt(5, base=120), max_tokens=1)
    sched.add(b)
    batch = step(sched)
    assert b.num_cached_blocks == 2 and batch.plan.positions.tolist() == list(range(8)), \
        "blocks 0..1 are cached but no state is: recomputed, cut where the cached chain ends"
    assert snapshots_of(batch)[0][0] == -1 and snapshots_of(batch)[0][1] >= 0
    assert sched.prefix_cache_hits == 0
    run_to_completion(sched)
    c = make_request("c", system + prompt(5, base=140), max_tokens=1)
    sched.add(c)
    batch = step(sched)
    assert batch.plan.positions.tolist()[0] == 8 and snapshots_of(batch)[0][0] >= 0, "c restores the shared 8"
    run_to_completion(sched)


def test_least_recently_used_snapshot_goes_first_and_its_prefix_then_misses():
    sched = snap_sched(snapshots=2)
    prompts = {name: prompt(9, base=base) for name, base in (("x", 20), ("y", 40), ("z", 60))}
    for name in ("x", "y"):
        sched.add(make_request(name, prompts[name], max_tokens=1))
        run_to_completion(sched)
    sched.add(make_request("x2", prompts["x"], max_tokens=1))          # x restored: most recently used
    run_to_completion(sched)
    assert sched.num_snapshot_restores == 1
    sched.add(make_request("z", prompts["z"], max_tokens=1))           # evicts y's, the least recent
    run_to_completion(sched)
    for name, hit in (("x3", True), ("y2", False)):
        req = make_request(name, prompts[name[0]], max_tokens=1)
        sched.add(req)
        batch = step(sched)
        assert (batch.plan.positions.tolist()[0] == 8) is hit, name
        assert (snapshots_of(batch)[0][0] >= 0) is hit, name
        run_to_completion(sched)
    assert sched.state_snapshots.num_cached == 2


def test_no_free_snapshot_slot_means_no_cut_and_no_save():
    sched = snap_sched(snapshots=1, budget=64)
    a, b = make_request("a", prompt(10, base=20), max_tokens=1), make_request("b", prompt(10, base=60), max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    # a takes the only slot for its save at 8; b runs its whole prompt uncut and saves nothing
    assert batch.num_new_tokens == [8, 10]
    assert snapshots_of(batch)[1] == [-1, -1]
    assert sched.state_snapshots.num_cached == 1
    run_to_completion(sched)


def test_a_save_of_a_request_aborted_in_flight_is_dropped_and_its_slot_returned():
    sched = snap_sched(snapshots=2)
    req = make_request("a", prompt(10), max_tokens=2)
    sched.add(req)
    batch = sched.schedule()
    assert snapshots_of(batch)[0][1] >= 0 and sched.state_snapshots.num_free == 1
    sched.finish(req, "abort")
    sched.complete(batch)
    assert sched.state_snapshots.num_cached == 0 and sched.state_snapshots.num_free == 2
    assert sched.allocator.num_free == sched.allocator.num_blocks


def test_with_mtp_the_snapshot_hangs_from_the_block_keyed_with_its_next_token():
    """With MTP a block's key holds the token after it (`Scheduler._key_extra`); the snapshot is
    found through that block, so a prompt going on with another token misses both."""
    sched = snap_sched(k=1)
    sched.add(make_request("a", prompt(10), max_tokens=1))
    step(sched)
    run_to_completion(sched)
    same, other = prompt(10) + [5], prompt(8) + [77, 78, 79]
    for ids, hit in ((same, True), (other, False)):
        req = make_request("r", ids, max_tokens=1)
        sched.add(req)
        batch = step(sched)
        assert (snapshots_of(batch)[0][0] >= 0) is hit and (req.num_computed_tokens >= 8) is hit
        run_to_completion(sched)


def test_reset_forgets_snapshots_and_stats_count_them():
    sched = snap_sched()
    sched.add(make_request("a", prompt(10), max_tokens=1))
    run_to_completion(sched)
    stats = sched.prefix_cache_stats()
    assert stats["cached_state_snapshots"] == 1 and stats["state_snapshot_saves"] == 1
    sched.reset_prefix_cache()
    assert sched.state_snapshots.num_cached == 0 and sched.state_snapshots.num_free == 4
    req = make_request("b", prompt(10), max_tokens=1)
    sched.add(req)
    batch = step(sched)
    assert batch.plan.positions.tolist()[0] == 0 and sched.num_snapshot_restores == 0
    run_to_completion(sched)


def test_snapshot_allocator_finds_by_the_block_cache_id():
    """The snapshot LRU is a BlockAllocator keyed by (KV block cache id, ()): `find` and `cache_id`."""
    kv, snaps = BlockAllocator(4, enable_caching=True), BlockAllocator(2, enable_caching=True)
    [blk] = kv.allocate(1)
    cid = kv.cache(blk, ROOT, (1, 2))
    assert kv.cache_id(blk) == cid != ROOT
    [s] = snaps.allocate(1)
    snaps.cache(s, cid, ())
    snaps.free([s])
    assert snaps.find(cid) == s and snaps.find(cid + 1) is None
    snaps.allocate(2)                                   # pressure: the cached snapshot is evicted
    assert snaps.find(cid) is None and snaps.cache_id(s) == ROOT
