"""Matrix products with quantized weights that dequantize inside the kernel: int4 (AWQ / GPTQ, in
the `Int4Weight` layout) and block-scaled FP8 e4m3. y = x @ W.T for x [M, K] in bf16/fp16/fp32.

Decode is bound by reading the weights: 4 bits a weight instead of 16 is what buys the speed, so each
tile of packed weights is read once, unpacked in registers and multiplied at the activations'
precision (weight-only quantization, W4A16 / W8A16). The activations are never quantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import sm_count


@triton.jit
def _store(y_ptr, acc, rm, rn, M, N, stride_ym, SPLIT_K: tl.constexpr):
    """The tile's sum, or with split-K this split's float32 partial (plane program_id(2) of [S, M, N])."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + tl.program_id(2) * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def _int4_kernel(x_ptr, q_ptr, z_ptr, s_ptr, y_ptr, M, stride_xm, stride_ym, k_per_split,
                 N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    shift = tl.arange(0, 8) * 4                             # row 8w + j is nibble j of word w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split                # k_per_split: whole BLOCK_K tiles
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):   # one group a tile
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w_row = k0 // 8 + rw                                # each packed word is read once
        words = tl.load(q_ptr + w_row[:, None] * N + rn[None, :],
                        mask=(w_row[:, None] < K // 8) & (rn[None, :] < N), other=0)
        q = (words[:, None, :] >> shift[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        g = k0 // GROUP
        z = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        w = ((q - z[None, :]) * s[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    _store(y_ptr, acc, rm, rn, M, N, stride_ym, SPLIT_K)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, stride_xm, stride_ym, scale_cols, k_per_split,
                N: tl.constexpr, K: tl.constexpr,
                BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
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
        s = tl.load(s_ptr + scale_row * scale_cols + k0 // BLOCK_IN)
        if IEEE:
            part = tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * s
    _store(y_ptr, acc, rm, rn, M, N, stride_ym, SPLIT_K)


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
    split_k: programs sharing one output tile's K range (0: `split_k_for` picks)."""
    block_n: int = 64
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 0

    def k_tile(self, size: int, what: str) -> int:
        if self.block_k:
            if size % self.block_k:
                raise ValueError(f"block_k={self.block_k} does not divide the {what} ({size})")
            return self.block_k
        return _tile(size, what)


DEFAULT_TILES = Tiles()
MAX_SPLIT_K = 16


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def split_k_for(programs: int, k_tiles: int, sms: int) -> int:
    """Decode multiplies one row by a weight: with N / BLOCK_N output tiles alone, a 4,096-wide
    projection launches 64 programs on 132 SMs, each walking all of K, too few loads in flight to
    stream the weight. Split K until there are about two programs per SM, each with >= 4 K tiles."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLIT_K, -(-2 * sms // programs), k_tiles // 4))


def _launch(kernel, x: torch.Tensor, out_features: int, in_features: int, block_n: int, block_k: int,
            tiles: Tiles, weights: tuple, scalars: tuple = (), **constexprs) -> torch.Tensor:
    """Run `kernel` on x [M, K] over (M tiles, N tiles, K splits); with splits > 1 each writes a
    float32 partial and one sum (in split order: deterministic, unlike atomics) gives y."""
    m = x.shape[0]
    block_m = _block_m(m)
    grid_mn = triton.cdiv(m, block_m), triton.cdiv(out_features, block_n)
    k_tiles = triton.cdiv(in_features, block_k)
    split = tiles.split_k or split_k_for(grid_mn[0] * grid_mn[1], k_tiles, sm_count(x.device))
    split = max(1, min(split, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    split = triton.cdiv(in_features, k_per_split)          # no empty splits
    y = torch.empty(m, out_features, device=x.device, dtype=x.dtype)
    dest = y if split == 1 else torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
    kernel[(*grid_mn, split)](x, *weights, dest, m, x.stride(0), y.stride(0), *scalars, k_per_split,
                              N=out_features, K=in_features, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=tiles.num_warps,
                              num_stages=tiles.num_stages, **constexprs)
    return y if split == 1 else dest.sum(0).to(x.dtype)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
                perm: torch.Tensor | None = None, tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W the int4 weight in `model/quant/packed.py`'s
    layout: qweight int32 [K / 8, N], zeros and scales float32 [K / group, N], perm (act-order) [K]."""
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    lead = x.shape[:-1]
    x = x.reshape(-1, in_features)
    if perm is not None:
        x = x.index_select(1, perm)                        # act-order: rows in group order
    y = _launch(_int4_kernel, x.contiguous(), out_features, in_features, tiles.block_n,
                tiles.k_tile(group, "int4 group size"), tiles, (qweight, zeros, scales), GROUP=group)
    return y.view(*lead, out_features)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int], tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] e4m3 times its [N / bo, K / bi] block scales).T -> [..., N]."""
    out_features, in_features = weight.shape
    bo, bi = block
    lead = x.shape[:-1]
    x = x.reshape(-1, in_features).contiguous()
    block_n = tiles.block_n if tiles.block_n and bo % tiles.block_n == 0 else _tile(bo, "fp8 scale block rows")
    y = _launch(_fp8_kernel, x, out_features, in_features, block_n, tiles.k_tile(bi, "fp8 scale block columns"),
                tiles, (weight, scale_inv.float().contiguous()), (scale_inv.shape[1],),
                BLOCK_OUT=bo, BLOCK_IN=bi)
    return y.view(*lead, out_features)
