"""int4 decode product on tensor cores: y = x @ W.T for up to 8 bf16 / fp16 rows, W in the
`Int4Weight` layout (qweight int32 [K / 8, N], zeros and scales float32 [K / group, N]).

The CUDA-core GEMV (`quant_matmul._int4_gemv_kernel`) spends ~3.75 issue slots a weight (unpack,
then one FMA per weight and row), which keeps it near 60% issue and ~2 TB/s on an H200, and its
FMAs grow with the rows. Here the weights are the A operand of `mma.m16n8k16` (swap-AB: 16 output
columns by 16 of K a fragment) and x^T its B operand, 8 columns: all M <= 8 rows cost the same.
A word's nibbles are unpacked straight into A's registers, two a 32-bit register, with no data
movement between lanes: `lop3` masks nibbles i and i + 4 under the exponent of 128 (bf16 0x4300;
fp16 1024, 0x6400), which reads as the pair (128 + q_i, 128 + q_{i+4}), and one packed subtract
of (128 + z, 128 + z) leaves q - z exactly (both are small integers: AWQ's and GPTQ's zeros are
integers, 0..16). The unpack is ~1.4 slots a weight; with x, the MMA and the loop ~2.9 in the
sm_90 SASS at the default shape (RESULTS.md, thirteenth session).

That needs explicit layouts, hence Gluon (Triton >= 3.6): the MMA's A fragment gives lane
(c = lane % 4) four K pairs a 32-wide chunk of K; the dot's K order is chosen so that those eight
positions are the nibbles of one word (position p = 32 ch + 8 i + 2 c + h holds K = 8 w + i + 4 h
of word w = 4 ch + c), so the words' layout is A's with its three K bits dropped, and x is loaded
in natural K order (a lane's 8 K of a word: one 16-byte load) and permuted in registers the same
way. `convert_layout(..., assert_trivial=True)` proves both conversions move nothing.
Per step (inside one group): the (q - z) x sums from the MMA times the group's scales, in float32.
PDL as the CUDA-core GEMV's (`kernels/pdl.py`): wait first, signal after the loop.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from pipespec.kernels import sm_count
from pipespec.kernels.gemv import Gemv, _run, gemv_split_k
from pipespec.kernels.pdl import pdl_args
from pipespec.kernels.pdl_gluon import pdl_signal, pdl_wait


def _unpack_asm(magic: int, sub: str) -> str:
    """Word $4 -> four registers of (nibble i, nibble i + 4) minus the zero pair $6 (pack=2: $5 and
    $7 repeat $4 and $6)."""
    lines = []
    for i in range(4):
        src = "$4" if i == 0 else "t"
        if i:
            lines.append(f"shr.u32 t, $4, {4 * i};")
        lines += [f"lop3.b32 ${i}, {src}, 0x000F000F, {magic:#x}, 0xEA;", f"{sub} ${i}, ${i}, $6;"]
    return "{\n.reg .b32 t;\n" + "\n".join(lines) + "\n}"


_BF16_UNPACK = gl.constexpr(_unpack_asm(0x43004300, "sub.bf16x2"))
_FP16_UNPACK = gl.constexpr(_unpack_asm(0x64006400, "sub.f16x2"))


@gluon.jit
def _int4_mma_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, k_per_split,
                     N: gl.constexpr, K: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr, TAIL_SUM: gl.constexpr, WARPS: gl.constexpr,
                     W_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, PDL: gl.constexpr):
    pdl_wait(PDL)
    CH: gl.constexpr = BLOCK_K // 32
    KW: gl.constexpr = BLOCK_K // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    n0 = gl.program_id(0) * BLOCK_N
    rw = gl.arange(0, KW, layout=gl.SliceLayout(1, W_LAYOUT))
    rn_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, W_LAYOUT))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, X_LAYOUT))
    rm = gl.arange(0, 8, layout=gl.SliceLayout(0, X_LAYOUT))
    x_off = gl.minimum(rm, M - 1)[None, :] * stride_xm + rk[:, None]      # rows past M repeat the last
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    w_mask = (rw[:, None] < KW) & (rn_w[None, :] < N)          # (rw < KW: the words' shape)
    acc = gl.zeros([BLOCK_N, 8], gl.float32, mma)
    k_start = gl.program_id(1) * k_per_split
    for k0 in range(k_start, gl.minimum(k_start + k_per_split, K), BLOCK_K):
        g = k0 // GROUP
        if N % BLOCK_N == 0:
            words = gl.load(q_ptr + (k0 // 8 + rw)[:, None] * N + rn_w[None, :])
            z = gl.load(z_ptr + g * N + rn_w)
            s = gl.load(s_ptr + g * N + rn)
        else:
            words = gl.load(q_ptr + (k0 // 8 + rw)[:, None] * N + rn_w[None, :], mask=w_mask, other=0)
            z = gl.load(z_ptr + g * N + rn_w, mask=rn_w < N, other=0.0)
            s = gl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0)
        if x_ptr.dtype.element_ty == gl.bfloat16:        # plus the value of the magic exponent
            z = z + 128.0
        else:
            z = z + 1024.0
        zh = z.to(x_ptr.dtype.element_ty).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        zz, _ = gl.broadcast((zh | (zh << 16))[None, :], words)
        w2 = gl.join(words, words)                  # pack=2 takes two elements an asm: the word twice
        z2 = gl.join(zz, zz)
        if x_ptr.dtype.element_ty == gl.bfloat16:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_BF16_UNPACK, "=r,=r,=r,=r,r,r,r,r", [w2, z2],
                                                       dtype=(x_ptr.dtype.element_ty,) * 4, is_pure=True, pack=2)
        else:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_FP16_UNPACK, "=r,=r,=r,=r,r,r,r,r", [w2, z2],
                                                       dtype=(x_ptr.dtype.element_ty,) * 4, is_pure=True, pack=2)
        q = gl.join(gl.join(p0, p1), gl.join(p2, p3))                          # [KW, BN, h, i0, i1]
        q = gl.permute(gl.reshape(q, [CH, 4, BLOCK_N, 2, 2, 2]), [2, 0, 5, 4, 1, 3])   # [BN, ch, i1, i0, c, h]
        a = gl.convert_layout(gl.reshape(q, [BLOCK_N, BLOCK_K]), a_l, assert_trivial=True)
        x = gl.reshape(gl.load(x_ptr + k0 + x_off), [CH, 4, 2, 2, 2, 8])      # K = 32 ch + 8 c + 4 h + 2 i1 + i0
        x = gl.permute(x, [0, 3, 4, 1, 2, 5])                                  # [ch, i1, i0, c, h, m]
        b = gl.convert_layout(gl.reshape(x, [BLOCK_K, 8]), b_l, assert_trivial=True)
        acc += mma_v2(a, b, gl.zeros([BLOCK_N, 8], gl.float32, mma)) * s[:, None]
    pdl_signal(PDL)
    rm_c = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    mask = (rm_c[None, :] < M) & (rn[:, None] < N)
    if SPLIT_K == 1:
        gl.store(y_ptr + rm_c[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:           # float32 partials, summed in split order by `_sum_splits`
        gl.store(p_ptr + gl.program_id(1) * M * N + rm_c[None, :] * N + rn[:, None], acc, mask=mask)


def _bits(n: int) -> list[int]:
    return [1 << j for j in range(n.bit_length() - 1)]


@functools.cache
def _layouts(block_n: int, block_k: int, warps: int):
    """The words' [K / 8, BN] layout (A's, less its bits h, i0, i1: A holds output column
    16 w' + lane / 4 (+ 8) of warp w', then the next 16 * warps) and x^T's [BK, 8] in natural K order."""
    tiles, chunks = block_n // (16 * warps), block_k // 32
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 8]] + [[4 * b, 0] for b in _bits(chunks)] + [[0, 16 * warps * b] for b in _bits(tiles)],
        lane_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 16 * b] for b in _bits(warps)],
        block_bases=[], shape=[block_k // 8, block_n])
    x = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0]] + [[32 * b, 0] for b in _bits(chunks)],
        lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0] for _ in _bits(warps)],
        block_bases=[], shape=[block_k, 8])
    return words, x


