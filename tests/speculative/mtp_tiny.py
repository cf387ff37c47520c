"""Tiny random targets and MTP heads for the MTP tests (CPU, float32, built in milliseconds)."""
from __future__ import annotations

import torch

from pipespec.model.arch import ArchConfig
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.mtp import DeepSeekMTP


def tiny_arch(**overrides) -> ArchConfig:
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position=256, tie_word_embeddings=True)
    base.update(overrides)
    return ArchConfig(**base)


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else scale * noise)


def tiny_target(arch: ArchConfig | None = None, seed: int = 0, mixing: float = 1.0) -> LlamaForCausalLM:
    """`mixing` scales what the layers add to the residual stream: small values make the next token
    depend mostly on the current one (a target a short training run can learn to follow)."""
    target = LlamaForCausalLM(arch or tiny_arch())
    randomize(target, seed)
    with torch.no_grad():     # a strong embedding: the next token depends clearly on the context
        target.model.embed_tokens.weight.mul_(4.0)
        for layer in target.model.layers.values():
            layer.self_attn.o_proj.weight.mul_(mixing)
            layer.mlp.down_proj.weight.mul_(mixing)
    return target.eval().requires_grad_(False)


def tiny_head(arch: ArchConfig, seed: int = 1, **kwargs) -> DeepSeekMTP:
    head = DeepSeekMTP(arch, **kwargs)
    randomize(head, seed, scale=0.2)
    return head
