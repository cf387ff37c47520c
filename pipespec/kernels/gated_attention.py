"""The elementwise parts of Qwen3-Next / Qwen3.5 gated attention (`model/qwen3_next.py`), fused.

Around its attention kernel a gated-attention layer runs, in PyTorch, a concatenation of q and k,
their two zero-centred RMSNorms, the partial rotary of each head's leading dims, and after the
attention a copy of the strided gate, its sigmoid and the product: seven launches a layer at batch 1
(each a few microseconds inside a decode graph). Here they are two:

- `qk_norm_rope` reads each query and key head straight from the fused q/k/v projection's row
  (queries interleaved with their gates, `2 * head_dim` a head), norms it, rotates its first
  `rot` dims and writes contiguous q [T, H, D] and k [T, KVH, D];
- `sigmoid_gate` multiplies the attention output by sigmoid(gate), reading the gate in place.

Rounding follows the kernels they replace: the norm rounded to the dtype, then rotated in float32
and rounded; sigmoid(gate) rounded before the product, as torch rounds it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.fused_ops import rms_scale
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@cached_launch
@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, stride_t, eps,
                         H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)                      # heads 0 .. H - 1 are queries, then the keys
    is_q = j < H
    src = qkv_ptr + t * stride_t + tl.where(is_q, j * 2 * D, H * 2 * D + (j - H) * D)
    dst = tl.where(is_q, q_ptr + (t * H + j) * D, k_ptr + (t * KVH + j - H) * D)
    w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
    d = tl.arange(0, D_PAD)
    ok = d < D
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    rstd = rms_scale(tl.sum(x * x, axis=0), D, eps)
    dt = dst.dtype.element_ty
    # the unrotated dims: normed (zero-centred weight, float32) and rounded
    rest = ok & (d >= 2 * HALF)
    tl.store(dst + d, (x * rstd * (1.0 + tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32))).to(dt), mask=rest)
    # the rotated dims, as two halves a and b: rotate-half with the sign-folded tables [P, 2 * HALF]
    i = tl.arange(0, HALF)
    a = tl.load(src + i).to(tl.float32) * rstd * (1.0 + tl.load(w_ptr + i).to(tl.float32))
    b = tl.load(src + HALF + i).to(tl.float32) * rstd * (1.0 + tl.load(w_ptr + HALF + i).to(tl.float32))
    a, b = a.to(dt).to(tl.float32), b.to(dt).to(tl.float32)
    table = tl.load(pos_ptr + t) * 2 * HALF
    cos_a, cos_b = tl.load(cos_ptr + table + i), tl.load(cos_ptr + table + HALF + i)
    sin_a, sin_b = tl.load(sin_ptr + table + i), tl.load(sin_ptr + table + HALF + i)
    tl.store(dst + i, (a * cos_a + b * sin_a).to(dt))
    tl.store(dst + HALF + i, (b * cos_b + a * sin_b).to(dt))


def rotary_fits(rot: int, head_dim: int) -> bool:
    """Whether `qk_norm_rope` takes a rotary width (twice a power of two, at most head_dim)."""
    half = rot // 2
    return rot % 2 == 0 and half > 0 and half & (half - 1) == 0 and rot <= head_dim


def qk_norm_rope(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, >= H * 2D + KVH * D] (unit stride in a row; queries interleaved with their gates per
    head, then the keys) -> q [T, H, D], k [T, KVH, D]: zero-centred RMSNorm of each head (weights
    [D]), then rotate-half RoPE of its first `rot` dims with `RotaryEmbedding`'s sign-folded
    tables cos/sin [P, rot] (rot even, half of it a power of two)."""
    t = qkv.shape[0]
    rot = cos.shape[-1]
    if qkv.stride(-1) != 1 or not rotary_fits(rot, head_dim):
        raise ValueError(f"qk_norm_rope needs unit-stride rows and a rotary width of twice a power of two "
                         f"<= head_dim; got rotary {rot}, head_dim {head_dim}")
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        _qk_norm_rope_kernel[(t, heads + kv_heads)](
            qkv, q_weight, k_weight, cos, sin, positions, q, k, qkv.stride(0), eps, H=heads, KVH=kv_heads, D=head_dim,
            D_PAD=next_pow2(head_dim), HALF=rot // 2, num_warps=1, **pdl_args(qkv.device))
    return q, k


@cached_launch
@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, stride_gt, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H * D
    x = tl.load(x_ptr + t * H * D + c, mask=ok, other=0.0)
    # gate of head c // D: the second half of that head's 2D query-and-gate block
    g = tl.load(g_ptr + t * stride_gt + (c // D) * 2 * D + D + c % D, mask=ok, other=0.0).to(tl.float32)
    gate = tl.sigmoid(g).to(x.dtype)
    tl.store(out_ptr + t * H * D + c, (x.to(tl.float32) * gate.to(tl.float32)).to(x.dtype), mask=ok)


def sigmoid_gate(x: torch.Tensor, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """x [T, H * D] (contiguous: the attention output) times sigmoid of the gates held in qkv's rows
    (`qk_norm_rope`'s layout), in x's dtype."""
    t = x.shape[0]
    x = x.contiguous()
    out = torch.empty_like(x)
    if t:
        block = min(1024, next_pow2(heads * head_dim))
        _sigmoid_gate_kernel[(t, cdiv(heads * head_dim, block))](
            x, qkv, out, qkv.stride(0), H=heads, D=head_dim, BLOCK=block, num_warps=4, **pdl_args(x.device))
    return out
