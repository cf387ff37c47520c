"""Zero-centred RMSNorm: the weight is stored as an offset from one (Qwen3-Next, Qwen3.5, Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from pipespec import kernels


class ZeroCentredRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w), computed in float32; with `residual` it first adds it and returns
    the new residual too (the same calling convention as `layers.RMSNorm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if kernels.enabled(x):           # one kernel for the ten ops below (a small model's decode)
            from pipespec.kernels.fused_ops import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, zero_centred=True)
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        scale = 1.0 + self.weight.float()       # one plus the offset, in float32 even for bf16 weights
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)
        return out if residual is None else (out, residual)
