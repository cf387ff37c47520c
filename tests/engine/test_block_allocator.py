import pytest

from pipespec.engine.block_allocator import ROOT, BlockAllocator


def test_allocate_and_free_round_trip():
    a = BlockAllocator(8)
    assert (a.num_blocks, a.num_free, a.num_used, a.usage) == (8, 8, 0, 0.0)
    first = a.allocate(3)
    second = a.allocate(5)
    assert len(first) == 3 and len(second) == 5
    assert sorted(first + second) == list(range(8)), "blocks must be distinct and in range"
    assert a.num_free == 0 and a.usage == 1.0
    a.free(first)
    assert a.num_free == 3 and a.num_used == 5
    again = a.allocate(3)
    assert sorted(again) == sorted(first)
    a.free(again)
    a.free(second)
    assert a.num_free == 8


def test_can_allocate_and_over_allocation():
    a = BlockAllocator(4)
    assert a.can_allocate(0) and a.can_allocate(4) and not a.can_allocate(5)
    a.allocate(3)
    assert a.can_allocate(1) and not a.can_allocate(2)
    with pytest.raises(RuntimeError):
        a.allocate(2)
    assert a.num_free == 1, "a failed allocation must not take blocks"
    assert a.allocate(0) == []


def test_double_free_raises_and_keeps_state():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks[:1])
    with pytest.raises(RuntimeError, match="twice"):
        a.free(blocks[:1])
    assert a.num_free == 3
    never_allocated = next(b for b in range(4) if b not in blocks)
    with pytest.raises(RuntimeError):
        a.free([never_allocated])
    assert a.num_free == 3


def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockAllocator(0)


# -- reference counts and the prefix cache -------------------------------------------------------


def _chain(a: BlockAllocator, blocks, token_blocks):
    """Register `blocks` as a chain holding `token_blocks`; the cache ids."""
    ids, parent = [], ROOT
    for b, toks in zip(blocks, token_blocks):
        parent = a.cache(b, parent, tuple(toks))
        ids.append(parent)
    return ids


def test_refcounts_shared_block_survives_one_owner():
    a = BlockAllocator(4, enable_caching=True)
    [b] = a.allocate(1)
    _chain(a, [b], [(1, 2)])
    a.take([b])                                   # a second request hits it
    assert a.ref_count(b) == 2 and a.num_free == 3
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free == 3, "a block another request holds must stay in use"
    assert all(x != b for x in a.allocate(3)), "an in-use block was handed out again"
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_free == 1, "an unreferenced cached block counts as free"
    with pytest.raises(RuntimeError, match="twice"):
        a.free([b])


def test_freed_blocks_stay_cached_and_are_found_again():
    a = BlockAllocator(4, enable_caching=True)
    blocks = a.allocate(3)
    _chain(a, blocks, [(1, 2), (3, 4), (5, 6)])
    a.free(reversed(blocks))
    assert a.num_free == 4 and a.num_cached == 3
    hit, last = a.lookup([(1, 2), (3, 4), (7, 8)])
    assert hit == blocks[:2] and last == a.lookup([(1, 2), (3, 4)])[1] != ROOT
    assert a.num_evictable(hit) == 2
    a.take(hit)
    assert a.num_free == 2 and [a.ref_count(b) for b in hit] == [1, 1]


def test_chain_keys_depend_on_the_whole_prefix():
    a = BlockAllocator(4, enable_caching=True)
    x, y = a.allocate(2)
    _chain(a, [x, y], [(1, 2), (3, 4)])
    assert a.lookup([(3, 4)]) == ([], ROOT), "a block must not match without its parent"
    assert a.lookup([(9, 9), (3, 4)]) == ([], ROOT)
    assert a.lookup([(1, 2), (3, 4)])[0] == [x, y]
    assert a.lookup([(1, 2, 5)])[0] == [], "keys are exact: an extra token is part of them"


def test_lru_eviction_takes_free_blocks_first_then_least_recently_used():
    a = BlockAllocator(4, enable_caching=True)
    first, second = a.allocate(1), a.allocate(1)
    _chain(a, first, [(1,)])
    _chain(a, second, [(2,)])
    a.free(first)                      # freed first: least recently used
    a.free(second)
    fresh = a.allocate(2)
    assert not set(fresh) & set(first + second), "free blocks must go before cached ones"
    assert a.num_cached == 2
    [evicted] = a.allocate(1)
    assert evicted == first[0] and a.num_cached == 1
    assert a.lookup([(1,)]) == ([], ROOT) and a.lookup([(2,)])[0] == second
    a.take(second)                     # used again: no longer evictable
    assert a.num_free == 0 and not a.can_allocate(1)
    with pytest.raises(RuntimeError):
        a.allocate(1)


def test_never_evicts_in_use_blocks():
    a = BlockAllocator(3, enable_caching=True)
    held = a.allocate(2)
    _chain(a, held, [(1,), (2,)])
    [other] = a.allocate(1)
    a.free([other])
    for _ in range(5):
        got = a.allocate(1)
        assert got == [other]
        a.free(got)
    assert a.lookup([(1,), (2,)])[0] == held


def test_evicted_parent_id_is_not_reused_by_children():
    """A child keyed by its parent's block id would match a new parent reusing that id; cache ids
    are never reused, so the orphaned child stays unreachable."""
    a = BlockAllocator(2, enable_caching=True)
    parent, child = a.allocate(2)
    _chain(a, [parent, child], [(1,), (2,)])
    a.free([parent, child])            # head first: the parent is evicted while its child stays
    [reused] = a.allocate(1)
    assert reused == parent and a.num_cached == 1
    a.cache(reused, ROOT, (7,))        # new contents under the old parent's block id
    assert a.lookup([(7,), (2,)])[0] == [reused], "the orphaned child must not match under a new parent"


def test_same_key_twice_keeps_one_cached_block():
    a = BlockAllocator(4, enable_caching=True)
    x, y = a.allocate(2)
    cid = a.cache(x, ROOT, (1, 2))
    assert a.cache(y, ROOT, (1, 2)) == cid, "the duplicate hangs its children from the cached block"
    a.free([x, y])
    assert a.num_cached == 1 and a.num_free == 4
    assert a.lookup([(1, 2)])[0] == [x]


def test_reset_cache_keeps_referenced_blocks_allocated():
    a = BlockAllocator(4, enable_caching=True)
    x, y = a.allocate(2)
    _chain(a, [x, y], [(1,), (2,)])
    a.free([y])
    assert a.reset_cache() == 2
    assert a.num_cached == 0 and a.lookup([(1,)]) == ([], ROOT)
    assert a.num_free == 3 and a.ref_count(x) == 1
    a.free([x])
    assert a.num_free == 4


def test_caching_off_refuses_to_cache():
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    with pytest.raises(RuntimeError, match="off"):
        a.cache(b, ROOT, (1,))
