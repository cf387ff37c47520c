"""Finding a checkpoint's MTP family by its tensor names, and building and loading its layers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pipespec.model.arch import ArchConfig
from pipespec.model.mtp.base import MTPLayer
from pipespec.model.mtp.deepseek import DeepSeekMTP
from pipespec.model.mtp.deepseek_native import NATIVE_BLOCKS, NativeDeepSeekMTP
from pipespec.model.mtp.mimo import MiMoMTP
from pipespec.model.mtp.qwen3_next import Qwen3NextMTP
from pipespec.model.tp_layers import SINGLE
from pipespec.parallel import TensorParallel

logger = logging.getLogger(__name__)

FAMILIES: tuple[type[MTPLayer], ...] = (DeepSeekMTP, MiMoMTP, Qwen3NextMTP)
_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def detect_mtp(names: set[str], num_layers: int) -> tuple[type[MTPLayer], list[int]] | None:
    """(family, layer indices) of the MTP layers among a checkpoint's tensor names, or None."""
    found = [(family, family.layer_indices(names, num_layers)) for family in FAMILIES]
    found = [(family, indices) for family, indices in found if indices]
    if len(found) > 1:
        raise ValueError("the checkpoint holds MTP layers of several families: "
                         + ", ".join(family.marker for family, _ in found))
    return found[0] if found else None


def find_mtp_layers(names: set[str], num_layers: int) -> list[int]:
    """Indices of the checkpoint's MTP layers, whatever their family ([] when it has none)."""
    hit = detect_mtp(names, num_layers)
    return hit[1] if hit else []


def declared_mtp_layers(folder: Path) -> int | None:
    """How many MTP layers the folder's config.json says the model has (None: it does not say)."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text())
    for scope in (cfg, cfg.get("text_config") or {}):
        for key in _COUNT_KEYS:
            if scope.get(key):
                return int(scope[key])
    return None


def load_mtp_layers(source, arch: ArchConfig, dtype: torch.dtype, device, max_position: int | None = None,
                    indices: list[int] | None = None, declared: int | None = None,
                    tp: TensorParallel = SINGLE) -> list[MTPLayer]:
    """Build and load MTP layers from a weight source (a head file or a whole checkpoint).

    `indices`: which layers (default: all the checkpoint holds, or the first `declared` of them when
    the config names fewer).
    """
    from pipespec.model.quant.keep import keep_quantized
    from pipespec.model.weights import load_weights, parameters_on_meta

    names = source.names()
    hit = detect_mtp(names, arch.num_layers)
    if hit is None:
        raise ValueError("no MTP layer in the checkpoint; looked for "
                         + ", ".join(family.marker for family in FAMILIES))
    family, found = hit
    if declared is not None and declared > len(found):
        raise ValueError(f"config.json declares {declared} MTP layers, but the checkpoint holds "
                         f"{len(found)} ({family.marker}: {found})")
    if indices is None:
        indices = found[:declared] if declared else found
    unknown = sorted(set(indices) - set(found))
    if unknown:
        raise ValueError(f"no MTP layer {unknown} in the checkpoint; it holds {found} ({family.marker})")
    if family is DeepSeekMTP and arch.model_type in NATIVE_BLOCKS:   # the target family's own block
        family = NativeDeepSeekMTP
    with parameters_on_meta():      # allocated by the loader: a random initialisation first cost as much again
        layers = family.build(arch, indices, names, max_position, tp=tp)
    for layer in layers:
        keep_quantized(layer, source, device, f"MTP layer {layer.layer_index}")
        load_weights(layer, source, dtype, device, desc=f"Loading {family.family} MTP layer {layer.layer_index}")
    return layers


# the MTP family each model type's checkpoints ship: what a dummy load builds with no tensor names
_SHIPPED = {"deepseek_v3": NativeDeepSeekMTP, "deepseek_v32": NativeDeepSeekMTP, "glm_moe_dsa": NativeDeepSeekMTP,
            "glm4_moe": NativeDeepSeekMTP, "qwen3_next": Qwen3NextMTP, "qwen3_5": Qwen3NextMTP,
            "qwen3_5_moe": Qwen3NextMTP}


def dummy_mtp_layers(arch: ArchConfig, count: int, dtype: torch.dtype, device,
                     max_position: int | None = None, tp: TensorParallel = SINGLE) -> list[MTPLayer]:
    """`count` MTP layers of the family `arch.model_type` ships, with random weights (benchmarks)."""
    from pipespec.model.weights import init_dummy_weights

    family = _SHIPPED.get(arch.model_type)
    if family is None:
        raise ValueError(f"load_format='dummy' builds MTP layers for {', '.join(sorted(_SHIPPED))}; "
                         f"{arch.model_type} ships none (pass a head file as speculative_config['model'])")
    first = 0 if family is Qwen3NextMTP else arch.num_layers        # mtp.layers.{i} / model.layers.{N + i}
    layers = family.build(arch, list(range(first, first + count)), set(), max_position, tp=tp)
    for layer in layers:
        init_dummy_weights(layer, dtype, device, seed=1 + layer.layer_index)
    return layers


def load_mtp(source, arch: ArchConfig, dtype: torch.dtype, device, layer_index: int | None = None,
             max_position: int | None = None, tp: TensorParallel = SINGLE) -> MTPLayer:
    """One MTP layer (default: the checkpoint's first), with any embedding or head copy it ships."""
    indices = None if layer_index is None else [layer_index]
    return load_mtp_layers(source, arch, dtype, device, max_position, indices, tp=tp)[0]
