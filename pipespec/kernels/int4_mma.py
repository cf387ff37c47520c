"""int4 decode product on tensor cores: y = x @ W.T for up to 64 bf16 / fp16 rows (8 at the cost
of one), W in the `Int4Weight` layout (qweight int32 [K / 8, N], zeros and scales [K / group, N] in
fp16, bf16 or float32).

The CUDA-core GEMV (`quant_matmul._int4_gemv_kernel`) spends several issue slots a weight (unpack,
then one FMA per weight and row), which keeps it issue-bound below the memory's bandwidth, and its
FMAs grow with the rows. Here the weights are the A operand of `mma.m16n8k16` (swap-AB: 16 output
columns by 16 of K a fragment) and x^T its B operand, 8 columns: all M <= 8 rows cost the same
(more rows: 16, 32 or 64 columns, B fragments side by side, shorter K steps for their registers).
A word's nibbles are unpacked straight into A's registers, two a 32-bit register, with no data
movement between lanes: `lop3` masks nibbles i and i + 4 under the exponent of 128 (bf16 0x4300;
fp16 1024, 0x6400), which reads as the pair (128 + q_i, 128 + q_{i+4}), and one packed subtract
of (128 + z, 128 + z) leaves q - z exactly (both are small integers: AWQ's and GPTQ's zeros are
integers, 0..16). The unpack is about half the GEMV's slots a weight (counted in the sm_90 SASS;
RESULTS.md).

That needs explicit layouts, hence Gluon (Triton >= 3.6): the MMA's A fragment gives lane
(c = lane % 4) four K pairs a 32-wide chunk of K; the dot's K order is chosen so that those eight
positions are the nibbles of one word (position p = 32 ch + 8 i + 2 c + h holds K = 8 w + i + 4 h
of word w = 4 ch + c), so the words' layout is A's with its three K bits dropped, and x is loaded
in natural K order (a lane's 8 K of a word: one 16-byte load) and permuted in registers the same
way. Which output column an A row stands for is free: `_column` gives a lane's A rows adjacent
columns, so its words of a K row are one 16-byte load where A's own order made four 4-byte ones.
`convert_layout(..., assert_trivial=True)` proves the conversions move nothing.
Per step (inside one group): the (q - z) x sums from the MMA times the group's scales, in float32;
the next step's loads are issued before this one computes (one step ahead in registers).
PDL as the CUDA-core GEMV's (`kernels/pdl.py`): wait first, signal after the loop.
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


# per activation dtype: (the unpack, the value of its magic exponent added to the zeros)
UNPACK = {torch.bfloat16: (_unpack_asm(0x43004300, "sub.bf16x2"), 128.0),
          torch.float16: (_unpack_asm(0x64006400, "sub.f16x2"), 1024.0)}


@gluon.jit
def _load_step(q_ptrs, z_ptr, s_ptr, x_ptrs, k0, rn_w, rn, w_mask, N: gl.constexpr, GROUP: gl.constexpr,
               MASKED: gl.constexpr):
    """One step's words [KW, BN], zeros [BN] (words' columns), scales [BN] (the MMA's rows) and x^T
    [BK, ROWS] at K = k0."""
    g = k0 // GROUP
    if MASKED:
        words = gl.load(q_ptrs + (k0 // 8) * N, mask=w_mask, other=0)
        z = gl.load(z_ptr + g * N + rn_w, mask=rn_w < N, other=0.0)
        s = gl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0)
    else:
        words = gl.load(q_ptrs + (k0 // 8) * N)
        z = gl.load(z_ptr + g * N + rn_w)
        s = gl.load(s_ptr + g * N + rn)
    return words, z, s, gl.load(x_ptrs + k0)


@gluon.jit
def _column(r, T: gl.constexpr, WARPS: gl.constexpr):
    """The tile's column held by A's row r: row 16 WARPS t + 16 w + 8 u + g (warp w, lane 4 g + c,
    its u-th row of the t-th 16-row tile) is column 16 T w + 2 T g + 2 t + u, so that a lane's 2 T
    rows are adjacent columns."""
    return (16 * T) * ((r // 16) % WARPS) + (2 * T) * (r % 8) + 2 * (r // (16 * WARPS)) + (r // 8) % 2


@cached_launch
@gluon.jit
def _int4_mma_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, p_ptr, count_ptr, M, stride_xm, stride_ym, k_per_split,
                     N: gl.constexpr, K: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr, TAIL_SUM: gl.constexpr, WARPS: gl.constexpr,
                     W_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, UNPACK_ASM: gl.constexpr,
                     MAGIC: gl.constexpr, ROWS: gl.constexpr, PDL: gl.constexpr):
    pdl_wait(PDL)
    CH: gl.constexpr = BLOCK_K // 32
    KW: gl.constexpr = BLOCK_K // 8
    MASKED: gl.constexpr = N % BLOCK_N != 0
    T: gl.constexpr = BLOCK_N // (16 * WARPS)
    dt: gl.constexpr = x_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    n0 = gl.program_id(0) * BLOCK_N
    rw = gl.arange(0, KW, layout=gl.SliceLayout(1, W_LAYOUT))
    rn_w = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, W_LAYOUT))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, X_LAYOUT))
    rm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, X_LAYOUT))
    x_ptrs = x_ptr + gl.minimum(rm, M - 1)[None, :] * stride_xm + rk[:, None]    # rows past M repeat the last
    q_ptrs = q_ptr + rw[:, None] * N + rn_w[None, :]
    rn = n0 + _column(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma)), T, WARPS)
    w_mask = (rw[:, None] < KW) & (rn_w[None, :] < N)          # (rw < KW: the words' shape)
    acc = gl.zeros([BLOCK_N, ROWS], gl.float32, mma)
    k_start = gl.program_id(1) * k_per_split
    k_end = gl.minimum(k_start + k_per_split, K)
    # one step ahead in registers: the next step's loads are in flight while this one computes (a
    # cp.async ring in shared memory, 3-6 steps ahead, was slower: RESULTS.md)
    words, z, s, x = _load_step(q_ptrs, z_ptr, s_ptr, x_ptrs, k_start, rn_w, rn, w_mask, N, GROUP, MASKED)
    for k0 in range(k_start, k_end, BLOCK_K):
        # the last step loads itself again (cache hits) rather than masking the loads
        nxt = _load_step(q_ptrs, z_ptr, s_ptr, x_ptrs, gl.minimum(k0 + BLOCK_K, k_end - BLOCK_K), rn_w, rn,
                         w_mask, N, GROUP, MASKED)
        zh = (z.to(gl.float32) + MAGIC).to(dt).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        zz, _ = gl.broadcast((zh | (zh << 16))[None, :], words)
        # pack=2 takes two elements an asm: the word and its zero pair twice
        p0, p1, p2, p3 = gl.inline_asm_elementwise(UNPACK_ASM, "=r,=r,=r,=r,r,r,r,r",
                                                   [gl.join(words, words), gl.join(zz, zz)],
                                                   dtype=(x_ptr.dtype.element_ty,) * 4, is_pure=True, pack=2)
        q = gl.join(gl.join(p0, p1), gl.join(p2, p3))           # [KW, BN, h, i0, i1], columns in memory order
        q = gl.reshape(q, [CH, 4, WARPS, 8, T, 2, 2, 2, 2])     # [ch, c, w, g, t, u, h, i0, i1] (`_column`)
        q = gl.permute(q, [4, 2, 5, 3, 0, 8, 7, 1, 6])           # [A's rows: t, w, u, g; its K: ch, i1, i0, c, h]
        a = gl.convert_layout(gl.reshape(q, [BLOCK_N, BLOCK_K]), a_l, assert_trivial=True)
        x = gl.permute(gl.reshape(x, [CH, 4, 2, 2, 2, ROWS]), [0, 3, 4, 1, 2, 5])  # K = 32 ch + 8 c + 4 h + 2 i1 + i0
        b = gl.convert_layout(gl.reshape(x, [BLOCK_K, ROWS]), b_l, assert_trivial=True)
        acc += mma_v2(a, b, gl.zeros([BLOCK_N, ROWS], gl.float32, mma)) * s.to(gl.float32)[:, None]
        words, z, s, x = nxt
    pdl_signal(PDL)
    store_tile(acc, y_ptr, p_ptr, count_ptr, rn, M, N, stride_ym, ROWS, SPLIT_K, TAIL_SUM, mma)


@functools.cache
def _layouts(block_n: int, block_k: int, warps: int, rows: int = 8):
    """The words' [K / 8, BN] layout in memory order, each lane's 2 T columns adjacent (16-byte loads
    at T = 2; `_column` says which of A's rows they are), and x^T's [BK, rows] in natural K order
    (rows: 8 a B fragment, more in further registers)."""
    tiles, chunks = block_n // (16 * warps), block_k // 32
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1]] + [[0, 2 * b] for b in bits(tiles)] + [[4 * b, 0] for b in bits(chunks)],
        lane_bases=[[1, 0], [2, 0], [0, 2 * tiles], [0, 4 * tiles], [0, 8 * tiles]],
        warp_bases=[[0, 16 * tiles * b] for b in bits(warps)], block_bases=[], shape=[block_k // 8, block_n])
    x = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0]] + [[32 * b, 0] for b in bits(chunks)]
                  + [[0, 8 * b] for b in bits(rows // 8)],
        lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0] for _ in bits(warps)],
        block_bases=[], shape=[block_k, rows])
    return words, x


MAX_ROWS = 64


def mma_block_k(group: int, shape: Gemv, rows: int = 8) -> int:
    """K a step (`step_k`): inside one group, whole 32-wide chunks (a word row a lane's K pairs)."""
    return step_k(shape, rows, 32, group)


def int4_mma_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                    shape: Gemv) -> torch.Tensor:
    """x [M <= 64, K] bf16 / fp16 (contiguous) -> [M, N]; group: a multiple of 32 (`mma_block_k`).
    Up to 8 rows cost what one does (one B fragment); more take 8 columns a fragment more."""
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[0] > MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the int4 MMA decode kernel takes up to {MAX_ROWS} bf16 / fp16 rows, "
                         f"not {x.shape[0]} {x.dtype}")
    rows = mma_rows(x.shape[0])
    block_k = mma_block_k(group, shape, rows)
    if not block_k or in_features % group:
        raise ValueError(f"int4 group size {group}: not a multiple of 32 or not dividing K = {in_features}")
    grid, split = decode_grid(shape, x.device, out_features, in_features, shape.block_n, block_k, 4)
    words, xl = _layouts(shape.block_n, block_k, shape.num_warps, rows)
    unpack, magic = UNPACK[x.dtype]
    return _run(_int4_mma_kernel, grid, x, out_features, in_features, block_k, split, ((qweight, zeros, scales), ()),
                None, shape.tail_sum, GROUP=group, BLOCK_N=shape.block_n, WARPS=shape.num_warps, W_LAYOUT=words,
                X_LAYOUT=xl, UNPACK_ASM=unpack, MAGIC=magic, ROWS=rows, num_warps=shape.num_warps,
                **pdl_args(x.device))
