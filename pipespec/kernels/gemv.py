"""Decode matrix products on CUDA cores: y = x @ W.T for the few rows of a decode step (M <= 8).

At batch 1 a projection reads its whole weight to make one row, so its speed is how close it
streams the weight to the memory's bandwidth. Tensor-core tiles are at least 16 rows (mostly
padding here), and cuBLAS's small-N shapes stream small projections well below the memory's
bandwidth (RESULTS.md). These kernels keep every row against each weight tile as it is
loaded, split K over programs until the GPU has enough loads in flight, and sum the float32
partials in split order (deterministic: the tile's last split to finish adds them up in order).

`rowmajor_gemv` serves weights laid out [N, K] (nn.Linear's): bf16/fp16/fp32 dense ones, and FP8
e4m3 ones with block scales (`quant_matmul.fp8_block_matmul`). With `gated` its input is a fused
gate/up row [M, 2K] and the kernel multiplies silu(gate) * up, rounded as `fused_ops.silu_mul`
rounds it: the MLP's activation never makes a round trip through memory, nor a launch of its own.
The launch machinery (`_run`, `Gemv`, `gemv_split_k`) also serves the int4 decode kernel (whose
gated input is activated by `silu_mul` first: each of its lanes reads every x of a step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2, sm_count
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def _planes_sum(ptrs, plane, mask, SPLIT_K: tl.constexpr, CACHE: tl.constexpr):
    """The float32 partials at ptrs + s * plane summed in split order s = 0, 1, ...: the bits both
    split-K sums give (`_store`'s tail, `_sum_splits`). Unrolled, so all the loads are in flight at once."""
    total = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=CACHE)
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(ptrs + s * plane, mask=mask, other=0.0, cache_modifier=CACHE)
    return total


