"""Qwen3-Next / Qwen3.5 style MTP layers: every norm is zero-centred, y = norm(x) * (1 + w).

    x   = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])   <- embedding first
    out = norm(layers.{i}(x) + residual)           <- fed back as h at chained steps
    logits = target_head(out)

Tensors: `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` [H, 2H] and `mtp.norm`
are one set shared by all layers; `mtp.layers.{i}.` holds layer i's decoder block. The block here
is the dense Qwen3 kind (q/k norm, no bias); the real Qwen3-Next block (gated attention output,
MoE) slots in as another `block` when the target families that need it land.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.mtp.base import MTPLayer, dense_block
from pipespec.model.norms import ZeroCentredRMSNorm

FAMILY_QWEN3_NEXT = "qwen3_next"


class Qwen3NextMTPShared(nn.Module):
    """The input projection and norms all of a checkpoint's MTP layers share (`mtp.*`)."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm = ZeroCentredRMSNorm(h, eps)


class Qwen3NextMTP(MTPLayer):
    family = FAMILY_QWEN3_NEXT
    marker = "mtp.fc and mtp.layers.i (Qwen3-Next, Qwen3.5)"

    def __init__(self, arch: ArchConfig, layer_index: int = 0, max_position: int | None = None,
                 shared: Qwen3NextMTPShared | None = None):
        super().__init__(arch, layer_index, max_position)
        self.shared = shared or Qwen3NextMTPShared(arch)
        block_arch = dataclasses.replace(arch, qk_norm=True, qkv_bias=False, o_bias=False)
        self.block = dense_block(block_arch, norm=ZeroCentredRMSNorm)

    @classmethod
    def layer_indices(cls, names: set[str], num_layers: int) -> list[int]:
        if "mtp.fc.weight" not in names:
            return []
        return sorted({int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")})

    @classmethod
    def build(cls, arch, indices, names, max_position=None):
        shared = Qwen3NextMTPShared(arch)
        return [cls(arch, i, max_position, shared) for i in indices]

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("shared."):
            return "mtp." + name.removeprefix("shared.")
        return f"mtp.layers.{self.layer_index}." + name.removeprefix("block.")

    def combine(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        s = self.shared
        return s.fc(torch.cat([s.pre_fc_norm_embedding(e), s.pre_fc_norm_hidden(h)], dim=-1))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared.norm(out)
