"""The MTP layers DeepSeek-V3 and GLM-4.5 checkpoints ship, with their real decoder block.

Same names and input formula as `DeepSeekMTP` (`model.layers.{N+i}.`: enorm, hnorm, eh_proj, the
block, shared_head.norm, optional shared_head.head and embed_tokens), but the block is the target
family's own (MLA + MoE for DeepSeek-V3) and it caches what that block caches (the MLA latent).

    x   = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])      embedding first
    out = shared_head.norm(block(x) + residual)                 <- fed back as h at chained steps
    logits = head(out)

Which hidden a chained step takes: SGLang's DeepSeek NextN model returns the `shared_head.norm`
output and its EAGLE worker feeds that back (sglang/srt/models/deepseek_nextn.py); so does the
MTP alignment table of docs/architecture.md. The vLLM versions read for this
(model_executor/models/deepseek_mtp.py) return the pre-norm sum instead; DeepSeek's report gives no
chained inference rule (in training, module k's input is module k-1's output before its head). We follow SGLang. The choice never changes greedy
output (I6), only acceptance at drafts 2..K; pipespec's own trained heads (`DeepSeekMTP` on a Llama
block) keep the pre-norm convention they were trained with.

Position 0: vLLM zeroes the embedding of rows at position 0; SGLang and DeepSeek's formula do not.
We do not: the row at position 0 is the first prompt token's, whose MTP output is only used for a
one-token prompt's first draft.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape
from pipespec.model.mtp.deepseek import DeepSeekMTP


def _family_block(arch: ArchConfig, index: int, max_position: int, tp):
    """(the target family's decoder layer `index`, split over `tp` like the target's, its rope module)."""
    from pipespec.model.registry import TARGETS
    family = TARGETS[arch.model_type]
    cfg = family.parse(arch.hf_config)
    return family.make_layer(arch, cfg, index, tp), family.make_rope(cfg, max_position)


# targets whose MTP layers carry the family's own block
NATIVE_BLOCKS = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa")


class NativeDeepSeekMTP(DeepSeekMTP):
    """A DeepSeek-style MTP layer whose block is the target family's decoder layer."""

    def make_block(self, arch: ArchConfig, max_position: int | None) -> nn.Module:
        block, self.rotary = _family_block(arch, self.layer_index, max_position or arch.max_position, self.tp)
        return block

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(out)

    def head_norm(self, out: torch.Tensor) -> torch.Tensor:
        return out                       # `finish` has normed it

    def cache_shape(self) -> CacheShape:
        return self.block.self_attn.cache_shape()

    def checkpoint_names(self) -> dict[str, list[str]]:
        from pipespec.model.deepseek.model import fused_names
        names = {name: ckpts for name, ckpts in super().checkpoint_names().items()
                 if not name.startswith("block.")}
        for name, ckpts in fused_names(self.block).items():
            names["block." + name] = [self.prefix + c for c in ckpts]
        return names

    def init_from_target(self, target: nn.Module, layer: int | None = None) -> None:
        raise NotImplementedError("native MTP layers are loaded from their checkpoint")
