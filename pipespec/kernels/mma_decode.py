"""What the tensor-core decode kernels share (`kernels/int4_mma.py`, `kernels/fp8_mma.py`): both
are swap-AB products on `mma.m16n8k16`, the weights' output features as A's rows (16 a fragment)
and x^T as B (8 columns a fragment), so up to 8 rows cost what one does; both write their tile or,
with split K, a float32 partial summed in split order.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from pipespec.kernels import next_pow2
from pipespec.kernels.gemv import Gemv


def mma_rows(m: int) -> int:
    """x^T's columns for m rows: 8 (one B fragment) or the next power of two."""
    return max(8, next_pow2(m))


def step_k(shape: Gemv, rows: int, chunk: int, *sizes: int) -> int:
    """K a step: shape.block_k or less, at most 2,048 / rows (x^T's registers: rows / 8 B fragments),
    whole `chunk`-wide chunks, dividing each of `sizes` (a group, a scale block, K); 0 if none fits."""
    block_k = min(shape.block_k, 2048 // rows)
    while block_k >= chunk and any(size % block_k for size in sizes):
        block_k //= 2
    return block_k if block_k >= chunk else 0


def bits(n: int) -> list[int]:
    """The powers of two below n (a power of two): one layout basis each."""
    return [1 << j for j in range(n.bit_length() - 1)]


@gluon.jit
def store_tile(acc, y_ptr, p_ptr, count_ptr, rn, M, N, stride_ym, ROWS: gl.constexpr, SPLIT_K: gl.constexpr,
               TAIL_SUM: gl.constexpr, LAYOUT: gl.constexpr):
    """acc [BN, ROWS] (output features rn, rows of x) to y [M, N]; with split K to plane
    program_id(1) of the float32 partials [SPLIT_K, M, N], summed in split order by `_sum_splits` or,
    with TAIL_SUM, by the tile's last split as `gemv._store` does (the same bits)."""
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, LAYOUT))
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        planes = p_ptr + rm[None, :] * N + rn[:, None]
        gl.store(planes + gl.program_id(1) * M * N, acc, mask=mask)
        if TAIL_SUM:
            gl.thread_barrier()     # every lane's partial is stored before the count releases them
            if gl.atomic_add(count_ptr + gl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = gl.load(planes, mask=mask, other=0.0, cache_modifier=".cg")
                for sp in gl.static_range(1, SPLIT_K):
                    total += gl.load(planes + sp * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
                gl.store(count_ptr + gl.program_id(0), 0)
