"""Routed experts kept in block-scaled FP8, for many (token, slot) pairs: two grouped matrix products
on the tensor cores that read each picked expert's FP8 weights once.

The few-pair GEMVs (`moe_experts.py`) read an expert once per pair that picks it and scale every
element on CUDA cores: right at one token, but at a decode batch of 64 (256 pairs at top-4) far
slower than bf16 grouped GEMMs (RESULTS.md). Here the pairs are sorted by expert on
the device and each expert's group is padded to whole tiles of BM rows (`_tiles`), so a program owns
one expert's tile: it gathers its rows of x, loads [BK, BN] FP8 weight tiles, widens them to x's
dtype and multiplies on the tensor cores, applying the tile's one block scale to each BK step's
product (BN rows inside one scale block, BK = the block's width). Every shape comes from the host:
the tile count is the bound sum(ceil(n_e / BM)) <= (pairs + E (BM - 1)) / BM, and tiles past the
used ones, or of another rank's experts (`first`), exit at once. So a step captures in a CUDA graph.

Rounding is the grouped path's: gate and up rounded to x's dtype, silu(gate), their product, and
each slot's down output before the routing weights sum the slots in order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.moe_experts import silu_mul
from pipespec.kernels.quant_matmul import scaled_dot


def fits(gate_up, down, h_dim: int) -> bool:
    """Whether FP8 stacks `gate_up` [E * 2I, H], `down` [E * H, I] have the block geometry these
    kernels need: tiles of rows inside one scale block, K steps of one block's width."""
    (bo, bi), i_dim = gate_up.block, down.weight.shape[1]
    return (down.block == gate_up.block and bi >= 16 and bi & (bi - 1) == 0 and bo % min(64, bo) == 0
            and min(64, bo) >= 16 and h_dim % bo == 0 and i_dim % bo == 0 and h_dim % bi == 0
            and i_dim % bi == 0)


def _tiles(ids: torch.Tensor, first: int, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [tiles * BM]: the pair each padded row holds, -1 for padding; expert of each tile, E for
    none), worked out on the device from host shapes."""
    p, dev = ids.numel(), ids.device
    flat = ids.reshape(-1) - first
    # (no Python scalar goes into a tensor op here: inside a graph capture it would be a host copy)
    void = torch.full_like(flat, experts)
    flat = torch.where((flat >= 0) & (flat < experts), flat, void)       # another rank's: group E
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:experts] + bm - 1) // bm * bm                       # group E takes no tiles
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    group = flat[order]
    rank = torch.arange(p, device=dev) - (counts.cumsum(0) - counts)[group]   # place inside its group
    tiles = cdiv(p + experts * (bm - 1), bm)
    local = group.clamp(max=experts - 1)
    dest = torch.where(group < experts, ends[local] - padded[local] + rank, torch.full_like(group, tiles * bm))
    rows = torch.full((tiles * bm + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, dest, order)[:-1]
    tile_expert = torch.searchsorted(ends, torch.arange(tiles, device=dev) * bm, right=True)
    return rows, tile_expert


@triton.jit
def _fp8_tile_product(a, w_ptr, s_ptr, row0, rn, k0, rk, COLS: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                      IEEE: tl.constexpr):
    """a [BM, BK] times rows row0 + rn, columns k0 + rk of an FP8 stack (row length COLS), scaled by
    the one block they lie in: [BM, BN] float32. IEEE: float32 products (test runs), not TF32."""
    w = tl.load(w_ptr + (row0 + rn)[None, :].to(tl.int64) * COLS + (k0 + rk)[:, None])
    return scaled_dot(a, w, tl.load(s_ptr + (row0 // BO) * (COLS // BI) + k0 // BI), IEEE)


@cached_launch
@triton.jit
def _gate_up_kernel(x_ptr, rows_ptr, tile_e_ptr, w_ptr, s_ptr, h_ptr, E, stride_x, K: tl.constexpr,
                    H: tl.constexpr, I: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < E:
        pair = tl.load(rows_ptr + t * BM + tl.arange(0, BM))
        valid = pair >= 0
        token = tl.where(valid, pair // K, 0)
        n0 = tl.program_id(1) * BN
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BI)
        gate0 = e.to(tl.int64) * (2 * I) + n0                 # the expert's gate rows, then its up rows
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BI):
            a = tl.load(x_ptr + token[:, None] * stride_x + (k0 + rk)[None, :], mask=valid[:, None], other=0.0)
            acc_g += _fp8_tile_product(a, w_ptr, s_ptr, gate0, rn, k0, rk, H, BO, BI, IEEE)
            acc_u += _fp8_tile_product(a, w_ptr, s_ptr, gate0 + I, rn, k0, rk, H, BO, BI, IEEE)
        tl.store(h_ptr + pair[:, None] * I + (n0 + rn)[None, :], silu_mul(acc_g, acc_u, h_ptr), mask=valid[:, None])


@cached_launch
@triton.jit
def _down_kernel(h_ptr, rows_ptr, tile_e_ptr, w_ptr, s_ptr, y_ptr, E, H: tl.constexpr, I: tl.constexpr,
                 BO: tl.constexpr, BI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < E:
        pair = tl.load(rows_ptr + t * BM + tl.arange(0, BM))
        valid = pair >= 0
        safe = tl.where(valid, pair, 0)
        n0 = tl.program_id(1) * BN
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BI)
        row0 = e.to(tl.int64) * H + n0
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BI):
            a = tl.load(h_ptr + safe[:, None] * I + (k0 + rk)[None, :], mask=valid[:, None], other=0.0)
            acc += _fp8_tile_product(a, w_ptr, s_ptr, row0, rn, k0, rk, I, BO, BI, IEEE)
        tl.store(y_ptr + pair[:, None] * H + (n0 + rn)[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None])


def grouped_fp8_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                        first: int | None = None) -> torch.Tensor:
    """`routed_experts` for FP8 stacks (`model/quant/experts.py::Fp8Stack`) that `fits` allows."""
    t, k = ids.shape
    h_dim, i_dim = x.shape[-1], down.weight.shape[1]
    e = down.weight.shape[0] // h_dim
    (bo, bi), bn = gate_up.block, min(64, gate_up.block[0])
    x = x.contiguous()
    if t == 0:
        return torch.empty_like(x)
    bm = 16 if t * k <= 16 * e else 64               # decode batches: a few rows per expert
    rows, tile_expert = _tiles(ids, first or 0, e, bm)
    ieee = x.dtype == torch.float32
    hid = torch.empty(t * k, i_dim, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tile_expert.shape[0], i_dim // bn)](
        x, rows, tile_expert, gate_up.weight, gate_up.scale_inv, hid, e, x.stride(0), K=k, H=h_dim, I=i_dim,
        BO=bo, BI=bi, BM=bm, BN=bn, IEEE=ieee, num_warps=4, num_stages=3)
    y = torch.zeros(t * k, h_dim, dtype=x.dtype, device=x.device)     # other ranks' pairs stay zero
    _down_kernel[(tile_expert.shape[0], h_dim // bn)](
        hid, rows, tile_expert, down.weight, down.scale_inv, y, e, H=h_dim, I=i_dim, BO=bo, BI=bi, BM=bm, BN=bn,
        IEEE=ieee, num_warps=4, num_stages=3)
    return (y.view(t, k, h_dim).float() * weights.reshape(t, k, 1).float()).sum(1).to(x.dtype)
