"""Qwen3-Next / Qwen3.5 style MTP layers: every norm is zero-centred, y = norm(x) * (1 + w).

    x   = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])   <- embedding first
    out = norm(layers.{i}(x) + residual)           <- fed back as h at chained steps
    logits = target_head(out)

Tensors: `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` [H, 2H] and `mtp.norm`
are one set shared by all layers; `mtp.layers.{i}.` holds layer i's decoder block.

The block: for a Qwen3-Next / Qwen3.5 / Qwen3.6 target (the checkpoints that ship these layers) the
real one, a gated full-attention layer of the target's kind (`q_proj` yields query and output gate,
partial rotary; MoE when the target has experts); for a Llama-family target (heads trained by
pipespec) the dense Qwen3 kind (q/k norm, no bias).

h_t is the target's final-norm output: vLLM's and SGLang's Qwen3-Next / Qwen3.5 MTP predictors take
the hidden states the target model returns, which are after its final norm.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.linear import Linear
from pipespec.model.mtp.base import MTPLayer, dense_block
from pipespec.model.norms import ZeroCentredRMSNorm
from pipespec.model.tp_layers import SINGLE
from pipespec.model.qwen3_next import HybridDecoderLayer, hybrid_checkpoint_names, partial_rotary

FAMILY_QWEN3_NEXT = "qwen3_next"


class Qwen3NextMTPShared(nn.Module):
    """The input projection and norms all of a checkpoint's MTP layers share (`mtp.*`)."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = Linear(2 * h, h, bias=False)
        self.norm = ZeroCentredRMSNorm(h, eps)


class Qwen3NextMTP(MTPLayer):
    family = FAMILY_QWEN3_NEXT
    marker = "mtp.fc and mtp.layers.i (Qwen3-Next, Qwen3.5)"

    def __init__(self, arch: ArchConfig, layer_index: int = 0, max_position: int | None = None,
                 shared: Qwen3NextMTPShared | None = None, tp=None):
        super().__init__(arch, layer_index, max_position, tp or SINGLE)
        self.shared = shared or Qwen3NextMTPShared(arch)
        if arch.hybrid is not None:
            self.block = HybridDecoderLayer(arch, layer_index, linear=False, moe=arch.hybrid.num_experts > 0,
                                            tp=self.tp)
            self.rotary = partial_rotary(arch, max_position or arch.max_position)
        else:
            block_arch = dataclasses.replace(arch, qk_norm=True, qkv_bias=False, o_bias=False)
            self.block = dense_block(block_arch, norm=ZeroCentredRMSNorm, tp=self.tp)

    @classmethod
    def layer_indices(cls, names: set[str], num_layers: int) -> list[int]:
        if "mtp.fc.weight" not in names:
            return []
        return sorted({int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")})

    @classmethod
    def build(cls, arch, indices, names, max_position=None, tp=SINGLE):
        shared = Qwen3NextMTPShared(arch)
        return [cls(arch, i, max_position, shared, tp=tp) for i in indices]

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("shared."):
            return "mtp." + name.removeprefix("shared.")
        return f"mtp.layers.{self.layer_index}." + name.removeprefix("block.")

    def checkpoint_names(self) -> dict[str, list[str]]:
        if self.arch.hybrid is None:
            return super().checkpoint_names()
        return {name: [self.checkpoint_name(c) for c in ckpts]
                for name, ckpts in hybrid_checkpoint_names(self).items()}

    def combine(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        s = self.shared
        return s.fc(torch.cat([s.pre_fc_norm_embedding(e), s.pre_fc_norm_hidden(h)], dim=-1))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared.norm(out)
