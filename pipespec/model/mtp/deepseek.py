"""DeepSeek-V3/R1 and GLM-4.5/4.6 MTP layers (also pipespec's own trained heads).

    x   = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])
    out = block(x) + residual                <- fed back as h at chained steps (before shared_head.norm)
    logits = head(shared_head.norm(out))

Tensors sit under `model.layers.{N}.` (N >= the target's num_hidden_layers): `enorm`, `hnorm`,
`eh_proj` [H, 2H], the decoder block's own names, `shared_head.norm`, and optionally
`shared_head.head` and `embed_tokens` (copies of the target's).
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.layers import ParallelLMHead, RMSNorm
from pipespec.model.linear import Linear
from pipespec.model.mtp.base import MTPLayer, dense_block
from pipespec.model.tp_layers import SINGLE, VocabParallelEmbedding
from pipespec.parallel import TensorParallel

FAMILY_DEEPSEEK = "deepseek_v3"


class _SharedHead(nn.Module):
    def __init__(self, arch: ArchConfig, own_head: bool, tp: TensorParallel):
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if own_head:
            self.head = ParallelLMHead(arch.hidden_size, arch.vocab_size, tp)


class DeepSeekMTP(MTPLayer):
    """One DeepSeek-V3-style MTP layer on top of a Llama-family target."""

    family = FAMILY_DEEPSEEK
    marker = "model.layers.N.eh_proj (N >= num_hidden_layers; DeepSeek-V3, GLM-4.5)"

    def __init__(self, arch: ArchConfig, layer_index: int | None = None, max_position: int | None = None,
                 own_embedding: bool = False, own_head: bool = False, tp: TensorParallel = SINGLE):
        super().__init__(arch, arch.num_layers if layer_index is None else layer_index, max_position, tp)
        h = arch.hidden_size
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.block = self.make_block(arch, max_position)
        self.shared_head = _SharedHead(arch, own_head, tp)
        if own_embedding:       # a copy shipped in the checkpoint
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, h, tp)

    @classmethod
    def layer_indices(cls, names: set[str], num_layers: int) -> list[int]:
        found = set()
        for name in names:
            parts = name.split(".")
            if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[3] == "eh_proj":
                if int(parts[2]) >= num_layers:
                    found.add(int(parts[2]))
        return sorted(found)

    @classmethod
    def build(cls, arch, indices, names, max_position=None, tp=SINGLE):
        return [cls(arch, i, max_position, own_embedding=f"model.layers.{i}.embed_tokens.weight" in names,
                    own_head=f"model.layers.{i}.shared_head.head.weight" in names, tp=tp) for i in indices]

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    def make_block(self, arch: ArchConfig, max_position: int | None) -> nn.Module:
        return dense_block(arch, tp=self.tp)

    def combine(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))

    def head_norm(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(out)

    def own_embedding(self) -> torch.Tensor | None:
        return self.embed_tokens.weight if hasattr(self, "embed_tokens") else None

    def own_head(self) -> torch.Tensor | None:
        return self.shared_head.head.weight if hasattr(self.shared_head, "head") else None

    def init_from_target(self, target: nn.Module, layer: int | None = None) -> None:
        """Copy the target's decoder layer `layer` (default: its last) into this module's block. A
        block with a wider MLP (`arch.intermediate_size` above the target's) takes the target's
        gate and up rows first and its down columns first; its extra down columns start at zero, so
        the block starts as the target's layer computes, and its extra gate and up rows keep their
        random start, so that gradients reach the extra columns."""
        layer = self.arch.num_layers - 1 if layer is None else layer
        source = target.model.layers[str(layer)].state_dict()
        width, own = source["mlp.down_proj.weight"].shape[1], self.arch.intermediate_size
        if own < width:
            raise ValueError(f"an MLP of {own} columns cannot start from the target's {width}")
        with torch.no_grad():
            if own == width:
                self.block.load_state_dict(source)
                return
            state = self.block.state_dict()
            gate_up, down = source.pop("mlp.gate_up_proj.weight"), source.pop("mlp.down_proj.weight")
            mine = state["mlp.gate_up_proj.weight"]
            mine[:width], mine[own:own + width] = gate_up[:width], gate_up[width:]
            state["mlp.down_proj.weight"].zero_()[:, :width] = down
            state.update(source)
            self.block.load_state_dict(state)
