"""What every family's stage slice shares: its layer range, the embedding on the first stage, the
final norm and the LM head on the last, and the head resolved at call time (docs/architecture.md, I5). With
tensor parallelism the embedding and the head hold this rank's vocabulary rows and the logits are
gathered (`tp_layers.py`); a family that splits its layers sets `self.tp` before `_init_head()`.

A family subclasses `StageSlice`, builds `self.model = SliceModel(...)` from its own layers, rotary
table and final norm, then calls `_init_head()`; its forward wraps its layers in `_embed` and
`_finish`. Parameter names are the Hugging Face checkpoint names with global layer indices.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.layers import ParallelLMHead, RMSNorm, head_logits
from pipespec.model.tp_layers import SINGLE, VocabParallelEmbedding, gather_vocab
from pipespec.parallel import TensorParallel


def layer_span(arch: ArchConfig, layer_range: tuple[int, int] | None) -> tuple[int, int]:
    start, end = layer_range or (0, arch.num_layers)
    if not 0 <= start < end <= arch.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {arch.num_layers} layers")
    return start, end


class SliceModel(nn.Module):
    """A stage's `model.`: the embedding on the first stage, its layers by global index, the final
    norm on the last, and the rotary table."""

    def __init__(self, arch: ArchConfig, layers: dict[int, nn.Module], rotary: nn.Module,
                 norm: type[nn.Module] = RMSNorm, tp: TensorParallel = SINGLE):
        super().__init__()
        self.start, self.end = min(layers), max(layers) + 1
        self.is_first, self.is_last = self.start == 0, self.end == arch.num_layers
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        if self.is_last:
            self.norm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = rotary


class StageSlice(nn.Module):
    """The base of every family's target slice: what `pipespec.stage.interfaces.TargetModel` asks that
    all families share."""

    arch: ArchConfig
    tp: TensorParallel = SINGLE
    # a family whose attention runs on the torch backend only (sparse attention) says so
    reference_attention_only: bool = False

    def state_shapes(self) -> list:
        """Per-request linear-attention states of the local layers (families with such layers)."""
        return []

    def _init_head(self) -> None:
        # A tied head on a stage without the embedding loads its own copy of the embedding matrix.
        self.owns_head = self.model.is_last and not (self.arch.tie_word_embeddings and self.model.is_first)
        if self.owns_head:
            self.lm_head = ParallelLMHead(self.arch.hidden_size, self.arch.vocab_size, self.tp)

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def _tie_head(self, names: dict[str, list[str]]) -> dict[str, list[str]]:
        if self.owns_head and self.arch.tie_word_embeddings:
            names["lm_head.weight"] = ["model.embed_tokens.weight"]
        return names

    def _embed(self, input_ids, hidden, residual):
        """Stage 0 embeds `input_ids`; later stages continue from the previous stage's (hidden, residual)."""
        if self.model.is_first:
            return self.model.embed_tokens(input_ids), None
        return hidden, residual

    def _finish(self, hidden, residual):
        """On the last stage the final norm; returns (hidden, residual), residual None there."""
        if self.model.is_last:
            hidden, _ = self.model.norm(hidden, residual)
            return hidden, None
        return hidden, residual

    def head_weight(self) -> torch.Tensor:
        # resolved at call time through the owner, never captured (docs/architecture.md, I5)
        return self.lm_head.weight if self.owns_head else self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(head_logits(hidden, self.head_weight()), self.tp, self.arch.vocab_size)