@triton.jit
def _store(y_ptr, p_ptr, count_ptr, acc, rm, rn, M, N, stride_ym, tile, split, SPLIT_K: tl.constexpr,
           TAIL_SUM: tl.constexpr):
    """The tile's sum to y; with split-K this split's float32 partial (plane `split` of p [S, M, N]),
    and with TAIL_SUM the tile's last split to finish sums the planes into y itself, in split order
    (the bits `_sum_splits` gives, without its launch). count_ptr[tile] counts the tile's finished
    splits; the last one sets it back to zero for the next launch."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        planes = p_ptr + rm[:, None] * N + rn[None, :]
        tl.store(planes + split * M * N, acc, mask=mask)
        if TAIL_SUM:
            tl.debug_barrier()      # every lane's partial is stored before the count releases them
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                # the other splits' partials were released to this acquire; read them from L2
                total = _planes_sum(planes, M * N, mask, SPLIT_K, ".cg")
                tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.store(count_ptr + tile, 0)


@cached_launch
@triton.jit
def _sum_splits(p_ptr, y_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y (contiguous) = the float32 partials [SPLIT_K, size] summed in split order (deterministic,
    unlike atomics) and cast, in one launch."""
    pdl_signal(PDL)
    pdl_wait(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < size
    tl.store(y_ptr + r, _planes_sum(p_ptr + r, size, mask, SPLIT_K, "").to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemv_input(ptrs, K, mask, GATED: tl.constexpr, MASKED: tl.constexpr):
    """A decode kernel's input at `ptrs` (masked by `mask` if MASKED): x, or with GATED silu(gate) *
    up of a gate/up row (up K further on), each factor rounded to the input's dtype as
    `fused_ops.silu_mul` stores them."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    if GATED:
        if MASKED:
            up = tl.load(ptrs + K, mask=mask, other=0.0)
        else:
            up = tl.load(ptrs + K)
        gate = x.to(tl.float32)
        x = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(up.dtype)
    return x


@cached_launch
@triton.jit
def _rowmajor_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, scale_cols,
                          k_per_split,
                          N: tl.constexpr, K: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
                          SCALED: tl.constexpr, GATED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                          SPLIT_K: tl.constexpr, TAIL_SUM: tl.constexpr, PDL: tl.constexpr):
    """All M (<= BLOCK_M) rows against BLOCK_N weight rows (with SCALED: inside one scale row), a
    chunk of BLOCK_K a step. A lane loads VEC consecutive elements of a row (16 bytes, coalesced
    along K) and sums their products itself; with SCALED that sum is scaled by its block (VEC
    divides the block). Sums are kept apart per lane, [rows, N rows, K / VEC], so lanes are summed
    once, at the end. With PDL (`kernels/pdl.py`) it waits at once and lets the next kernel launch
    after its loop."""
    pdl_wait(PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, BLOCK_K // VEC)
    x_row = x_ptr + tl.minimum(rm, M - 1)[:, None] * stride_xm      # rows past M repeat the last: no mask
    s_row = s_ptr + (tl.program_id(0) * BLOCK_N // BLOCK_OUT) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + rk
        # x before w: Triton's layout pass then keeps the weight tile's layout (VEC elements a lane)
        # and moves x, the small operand, through shared memory; in the other order it moves the weights.
        x = gemv_input(x_row + k[None, :], K, k[None, :] < K, GATED, K % BLOCK_K != 0)
        if (K % BLOCK_K == 0) and (N % BLOCK_N == 0):
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :])
        else:
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        w = tl.reshape(w.to(tl.float32), (1, BLOCK_N, BLOCK_K // VEC, VEC))
        x = tl.reshape(x.to(tl.float32), (BLOCK_M, 1, BLOCK_K // VEC, VEC))
        if SCALED:
            kc = k0 + rc * VEC
            s = tl.load(s_row + kc // BLOCK_IN, mask=kc < K, other=0.0)
            acc += tl.sum(x * w, axis=3) * s[None, None, :]
        else:
            acc += tl.sum(x * w, axis=3)
    pdl_signal(PDL)         # after the loop: the next kernel launches in this one's tail
    _store(y_ptr, p_ptr, count_ptr, tl.sum(acc, axis=2), rm, rn, M, N, stride_ym, tl.program_id(0),
           tl.program_id(1), SPLIT_K, TAIL_SUM)


@dataclass(frozen=True)
class Gemv:
    """Launch shape of a decode kernel (`_rowmajor_gemv_kernel`, `quant_matmul._int4_gemv_kernel`),
    used up to `max_m` rows (more go to tensor cores). block_n: output features a program (int4:
    columns, each warp >= 128 of them; row-major: rows, inside one scale block); block_k: K a loop
    step at one row (int4: inside one group, and shrunk as rows add registers; row-major: elements,
    a multiple of the 16 bytes a lane loads); split_k: 0 lets `gemv_split_k` pick; tail_sum: a
    split tile's last program sums the partials (`_store`), else `_sum_splits` does, a launch more.

    max_m = 8: besides unpacking, these kernels spend about one FMA per weight and row on CUDA
    cores, so the issue slots a weight grow with the rows; up to 8 rows they stay ahead of the tl.dot
    kernels (whose BLOCK_M = 16 tiles cost the same at 1 row as at 16), by 16 rows CUDA-core FMAs
    lose to tensor cores."""
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 0
    max_m: int = 8
    tail_sum: bool = True
    min_m: int = 1          # fewer rows go elsewhere (the FP8 MMA kernel: one row streams faster on CUDA cores)


# Dense weights at one or two rows: 8 rows by 512 elements (16 bytes a lane: two warps a row), an 8 KB
# step (the best of a sweep, RESULTS.md). From 4 rows up cuBLAS is as fast or faster (the kernel's
# FMAs per weight grow with the rows).
DENSE_GEMV = Gemv(block_n=8, block_k=512, num_warps=4, max_m=2)
# A weight of at most 2 MiB streams fast whatever the rows, so the kernel is bound by latency, not
# FMAs, and takes up to 4 rows (a K = 3 verify step at batch 1); larger weights lose to cuBLAS there.
SMALL_WEIGHT_BYTES, SMALL_WEIGHT_ROWS = 2 << 20, 4


def dense_gemv_rows(weight: torch.Tensor) -> int:
    """The most rows the dense decode GEMV takes for `weight` (more go to cuBLAS)."""
    small = weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES
    return SMALL_WEIGHT_ROWS if small else DENSE_GEMV.max_m


def gemv_split_k(programs: int, k_steps: int, sms: int, step_bytes: int, weight_bytes: int, out_features: int) -> int:
    """Streaming at HBM3 bandwidth takes ~30 KB of loads in flight per SM; a decode program has about one
    step's weights in flight (int4: the next step's, prefetched; row-major: its own, all issued at
    the step's start). Split K until the programs hold that much, while each row's float32 partials
    (4 bytes an output and split, read back by `_sum_splits`) stay under 1/8 of the weight's bytes
    (more rows cost more partials, and more FMAs: the ratio to the kernel's time holds)."""
    want = cdiv(32768 * sms, step_bytes)
    if programs >= want:
        return 1
    return max(1, min(cdiv(want, programs), k_steps, weight_bytes // (32 * out_features)))


_COUNTS: dict[str, torch.Tensor] = {}     # per device: split tiles' finished-split counts, zero between launches
MAX_SPLIT_TILES = 1 << 16


def split_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's tile counters for `_store`'s tail sum, made (zeros) at its first eager call; None
    (sum in a launch of its own) for more tiles than it holds, or while a CUDA graph is captured before
    it exists (a capture would record the zeroing, not run it). The counters are shared by the
    device's kernels, which run one after another on one stream: the engine has no other."""
    counts = _COUNTS.get(str(device))
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTS[str(device)] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= counts.numel() else None


def _run(kernel, grid: tuple, x: torch.Tensor, out_features: int, in_features: int, block_k: int, split: int,
         args: tuple, out_dtype: torch.dtype | None = None, tail_sum: bool = True, **meta) -> torch.Tensor:
    """`kernel` on x [M, K] over grid + (K splits,): the split of program id len(grid) takes whole
    block_k steps; with splits > 1 each writes a float32 partial and the tile's last split
    (`tail_sum`, `_store`) or `_sum_splits` gives y (in `out_dtype`, default x's)."""
    m = x.shape[0]
    y = torch.empty(m, out_features, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return y
    k_tiles = cdiv(in_features, block_k)
    split = max(1, min(split, k_tiles))
    k_per_split = cdiv(k_tiles, split) * block_k
    split = cdiv(in_features, k_per_split)          # no empty splits
    partials = y if split == 1 else torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
    counts = split_counts(x.device, math.prod(grid)) if split > 1 and tail_sum else None
    weights, scalars = args
    kernel[(*grid, split)](x, *weights, y, partials, y if counts is None else counts, m, x.stride(0), y.stride(0),
                           *scalars, k_per_split, N=out_features, K=in_features, BLOCK_K=block_k, SPLIT_K=split,
                           TAIL_SUM=counts is not None, **meta)
    if split > 1 and counts is None:    # 128 outputs a one-warp program: a 4,096-wide row is read by 32 SMs
        _sum_splits[(cdiv(y.numel(), 128),)](partials, y, y.numel(), SPLIT_K=split, BLOCK=128, num_warps=1,
                                             **pdl_args(x.device))
    return y


def decode_grid(gemv: Gemv, device: torch.device, out_features: int, in_features: int, block_n: int,
                block_k: int, bits: int) -> tuple[tuple[int], int]:
    """A decode kernel's grid of output tiles and its K splits (`gemv.split_k`, or `gemv_split_k`'s
    for steps of block_n x block_k weights of `bits` each)."""
    grid = (cdiv(out_features, block_n),)
    split = gemv.split_k or gemv_split_k(grid[0], cdiv(in_features, block_k), sm_count(device),
                                         block_n * block_k * bits // 8, out_features * in_features * bits // 8,
                                         out_features)
    return grid, split


def _launch_gemv(kernel, x: torch.Tensor, out_features: int, in_features: int, block_n: int, block_k: int,
                 num_warps: int, gemv: Gemv, bits: int, args: tuple, out_dtype: torch.dtype | None = None,
                 **constexprs) -> torch.Tensor:
    """A decode kernel over (N tiles, K splits), all M rows in each program; `bits` a weight."""
    grid, split = decode_grid(gemv, x.device, out_features, in_features, block_n, block_k, bits)
    return _run(kernel, grid, x, out_features, in_features, block_k, split, args, out_dtype, gemv.tail_sum,
                BLOCK_M=next_pow2(x.shape[0]), BLOCK_N=block_n, num_warps=num_warps, **constexprs)


def rowmajor_gemv(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                  block: tuple[int, int] = (1, 1), gated: bool = False, shape: Gemv = DENSE_GEMV,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in `out_dtype` (default x's), M <= shape.max_m. With
    `scale_inv` the weight is FP8 scaled by its [N / bo, K / bi] blocks (`block` = (bo, bi)); with
    `gated`, x is [M, 2K] = cat[gate, up] and the product is of silu(gate) * up. Products and sums
    are float32 whatever the dtypes (x may be narrower than a float32 weight: a router's)."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features * (2 if gated else 1):
        raise ValueError(f"input of width {x.shape[-1]} for a weight of {in_features} columns"
                         f"{' (gated: twice that)' if gated else ''}")
    x = x.contiguous()
    bo, bi = block
    elems = 16 // weight.element_size()                    # a lane's 16 bytes
    block_k = max(shape.block_k, elems)
    if scale_inv is None:
        vec, block_n = elems, shape.block_n
    else:
        vec = min(elems, bi & -bi)                          # inside one scale block
        block_n = min(shape.block_n, bo & -bo)
    scales = (weight, 1) if scale_inv is None else (scale_inv.float().contiguous(), scale_inv.shape[1])
    return _launch_gemv(_rowmajor_gemv_kernel, x, out_features, in_features, block_n, block_k,
                        shape.num_warps, shape, 8 * weight.element_size(), ((weight, scales[0]), (scales[1],)),
                        out_dtype, BLOCK_OUT=bo, BLOCK_IN=bi, VEC=vec, SCALED=scale_inv is not None, GATED=gated,
                        **pdl_args(x.device))
