"""MTP (multi-token prediction) draft modules, and reading/writing them as checkpoints.

DeepSeek-V3 family (also GLM-4.5/4.6), DESIGN.md "MTP alignment": at target position t the module
takes the target's final hidden state h_t and token x_{t+1}, and predicts x_{t+2}:

    x   = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])
    out = decoder block(x) + residual        <- fed back as h at chained steps (pre shared_head.norm)
    logits = head(shared_head.norm(out))

Chained step k > 1 feeds the module's own `out` (before `shared_head.norm`, the DeepSeek convention)
with the next token; `hnorm` normalizes both kinds of input. Training and inference both use this.

The module *is* a `DecoderLayer` with the extra MTP parts beside it, so its parameters carry the
DeepSeek checkpoint names under `model.layers.{N}.` (N = the target's num_hidden_layers), with q/k/v
and gate/up fused as in the target (`checkpoint_names` maps them). The embedding and LM head are the
target's unless the checkpoint ships its own copy; they are passed in at forward time (I5).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import ForwardContext, KVCache
from pipespec.model.layers import RMSNorm, RotaryEmbedding
from pipespec.model.llama import DecoderLayer

FAMILY_DEEPSEEK = "deepseek_v3"
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class _SharedHead(nn.Module):
    def __init__(self, arch: ArchConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)


class DeepSeekMTP(DecoderLayer):
    """One DeepSeek-V3-style MTP layer on top of a Llama-family target."""

    family = FAMILY_DEEPSEEK

    def __init__(self, arch: ArchConfig, layer_index: int | None = None, max_position: int | None = None,
                 own_embedding: bool = False, own_head: bool = False):
        super().__init__(arch)
        h = arch.hidden_size
        self.arch = arch
        self.layer_index = arch.num_layers if layer_index is None else layer_index
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = _SharedHead(arch, own_head)
        if own_embedding:       # a copy for a last stage that does not own the target's (PP > 1)
            self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.rotary = RotaryEmbedding(arch, max_position or arch.max_position)

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer_index}."

    # -- checkpoint names ---------------------------------------------------------------------

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Parameter name -> the checkpoint tensors it is loaded from (concatenated along dim 0)."""
        names = {}
        for name in self.state_dict():
            parts = [name]
            for fused, split in _FUSED.items():
                if f".{fused}." in name:
                    parts = [name.replace(fused, s) for s in split]
            names[name] = [self.prefix + p for p in parts]
        return names

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The module's weights under their checkpoint names (fused tensors split), on CPU."""
        state = self.state_dict()
        out = {}
        for name, ckpts in self.checkpoint_names().items():
            tensor = state[name].detach().cpu()
            if len(ckpts) == 1:
                out[ckpts[0]] = tensor.contiguous()
                continue
            sizes = self._split_sizes(name)
            for ckpt, part in zip(ckpts, tensor.split(sizes, dim=0)):
                out[ckpt] = part.contiguous()
        return out

    def _split_sizes(self, name: str) -> list[int]:
        if ".qkv_proj." in name:
            a = self.self_attn
            return [a.q_size, a.kv_size, a.kv_size]
        return [self.mlp.intermediate, self.mlp.intermediate]

    def init_from_target(self, target: nn.Module, layer: int | None = None) -> None:
        """Copy the target's decoder layer `layer` (default: its last) into this module's block."""
        layer = self.arch.num_layers - 1 if layer is None else layer
        src = target.model.layers[str(layer)].state_dict()
        own = self.state_dict()
        with torch.no_grad():
            for name, tensor in src.items():
                own[name].copy_(tensor)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, ctx: ForwardContext, input_ids: torch.Tensor, hidden: torch.Tensor,
                embed_weight: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids: [T] the token after each row's hidden; hidden: [T, H] the target's final-normed
        hidden (step 1) or this module's previous output (chained steps). Returns the block output
        before `shared_head.norm`, [T, H]: what the next chained step takes as `hidden`.

        `embed_weight` is the target's embedding matrix, passed at call time; ignored when the
        module holds its own copy. `cache` defaults to `ctx.kv_caches[0]`.
        """
        weight = self.embed_tokens.weight if hasattr(self, "embed_tokens") else embed_weight
        if weight is None:
            raise ValueError("this MTP module has no embedding of its own; pass the target's embed_weight")
        e = nn.functional.embedding(input_ids, weight)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        if cache is None and ctx.kv_caches:
            cache = ctx.kv_caches[0]
        out, residual = super().forward(x, None, self.rotary(ctx.positions), cache, ctx)
        return out + residual

    def compute_logits(self, out: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits from the block output; `head_weight` is the target's LM head unless the module owns one."""
        weight = self.shared_head.head.weight if hasattr(self.shared_head, "head") else head_weight
        if weight is None:
            raise ValueError("this MTP module has no LM head of its own; pass the target's head_weight")
        x = self.shared_head.norm(out)
        return nn.functional.linear(x.to(weight.dtype), weight)


