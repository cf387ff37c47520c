"""Weight sources (safetensors folders, GGUF files) and loading a model's tensors from them.

A source maps Hugging Face tensor names to tensors in Hugging Face conventions and reads only the
tensors it is asked for, so each pipeline stage touches just its own slice of the checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from safetensors import safe_open
from tqdm.auto import tqdm

from pipespec.model.tp_layers import pairs


# fused projections of the model and the checkpoint tensors they concatenate (along dim 0)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}        # MLA's latent projections


def fused_parts(name: str) -> list[str]:
    """The checkpoint tensors a parameter is loaded from: a fused q/k/v, gate/up or MLA latent
    projection's are its parts' names, anything else's its own."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


class WeightSource(Protocol):
    def names(self) -> set[str]: ...
    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsSource:
    """One or many *.safetensors files (with model.safetensors.index.json when sharded)."""

    def __init__(self, paths: list[Path]):
        if not paths:
            raise ValueError("no *.safetensors files given")
        self._where: dict[str, Path] = {}
        for path in paths:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self._where[name] = path
        self._open: dict[Path, object] = {}

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsSource":
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(f"shards named in {index} are missing: {', '.join(missing)}")
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {folder}")
        return cls(files)

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        path = self._where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name)

    def get_slice(self, name: str):
        """A lazy view of one tensor: `.get_shape()`, and indexing reads only the part asked for
        (one expert of a fused [E, ...] tensor, say)."""
        path = self._where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_slice(name)


def checkpoint_shards(model: torch.nn.Module) -> dict:
    """Parameter name -> the `tp_layers.Shard` of its checkpoint tensors this rank reads, for every
    tensor-parallel layer of `model` (a layer says so with `checkpoint_shards()`)."""
    out = {}
    for prefix, module in model.named_modules():
        shards = getattr(module, "checkpoint_shards", None)
        if callable(shards):
            out.update({f"{prefix}.{name}" if prefix else name: s for name, s in shards().items()})
    return out


