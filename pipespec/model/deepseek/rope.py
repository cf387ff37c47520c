"""Rotary embedding on a slice of each head (MLA's rope dims, GLM's partial rotary), with YaRN.

Two pair layouts: rotate-half (dims i and i + D/2 form a pair) and interleaved (dims 2i and 2i + 1,
DeepSeek's `rope_interleave`). The interleaved rotation returns the pairs de-interleaved (rotated
evens, then rotated odds), as the reference does; q and k share the layout, so their dot product is
the same, and the cache stores keys in it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pipespec import kernels
from pipespec.model.deepseek.config import YaRN, yarn_mscale


def yarn_inv_freq(dim: int, theta: float, y: YaRN) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scale): interpolate long wavelengths by `factor`, keep short
    ones, ramp linearly between the correction dims of beta_fast and beta_slow rotations."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / base, 1.0 / (y.factor * base)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                    # 1: extrapolate (short wavelengths)
    inv_freq = inter * (1 - keep) + extra * keep
    if y.attention_factor is not None:
        scale = float(y.attention_factor)
    elif y.mscale and y.mscale_all_dim:
        scale = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        scale = yarn_mscale(y.factor)
    return inv_freq, scale


class SliceRope(nn.Module):
    """cos/sin tables [P, D/2] for a rotary slice of width D; `rotate(x, positions)` on [T, heads, D]."""

    def __init__(self, dim: int, theta: float, max_position: int, yarn: YaRN | None = None,
                 interleaved: bool = False):
        super().__init__()
        if yarn is None:
            inv_freq, scale = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        else:
            inv_freq, scale = yarn_inv_freq(dim, theta, yarn)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        self.interleaved = interleaved

    def forward(self, positions: torch.Tensor) -> "SliceRope":
        # blocks take the rope object and rotate with ctx.positions (the call mirrors Llama's rotary)
        return self

    @staticmethod
    def fused_serves(dim: int) -> bool:
        """Whether the rotary kernels take a slice of `dim` (their pair index is a power-of-two range)."""
        half = dim // 2
        return half & (half - 1) == 0

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool | None = None) -> torch.Tensor:
        """`interleaved` overrides the table's layout (DeepSeek-V3.2's indexer rotates half)."""
        interleaved = self.interleaved if interleaved is None else interleaved
        if kernels.enabled(x) and x.stride(-1) == 1 and self.fused_serves(x.shape[-1]):
            from pipespec.kernels.fused_ops import slice_rope     # one kernel for the dozen ops below
            return slice_rope(x, self.cos, self.sin, positions, interleaved)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        if interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x.chunk(2, dim=-1)
        a32, b32 = a.float(), b.float()
        return torch.cat((a32 * cos - b32 * sin, b32 * cos + a32 * sin), dim=-1).to(x.dtype)
