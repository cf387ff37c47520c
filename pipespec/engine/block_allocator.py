"""Fixed-size KV block allocator: reference counts, and optionally a prefix cache of full blocks.

Every block handed out has a reference count; `free` drops one reference. Without caching a block
whose count reaches 0 goes back to the free list. With caching (`enable_caching`), a full block whose
contents are final may be registered under a key (`cache`); when its last reference goes it stays
in the cache, evictable, and a later request asking for the same key takes it again (`take`). Blocks
are handed out from the free list first, then by evicting cached blocks least recently used first.
A block some request still references is never evicted.

Keys are exact, never a lossy hash: a block's key is (its parent's cache id, the tuple of the token
ids it holds, plus any extra token its contents depend on: `Scheduler._key_extra`). Dict lookups
compare keys for equality, so two different prefixes can never share a block. The parent's *cache
id* is a serial number given at registration and never reused (0: no parent), not the parent's block
id: a block id is reused after eviction, and a child keyed by it would then match a new parent with
other contents. A child whose parent was evicted just becomes unreachable and ages out of the LRU.

The scheduler keeps its snapshots of linear-attention states in one too: a "block" is then a snapshot
slot, keyed by the cache id of the KV block that ends where the snapshot was taken (no tokens).
"""
from __future__ import annotations

from collections import deque

ROOT = 0    # the cache id a request's first block hangs from


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free = deque(range(num_blocks))     # never cached (or reset): handed out first
        self._refs = [0] * num_blocks
        self._key: list[tuple | None] = [None] * num_blocks   # cached blocks' keys
        self._cache_id = [ROOT] * num_blocks
        self._cached: dict[tuple, int] = {}       # key -> block id
        self._evictable: dict[int, None] = {}     # cached, unreferenced; insertion order = LRU first
        self._next_id = ROOT + 1

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones no request references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each: free ones first, then the least recently used cached
        blocks, which leave the cache."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free; check can_allocate first")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b = next(iter(self._evictable))
                del self._evictable[b]
                self._uncache(b)
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks) -> None:
        """Drop one reference to each block; a block nobody references any more becomes evictable if
        it is cached (most recently used: free a request's blocks last to first, so that its tail
        goes before its head), else free."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # -- the prefix cache ---------------------------------------------------------------------

    def cache(self, block: int, parent_id: int, tokens: tuple) -> int:
        """Register a referenced, full block whose contents follow from (parent_id, tokens); the cache
        id its children's keys name. If another block already holds that key, it stays the cached
        one (both hold the same contents) and its id is returned; `block` stays uncached."""
        if not self.enable_caching:
            raise RuntimeError("the prefix cache is off")
        if self._refs[block] <= 0:
            raise RuntimeError(f"KV block {block} is not allocated; only a block in use can be cached")
        if self._key[block] is not None:
            raise RuntimeError(f"KV block {block} is cached already")
        key = (parent_id, tokens)
        other = self._cached.get(key)
        if other is not None:
            return self._cache_id[other]
        self._cached[key] = block
        self._key[block] = key
        self._cache_id[block] = cache_id = self._next_id
        self._next_id += 1
        return cache_id

    def lookup(self, keys) -> tuple[list[int], int]:
        """The longest chain of cached blocks: `keys` yields each block's tokens in order; returns
        the blocks found and the cache id of the last one (ROOT if none). Takes nothing: see `take`."""
        blocks, parent = [], ROOT
        if not self._cached:
            return blocks, parent
        for tokens in keys:
            b = self._cached.get((parent, tokens))
            if b is None:
                break
            blocks.append(b)
            parent = self._cache_id[b]
        return blocks, parent

    def find(self, parent_id: int, tokens: tuple = ()) -> int | None:
        """The cached block under the key (parent_id, tokens), or None."""
        return self._cached.get((parent_id, tokens))

    def cache_id(self, block: int) -> int:
        """A cached block's cache id (ROOT: not cached)."""
        return self._cache_id[block]

    def num_evictable(self, blocks) -> int:
        """How many of these cached blocks nobody references (taking them uses up free room)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def take(self, blocks) -> None:
        """Add a reference to each of these cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if self._key[b] is None:
                raise RuntimeError(f"KV block {b} is not cached")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def reset_cache(self) -> int:
        """Forget every cached block (referenced ones stay allocated, uncached); how many were cached."""
        n = len(self._cached)
        for b in list(self._cached.values()):
            self._uncache(b)
        self._free.extend(self._evictable)
        self._evictable.clear()
        return n

    def _uncache(self, b: int) -> None:
        del self._cached[self._key[b]]
        self._key[b] = None
        self._cache_id[b] = ROOT
