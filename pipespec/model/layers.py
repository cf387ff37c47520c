"""Building blocks shared by decoder families: RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from pipespec import kernels
from pipespec.model.arch import ArchConfig
from pipespec.model.linear import linear, weight_times_rows
from pipespec.model.tp_layers import SINGLE, Shard, gate_up_parallel, gather_vocab, RowParallelLinear, vocab_shard
from pipespec.parallel import TensorParallel


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for an LM head [V, H]: on CPU at any row count as `weight_times_rows`, its
    transposed view as it is (the logits' readers, argmax and sampling, take any strides; `linear`
    copies only because the next layer reads rows)."""
    if x.device.type != "cpu" or x.dim() != 2 or weight.stride(1) != 1:
        return linear(x, weight)
    return weight_times_rows(x, weight)


class LMHead(nn.Linear):
    """A projection onto the vocabulary. Its product goes through `head_logits`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(x, self.weight)


class ParallelLMHead(LMHead):
    """An LM head holding this rank's vocabulary rows (tp_layers.py); `forward` returns the full
    logits, gathered in rank order."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel = SINGLE):
        super().__init__(hidden, tp.vocab_range(vocab)[1], bias=False)
        self.tp, self.vocab = tp, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(head_logits(x, self.weight), self.tp, self.vocab)

    def checkpoint_shards(self) -> dict[str, Shard]:
        return {"weight": vocab_shard(self.vocab, self.tp)} if self.tp.size > 1 else {}


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual` it first adds it and returns the new residual."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if kernels.enabled(x):
            from pipespec.kernels.fused_ops import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    dim = arch.head_dim
    # float32 throughout, as Hugging Face computes it, so positions far out agree to the last bit
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
    if rs.kind == "linear":
        return inv_freq / rs.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / rs.factor,
                       torch.where(wavelen < high_wavelen, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face convention), from cos/sin tables indexed by position.

    The tables are stored full width with the sign of the first half of sin folded in, so that
    rope(x) = x * cos + roll(x, D/2) * sin: three elementwise ops instead of a split and a concat.
    """

    def __init__(self, arch: ArchConfig, max_position: int):
        super().__init__()
        inv_freq = rope_inv_freq(arch)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor) -> "Rope":
        """The rotation of the step's rows; made once per step, used by every layer."""
        return Rope(self.cos, self.sin, positions)


class Rope:
    """Sign-folded cos/sin tables [P, D] and the step's positions [T]."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
        self.cos, self.sin, self.positions = cos, sin, positions

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each row, [T, 1, D], gathered once on first use."""
        return self.cos[self.positions][:, None, :], self.sin[self.positions][:, None, :]


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads may be stacked together). The fused kernel rotates in place."""
    if kernels.enabled(x) and x.stride(-1) == 1:
        from pipespec.kernels.fused_ops import rope_
        return rope_(x, rope.cos, rope.sin, rope.positions)
    cos, sin = rope.rows
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return x * cos + rolled * sin
    return (x.float() * cos + rolled.float() * sin).to(x.dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP; with TP its gate/up columns and down rows are this rank's slice of the
    intermediate size, and down_proj all-reduces."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE, reduce: bool = True,
                 what: str = "intermediate_size"):
        super().__init__()
        # gate and up, fused
        self.gate_up_proj, self.intermediate = gate_up_parallel(hidden, intermediate, tp, what)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, what, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated=True)
