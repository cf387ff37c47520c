"""MTP head files: one MTP layer under its checkpoint names, with metadata naming its base model."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pipespec.model.arch import ArchConfig
from pipespec.model.mtp.base import MTPLayer
from pipespec.model.mtp.loading import load_mtp
from pipespec.model.tp_layers import SINGLE
from pipespec.parallel import TensorParallel

META_FAMILY = "pipespec.mtp_family"
META_BASE_MODEL = "pipespec.base_model"
META_BASE_CONFIG = "pipespec.base_model_config"
META_LAYER_INDEX = "pipespec.layer_index"
META_BLOCK_INTERMEDIATE = "pipespec.block_intermediate_size"    # the head's MLP width, when not the target's


def save_mtp(path: str | Path, module: MTPLayer, base_model: str, dtype: torch.dtype | None = None,
             extra: dict[str, object] | None = None, base_arch: ArchConfig | None = None,
             tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write `module` as a safetensors file under its checkpoint names (DeepSeek-V3 names for the
    heads pipespec trains), with metadata naming its base model (`base_arch`: the target's config,
    default the module's) and its block's MLP width. `extra` values that are not strings are stored
    as JSON; `tensors`: more tensors to store as they are (a draft vocabulary)."""
    from safetensors.torch import save_file

    weights = module.checkpoint_tensors()
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    tensors = {**weights, **{k: v.contiguous() for k, v in (tensors or {}).items()}}
    meta = {"format": "pt", META_FAMILY: module.family, META_BASE_MODEL: base_model,
            META_BASE_CONFIG: json.dumps(dataclasses.asdict(base_arch or module.arch)),
            META_LAYER_INDEX: str(module.layer_index), "num_nextn_predict_layers": "1",
            META_BLOCK_INTERMEDIATE: str(module.arch.intermediate_size)}
    for key, value in (extra or {}).items():
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_mtp_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_mtp_file(path: str | Path, arch: ArchConfig, dtype: torch.dtype = torch.float32, device="cpu",
                  max_position: int | None = None, tp: TensorParallel = SINGLE) -> tuple[MTPLayer, dict[str, str]]:
    """Load a head file written by `save_mtp` (or any file of MTP tensors); returns (module, metadata)."""
    from pipespec.model.weights import SafetensorsSource

    meta = read_mtp_metadata(path)
    if META_BASE_CONFIG in meta:
        base = json.loads(meta[META_BASE_CONFIG])
        for key in ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if base.get(key) != getattr(arch, key):
                raise ValueError(f"MTP head {path} was trained for {meta.get(META_BASE_MODEL)!r} with "
                                 f"{key}={base.get(key)}, but the target has {key}={getattr(arch, key)}")
    width = int(meta.get(META_BLOCK_INTERMEDIATE, arch.intermediate_size))
    if width != arch.intermediate_size:          # a head trained with a wider (or narrower) MLP
        arch = dataclasses.replace(arch, intermediate_size=width)
    module = load_mtp(SafetensorsSource([Path(path)]), arch, dtype, device, max_position=max_position, tp=tp)
    return module, meta
