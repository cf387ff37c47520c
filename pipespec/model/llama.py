"""Llama-family decoder: Llama 2/3, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

A model instance holds one pipeline stage's slice of layers `[start, end)`: the first stage also
owns the embedding, the last the final norm and the LM head. Parameter names are the Hugging Face
checkpoint names with global layer indices, so a stage loads exactly the tensors it names.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext, KVCache
from pipespec.model.layers import GatedMLP, LMHead, RMSNorm, Rope, RotaryEmbedding, apply_rope, head_logits


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        # q, k and v projections fused into one matrix (loaded from the three checkpoint tensors)
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=arch.o_bias)
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
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, hidden, residual, rope, cache, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, start: int, end: int, max_position: int):
        super().__init__()
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == arch.num_layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(arch) for i in range(start, end)})
        if self.is_last:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch, max_position)


class LlamaForCausalLM(nn.Module):
    """One stage of a Llama-family causal LM (the whole model when the range covers every layer)."""

    def __init__(self, arch: ArchConfig, layer_range: tuple[int, int] | None = None,
                 max_position: int | None = None):
        super().__init__()
        start, end = layer_range or (0, arch.num_layers)
        if not 0 <= start < end <= arch.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {arch.num_layers} layers")
        self.arch = arch
        self.model = LlamaModel(arch, start, end, max_position or arch.max_position)
        # A tied head on a stage without the embedding loads its own copy of the embedding matrix.
        self.owns_head = self.model.is_last and not (arch.tie_word_embeddings and self.model.is_first)
        if self.owns_head:
            self.lm_head = LMHead(arch.hidden_size, arch.vocab_size, bias=False)

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def cache_shapes(self) -> list[CacheShape]:
        """The paged cache of each local layer, in `ctx.kv_caches` order."""
        a = self.arch
        return [CacheShape(a.num_kv_heads, a.head_dim, a.head_dim)] * self.num_local_layers

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors it is loaded from (concatenated along dim 0)."""
        names = {}
        for name in self.state_dict():
            if ".qkv_proj." in name:
                names[name] = [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            elif ".gate_up_proj." in name:
                names[name] = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
            else:
                names[name] = [name]
        if self.owns_head and self.arch.tie_word_embeddings:
            names["lm_head.weight"] = ["model.embed_tokens.weight"]
        return names

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Stage 0 takes `input_ids`, later stages the previous stage's (hidden, residual).

        Returns (hidden, residual); on the last stage hidden is final-normed and residual is None.
        """
        m = self.model
        if m.is_first:
            hidden, residual = m.embed_tokens(input_ids), None
        rope = m.rotary(ctx.positions)
        for local, layer in enumerate(m.layers.values()):
            hidden, residual = layer(hidden, residual, rope, ctx.kv_caches[local], ctx)
        if m.is_last:
            hidden, _ = m.norm(hidden, residual)
            residual = None
        return hidden, residual

    def head_weight(self) -> torch.Tensor:
        # resolved at call time through the owner, never captured (DESIGN.md, I5)
        return self.lm_head.weight if self.owns_head else self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(hidden, self.head_weight())
