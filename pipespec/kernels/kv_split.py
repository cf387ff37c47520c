"""How many programs split each program's keys in the paged and MLA attention kernels (flash-decoding):
pure functions of host shapes, so a captured graph fixes the count and the CPU tests check it."""
from __future__ import annotations

import functools

from pipespec.kernels import SMLimits, cdiv

MAX_SPLITS = 128
SPLIT_MIN_KV = 1024        # below this many keys a request's one program reads them fast enough
FIXED_TILES = 2            # a program's cost beyond its key tiles, in tiles (start, partials, combine)


def num_kv_splits(programs: int, max_kv: int, sms: int, per_sm: int = 4, max_splits: int = MAX_SPLITS,
                  min_kv: int = SPLIT_MIN_KV, keys_per_split: int = 256) -> int:
    """Splits of each program's keys: enough programs for about `per_sm` per SM, each split reading
    at least `keys_per_split` keys; 1 (no split) when the grid already has that many or contexts
    are shorter than `min_kv`. (MLA's rule; `wave_splits` is this kernel's.)"""
    if max_kv < min_kv or programs >= per_sm * sms:
        return 1
    return max(1, min(max_splits, cdiv(per_sm * sms, programs), max_kv // keys_per_split))


def resident_programs(registers: int, shared: int, num_warps: int, sm: SMLimits) -> int:
    """Programs of a compiled kernel (`registers` a thread, `shared` bytes) one SM runs at once:
    registers are granted 8 a thread at a time, a block's shared memory takes 1 KiB more."""
    warp_registers = cdiv(registers, 8) * 8 * 32
    return max(1, min(sm.registers // (warp_registers * num_warps), sm.shared // (shared + 1024),
                      sm.threads // (32 * num_warps), sm.blocks))


@functools.lru_cache(maxsize=4096)
def wave_splits(programs: int, max_kv: int, slots: int, block_n: int, max_splits: int = MAX_SPLITS,
                min_kv: int = SPLIT_MIN_KV, keys_per_split: int = 256, fixed_tiles: int = FIXED_TILES) -> int:
    """Splits of each program's keys, the fewest of the cheapest: the GPU runs `slots` programs at
    once (SMs x resident programs), so `programs * s` of them take cdiv(programs * s, slots) waves,
    each as long as one split's key tiles plus `fixed_tiles`. A last wave a few programs long costs
    as much as a full one (64 requests of 3 KV heads in 3 splits: 576 programs in 3 waves of 264,
    the last 48; in 4 splits 768, three full waves of shorter programs). Splits read at least
    `keys_per_split` keys; contexts shorter than `min_kv` are not split."""
    if max_kv < min_kv:
        return 1

    def cost(s: int) -> tuple[int, int]:
        return cdiv(programs * s, slots) * (cdiv(cdiv(max_kv, s), block_n) + fixed_tiles), s

    return min(range(1, max(1, min(max_splits, max_kv // keys_per_split)) + 1), key=cost)
