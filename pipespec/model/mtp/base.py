"""What every MTP family shares: the drafting contract the proposer calls, and the decoder block.

docs/architecture.md, "MTP alignment": at target position t an MTP layer takes the target's final hidden h_t
and the token x_{t+1}, and predicts x_{t+2}:

    x   = combine(embed(x_{t+1}), h_t)           <- family: norms, concat order, input projection
    out = finish(block(x) + residual)            <- family: what chained steps feed back as h
    logits = head(head_norm(out))

A family is a small subclass naming its tensors (`checkpoint_name`), finding its layers in a
checkpoint (`layer_indices`), building them (`build`) and defining `combine`, `finish` and
`head_norm`. The block is a child module (`self.block`), so other block kinds can slot in later.
The embedding and LM head are the target's unless the layer owns a copy; they are passed in at
forward time, never held (I5). With tensor parallelism (`tp`) the block is split like the target's,
the embedding and head (the target's or the layer's own) hold this rank's vocabulary rows, and the
logits are gathered in rank order, so every rank drafts the same tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext, KVCache
from pipespec.model.layers import RMSNorm, RotaryEmbedding, head_logits
from pipespec.model.llama import DecoderLayer
from pipespec.model.tp_layers import SINGLE, gather_vocab, vocab_embedding
from pipespec.model.weights import fused_parts
from pipespec.parallel import TensorParallel



def dense_block(arch: ArchConfig, norm: type[nn.Module] = RMSNorm, tp: TensorParallel = SINGLE) -> DecoderLayer:
    """A Llama-family decoder block (q/k/v bias, q/k norm as `arch` says) with every RMSNorm of
    kind `norm` (e.g. zero-centred), split over `tp`."""
    block = DecoderLayer(arch, tp)
    if norm is not RMSNorm:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is RMSNorm:
                    setattr(parent, name, norm(child.weight.numel(), child.eps))
    return block


class MTPLayer(nn.Module):
    family = ""
    marker = ""        # the checkpoint names that give the family away (for error messages)

    def __init__(self, arch: ArchConfig, layer_index: int, max_position: int | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.arch, self.tp = arch, tp
        self.layer_index = layer_index
        self.rotary = RotaryEmbedding(arch, max_position or arch.max_position)

    # -- what a family defines ------------------------------------------------------------------

    @classmethod
    def layer_indices(cls, names: set[str], num_layers: int) -> list[int]:
        """The indices of this family's MTP layers in a checkpoint with these tensor names."""
        raise NotImplementedError

    @classmethod
    def build(cls, arch: ArchConfig, indices: list[int], names: set[str],
              max_position: int | None = None, tp: TensorParallel = SINGLE) -> list["MTPLayer"]:
        """Unloaded layers for `indices`, with the optional parts the checkpoint `names` hold."""
        return [cls(arch, i, max_position, tp=tp) for i in indices]

    @property
    def prefix(self) -> str:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """One (unfused) parameter name -> its checkpoint tensor name."""
        return self.prefix + name.removeprefix("block.")

    def combine(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def head_norm(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def cache_shape(self) -> CacheShape:
        """This layer's paged cache (its block attends like a target layer)."""
        attn = self.block.self_attn
        return CacheShape(attn.num_kv_heads, attn.head_dim, attn.head_dim)

    def own_embedding(self) -> torch.Tensor | None:
        return None

    def own_head(self) -> torch.Tensor | None:
        return None

    # -- checkpoint names ---------------------------------------------------------------------

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors it is loaded from (concatenated along dim 0)."""
        return {name: [self.checkpoint_name(p) for p in fused_parts(name)] for name in self.state_dict()}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The module's weights under their checkpoint names (fused tensors split), on CPU."""
        state = self.state_dict()
        out = {}
        for name, ckpts in self.checkpoint_names().items():
            tensor = state[name].detach().cpu()
            parts = tensor.split(self._split_sizes(name), dim=0) if len(ckpts) > 1 else [tensor]
            for ckpt, part in zip(ckpts, parts):
                out[ckpt] = part.contiguous()
        return out

    def _split_sizes(self, name: str) -> list[int]:
        if ".qkv_proj." in name:
            a = self.block.self_attn
            return [a.q_size, a.kv_size, a.kv_size]
        return [self.block.mlp.intermediate, self.block.mlp.intermediate]

    # -- the drafting contract ----------------------------------------------------------------

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor, hidden: torch.Tensor,
                embed_weight: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids: [T] the token after each row's hidden; hidden: [T, H] the target's final-normed
        hidden (step 1) or this layer's previous output (chained steps). Returns [T, H], what the
        next chained step takes as `hidden`.

        `embed_weight` is the target's embedding matrix, passed at call time; ignored when the
        layer holds its own copy. `cache` defaults to `ctx.kv_caches[0]`.
        """
        weight = self.own_embedding()
        if weight is None:
            weight = embed_weight
        if weight is None:
            raise ValueError("this MTP module has no embedding of its own; pass the target's embed_weight")
        e = vocab_embedding(input_ids, weight, self.tp)
        x = self.combine(e, hidden.to(e.dtype))
        if cache is None and ctx.kv_caches:
            cache = ctx.kv_caches[0]
        out, residual = self.block(x, None, self.rotary(ctx.positions), cache, ctx)
        return self.finish(out + residual)

    def compute_logits(self, out: torch.Tensor, head_weight: torch.Tensor | None = None,
                       vocab=None) -> torch.Tensor:
        """Logits from `forward`'s output; `head_weight` is the target's LM head unless the layer owns one.
        `vocab` (a `DraftVocab`): logits over its tokens only, in its order."""
        weight = self.own_head()
        if weight is None:
            weight = head_weight
        if weight is None:
            raise ValueError("this MTP module has no LM head of its own; pass the target's head_weight")
        if vocab is not None:
            weight = vocab.head_rows(weight)
        return gather_vocab(head_logits(self.head_norm(out).to(weight.dtype), weight), self.tp,
                            self.arch.vocab_size)
