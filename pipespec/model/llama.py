"""Llama-family decoder: Llama 2/3, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

A model instance holds one pipeline stage's slice of layers `[start, end)`: the first stage also
owns the embedding, the last the final norm and the LM head. Parameter names are the Hugging Face
checkpoint names with global layer indices, so a stage loads exactly the tensors it names.

With tensor parallelism (`tp`, size T) each rank keeps num_heads / T query heads and its KV heads
(split, or one replicated when there are fewer than T), a slice of the intermediate size, and the
vocabulary rows of the embedding and head; o_proj and down_proj all-reduce (`tp_layers.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext, KVCache
from pipespec.model.layers import GatedMLP, RMSNorm, Rope, RotaryEmbedding, apply_rope
from pipespec.model.slice import SliceModel, StageSlice, layer_span
from pipespec.model.tp_layers import SINGLE, RowParallelLinear, qkv_parallel
from pipespec.model.weights import fused_parts
from pipespec.parallel import TensorParallel


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        # q, k and v projections fused into one matrix (loaded from the three checkpoint tensors),
        # this rank's heads of each
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            h, arch.num_heads, arch.num_kv_heads, d, arch.qkv_bias, tp)
        self.head_dim = d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(arch.num_heads * d, h, arch.o_bias, tp, "num_attention_heads * head_dim")
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache,
                ctx: ForwardContext):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = apply_rope(qk, rope)             # q and k heads rotated in one go
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = ctx.backend.forward(q, k, v, cache, ctx, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, tp)

    def forward(self, hidden, residual, rope, cache, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(StageSlice):
    """One stage of a Llama-family causal LM (the whole model when the range covers every layer)."""

    def __init__(self, arch: ArchConfig, layer_range: tuple[int, int] | None = None,
                 max_position: int | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        start, end = layer_span(arch, layer_range)
        self.arch, self.tp = arch, tp
        self.model = SliceModel(arch, {i: DecoderLayer(arch, tp) for i in range(start, end)},
                                RotaryEmbedding(arch, max_position or arch.max_position), tp=tp)
        self._init_head()

    def cache_shapes(self) -> list[CacheShape]:
        """The paged cache of each local layer, in `ctx.kv_caches` order."""
        a = self.arch
        kv_heads = next(iter(self.model.layers.values())).self_attn.num_kv_heads   # this rank's
        return [CacheShape(kv_heads, a.head_dim, a.head_dim)] * self.num_local_layers

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors it is loaded from (concatenated along dim 0)."""
        return self._tie_head({name: fused_parts(name) for name in self.state_dict()})

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Stage 0 takes `input_ids`, later stages the previous stage's (hidden, residual).

        Returns (hidden, residual); on the last stage hidden is final-normed and residual is None.
        """
        hidden, residual = self._embed(input_ids, hidden, residual)
        rope = self.model.rotary(ctx.positions)
        for local, layer in enumerate(self.model.layers.values()):
            hidden, residual = layer(hidden, residual, rope, ctx.kv_caches[local], ctx)
        return self._finish(hidden, residual)
