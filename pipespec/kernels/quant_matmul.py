"""Matrix products with quantized weights that dequantize inside the kernel: int4 (AWQ / GPTQ, in
the `Int4Weight` layout) and block-scaled FP8 e4m3. y = x @ W.T for x [M, K] in bf16/fp16/fp32.

Decode is bound by reading the weights: 4 bits a weight instead of 16 is what buys the speed, so each
tile of packed weights is read once, unpacked in registers and multiplied at the activations'
precision (weight-only quantization, W4A16 / W8A16). The activations are never quantized.

Three paths: up to `Gemv.max_m` rows (decode) the GEMV kernels multiply on CUDA cores, every row
against each weight tile as it is loaded (bf16 / fp16 rows on a GPU take the tensor-core decode
kernels of `kernels/int4_mma.py` and `kernels/fp8_mma.py` instead, up to their own max_m); more
rows take the tl.dot kernels, whose tiles are at least 16 rows (mostly padding at batch 1). All
split K over programs when the output alone gives too few, summing float32 partials in split order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2, sm_count
from pipespec.kernels.gemv import Gemv, _launch_gemv, _run, _store, rowmajor_gemv
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def scaled_dot(x, w, scale, IEEE: tl.constexpr):
    """x [M, K] times an FP8 weight tile w [K, N] widened to x's dtype, times the tile's one block
    scale: float32 [M, N]. IEEE: float32 products (test runs in float32), not TF32."""
    if IEEE:
        return tl.dot(x, w.to(x.dtype), input_precision="ieee") * scale
    return tl.dot(x, w.to(x.dtype)) * scale


@triton.jit
def unpack_int4(words, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed words [BLOCK_K / 8, BLOCK_N] -> their 4-bit values [BLOCK_K, BLOCK_N] in float32: row
    8w + j is nibble j of word w (`model/quant/packed.py`'s layout)."""
    q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    return tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)