def _read(source: WeightSource, name: str, shard, part: int) -> torch.Tensor:
    """One checkpoint tensor, or only this rank's slice of it: through the source's lazy slices when
    it has them (safetensors reads just those bytes), else cut from the whole tensor."""
    if shard is None:
        return source.get(name)
    spans = pairs(shard.ranges[part])
    get_slice = getattr(source, "get_slice", None)
    whole = lazy = None
    if get_slice is not None:
        lazy = get_slice(name)
        shape = list(lazy.get_shape())
    else:
        whole = source.get(name)
        shape = list(whole.shape)
    if len(shape) <= shard.dim or shape[shard.dim] != shard.sizes[part]:
        raise ValueError(f"tensor shape mismatch: {name} {tuple(shape)}; the model expects {shard.sizes[part]} "
                         f"along dim {shard.dim} (it reads a slice of it)")
    if lazy is not None:
        pieces = [lazy[(slice(None),) * shard.dim + (slice(a, b),)] for a, b in spans]
    else:
        pieces = [whole.narrow(shard.dim, a, b - a) for a, b in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


def load_weights(model: torch.nn.Module, source: WeightSource, dtype: torch.dtype, device,
                 desc: str = "Loading weights") -> None:
    """Fill every parameter of `model` from `source`; the model is moved to (dtype, device). A
    tensor-parallel layer's parameters read only their shard (`checkpoint_shards`)."""
    wanted: dict[str, list[str]] = model.checkpoint_names()
    shards = checkpoint_shards(model)
    available = source.names()
    missing = sorted(c for ckpts in wanted.values() for c in ckpts if c not in available)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
    place_parameters(model, dtype, device)
    params = dict(model.named_parameters())
    for name, ckpts in tqdm(sorted(wanted.items()), desc=desc, unit="tensor", leave=False, disable=None):
        param = params[name]
        shard = shards.get(name)
        parts = [_read(source, c, shard, i) for i, c in enumerate(ckpts)]
        for c, part in zip(ckpts, parts):
            if not part.is_floating_point() or part.element_size() < 2:   # int or float8: quantized
                raise ValueError(f"tensor {c} is {part.dtype}, not a plain float weight: the checkpoint is "
                                 "quantized in a way pipespec did not recognise")
        # fused parameters (q/k/v, gate/up) take their parts in order along dim 0; each part is copied
        # straight into its rows, converted on the way (no joined or converted copy first: in a new
        # process each such copy costs its pages' first touch as well)
        rows = sum(part.shape[0] if part.dim() else 1 for part in parts)
        # the last vocabulary shard: rows past the vocabulary stay zero, never looked up
        pad = param.shape[0] - rows if shard is not None and shard.pad and rows < param.shape[0] else 0
        if any(part.dim() != param.dim() or part.shape[1:] != param.shape[1:] for part in parts) \
                or rows + pad != (param.shape[0] if param.dim() else 1):
            shapes = ", ".join(f"{c} {tuple(p.shape)}" for c, p in zip(ckpts, parts))
            raise ValueError(f"tensor shape mismatch: {shapes}; the model expects {tuple(param.shape)}"
                             + (" in total along dim 0" if len(parts) > 1 else ""))
        with torch.no_grad():
            if len(parts) == 1 and not pad:
                param.copy_(parts[0])
                continue
            at = 0
            for part in parts:
                param[at:at + part.shape[0]].copy_(part)
                at += part.shape[0]
            param[at:].zero_()


@contextlib.contextmanager
def parameters_on_meta():
    """Build a model without memory for its parameters: every parameter registered inside is moved to
    the meta device (so its initialisation costs nothing) until `place_parameters` allocates it on
    its device in its dtype. Building a 30B model's float32 parameters on the host first, then moving
    them, held twice the weights (on the host, then on the GPU at `.to`). Buffers (rotary tables) are
    computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def place_parameters(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    """Every parameter on `device` in its dtype (`param_dtypes`), one at a time, so the peak is the
    weights plus one tensor: one still on the meta device gets fresh memory there (its values come
    from the loader), one with values is converted. Buffers move as they are (float32 rotary tables)."""
    dtypes = param_dtypes(model, dtype)
    placed: dict[int, nn.Parameter] = {}          # a parameter two modules share stays shared
    for mname, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in placed:
                name = f"{mname}.{pname}" if mname else pname
                data = (torch.empty(param.shape, dtype=dtypes[name], device=device) if param.is_meta
                        else param.detach().to(device=device, dtype=dtypes[name]))
                placed[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[pname] = placed[id(param)]
    model.to(device=device)       # the buffers, and any module's views of them (`QuantLinear._apply`)


def param_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each parameter: the model's, or float32 for those a module lists in its
    `float32_params` (an MoE router, whose logits are computed in float32: stored so, its weight is
    not converted again at every step)."""
    out = {}
    for mname, module in model.named_modules():
        keep = getattr(module, "float32_params", ())
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = torch.float32 if pname in keep else dtype
    return out


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, dtype: torch.dtype, device, seed: int = 0,
                       key: dict[str, str] | None = None) -> None:
    """Random weights of the right shapes, made on the device (`load_format="dummy"`): norms 1,
    everything else N(0, 0.02), so activations stay finite through any depth. Each tensor is drawn
    from a generator keyed by its (global) name, so a model is the same however its layers are
    split into stages; a tensor-parallel shard is cut from the whole tensor drawn so, so it is also
    the same at every tensor-parallel size. `key` renames parameters whose name elsewhere differs (a
    copy of a tensor another module owns draws the same values as the original)."""
    place_parameters(model, dtype, device)
    gen = torch.Generator(device=device)
    shards = checkpoint_shards(model)
    for own, param in model.named_parameters():
        name = (key or {}).get(own, own)
        if "norm" in name.rsplit(".", 2)[-2]:
            param.data.fill_(1.0)
            continue
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        shard = shards.get(own)
        if shard is None:
            param.data.normal_(0.0, 0.02, generator=gen)
            continue
        shape = list(param.shape)
        shape[shard.dim] = sum(shard.sizes)
        whole = torch.empty(shape, dtype=param.dtype, device=device).normal_(0.0, 0.02, generator=gen)
        offsets = [sum(shard.sizes[:i]) for i in range(len(shard.sizes))]
        pieces = [whole.narrow(shard.dim, off + a, b - a) for off, r in zip(offsets, shard.ranges)
                  for a, b in pairs(r)]
        cut = torch.cat(pieces, dim=shard.dim)
        param.data.zero_()
        param.data.narrow(shard.dim, 0, cut.shape[shard.dim]).copy_(cut)
