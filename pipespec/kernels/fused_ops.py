"""Fused elementwise kernels for the decoder: residual add + RMSNorm (plain or zero-centred), gated
RMSNorm, RoPE (in place, or on a slice of each head as MLA and partial rotary use), SiLU-and-multiply,
KV write, and MLA's cache entry (the latent's norm, the rope key's rotation and the write in one).

Each replaces several PyTorch launches with one, which is what a small model's decode step is made
of once CUDA graphs remove the launch overhead. Numerics follow the PyTorch path in `model.layers`:
float32 inside, rounded to the tensor's dtype where the PyTorch ops round.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait

@cached_launch
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, n_cols, stride_x, eps,
                     HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)      # the sum is rounded to the model dtype, as in torch
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    y = _normed(x.to(tl.float32), w, n_cols, eps, out_ptr.dtype.element_ty, ZERO_CENTRED)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_scale(sum_sq, n_cols, eps):
    """1 / rms from a row's sum of squares over its n_cols columns."""
    return 1.0 / tl.sqrt(sum_sq / n_cols + eps)


@triton.jit
def _normed(xf, w, n_cols, eps, dtype: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """RMSNorm of one float32 row (padding zero) by weight w, before the final cast to `dtype`."""
    rstd = rms_scale(tl.sum(xf * xf, axis=0), n_cols, eps)
    if ZERO_CENTRED:        # y = norm(x) * (1 + w), all in float32 (`model/norms.py`)
        return xf * rstd * (1.0 + w)
    return (xf * rstd).to(dtype).to(tl.float32) * w      # Llama: the norm is rounded before the weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centred: bool = False):
    """RMSNorm of x (of x + residual when given, also returning that sum as the new residual);
    `zero_centred`: the weight is an offset from one (`model/norms.py::ZeroCentredRMSNorm`). A 2-D x
    may have any row stride (a slice of a fused projection's rows is read in place); the outputs
    are contiguous."""
    if not (x.dim() == 2 and x.stride(-1) == 1):
        x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    rows = x.numel() // n
    if rows == 0:
        return out if residual is None else (out, res_out)
    _rms_norm_kernel[(rows,)](x, residual.contiguous() if residual is not None else x, out, res_out,
                              weight, n, x.stride(0) if x.dim() == 2 else n, eps, HAS_RESIDUAL=residual is not None,
                              ZERO_CENTRED=zero_centred, BLOCK=next_pow2(n), **pdl_args(x.device))
    return out if residual is None else (out, res_out)


@cached_launch
@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = rms_scale(tl.sum(x * x, axis=0), n_cols, eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (y * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim (plain weight) times silu(z) in float32 (Gated DeltaNet's output
    norm, `model/gated_deltanet.py::GatedRMSNorm`): one kernel for its ten PyTorch ops."""
    x, z = x.contiguous(), z.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    if x.numel():
        _gated_rms_norm_kernel[(x.numel() // n,)](x, z, weight, out, n, eps, BLOCK=next_pow2(n),
                                                  **pdl_args(x.device))
    return out


@cached_launch
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, act * up, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat[gate, up] along the last dim."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * n)
    block = min(1024, next_pow2(n))
    if rows == 0:
        return out
    _silu_mul_kernel[(rows, cdiv(n, block))](gate_up, out, n, BLOCK=block, **pdl_args(gate_up.device))
    return out


@cached_launch
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h,
                 HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + t)
    base = x_ptr + t * stride_t + h * stride_h
    x = tl.load(base + d).to(tl.float32)
    rolled = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + d)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + d)
    tl.debug_barrier()      # every lane has read its rolled partner before any lane writes
    tl.store(base + d, (x * cos + rolled * sin).to(x_ptr.dtype.element_ty))


def rope_(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place with the sign-folded tables of `RotaryEmbedding` ([P, D])."""
    t, heads, d = x.shape
    assert x.stride(-1) == 1 and d & (d - 1) == 0, "rope_ needs unit-stride, power-of-two head_dim"
    if t:
        _rope_kernel[(t, heads)](x, cos_table, sin_table, positions, x.stride(0), x.stride(1), HEAD_DIM=d,
                                 num_warps=1, **pdl_args(x.device))
    return x


@cached_launch
@triton.jit
def _slice_rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, heads,
                       HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    ok = h[:, None] < heads
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * HALF + i)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + i)[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h
    _rotate_slice(base, out_ptr + (t * heads + h[:, None]) * (2 * HALF), i[None, :], cos, sin, ok, HALF, INTERLEAVED)


@triton.jit
def _rotate_slice(src, dst, i, cos, sin, ok, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate the pairs of a rotary slice at `src` (i: the pair indices, broadcast against the rows
    of src/dst) and store it at `dst` in dst's dtype: first members, then second members."""
    if INTERLEAVED:          # pairs (2i, 2i + 1)
        a = tl.load(src + 2 * i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(src + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
    else:                    # pairs (i, i + D/2)
        a = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + i, (a * cos - b * sin).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + i, (b * cos + a * sin).to(dst.dtype.element_ty), mask=ok)


def slice_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """`model/deepseek/rope.py::SliceRope.rotate` in one kernel: x [T, heads, D] (any row and head
    strides, unit stride within a head), tables float32 [P, D/2]; returns a new contiguous
    [T, heads, D] in x's dtype, the rotated pairs' first members then their second."""
    t, heads, d = x.shape
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t:
        block_h = min(16, next_pow2(heads))
        _slice_rope_kernel[(t, cdiv(heads, block_h))](x, out, cos, sin, positions, x.stride(0), x.stride(1),
                                                      heads, HALF=d // 2, INTERLEAVED=interleaved,
                                                      BLOCK_H=block_h, num_warps=1, **pdl_args(x.device))
    return out


@cached_launch
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:            # padding rows (slot -1) of a captured batch write nothing
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        tl.store(kc_ptr + slot * ROW + cols, tl.load(k_ptr + t * stride_kt + cols, mask=mask), mask=mask)
        tl.store(vc_ptr + slot * ROW + cols, tl.load(v_ptr + t * stride_vt + cols, mask=mask), mask=mask)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, KVH, D] (heads contiguous within a row) at their slots, in one launch."""
    row = k.shape[1] * k.shape[2]
    if k.shape[0] == 0:
        return
    assert k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] and k.stride(2) == 1 and v.stride(2) == 1
    _write_kv_kernel[(k.shape[0],)](k, v, key_cache, value_cache, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=next_pow2(row), **pdl_args(k.device))


@cached_launch
@triton.jit
def _mla_entry_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, cache_ptr, stride_kt, stride_ct, eps,
                      R: tl.constexpr, R_PAD: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        r = tl.arange(0, R_PAD)
        mask = r < R
        x = tl.load(kv_ptr + t * stride_kt + r, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r, mask=mask, other=0.0).to(tl.float32)
        dst = cache_ptr + slot * stride_ct
        y = _normed(x, w, R, eps, kv_ptr.dtype.element_ty, False).to(kv_ptr.dtype.element_ty)   # kv_a_layernorm
        tl.store(dst + r, y.to(cache_ptr.dtype.element_ty), mask=mask)
        i = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cos_ptr + pos * HALF + i)
        sin = tl.load(sin_ptr + pos * HALF + i)
        _rotate_slice(kv_ptr + t * stride_kt + R, dst + R, i, cos, sin, i < HALF, HALF, INTERLEAVED)


def mla_cache_entry(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, interleaved: bool, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """MLA's cache entry of each row in one launch: kv_a [T, R + DR] (the kv_a projection's rows,
    unit stride within a row) -> cache[slot, 0, :R] = RMSNorm(latent) (Llama rounding, as
    `layers.RMSNorm`), cache[slot, 0, R:R + DR] = the rotated rope key (as `fused_ops.slice_rope`
    lays it out); tables float32 [P, DR/2]. Rows whose slot is negative write nothing."""
    t, width = kv_a.shape
    rank, half = norm_weight.shape[0], (width - norm_weight.shape[0]) // 2
    assert kv_a.stride(1) == 1 and cache.stride(-1) == 1 and half & (half - 1) == 0
    if t:
        _mla_entry_kernel[(t,)](kv_a, norm_weight, cos, sin, positions, slot_mapping, cache, kv_a.stride(0),
                                cache.stride(0), eps, R=rank, R_PAD=next_pow2(rank), HALF=half,
                                INTERLEAVED=interleaved, num_warps=4, **pdl_args(kv_a.device))
