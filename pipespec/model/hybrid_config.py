"""The parts of a Qwen3-Next / Qwen3.5 / Qwen3.6 config.json that the Llama fields do not cover:
which layers are Gated DeltaNet (linear attention) and which gated full attention, the DeltaNet's
shapes, partial rotary, and the MoE (transformers' `qwen3_next`, `qwen3_5`, `qwen3_5_moe` configs)."""
from __future__ import annotations

from dataclasses import dataclass

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Qwen3.5/3.6 are vision-language checkpoints: the text config is nested, the weights sit under
# `model.language_model.` and the vision tower under `model.visual.`
NESTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    partial_rotary_factor: float
    fused_linear_proj: bool           # Qwen3-Next: in_proj_qkvz / in_proj_ba, interleaved per key head
    num_experts: int = 0              # 0: every layer has a dense SwiGLU MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, model_type: str, text: dict) -> "HybridConfig":
        n = text["num_hidden_layers"]
        types = text.get("layer_types")
        if types is None:
            interval = text.get("full_attention_interval", 4)
            types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must name {n} layers, each {LINEAR!r} or {FULL!r}; got {types}")
        rope = text.get("rope_parameters") or {}
        experts = int(text.get("num_experts") or 0)
        if model_type == "qwen3_5":
            experts = 0
        if experts:
            step = text.get("decoder_sparse_step", 1)
            dense = set(text.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        else:
            moe_layers = ()
        return cls(
            layer_types=tuple(types),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 text.get("partial_rotary_factor", 0.25))),
            fused_linear_proj=model_type == "qwen3_next",
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            # Qwen3.5-MoE's router always renormalises; Qwen3-Next's says so in its config
            norm_topk_prob=bool(text.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
            moe_layers=moe_layers,
        )

