"""FP8 decode product on tensor cores: y = x @ W.T for up to 32 bf16 / fp16 rows (8 at the cost of
one), W e4m3 [N, K] with float32 block scales [N / bo, K / bi] (`Fp8Weight`).

The CUDA-core GEMV (`gemv._rowmajor_gemv_kernel` with SCALED) spends one FMA per weight and row,
so its time grows with the rows. Here, as in `kernels/int4_mma.py`, the weights are the A operand
of `mma.m16n8k16` and x^T its B operand (`kernels/mma_decode.py`), so a few rows cost what one
does; at a single row the GEMV still streams faster (`Tiles.fp8_mma`: 2 to 32 rows).

Widening e4m3 in registers: `cvt.rn.f16x2.e4m3x2` turns two bytes into two exact f16s (every e4m3
value, subnormals too, is an f16 normal) in one conversion-unit instruction. fp16 rows multiply
those as they are. bf16 rows need bf16 weights, and a second conversion per pair (f16 -> f32 ->
bf16) would double the conversion unit's work; instead the f16's bits shifted right by 3 (sign
kept) are a bf16 with the same sign and mantissa and exponent field, read with bias 127 for 15:
w * 2**-112, exact and normal (e4m3's smallest, 2**-9, becomes 2**-121), and the float32 sums are
scaled back by 2**112 with the block scale. Products below 2**-126 (|w x| < 2**-14) are subnormal
in float32; sm_90's MMA keeps them (rows of tiny activations sum to bf16 rounding in
`tests/kernels/test_fp8_mma.py`).

Layout: a lane of the A fragment holds, per 16-wide K fragment, K pairs (2c, 2c + 1) and
(2c + 8, 2c + 9) of rows g and g + 8 (lane 4g + c). The dot's K order is free: position
p = 64 h + 16 f + 8 e + 2 c + i holds memory K = 64 h + 16 c + 4 f + 2 e + i, so a lane's 16
positions of a 64-wide chunk are 16 consecutive bytes of its row (one 16-byte load; a warp's load
covers 64 contiguous bytes of 8 rows) and the four lanes of a row cover 64 contiguous bytes. x^T is
loaded in memory order with the same lanes and permuted the same way in registers;
`convert_layout(..., assert_trivial=True)` proves both moves are register renames. Per step (inside
one scale block of K): the MMA's float32 sums times each row's block scale; the next step's loads
are issued before this one computes. PDL as the GEMV's: wait first, signal after the loop.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from pipespec.kernels.gemv import Gemv, _run, decode_grid
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.mma_decode import bits, mma_rows, step_k, store_tile
from pipespec.kernels.pdl import pdl_args
from pipespec.kernels.pdl_gluon import pdl_signal, pdl_wait

# word $2 (four e4m3 bytes; pack=2: $3 repeats it) -> f16 pairs of bytes (0, 1) in $0 and (2, 3) in $1
_TO_F16 = """{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}"""
# the same, then each f16 pair's bits (sign apart) shifted right by 3: bf16 pairs of w * 2**-112
_TO_BF16 = _TO_F16[:-1] + """.reg .b32 t;
and.b32 t, $0, 0x7FFF7FFF;
shr.u32 t, t, 3;
lop3.b32 $0, t, $0, 0x80008000, 0xF8;
and.b32 t, $1, 0x7FFF7FFF;
shr.u32 t, t, 3;
lop3.b32 $1, t, $1, 0x80008000, 0xF8;
}"""
# per activation dtype: (the widening, the power of two its weights are scaled by: 2**-EXP)
WIDEN = {torch.bfloat16: (_TO_BF16, 112), torch.float16: (_TO_F16, 0)}

MAX_ROWS = 32


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, k0, w_mask, BLOCK_IN: gl.constexpr, MASKED: gl.constexpr):
    """One step's weight words [BN, BK / 4] (four bytes each), its rows' block scales [BN] and x^T
    [BK, ROWS] at K = k0."""
    if MASKED:
        w = gl.load(w_ptrs + k0 // 4, mask=w_mask, other=0)
    else:
        w = gl.load(w_ptrs + k0 // 4)
    return w, gl.load(s_ptrs + k0 // BLOCK_IN), gl.load(x_ptrs + k0)


@cached_launch
@gluon.jit
def _fp8_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, scale_cols, k_per_split,
                    N: gl.constexpr, K: gl.constexpr, BLOCK_OUT: gl.constexpr, BLOCK_IN: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr, TAIL_SUM: gl.constexpr,
                    WARPS: gl.constexpr, W_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, WIDEN_ASM: gl.constexpr,
                    EXP: gl.constexpr, ROWS: gl.constexpr, PDL: gl.constexpr):
    pdl_wait(PDL)
    H: gl.constexpr = BLOCK_K // 64
    MASKED: gl.constexpr = N % BLOCK_N != 0
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    n0 = gl.program_id(0) * BLOCK_N
    rn_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_LAYOUT))
    rw = gl.arange(0, BLOCK_K // 4, layout=gl.SliceLayout(0, W_LAYOUT))
    w_ptrs = w_ptr + rn_w[:, None] * (K // 4) + rw[None, :]
    w_mask = (rn_w[:, None] < N) & (rw[None, :] < BLOCK_K // 4)     # (rw < BLOCK_K / 4: the tile's shape)
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, X_LAYOUT))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, X_LAYOUT))
    x_ptrs = x_ptr + gl.minimum(rm, M - 1)[None, :] * stride_xm + rk[:, None]    # rows past M repeat the last
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    s_ptrs = s_ptr + (gl.minimum(rn, N - 1) // BLOCK_OUT) * scale_cols          # each A row's scale row
    acc = gl.zeros([BLOCK_N, ROWS], gl.float32, mma)
    k_start = gl.program_id(1) * k_per_split
    k_end = gl.minimum(k_start + k_per_split, K)
    w, s, x = _load_step(w_ptrs, s_ptrs, x_ptrs, k_start, w_mask, BLOCK_IN, MASKED)
    for k0 in range(k_start, k_end, BLOCK_K):
        # the last step loads itself again (cache hits) rather than masking the loads
        nxt = _load_step(w_ptrs, s_ptrs, x_ptrs, gl.minimum(k0 + BLOCK_K, k_end - BLOCK_K), w_mask, BLOCK_IN,
                         MASKED)
        lo, hi = gl.inline_asm_elementwise(WIDEN_ASM, "=r,=r,r,r", [gl.join(w, w)],
                                           dtype=(x_ptr.dtype.element_ty,) * 2, is_pure=True, pack=2)
        # [n, h, c, f, i, e]: memory K = 64 h + 16 c + 4 f + 2 e + i; to the dot's K order [n, h, f, e, c, i]
        a = gl.permute(gl.reshape(gl.join(lo, hi), [BLOCK_N, H, 4, 4, 2, 2]), [0, 1, 3, 5, 2, 4])
        a = gl.convert_layout(gl.reshape(a, [BLOCK_N, BLOCK_K]), a_l, assert_trivial=True)
        b = gl.permute(gl.reshape(x, [H, 4, 4, 2, 2, ROWS]), [0, 2, 3, 1, 4, 5])
        b = gl.convert_layout(gl.reshape(b, [BLOCK_K, ROWS]), b_l, assert_trivial=True)
        # 2**EXP in two factors: a block scale up to 2**16 times 2**112 would pass float32's range
        part = mma_v2(a, b, gl.zeros([BLOCK_N, ROWS], gl.float32, mma)) * (2.0 ** (EXP // 2))
        acc += part * (s * (2.0 ** (EXP - EXP // 2)))[:, None]
        w, s, x = nxt
    pdl_signal(PDL)
    store_tile(acc, y_ptr, p_ptr, count_ptr, rn, M, N, stride_ym, ROWS, SPLIT_K, TAIL_SUM, mma)


@functools.cache
def _layouts(block_n: int, block_k: int, warps: int, rows: int):
    """The weight words' [BN, BK / 4] and x^T's [BK, rows] layouts in memory order: lane 4g + c holds
    rows g, g + 8 (+16 a warp, +16 warps a tile) and 16 consecutive K from 16c in each 64-wide chunk."""
    tiles, chunks = block_n // (16 * warps), block_k // 64
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + [[0, 16 * b] for b in bits(chunks)] + [[8, 0]]
                  + [[16 * warps * b, 0] for b in bits(tiles)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 * b, 0] for b in bits(warps)], block_bases=[], shape=[block_n, block_k // 4])
    x = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]] + [[64 * b, 0] for b in bits(chunks)]
                  + [[0, 8 * b] for b in bits(rows // 8)],
        lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0] for _ in bits(warps)],
        block_bases=[], shape=[block_k, rows])
    return words, x


def fp8_mma_block_k(block: tuple[int, int], in_features: int, shape: Gemv, rows: int = 8) -> int:
    """K a step (`step_k`): inside one scale block and dividing K, whole 64-wide chunks (a lane's
    16 bytes in each)."""
    return step_k(shape, rows, 64, block[1], in_features)


def fp8_mma_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   shape: Gemv) -> torch.Tensor:
    """x [M <= 32, K] bf16 / fp16 (contiguous) -> [M, N]; weight e4m3 [N, K], scale_inv float32
    [ceil(N / bo), K / bi] (`fp8_mma_block_k` says which K and blocks it takes)."""
    out_features, in_features = weight.shape
    if x.shape[0] > MAX_ROWS or x.dtype not in WIDEN:
        raise ValueError(f"the FP8 MMA decode kernel takes up to {MAX_ROWS} bf16 / fp16 rows, "
                         f"not {x.shape[0]} {x.dtype}")
    rows = mma_rows(x.shape[0])
    block_k = fp8_mma_block_k(block, in_features, shape, rows)
    if not block_k or shape.block_n % (16 * shape.num_warps):
        raise ValueError(f"FP8 blocks {block} with K = {in_features}: no step of 64-wide chunks inside one block "
                         f"divides K, or {shape.block_n} columns are not 16 a warp")
    grid, split = decode_grid(shape, x.device, out_features, in_features, shape.block_n, block_k, 8)
    w_layout, x_layout = _layouts(shape.block_n, block_k, shape.num_warps, rows)
    widen, exp = WIDEN[x.dtype]
    return _run(_fp8_mma_kernel, grid, x, out_features, in_features, block_k, split,
                ((weight.view(torch.int32), scale_inv), (scale_inv.shape[1],)), None, shape.tail_sum,
                BLOCK_OUT=block[0], BLOCK_IN=block[1], BLOCK_N=shape.block_n, WARPS=shape.num_warps,
                W_LAYOUT=w_layout, X_LAYOUT=x_layout, WIDEN_ASM=widen, EXP=exp, ROWS=rows,
                num_warps=shape.num_warps, **pdl_args(x.device))
