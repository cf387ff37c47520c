"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention with optional per-head q/k RMSNorm and
rotary on the first `partial_rotary_factor` of each head (rotate-half within that slice), on the
DeepSeek-V3 MoE (sigmoid router, correction bias, groups, shared experts, first dense layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import CacheShape, ForwardContext, KVCache
from pipespec.model.deepseek.config import MoEConfig, YaRN, parse_moe, parse_yarn, rope_dict, rope_theta
from pipespec.model.deepseek.model import DecoderLayer, DeepseekV3ForCausalLM
from pipespec.model.deepseek.rope import SliceRope
from pipespec.model.layers import RMSNorm
from pipespec.model.tp_layers import SINGLE, RowParallelLinear, qkv_parallel
from pipespec.parallel import TensorParallel


@dataclass(frozen=True)
class GlmConfig:
    head_dim: int
    rotary_dim: int
    rope_theta: float
    yarn: YaRN | None
    qk_norm: bool
    attention_bias: bool
    moe: MoEConfig


def parse_glm(cfg: dict) -> GlmConfig:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # transformers 5 keeps it in rope_parameters, older configs at the top level; 0.5 by default
    factor = rope_dict(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    return GlmConfig(head_dim=int(head_dim), rotary_dim=int(head_dim * factor), rope_theta=rope_theta(cfg),
                     yarn=parse_yarn(cfg), qk_norm=bool(cfg.get("use_qk_norm", False)),
                     attention_bias=bool(cfg.get("attention_bias", False)), moe=parse_moe(cfg))


class GlmAttention(nn.Module):
    def __init__(self, arch: ArchConfig, cfg: GlmConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        h, d = arch.hidden_size, cfg.head_dim
        # this rank's heads (KV heads split, or replicated when fewer than T)
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            h, arch.num_heads, arch.num_kv_heads, d, cfg.attention_bias, tp)
        self.head_dim, self.rotary_dim = d, cfg.rotary_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(arch.num_heads * d, h, False, tp, "num_attention_heads * head_dim")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)

    def cache_shape(self) -> CacheShape:
        return CacheShape(self.num_kv_heads, self.head_dim, self.head_dim)

    def forward(self, x: torch.Tensor, rope: SliceRope, cache: KVCache, ctx: ForwardContext) -> torch.Tensor:
        t, nh = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, nh + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
        r = self.rotary_dim          # rotate the leading slice of every q and k head, pass the rest
        qk = torch.cat((rope.rotate(qk[..., :r], ctx.positions), qk[..., r:]), dim=-1)
        out = ctx.backend.forward(qk[:, :nh], qk[:, nh:], v, cache, ctx, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(t, self.q_size))


def make_glm_layer(arch: ArchConfig, cfg: GlmConfig, index: int, tp: TensorParallel = SINGLE) -> DecoderLayer:
    return DecoderLayer(arch, cfg.moe, index, GlmAttention(arch, cfg, tp), tp)


def make_glm_rope(cfg: GlmConfig, max_position: int) -> SliceRope:
    return SliceRope(cfg.rotary_dim, cfg.rope_theta, max_position, cfg.yarn, interleaved=False)


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    parse = staticmethod(parse_glm)
    make_layer = staticmethod(make_glm_layer)
    make_rope = staticmethod(make_glm_rope)
