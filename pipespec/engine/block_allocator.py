"""Fixed-size KV block allocator with cheap invariant checks."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._in_use = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free; check can_allocate first")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._in_use[b] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._in_use[b]:
                raise RuntimeError(f"KV block {b} freed twice")
            self._in_use[b] = False
            self._free.append(b)