@cached_launch
@triton.jit
def _int4_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, k_per_split,
                 N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TAIL_SUM: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split                # k_per_split: whole BLOCK_K tiles
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):   # one group a tile
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w_row = k0 // 8 + rw                                # each packed word is read once
        words = tl.load(q_ptr + w_row[:, None] * N + rn[None, :],
                        mask=(w_row[:, None] < K // 8) & (rn[None, :] < N), other=0)
        q = unpack_int4(words, BLOCK_K, BLOCK_N)
        g = k0 // GROUP
        z = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        w = ((q - z[None, :]) * s[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    _store(y_ptr, p_ptr, count_ptr, acc, rm, rn, M, N, stride_ym, pid_m * tl.num_programs(1) + pid_n,
           tl.program_id(2), SPLIT_K, TAIL_SUM)


@cached_launch
@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, scale_cols, k_per_split,
                N: tl.constexpr, K: tl.constexpr,
                BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TAIL_SUM: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_row = (pid_n * BLOCK_N) // BLOCK_OUT              # BLOCK_N divides BLOCK_OUT: one scale row
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):   # one scale a tile
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += scaled_dot(x, w, tl.load(s_ptr + scale_row * scale_cols + k0 // BLOCK_IN), IEEE)
    _store(y_ptr, p_ptr, count_ptr, acc, rm, rn, M, N, stride_ym, pid_m * tl.num_programs(1) + pid_n,
           tl.program_id(2), SPLIT_K, TAIL_SUM)


@triton.jit
def _int4_step_loads(q_ptr, z_ptr, s_ptr, k0, k_end, rw, rn, N: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Packed words [1, KW, BN] of the step at k0 and its group's zeros and scales [1, 1, BN]; zeros
    (no memory read) from k_end on."""
    if N % BLOCK_N == 0:
        mask = k0 < k_end
    else:
        mask = (k0 < k_end) & (rn < N)
    words = tl.load(q_ptr + (k0 // 8 + rw) * N + rn, mask=mask, other=0)
    g = k0 // GROUP
    return words, tl.load(z_ptr + g * N + rn, mask=mask, other=0.0), tl.load(s_ptr + g * N + rn, mask=mask, other=0.0)


@cached_launch
@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, exp_bits,
                      k_per_split, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      TAIL_SUM: tl.constexpr, PDL: tl.constexpr):
    """Decode on CUDA cores: all M (<= BLOCK_M) rows against BLOCK_N output columns, BLOCK_K rows of
    K (inside one group) a step. A lane loads 4 words of each word row (16 bytes, coalesced along N;
    `int4_matmul` gives each warp >= 128 columns), so it holds whole columns of the step and sums
    over K alone, with no shuffles. Every tensor is [rows, words, columns] or a broadcast of it, so
    all take the words' layout (Triton moves nothing through shared memory). Within a group,
    sum (q - z) * s * x = s * (sum q x - z * sum x): zeros and scales once a step.

    A nibble masked in place under the exponent of 2**23 reads as the float 2**23 + q * 2**lo (bit
    lo its lowest): int to float with no conversion instruction. EXACT: q itself is then made with
    one more exact FMA. Otherwise the words are shifted so that each nibble sits at bit 12 or 16
    (four shifts a word, two nibbles each) and f = 2**23 + q * 2**lo multiplies x * 2**-lo as it
    is: f * x' = q * x + 2**(23 - lo) * x, whose second term is summed apart (from x alone, per row)
    and taken off once a step. Half an instruction a weight less, ~1.5 more an x and row: at one
    row 959 instructions a step against 1,155 in the sm_90 SASS, break-even near 3 rows
    (`int4_matmul` takes it up to 2, for 16-bit rows). The float32 sums then carry the 2**11 * x
    terms, so their rounding is ~2**-13 of the row's scale (a float32 row would lose digits;
    bf16 / fp16 outputs do not see it). PDL as the dense GEMV's (`kernels/pdl.py`): wait first,
    signal after the loop."""
    pdl_wait(PDL)
    rm = tl.arange(0, BLOCK_M)[:, None, None]
    rw = tl.arange(0, BLOCK_K // 8)[None, :, None]
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]
    x_row = x_ptr + tl.minimum(rm, M - 1) * stride_xm       # rows past M repeat the last: no mask
    acc = tl.zeros((BLOCK_M, 1, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)             # BLOCK_K divides K
    # Words, zeros and scales are loaded a step ahead. Loaded in their own step, ptxas spreads them
    # through the step's arithmetic (a few 16-byte loads in flight a lane, seen in the SASS); loads
    # whose values wait for the next iteration go out together.
    words, z, s = _int4_step_loads(q_ptr, z_ptr, s_ptr, k_start, k_end, rw, rn, N, GROUP, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_K):
        next_words, next_z, next_s = _int4_step_loads(q_ptr, z_ptr, s_ptr, k0 + BLOCK_K, k_end, rw, rn, N, GROUP,
                                                      BLOCK_N)
        qx = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)     # summed over words per step
        xs = tl.zeros((BLOCK_M, BLOCK_K // 8, 1), dtype=tl.float32)           # sum x
        if EXACT:
            # nibble j at bit lo = 4 * (j % 4) of half j // 4; the exponent is ORed in once a word:
            # (w | E) & (m | E) == (w & m) | E (the sign bits the arithmetic shift brings in are masked off)
            halves = (words | 0x4B000000, (words >> 16) | 0x4B000000)
            for j in tl.static_range(8):
                x = tl.load(x_row + k0 + 8 * rw + j).to(tl.float32)            # [BM, KW, 1]
                q = (halves[j // 4] & ((0xF << (4 * (j % 4))) | 0x4B000000)).to(tl.float32, bitcast=True)
                qx += (q * 2.0 ** -(4 * (j % 4)) - 2.0 ** (23 - 4 * (j % 4))) * x              # exact: q
                xs += x
            qsum = tl.sum(qx, axis=1, keep_dims=True)
            xsum = tl.sum(xs, axis=1, keep_dims=True)
        else:
            xb = tl.zeros((BLOCK_M, BLOCK_K // 8, 1), dtype=tl.float32)       # sum 2**(23 - lo) x
            for i in tl.static_range(4):
                # nibbles 2i, 2i + 1 shifted to bits lo = 12 and 16 (the other bits are masked off):
                # f_even * x = 2**12 (q x + 2**11 x), f_odd * x * 2**-4 = 2**12 (q x + 2**7 x)
                part = words << (12 - 8 * i) if i < 2 else words >> (8 * i - 12)
                x_even = tl.load(x_row + k0 + 8 * rw + 2 * i).to(tl.float32)
                x_odd = tl.load(x_row + k0 + 8 * rw + 2 * i + 1).to(tl.float32)
                qx += ((part & 0xF000) | exp_bits).to(tl.float32, bitcast=True) * x_even
                qx += ((part & 0xF0000) | exp_bits).to(tl.float32, bitcast=True) * (x_odd * 2.0 ** -4)
                xb += x_even * 2.0 ** 11 + x_odd * 2.0 ** 7
                xs += x_even + x_odd
            qsum = tl.sum(qx, axis=1, keep_dims=True) * 2.0 ** -12 - tl.sum(xb, axis=1, keep_dims=True)
            xsum = tl.sum(xs, axis=1, keep_dims=True)
        acc += s.to(tl.float32) * (qsum - z.to(tl.float32) * xsum)
        words, z, s = next_words, next_z, next_s
    pdl_signal(PDL)
    _store(y_ptr, p_ptr, count_ptr, tl.sum(acc, axis=1), tl.arange(0, BLOCK_M),
           tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), M, N, stride_ym, tl.program_id(0), tl.program_id(1),
           SPLIT_K, TAIL_SUM)


# The float 2**23's bits, passed to the int4 decode kernel as an argument so that it sits in a
# register: (bits & mask) | EXP_2_23 is then one LOP3 (two with both operands immediates).
EXP_2_23 = 0x4B000000


def _tile(size: int, what: str) -> int:
    """The largest power of two <= 64 dividing `size` (a group or scale block), at least 16 (tl.dot)."""
    tile = 64
    while size % tile:
        tile //= 2
    if tile < 16:
        raise ValueError(f"{what} of {size} is not a multiple of 16; the quantized kernels need one")
    return tile


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one product: the defaults, or a benchmark's candidates (`quant_gpu.py`).
    0 for block_n / block_k: the largest power of two <= 64 dividing the group or scale block.
    split_k: programs sharing one output tile's K range (0: `split_k_for` picks).
    int4_gemv / fp8_gemv: the CUDA-core decode kernels' shapes (M <= max_m), chosen from the sm_90
    SASS at M = 1. int4: one warp of 256 columns (8 a lane: each x value it loads serves 8 weights),
    32 rows of K a step, the next step prefetched. fp8: 16 rows by 512 bytes (16 bytes a lane, a
    warp per 4 rows); wider steps gain little and narrower ones cost more instructions a weight.
    int4_mma: the tensor-core decode kernel's shape (`kernels/int4_mma.py`), which serves bf16 / fp16
    rows on a GPU ahead of int4_gemv (None: int4_gemv does): 128 columns by 128 of K a program of 4
    warps, split K summed by `_sum_splits`; int4_mma_wide: its shape for outputs of WIDE_N columns
    or more while int4_mma is set (None: int4_mma's), 256 columns. The kernel takes up to 64 rows
    (`int4_mma.MAX_ROWS`), but max_m = 32: at 64 rows the tl.dot kernels are faster.
    fp8_mma: the FP8 tensor-core decode kernel's shape (`kernels/fp8_mma.py`; None: fp8_gemv serves
    every decode row), 128 rows by 128 of K a program of 4 warps, from 2 to 32 rows: a single row is
    faster on the CUDA-core GEMV. Each default is the best (or near it) of a sweep over the 8B
    shape's projections (benchmarks/RESULTS.md, "Moved from code comments")."""
    block_n: int = 64
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 0
    int4_gemv: Gemv = Gemv(block_n=256, block_k=32, num_warps=1)
    int4_mma: Gemv | None = Gemv(block_n=128, block_k=128, num_warps=4, tail_sum=False, max_m=32)
    int4_mma_wide: Gemv | None = Gemv(block_n=256, block_k=128, num_warps=4, tail_sum=False, max_m=32)
    fp8_gemv: Gemv = Gemv(block_n=16, block_k=512, num_warps=4)
    fp8_mma: Gemv | None = Gemv(block_n=128, block_k=128, num_warps=4, tail_sum=False, min_m=2, max_m=32)

    def k_tile(self, size: int, what: str) -> int:
        if self.block_k:
            if size % self.block_k:
                raise ValueError(f"block_k={self.block_k} does not divide the {what} ({size})")
            return self.block_k
        return _tile(size, what)


DEFAULT_TILES = Tiles()
WIDE_N = 16384
MAX_SPLIT_K = 16


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


@functools.cache
def _mma_device(device: torch.device, capability: tuple[int, int]) -> bool:
    """Gluon (Triton >= 3.6) and at least `capability`: bf16 mma.sync (8.0) for `kernels/int4_mma.py`,
    also the e4m3 -> f16 cvt (8.9) for `kernels/fp8_mma.py`."""
    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    return version >= (3, 6) and torch.cuda.get_device_capability(device) >= capability


def _mma_takes(x: torch.Tensor, shape: Gemv | None, capability: tuple[int, int]) -> bool:
    """Whether an MMA decode kernel's shape takes x's rows: bf16 / fp16, min_m..max_m of them, on a GPU
    that runs it."""
    return (shape is not None and shape.min_m <= x.shape[0] <= shape.max_m and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16) and _mma_device(x.device, capability))


def _int4_mma_serves(x: torch.Tensor, group: int, shape: Gemv | None) -> bool:
    if not _mma_takes(x, shape, (8, 0)):
        return False
    from pipespec.kernels.int4_mma import mma_block_k           # imports Gluon
    from pipespec.kernels.mma_decode import mma_rows
    return mma_block_k(group, shape, mma_rows(x.shape[0])) > 0


def _fp8_mma_serves(x: torch.Tensor, in_features: int, block: tuple[int, int], shape: Gemv | None) -> bool:
    if not _mma_takes(x, shape, (8, 9)):
        return False
    from pipespec.kernels.fp8_mma import fp8_mma_block_k                # imports Gluon
    from pipespec.kernels.mma_decode import mma_rows
    return fp8_mma_block_k(block, in_features, shape, mma_rows(x.shape[0])) > 0


def split_k_for(programs: int, k_tiles: int, sms: int) -> int:
    """Decode multiplies one row by a weight: with N / BLOCK_N output tiles alone, a 4,096-wide
    projection launches 64 programs on 132 SMs, each walking all of K, too few loads in flight to
    stream the weight. Split K until there are about two programs per SM, each with >= 4 K tiles."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLIT_K, cdiv(2 * sms, programs), k_tiles // 4))


def _launch(kernel, x: torch.Tensor, out_features: int, in_features: int, block_n: int, block_k: int,
            tiles: Tiles, args: tuple, **constexprs) -> torch.Tensor:
    """A tl.dot kernel over (M tiles, N tiles, K splits)."""
    block_m = _block_m(x.shape[0])
    grid = cdiv(x.shape[0], block_m), cdiv(out_features, block_n)
    split = tiles.split_k or split_k_for(grid[0] * grid[1], cdiv(in_features, block_k), sm_count(x.device))
    return _run(kernel, grid, x, out_features, in_features, block_k, split, args, IEEE=x.dtype == torch.float32,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                **constexprs)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                perm: torch.Tensor | None = None, tiles: Tiles = DEFAULT_TILES, gated: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W the int4 weight in `model/quant/packed.py`'s
    layout: qweight int32 [K / 8, N], zeros and scales [K / group, N] (fp16, bf16 or float32), perm
    (act-order) [K].
    gated: x is [..., 2K] = cat[gate, up] and the product is of silu(gate) * up (`silu_mul` first)."""
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if gated:       # activated first: inside the decode kernel each lane would redo it, which was slower
        from pipespec.kernels.fused_ops import silu_mul
        x = silu_mul(x)
    if perm is not None:
        x = x.index_select(1, perm)                        # act-order: rows in group order
    x = x.contiguous()
    g = tiles.int4_gemv
    wide = tiles.int4_mma and tiles.int4_mma_wide and out_features >= WIDE_N     # int4_mma None: no MMA at all
    mma = tiles.int4_mma_wide if wide else tiles.int4_mma
    if _int4_mma_serves(x, group, mma):
        from pipespec.kernels.int4_mma import int4_mma_matmul
        y = int4_mma_matmul(x, qweight, zeros, scales, group, mma)
    elif x.shape[0] <= g.max_m:
        if group % 8 or in_features % group:
            raise ValueError(f"int4 group size {group}: not a multiple of 8 or not dividing K = {in_features}")
        rows = next_pow2(x.shape[0])
        # Each warp >= 128 columns (else its lanes split K and the layouts clash), and <= 64 // rows
        # columns a lane (its sums, 2 * rows * columns registers). A step: inside one group (its
        # zeros and scales apply to the step's sums), block_k / rows rows (registers), and x's
        # [rows, words] slice under one value a thread (else Triton moves it through shared memory).
        warps = max(1, min(g.block_n // 128, max(g.num_warps, g.block_n * rows // 2048)))
        block_k = max(8, min(g.block_k // rows, group & -group, 128 * warps // rows))
        y = _launch_gemv(_int4_gemv_kernel, x, out_features, in_features, g.block_n, block_k, warps, g, 4,
                         ((qweight, zeros, scales), (EXP_2_23,)),
                         GROUP=group, EXACT=x.dtype == torch.float32 or rows > 2, **pdl_args(x.device))
    else:
        y = _launch(_int4_kernel, x, out_features, in_features, tiles.block_n, tiles.k_tile(group, "int4 group size"),
                    tiles, ((qweight, zeros, scales), ()), GROUP=group)
    return y.view(*lead, out_features)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int], tiles: Tiles = DEFAULT_TILES, gated: bool = False) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] e4m3 times its [N / bo, K / bi] block scales).T -> [..., N].
    gated: x is [..., 2K] = cat[gate, up] and the product is of silu(gate) * up (the CUDA-core
    decode kernel reads the gate/up row itself; the others take `silu_mul`'s)."""
    out_features, in_features = weight.shape
    bo, bi = block
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    g = tiles.fp8_gemv
    mma = _fp8_mma_serves(x, in_features, block, tiles.fp8_mma)
    if gated and (mma or x.shape[0] > g.max_m):      # only the CUDA-core GEMV reads a gate/up row itself
        from pipespec.kernels.fused_ops import silu_mul
        x = silu_mul(x)
        gated = False
    if mma:
        from pipespec.kernels.fp8_mma import fp8_mma_matmul
        y = fp8_mma_matmul(x, weight, scale_inv.float().contiguous(), block, tiles.fp8_mma)
    elif x.shape[0] <= g.max_m:
        y = rowmajor_gemv(x, weight, scale_inv, block, gated=gated, shape=g)
    else:
        block_n = tiles.block_n if tiles.block_n and bo % tiles.block_n == 0 else _tile(bo, "fp8 scale block rows")
        args = (weight, scale_inv.float().contiguous()), (scale_inv.shape[1],)
        y = _launch(_fp8_kernel, x, out_features, in_features, block_n, tiles.k_tile(bi, "fp8 scale block columns"),
                    tiles, args, BLOCK_OUT=bo, BLOCK_IN=bi)
    return y.view(*lead, out_features)
