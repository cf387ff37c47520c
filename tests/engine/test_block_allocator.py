import pytest

from pipespec.engine.block_allocator import BlockAllocator


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
