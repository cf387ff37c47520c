"""Tiny random Hugging Face checkpoints that ship their own MTP layers, one per MTP family, written
with the tensor names and config keys of the real checkpoints; and each family's formula in plain
PyTorch, read straight from those names (the oracle the modules are checked against).

| family     | target (config.json)                          | MTP tensors                                |
|------------|-----------------------------------------------|--------------------------------------------|
| deepseek   | llama, num_nextn_predict_layers               | model.layers.{L+i}.enorm/hnorm/eh_proj/... |
| mimo       | mimo (MiMoForCausalLM, Qwen2 block)           | model.mtp_layers.{i}.token_layernorm/...   |
| qwen3_next | qwen3, mtp_num_hidden_layers                  | mtp.pre_fc_norm_*/fc/norm, mtp.layers.{i}  |

`echo=True` writes weights under which the MTP layers predict what the target will say next: the
target's layers add little to the residual stream (`mixing`), so its next token depends mostly on
the current one, and each MTP layer passes the embedding of its input token through to a copy of
the target's final norm. Drafts are then mostly right, which they are only if the family's concat
order and norms are computed as the real checkpoints mean them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

FAMILIES = ("deepseek", "mimo", "qwen3_next")
FAMILY_NAME = {"deepseek": "deepseek_v3", "mimo": "mimo", "qwen3_next": "qwen3_next"}    # MTPLayer.family
H, I, HEADS, KV_HEADS, VOCAB, LAYERS, EPS, THETA = 64, 96, 4, 2, 512, 2, 1e-6, 10000.0
HEAD_DIM = {"deepseek": 16, "mimo": 16, "qwen3_next": 32}
_TARGET_TYPE = {"deepseek": ("llama", "LlamaForCausalLM"), "mimo": ("mimo", "MiMoForCausalLM"),
                "qwen3_next": ("qwen3", "Qwen3ForCausalLM")}
_COUNT_KEY = {"deepseek": "num_nextn_predict_layers", "mimo": "num_nextn_predict_layers",
              "qwen3_next": "mtp_num_hidden_layers"}


def config(family: str, num_mtp: int) -> dict:
    model_type, architecture = _TARGET_TYPE[family]
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": VOCAB, "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "rms_norm_eps": EPS, "rope_theta": THETA,
            "max_position_embeddings": 256, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", _COUNT_KEY[family]: num_mtp,
            **({"head_dim": HEAD_DIM[family]} if family == "qwen3_next" else {})}


def block_kind(family: str, mtp: bool) -> dict:
    """bias: q/k/v bias (Qwen2, MiMo); qk_norm: q/k RMSNorm (Qwen3); zero_centred: (1 + w) norms."""
    return {"bias": family == "mimo", "qk_norm": family == "qwen3_next",
            "zero_centred": mtp and family == "qwen3_next"}


def mtp_prefixes(family: str, i: int) -> tuple[str, str]:
    """(prefix of layer i's own tensors, prefix of its decoder block)."""
    if family == "deepseek":
        return f"model.layers.{LAYERS + i}.", f"model.layers.{LAYERS + i}."
    if family == "mimo":
        return f"model.mtp_layers.{i}.", f"model.mtp_layers.{i}."
    return "mtp.", f"mtp.layers.{i}."


def _block_shapes(family: str, kind: dict) -> dict[str, tuple]:
    d = HEAD_DIM[family]
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (HEADS * d, H), "self_attn.k_proj.weight": (KV_HEADS * d, H),
              "self_attn.v_proj.weight": (KV_HEADS * d, H), "self_attn.o_proj.weight": (H, HEADS * d),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    if kind["bias"]:
        shapes.update({"self_attn.q_proj.bias": (HEADS * d,), "self_attn.k_proj.bias": (KV_HEADS * d,),
                       "self_attn.v_proj.bias": (KV_HEADS * d,)})
    if kind["qk_norm"]:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return shapes


# (token norm, hidden norm, output norm), input projection
_NORMS = {"deepseek": ("enorm", "hnorm", "shared_head.norm"),
          "mimo": ("token_layernorm", "hidden_layernorm", "final_layernorm"),
          "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
_PROJ = {"deepseek": "eh_proj", "mimo": "input_proj", "qwen3_next": "fc"}


def _mtp_own_shapes(family: str) -> dict[str, tuple]:
    return {**{f"{n}.weight": (H,) for n in _NORMS[family]}, f"{_PROJ[family]}.weight": (H, 2 * H)}


def shapes(family: str, num_mtp: int) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(target tensors, MTP tensors): checkpoint name -> shape."""
    target = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for layer in range(LAYERS):
        for name, shape in _block_shapes(family, block_kind(family, mtp=False)).items():
            target[f"model.layers.{layer}.{name}"] = shape
    mtp = {}
    for i in range(num_mtp):
        own, block = mtp_prefixes(family, i)
        mtp.update({own + n: s for n, s in _mtp_own_shapes(family).items()})
        mtp.update({block + n: s for n, s in _block_shapes(family, block_kind(family, mtp=True)).items()})
    return target, mtp


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith("layernorm.weight")


def random_tensors(family: str, num_mtp: int, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor matters: norms around 1 (zero-centred ones around 0), biases large."""
    g = torch.Generator().manual_seed(seed)
    target, mtp = shapes(family, num_mtp)
    out = {}
    for name, shape in {**target, **mtp}.items():
        noise = torch.randn(shape, generator=g)
        centred = name in mtp and block_kind(family, mtp=True)["zero_centred"]
        if _is_norm(name):
            out[name] = 0.3 * noise + (0.0 if centred else 1.0)
        else:
            out[name] = (0.5 if name.endswith("bias") else 0.15) * noise
    out["model.embed_tokens.weight"] *= 8      # the next token depends clearly on the current one
    return out


def echo_tensors(family: str, num_mtp: int, seed: int, mixing: float, mtp_mixing: float) -> dict[str, torch.Tensor]:
    tensors = random_tensors(family, num_mtp, seed)
    mtp_names = shapes(family, num_mtp)[1]
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] *= mtp_mixing if name in mtp_names else mixing
    final = tensors["model.norm.weight"]
    centred = block_kind(family, mtp=True)["zero_centred"]
    pick_embedding = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    if family == "mimo":                       # MiMo concatenates [hidden | embedding]
        pick_embedding = pick_embedding.roll(H, dims=1)
    token_norm, _, out_norm = _NORMS[family]
    for i in range(num_mtp):
        own, _ = mtp_prefixes(family, i)
        tensors[f"{own}{_PROJ[family]}.weight"] = pick_embedding.clone()
        tensors[f"{own}{token_norm}.weight"] = torch.zeros(H) if centred else torch.ones(H)
        tensors[f"{own}{out_norm}.weight"] = final - 1 if centred else final.clone()
    return tensors


def write_checkpoint(folder: Path, family: str, tensors: dict[str, torch.Tensor], num_mtp: int,
                     tokenizer=None) -> Path:
    """A Hugging Face folder: config.json, model.safetensors and (to serve it) a tokenizer."""
    from tests.conftest import write_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config(family, num_mtp), indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    if tokenizer is not None:
        write_tokenizer_files(folder, tokenizer)
    return folder


# -- the formulas, in plain PyTorch over checkpoint names --------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, zero_centred: bool) -> torch.Tensor:
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * (1 + w) if zero_centred else x * w


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def decoder_block(t: dict, p: str, x: torch.Tensor, positions: torch.Tensor, family: str, mtp: bool) -> torch.Tensor:
    """One pre-norm decoder block over one sequence (causal); returns the residual stream after it."""
    kind, d, n = block_kind(family, mtp), HEAD_DIM[family], x.shape[0]
    zc = kind["zero_centred"]

    def proj(name, h):
        out = h @ t[p + f"self_attn.{name}.weight"].T
        return out + t[p + f"self_attn.{name}.bias"] if kind["bias"] else out

    h = rms_norm(x, t[p + "input_layernorm.weight"], zc)
    q, k, v = (proj(name, h).view(n, -1, d) for name in ("q_proj", "k_proj", "v_proj"))
    if kind["qk_norm"]:
        q, k = rms_norm(q, t[p + "self_attn.q_norm.weight"], zc), rms_norm(k, t[p + "self_attn.k_norm.weight"], zc)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = x + attn @ t[p + "self_attn.o_proj.weight"].T
    h = rms_norm(x, t[p + "post_attention_layernorm.weight"], zc)
    gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T


def mtp_step(t: dict, family: str, i: int, token_ids: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer i over one sequence: (what a chained step feeds back, logits)."""
    own, block = mtp_prefixes(family, i)
    e = t["model.embed_tokens.weight"][token_ids]
    if family == "deepseek":
        x = torch.cat([rms_norm(e, t[own + "enorm.weight"], False),
                       rms_norm(hidden, t[own + "hnorm.weight"], False)], -1)
        out = decoder_block(t, block, x @ t[own + "eh_proj.weight"].T, positions, family, True)
        return out, rms_norm(out, t[own + "shared_head.norm.weight"], False) @ t["lm_head.weight"].T
    if family == "mimo":
        x = torch.cat([rms_norm(hidden, t[own + "hidden_layernorm.weight"], False),
                       rms_norm(e, t[own + "token_layernorm.weight"], False)], -1)
        out = decoder_block(t, block, x @ t[own + "input_proj.weight"].T, positions, family, True)
        out = rms_norm(out, t[own + "final_layernorm.weight"], False)
        return out, out @ t["lm_head.weight"].T
    x = torch.cat([rms_norm(e, t["mtp.pre_fc_norm_embedding.weight"], True),
                   rms_norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], True)], -1)
    out = decoder_block(t, block, x @ t["mtp.fc.weight"].T, positions, family, True)
    out = rms_norm(out, t["mtp.norm.weight"], True)
    return out, out @ t["lm_head.weight"].T