# -- files ------------------------------------------------------------------------------------

META_FAMILY = "pipespec.mtp_family"
META_BASE_MODEL = "pipespec.base_model"
META_BASE_CONFIG = "pipespec.base_model_config"
META_LAYER_INDEX = "pipespec.layer_index"


def save_mtp(path: str | Path, module: DeepSeekMTP, base_model: str, dtype: torch.dtype | None = None,
             extra: dict[str, object] | None = None) -> None:
    """Write `module` as a DeepSeek-V3-named safetensors file with metadata naming its base model.

    `extra` values that are not strings are stored as JSON.
    """
    from safetensors.torch import save_file

    tensors = module.checkpoint_tensors()
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    meta = {"format": "pt", META_FAMILY: module.family, META_BASE_MODEL: base_model,
            META_BASE_CONFIG: json.dumps(dataclasses.asdict(module.arch)),
            META_LAYER_INDEX: str(module.layer_index), "num_nextn_predict_layers": "1"}
    for key, value in (extra or {}).items():
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_mtp_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def find_mtp_layers(names: set[str], num_layers: int) -> list[int]:
    """Layer indices >= num_layers that hold a DeepSeek-style MTP layer (they have `eh_proj`)."""
    found = set()
    for name in names:
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "eh_proj":
            index = int(parts[2])
            if index >= num_layers:
                found.add(index)
    return sorted(found)


def load_mtp(source, arch: ArchConfig, dtype: torch.dtype, device, layer_index: int | None = None,
             max_position: int | None = None) -> DeepSeekMTP:
    """Build and load a DeepSeek-style MTP layer from a weight source (a head file or a whole
    DeepSeek/GLM checkpoint); an embedding or head copy in the checkpoint is loaded when present."""
    from pipespec.model.weights import load_weights

    names = source.names()
    if layer_index is None:
        layers = find_mtp_layers(names, arch.num_layers)
        if not layers:
            raise ValueError(f"no MTP layer (model.layers.N.eh_proj with N >= {arch.num_layers}) in the checkpoint")
        layer_index = layers[0]
    prefix = f"model.layers.{layer_index}."
    module = DeepSeekMTP(arch, layer_index, max_position,
                         own_embedding=prefix + "embed_tokens.weight" in names,
                         own_head=prefix + "shared_head.head.weight" in names)
    load_weights(module, source, dtype, device, desc="Loading MTP layer")
    return module


def load_mtp_file(path: str | Path, arch: ArchConfig, dtype: torch.dtype = torch.float32, device="cpu",
                  max_position: int | None = None) -> tuple[DeepSeekMTP, dict[str, str]]:
    """Load a head file written by `save_mtp` (or any DeepSeek-named MTP file); returns (module, metadata)."""
    from pipespec.model.weights import SafetensorsSource

    meta = read_mtp_metadata(path)
    if META_BASE_CONFIG in meta:
        base = json.loads(meta[META_BASE_CONFIG])
        for key in ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if base.get(key) != getattr(arch, key):
                raise ValueError(f"MTP head {path} was trained for {meta.get(META_BASE_MODEL)!r} with "
                                 f"{key}={base.get(key)}, but the target has {key}={getattr(arch, key)}")
    module = load_mtp(SafetensorsSource([Path(path)]), arch, dtype, device, max_position=max_position)
    return module, meta