def mma_block_k(group: int, shape: Gemv) -> int:
    """K a step: shape.block_k or less, inside one group, whole 32-wide chunks; 0 if none fits."""
    block_k = shape.block_k
    while block_k >= 32 and group % block_k:
        block_k //= 2
    return block_k if block_k >= 32 else 0


def int4_mma_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                    shape: Gemv) -> torch.Tensor:
    """x [M <= 8, K] bf16 / fp16 (contiguous) -> [M, N]; group: a multiple of 32 (`mma_block_k`)."""
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[0] > 8 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the int4 MMA decode kernel takes up to 8 bf16 / fp16 rows, not {x.shape[0]} {x.dtype}")
    block_k = mma_block_k(group, shape)
    if not block_k or in_features % group:
        raise ValueError(f"int4 group size {group}: not a multiple of 32 or not dividing K = {in_features}")
    grid = (triton.cdiv(out_features, shape.block_n),)
    split = shape.split_k or gemv_split_k(grid[0], in_features // block_k, sm_count(x.device),
                                          shape.block_n * block_k // 2, out_features * in_features // 2, out_features)
    words, xl = _layouts(shape.block_n, block_k, shape.num_warps)
    return _run(_int4_mma_kernel, grid, x, out_features, in_features, block_k, split, ((qweight, zeros, scales), ()),
                None, False, GROUP=group, BLOCK_N=shape.block_n, WARPS=shape.num_warps, W_LAYOUT=words,
                X_LAYOUT=xl, num_warps=shape.num_warps, **pdl_args(x.device))
