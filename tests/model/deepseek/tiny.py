"""Tiny random DeepSeek-V3 and GLM-4.5 checkpoints written by transformers' save_pretrained (the
logits oracle).

DeepSeek-V3 shapes cover the config's branches: "lora_yarn" (q LoRA, interleaved rope, YaRN with
mscale, MoE with 2 groups) and "plain" (q_proj, rotate-half rope, no scaling). "glm" is GLM-4.5:
GQA with q/k norm and bias, partial rotary 0.5. Experts and the router's correction bias are random,
so routing matters.
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               num_experts_per_tok=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False, routed_scaling_factor=2.5, norm_topk_prob=True)

SHAPES = {
    "lora_yarn": dict(q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1,
                      rope_interleave=True,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7,
                                       "rope_theta": 10000.0}),
    "plain": dict(q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, n_group=1, topk_group=1,
                  rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

GLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
           n_group=2, topk_group=1, first_k_dense_replace=1, num_hidden_layers=3, use_qk_norm=True,
           attention_bias=True, routed_scaling_factor=1.5, max_position_embeddings=256, rms_norm_eps=1e-5,
           bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
SHAPES["glm"] = GLM
# DeepSeek-V3.2: MLA (q LoRA, interleaved rope, YaRN) with the sparse-attention indexer; index_topk
# covers the parity prompts, tests of the selection override it
V32 = dict(_COMMON, q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1,
           index_topk=64, index_head_dim=16, index_n_heads=2,
           rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7,
                            "rope_theta": 10000.0})
SHAPES["v32"] = V32
# GLM-5: V3.2's layout, the indexer's rope interleaved, layer 1 reusing layer 0's selection (every
# PP split of 4 layers into 2 or 3 stages starts its stages at full layers)
GLM5 = dict(V32, num_hidden_layers=4, indexer_types=["full", "shared", "full", "full"], rms_norm_eps=1e-5)
SHAPES["glm5"] = GLM5


def hf_config(shape: str, **overrides):
    from transformers import DeepseekV32Config, DeepseekV3Config, Glm4MoeConfig, GlmMoeDsaConfig
    if shape == "glm":
        return Glm4MoeConfig(**{**GLM, **overrides})
    if shape == "glm5":
        return GlmMoeDsaConfig(**{**GLM5, **overrides})
    if shape == "v32":
        return DeepseekV32Config(**{**V32, **overrides})
    return DeepseekV3Config(**{**_COMMON, **SHAPES[shape], **overrides})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Norms around 1, weights 0.15 N(0, 1), correction biases large enough to change routing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("norm.bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def write_model(folder: Path, shape: str, seed: int, tokenizer=None, **overrides):
    """(folder, the transformers model that wrote it)."""
    from transformers import AutoModelForCausalLM
    from tests.conftest import write_tokenizer_files

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(shape, **overrides), dtype=torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    if tokenizer is not None:
        write_tokenizer_files(folder, tokenizer)
    return folder, model


def write_with_mtp(folder: Path, shape: str, seed: int, num_mtp: int = 1, tokenizer=None, mixing: float = 0.1,
                   mtp_mixing: float = 0.05, pick: str = "embedding", **overrides) -> Path:
    """A checkpoint whose MTP layers sit under their real names (`model.layers.{N+i}.`).

    transformers builds N + num_mtp layers, so the MTP blocks are real MLA + MoE layers with the
    checkpoint's own tensor names; config.json then says N layers and num_nextn_predict_layers, and
    enorm / hnorm / eh_proj / shared_head.norm are added. Echo weights: the target's layers add
    little (`mixing`), so its next token depends mostly on the current one, and eh_proj passes the
    embedding half through (`pick="hidden"` passes the other half: a wrongly wired layer;
    `pick="random"`: a random projection) to a copy of the final norm, so a rightly wired MTP layer drafts what the target will say next.
    """
    import json

    from safetensors.torch import load_file, save_file

    n = SHAPES[shape]["num_hidden_layers"]
    if "indexer_types" in SHAPES[shape]:                  # the MTP layers run their own indexer
        overrides.setdefault("indexer_types", SHAPES[shape]["indexer_types"] + ["full"] * num_mtp)
    write_model(folder, shape, seed, tokenizer, num_hidden_layers=n + num_mtp, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=num_mtp)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):   # per-layer lists name the target's layers
        if key in cfg:
            cfg[key] = cfg[key][:n]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.embed_tokens.weight"] *= 8
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            layer = int(name.split(".")[2])
            tensors[name] *= mixing if layer < n else mtp_mixing
    h = cfg["hidden_size"]
    eye, zero = torch.eye(h), torch.zeros(h, h)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(n, n + num_mtp):
        p = f"model.layers.{i}."
        if pick == "random":
            tensors[p + "eh_proj.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
        else:
            tensors[p + "eh_proj.weight"] = torch.cat([eye, zero] if pick == "embedding" else [zero, eye], dim=1)
        tensors[p + "enorm.weight"] = torch.ones(h)
        tensors[p + "hnorm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
        tensors[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
