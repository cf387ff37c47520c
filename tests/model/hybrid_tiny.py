"""Tiny random Qwen3.5 (multimodal layout), Qwen3.5-MoE and Qwen3-Next checkpoints written by
transformers' save_pretrained, with MTP tensors added under the real names (`mtp.*`; transformers
drops them on load, so its model is the target-only oracle).

Four layers, linear / full / linear / full, so a split into 2 or 3 stages cuts between the two kinds
(and leaves a stage with linear-attention layers only).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
VOCAB, H, LAYERS = 160, 32, 4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_TEXT = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, layer_types=LAYER_TYPES, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=H)


_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _torch_rules() -> None:
    """The oracle runs on the CPU: where fla-core is installed (the GPU machine), transformers binds
    its delta rules to fla's Triton kernels at import, which refuse CPU tensors; give the modeling
    modules back their PyTorch rules (idempotent)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next
    for module in (modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next):
        for name in _RULES:
            rule = getattr(module, name, None)
            if rule is not None:
                setattr(module, name, getattr(rule, "__wrapped__", rule))


def hf_model(kind: str, tied: bool = False):
    """A random transformers model of `kind`, weights large enough that every tensor matters
    (`tied`: Qwen3.5 with the LM head tied to the embedding, as the small real ones are)."""
    import transformers as tr
    _torch_rules()
    if kind == "qwen3_5":
        model = tr.Qwen3_5ForConditionalGeneration(tr.Qwen3_5Config(
            text_config=dict(_TEXT, intermediate_size=48, tie_word_embeddings=tied), vision_config=_VISION,
            tie_word_embeddings=tied))
    elif kind == "qwen3_5_moe":
        model = tr.Qwen3_5MoeForConditionalGeneration(tr.Qwen3_5MoeConfig(
            text_config=dict(_TEXT, **_MOE), vision_config=_VISION, tie_word_embeddings=False))
    else:   # layer 1 dense (mlp_only_layers), the others MoE
        model = tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig(**_TEXT, intermediate_size=48, mlp_only_layers=[1],
                                                           **_MOE))
    g = torch.Generator().manual_seed(KINDS.index(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(noise.abs().log() * 0.5)
            elif "norm" in name or name.endswith("dt_bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.2 * noise)
    return model.eval()


def mtp_tensors(kind: str, num_mtp: int, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP tensors of the real checkpoints' names and shapes: one shared set, then
    `mtp.layers.{i}.` gated full-attention blocks (MoE in the MoE kinds)."""
    g = torch.Generator().manual_seed(seed)
    hd, heads, kv = 16, 4, 2
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    for i in range(num_mtp):
        p = f"mtp.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (2 * heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                       p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if kind == "qwen3_5":
            shapes.update({p + f"mlp.{n}.weight": s for n, s in
                           (("gate_proj", (48, H)), ("up_proj", (48, H)), ("down_proj", (H, 48)))})
        else:
            shapes[p + "mlp.gate.weight"] = (_MOE["num_experts"], H)
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
            for e, inter in [(f"experts.{e}", 16) for e in range(_MOE["num_experts"])] + [("shared_expert", 24)]:
                shapes.update({p + f"mlp.{e}.gate_proj.weight": (inter, H), p + f"mlp.{e}.up_proj.weight": (inter, H),
                               p + f"mlp.{e}.down_proj.weight": (H, inter)})
    return {n: (0.3 if "norm" in n else 0.2) * torch.randn(s, generator=g) for n, s in shapes.items()}


def write(folder: Path, kind: str, tokenizer=None, num_mtp: int = 0, mtp: dict | None = None, tied: bool = False):
    """save_pretrained the transformers model, then add MTP tensors (and `mtp_num_hidden_layers`)."""
    from tests.conftest import write_tokenizer_files
    model = hf_model(kind, tied)
    model.save_pretrained(folder)
    if num_mtp:
        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        tensors.update(mtp if mtp is not None else mtp_tensors(kind, num_mtp, seed=7))
        save_file(tensors, str(path), metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = num_mtp
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer is not None:
        write_tokenizer_files(folder, tokenizer)
    return model


_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def make_echo(folder: Path, mixing: float, mtp_mixing: float, seed: int = 11) -> None:
    """Rewrite a checkpoint written by `write(..., num_mtp=n)` so that the target predicts t -> t+1
    and an MTP layer wired as the format says drafts t + 2.

    Unit-norm embeddings, lm_head[j] = emb[j - 1], final norms 1 + 0: with layers that add nothing
    (`mixing` = 0) the target's final hidden is its input embedding, so it predicts the next id. Each
    layer's output projections are scaled by `mixing` (the target) or `mtp_mixing` (the MTP blocks),
    so with mixing > 0 the target sometimes says something else and drafts are sometimes rejected.
    mtp.fc = [I | 0] passes on the embedding half of cat[embedding(x_{t+1}), hidden(h_t)]: t + 2. A
    drafter that swaps the halves, skips the projection or is fed x_t instead drafts t + 1.
    """
    path = folder / "model.safetensors"
    t = load_file(str(path))
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in t else "model."
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.functional.normalize(torch.randn(VOCAB, H, generator=g), dim=-1)
    t[prefix + "embed_tokens.weight"] = emb
    t["lm_head.weight"] = emb.roll(1, dims=0)
    t[prefix + "norm.weight"] = torch.zeros(H)
    t["mtp.norm.weight"] = torch.zeros(H)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    t["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(H)
    t["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    for name in list(t):
        if name.endswith(_OUTPUTS) and ".layers." in name:
            scale = mtp_mixing if name.startswith("mtp.") else mixing
            t[name] = t[name] * scale
    save_file(t, str(path), metadata={"format": "pt"})
