"""Xiaomi MiMo-7B MTP layers (the target is a Qwen2 decoder).

    x   = input_proj(cat[hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))])    <- hidden first
    out = final_layernorm(block(x) + residual)      <- fed back as h at chained steps
    logits = target_head(out)

Tensors sit under `model.mtp_layers.{i}.`: `token_layernorm`, `hidden_layernorm`, `input_proj`
[H, 2H], a Qwen2 decoder block under its own names, `final_layernorm`.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.layers import RMSNorm
from pipespec.model.linear import Linear
from pipespec.model.mtp.base import MTPLayer, dense_block
from pipespec.model.tp_layers import SINGLE

FAMILY_MIMO = "mimo"


class MiMoMTP(MTPLayer):
    family = FAMILY_MIMO
    marker = "model.mtp_layers.i.input_proj (MiMo)"

    def __init__(self, arch: ArchConfig, layer_index: int = 0, max_position: int | None = None, tp=None):
        super().__init__(arch, layer_index, max_position, tp or SINGLE)
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.block = dense_block(arch, tp=self.tp)
        self.final_layernorm = RMSNorm(h, eps)

    @classmethod
    def layer_indices(cls, names: set[str], num_layers: int) -> list[int]:
        return sorted({int(n.split(".")[2]) for n in names
                       if n.startswith("model.mtp_layers.") and n.endswith(".input_proj.weight")})

    @property
    def prefix(self) -> str:
        return f"model.mtp_layers.{self.layer_index}."

    def combine(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(h), self.token_layernorm(e)], dim=-1))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(out)
