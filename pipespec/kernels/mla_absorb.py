"""MLA's absorbed per-head products for decode and verify rows, read straight from kv_b_proj's weight.

kv_b_proj's weight is [H * (dn + dv), R]: per head h, dn rows of W_uk then dv rows of W_uv, each
R wide. The absorbed form needs, for the few query rows of a step,

    q_lat[t, h, :] = q_nope[t, h, :] @ W_uk[h]          (sum over dn: a column-wise product)
    out[t, h, :]   = W_uv[h] @ o_lat[t, h, :]            (sum over R: a row-wise product)

Batched cuBLAS GEMMs stream these small per-head weights far below the memory's bandwidth at a
row or two (RESULTS.md). Here each program takes one head's tile of
the weight, the row against it, and sums on CUDA cores in float32 (a row is far too few for
tensor-core tiles); nothing is copied or transposed first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait

MAX_ROWS = 8          # query rows the kernels take
# Rows up to which the layer takes them: one (batch-1 decode). Their CUDA-core FMAs per weight grow
# with the rows, and from 2 rows the einsum is faster (`benchmarks/mla_kernel.py`).
FAST_ROWS = 1


@cached_launch
@triton.jit
def _uk_kernel(q_ptr, w_ptr, out_ptr, T, stride_qt, stride_qh, stride_ot, stride_oh,
               DN: tl.constexpr, HEAD_ROWS: tl.constexpr, R: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """out[t, h, r-tile] = sum_d q[t, h, d] * W[h * HEAD_ROWS + d, r-tile]."""
    pdl_signal(PDL)
    pdl_wait(PDL)
    h = tl.program_id(0)
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rt = tl.arange(0, BLOCK_T)
    t_ok = rt < T
    w_head = w_ptr + h.to(tl.int64) * HEAD_ROWS * R
    # products kept apart per d until the end: summing over d (across warps) at every step would
    # cost a shared-memory reduction a step
    acc = tl.zeros((BLOCK_T, BLOCK_D, BLOCK_R), tl.float32)
    for d0 in range(0, DN, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = tl.load(w_head + d[:, None] * R + rr[None, :], mask=(d[:, None] < DN) & (rr[None, :] < R), other=0.0)
        q = tl.load(q_ptr + rt[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=t_ok[:, None] & (d[None, :] < DN), other=0.0)
        acc += q.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    tl.store(out_ptr + rt[:, None] * stride_ot + h * stride_oh + rr[None, :],
             tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & (rr[None, :] < R))


@cached_launch
@triton.jit
def _uv_kernel(x_ptr, w_ptr, out_ptr, T, stride_xt, stride_xh, stride_ot, stride_oh,
               DN: tl.constexpr, DV: tl.constexpr, HEAD_ROWS: tl.constexpr, R: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """out[t, h, v-tile] = sum_r W[h * HEAD_ROWS + DN + v, r] * x[t, h, r]."""
    pdl_signal(PDL)
    pdl_wait(PDL)
    h = tl.program_id(0)
    rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rt = tl.arange(0, BLOCK_T)
    t_ok = rt < T
    w_rows = w_ptr + (h.to(tl.int64) * HEAD_ROWS + DN + rv) * R
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        w = tl.load(w_rows[:, None] + r[None, :], mask=(rv[:, None] < DV) & (r[None, :] < R), other=0.0)
        x = tl.load(x_ptr + rt[:, None] * stride_xt + h * stride_xh + r[None, :],
                    mask=t_ok[:, None] & (r[None, :] < R), other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + rt[:, None] * stride_ot + h * stride_oh + rv[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & (rv[None, :] < DV))


def _check(x: torch.Tensor, weight: torch.Tensor, heads: int, width: int) -> None:
    if x.shape[0] > MAX_ROWS or x.stride(-1) != 1 or not weight.is_contiguous() or x.shape[1] != heads:
        raise ValueError(f"absorbed MLA products take <= {MAX_ROWS} rows [T, {heads}, {width}] with unit stride "
                         f"inside a head and a contiguous kv_b weight; got {tuple(x.shape)}")


def _launch(kernel, x: torch.Tensor, weight: torch.Tensor, out_width: int, tile: int, **meta) -> torch.Tensor:
    """`kernel` over (heads, output tiles of `tile`) for x [T, H, *] -> [T, H, out_width] in x's dtype."""
    t, heads, _ = x.shape
    out = torch.empty(t, heads, out_width, dtype=x.dtype, device=x.device)
    if t:
        kernel[(heads, cdiv(out_width, tile))](x, weight, out, t, x.stride(0), x.stride(1), out.stride(0),
                                               out.stride(1), num_warps=4, **meta, **pdl_args(x.device))
    return out


def absorb_query(q_nope: torch.Tensor, weight: torch.Tensor, dn: int, dv: int) -> torch.Tensor:
    """q_nope [T, H, dn] (any row and head strides) through W_uk: -> q_lat [T, H, R] in q's dtype."""
    _check(q_nope, weight, q_nope.shape[1], dn)
    rows = next_pow2(max(q_nope.shape[0], 1))
    return _launch(_uk_kernel, q_nope, weight, weight.shape[1], 64, DN=dn, HEAD_ROWS=dn + dv, R=weight.shape[1],
                   BLOCK_T=rows, BLOCK_D=max(8, 64 // rows), BLOCK_R=64)


def absorb_output(o_lat: torch.Tensor, weight: torch.Tensor, dn: int, dv: int) -> torch.Tensor:
    """o_lat [T, H, R] through W_uv: -> [T, H, dv] in o_lat's dtype."""
    _check(o_lat, weight, o_lat.shape[1], o_lat.shape[2])
    rows = next_pow2(max(o_lat.shape[0], 1))
    return _launch(_uv_kernel, o_lat, weight, dv, 16, DN=dn, DV=dv, HEAD_ROWS=dn + dv, R=o_lat.shape[2],
                   BLOCK_T=rows, BLOCK_V=16, BLOCK_R=max(64, 512 // rows))
