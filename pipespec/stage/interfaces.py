"""What a stage asks of the parts it runs, as explicit protocols (tests/stage/test_interfaces.py checks
every family and the MTP proposer against them). The attention backend's contract is the abstract
class `pipespec.model.attention.AttentionBackend`."""
from __future__ import annotations

from typing import Protocol

import torch

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext
from pipespec.model.linear_state import StateShape


class SliceLayers(Protocol):
    is_first: bool               # embeds the step's input ids
    is_last: bool                # final-norms its output; the stage verifies and drafts


class TargetModel(Protocol):
    """One stage's slice of the target (`pipespec.model.registry.TARGETS` builds it by model_type)."""

    arch: ArchConfig
    model: SliceLayers
    reference_attention_only: bool

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 0 embeds `input_ids`, later stages continue from (hidden, residual); returns
        (hidden, residual), on the last stage the final-normed hidden and None."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: full-vocabulary logits of the rows given."""

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight, resolved through its owner at call time (the drafter's head too)."""

    def cache_shapes(self) -> list[CacheShape]:
        """One paged KV cache per local attention layer, in layer order."""

    def state_shapes(self) -> list[StateShape]:
        """One per-request state per local linear-attention layer (none for most families)."""

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Each local parameter's names in the checkpoint."""


class Drafter(Protocol):
    """The last stage's drafter (`pipespec.speculative.proposer.MTPProposer`)."""

    kv_caches: list

    def propose(self, target_ctx: ForwardContext, mtp_input_ids: torch.Tensor, line_tables: torch.Tensor,
                hidden: torch.Tensor, last_rows: torch.Tensor, last_tokens: torch.Tensor,
                num_spec_tokens: int | None = None) -> torch.Tensor:
        """Drafts [S, k] for a step's lines, from the target's final `hidden`; no host sync."""

    def write_kv(self, target_ctx: ForwardContext, mtp_input_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """A step without lines: the drafter's KV at its rows only."""
