"""Qwen3-Next and Qwen3.5 / Qwen3.6 (dense and MoE) decoders: a hybrid stack of Gated DeltaNet
(linear attention) and gated full-attention layers (reference: transformers' `qwen3_next`, `qwen3_5`,
`qwen3_5_moe` modeling files, read for the math and names).

- Every RMSNorm but the DeltaNet's gated one is zero-centred: y = norm(x) * (1 + w).
- Gated attention: `q_proj` yields per head [query | output gate]; q/k RMS-normed per head; rotary on
  the first `partial_rotary_factor` of each head only; output times sigmoid(gate) before `o_proj`.
  For text-only input Qwen3.5's multimodal rotary is 1-D rotary at the token positions.
- MLP: dense SwiGLU, or MoE on the layers the config names.

With tensor parallelism (`tp`) each rank keeps its attention heads (KV heads split or replicated),
its Gated DeltaNet key heads with their value heads (gated_deltanet.py), its routed experts and its
slice of the MLPs' intermediate sizes (moe.py), and its vocabulary rows; each of its states and KV
caches holds its own heads only.

A stage holds layers [start, end) as `LlamaForCausalLM` does. Full-attention layers use the paged KV
cache (`cache_shapes`); linear-attention layers use per-request state slots (`state_shapes`,
`ctx.linear`), never a KV cache.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipespec import kernels
from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext
from pipespec.model.gated_deltanet import GatedDeltaNet, StateShape
from pipespec.model.hybrid_config import LINEAR
from pipespec.model.layers import GatedMLP, RotaryEmbedding, apply_rope
from pipespec.model.moe import SparseMoE
from pipespec.model.norms import ZeroCentredRMSNorm
from pipespec.model.slice import SliceModel, StageSlice, layer_span
from pipespec.model.tp_layers import SINGLE, ColumnParallelLinear, RowParallelLinear, kv_head_range
from pipespec.model.weights import fused_parts
from pipespec.parallel import TensorParallel


def rotary_dim(arch: ArchConfig) -> int:
    return int(arch.head_dim * arch.hybrid.partial_rotary_factor)


def partial_rotary(arch: ArchConfig, max_position: int) -> RotaryEmbedding:
    """Rotary tables over the rotated part of each head only."""
    return RotaryEmbedding(dataclasses.replace(arch, head_dim=rotary_dim(arch)), max_position)


class GatedAttention(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        q0, nq = tp.split(arch.num_heads, "num_attention_heads")
        k0, nk = kv_head_range(arch.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nk, d
        self.rot = rotary_dim(arch)
        # q_proj (query and gate, interleaved per head), k_proj and v_proj fused into one matrix: this
        # rank's heads of each
        self.q_size, self.kv_size = 2 * nq * d, nk * d
        self.qkv_proj = ColumnParallelLinear(h, [(q0 * 2 * d, nq * 2 * d), (k0 * d, nk * d), (k0 * d, nk * d)],
                                             arch.qkv_bias, [arch.num_heads * 2 * d, arch.num_kv_heads * d,
                                                             arch.num_kv_heads * d])
        self.o_proj = RowParallelLinear(arch.num_heads * d, h, arch.qkv_bias, tp, "num_attention_heads * head_dim")
        self.q_norm = ZeroCentredRMSNorm(d, arch.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, arch.rms_norm_eps)

    def forward(self, x, rope, cache, ctx: ForwardContext):
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        if kernels.enabled(qkv):
            from pipespec.kernels.gated_attention import rotary_fits
            if rotary_fits(self.rot, d):
                return self._fused(qkv, rope, cache, ctx)
        qg, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        qk = torch.cat((self.q_norm(q), self.k_norm(k.view(t, self.num_kv_heads, d))), dim=1)
        part = qk[..., :self.rot]               # partial rotary: the leading dims of each head
        rotated = apply_rope(part, rope)
        if rotated is not part:                 # the kernel rotates in place; PyTorch returns a copy
            part.copy_(rotated)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = ctx.backend.forward(q.contiguous(), k.contiguous(), v.view(t, self.num_kv_heads, d), cache, ctx,
                                  d ** -0.5)
        out = out.reshape(t, self.num_heads * d) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)

    def _fused(self, qkv, rope, cache, ctx: ForwardContext):
        """`forward` on the GPU: the norms, the rotary and the gate in two kernels
        (`kernels/gated_attention.py`) instead of seven launches."""
        from pipespec.kernels.gated_attention import qk_norm_rope, sigmoid_gate
        t, d = qkv.shape[0], self.head_dim
        q, k = qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, d, self.q_norm.weight, self.k_norm.weight,
                            self.q_norm.eps, rope.cos, rope.sin, rope.positions)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, d)
        out = ctx.backend.forward(q, k, v, cache, ctx, d ** -0.5)
        return self.o_proj(sigmoid_gate(out.reshape(t, self.num_heads * d), qkv, self.num_heads, d))


def make_mlp(arch: ArchConfig, layer: int, moe: bool | None = None, tp: TensorParallel = SINGLE) -> nn.Module:
    c = arch.hybrid
    if (layer in c.moe_layers) if moe is None else moe:
        return SparseMoE(arch.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.shared_expert_intermediate_size, c.norm_topk_prob, tp)
    return GatedMLP(arch.hidden_size, arch.intermediate_size, tp)


class HybridDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, linear: bool | None = None, moe: bool | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.linear = arch.hybrid.layer_types[layer] == LINEAR if linear is None else linear
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(h, eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(h, arch.hybrid, eps, tp)
        else:
            self.self_attn = GatedAttention(arch, tp)
        self.post_attention_layernorm = ZeroCentredRMSNorm(h, eps)
        self.mlp = make_mlp(arch, layer, moe, tp)

    def forward(self, hidden, residual, rope, cache, ctx, state=None):
        """`cache`: this layer's paged KV (full attention); `state`: its linear-attention states."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.linear:
            hidden = self.linear_attn(hidden, ctx.linear, state)
        else:
            hidden = self.self_attn(hidden, rope, cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def hybrid_checkpoint_names(module: nn.Module, prefix: str = "") -> dict[str, list[str]]:
    """Parameter name -> checkpoint tensors, for any module built of these layers (target or MTP)."""
    names = {}
    for full, param in module.named_parameters():
        owner, _, leaf = full.rpartition(".")
        if owner.endswith("mlp.experts"):
            names[full] = module.get_submodule(owner).checkpoint_names(prefix + owner)[prefix + full]
            continue
        ckpt = prefix + full
        if full.endswith("linear_attn.in_proj.weight"):
            parts = module.get_submodule(owner.rpartition(".")[0]).checkpoint_parts()
            names[full] = [ckpt.replace("in_proj.", p + ".") for p in parts]
        else:
            names[full] = fused_parts(ckpt)
    return names


class Qwen3NextForCausalLM(StageSlice):
    """One stage of a Qwen3-Next / Qwen3.5 / Qwen3.6 model (the whole model when the range covers it)."""

    def __init__(self, arch: ArchConfig, layer_range: tuple[int, int] | None = None,
                 max_position: int | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        if arch.hybrid is None:
            raise ValueError(f"model_type {arch.model_type!r} has no linear-attention config")
        start, end = layer_span(arch, layer_range)
        self.arch, self.tp = arch, tp
        self.model = SliceModel(arch, {i: HybridDecoderLayer(arch, i, tp=tp) for i in range(start, end)},
                                partial_rotary(arch, max_position or arch.max_position), norm=ZeroCentredRMSNorm,
                                tp=tp)
        self._init_head()

    def cache_shapes(self) -> list[CacheShape]:
        """One paged cache per local full-attention layer, in layer order (`ctx.kv_caches`)."""
        a = self.arch
        return [CacheShape(layer.self_attn.num_kv_heads, a.head_dim, a.head_dim)     # this rank's KV heads
                for layer in self.model.layers.values() if not layer.linear]

    def state_shapes(self) -> list[StateShape]:
        """One state per local linear-attention layer, in layer order (`ctx.linear.states`)."""
        return [layer.linear_attn.state_shape() for layer in self.model.layers.values() if layer.linear]

    def checkpoint_names(self) -> dict[str, list[str]]:
        return self._tie_head(hybrid_checkpoint_names(self))

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        m = self.model
        if ctx.linear is None and self.state_shapes():
            raise ValueError(f"{self.arch.model_type} has linear-attention layers, which need per-request state "
                             "slots (ForwardContext.linear, built by the stage from the plan); this caller "
                             "provides none (teacher-forced training and evaluation do not support it yet)")
        hidden, residual = self._embed(input_ids, hidden, residual)
        rope = m.rotary(ctx.positions)
        n_full = n_linear = 0
        for layer in m.layers.values():
            if layer.linear:
                hidden, residual = layer(hidden, residual, rope, None, ctx, ctx.linear.states[n_linear])
                n_linear += 1
            else:
                hidden, residual = layer(hidden, residual, rope, ctx.kv_caches[n_full], ctx)
                n_full += 1
        return self._finish(hidden, residual)
