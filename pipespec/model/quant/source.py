"""A weight source that serves a quantized checkpoint's linear weights dequantized.

Under their logical names (`...q_proj.weight`), so model code and `load_weights` need not know the
checkpoint was quantized; the quantized parts (`qweight`, `weight_scale_inv`, ...) are consumed and
hidden. Nothing is guessed: a layer whose parts are incomplete, quantized tensors in a module the
config keeps in full precision, or leftover quantization tensors are errors naming them.
"""
from __future__ import annotations

import torch

from pipespec.model.quant.config import QuantConfig
from pipespec.model.quant.formats import dequant_awq, dequant_fp8, dequant_gptq
from pipespec.model.quant.packed import Fp8Weight, Int4Weight

_PARTS = {"fp8": ("weight", "weight_scale_inv"), "awq": ("qweight", "qzeros", "scales"),
          "gptq": ("qweight", "qzeros", "scales", "g_idx")}
_MARKER = {"fp8": "weight_scale_inv", "awq": "qweight", "gptq": "qweight"}
QUANT_SUFFIXES = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale",
                            "input_scale"})


class QuantizedSource:
    def __init__(self, inner, config: QuantConfig):
        self.inner, self.config = inner, config
        names = inner.names()
        marker = "." + _MARKER[config.method]
        self._layers: dict[str, str] = {}           # logical weight name -> the layer's prefix
        consumed: set[str] = set()
        for prefix in sorted(n[:-len(marker)] for n in names if n.endswith(marker)):
            parts = [f"{prefix}.{p}" for p in _PARTS[config.method]]
            missing = [p for p in parts if p not in names]
            if missing:
                raise ValueError(f"quantized layer {prefix} lacks {', '.join(missing)} ({config.method} layout)")
            if not config.converts(prefix):
                raise ValueError(f"{prefix} holds {config.method} tensors, but quantization_config lists it "
                                 "among the modules kept in full precision")
            self._layers[f"{prefix}.weight"] = prefix
            consumed.update(parts)
        left = sorted(n for n in names - consumed if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES)
        if left:
            raise ValueError(f"quantization tensors that belong to no {config.method} layer: {', '.join(left[:5])}")
        self._names = (names - consumed) | set(self._layers)

    def names(self) -> set[str]:
        return self._names

    def is_quantized(self, name: str) -> bool:
        return name in self._layers

    def packed(self, name: str) -> Int4Weight | Fp8Weight:
        """A quantized layer's weight as the GPU kernels read it (`name`: its logical '...weight')."""
        part = self._parts(name)
        c = self.config
        if c.method == "fp8":
            return Fp8Weight(part["weight"], part["weight_scale_inv"].float(), c.block)
        if c.method == "awq":
            return Int4Weight.from_awq(part["qweight"], part["qzeros"], part["scales"], c.group_size)
        return Int4Weight.from_gptq(part["qweight"], part["qzeros"], part["scales"], part["g_idx"])

    def _parts(self, name: str) -> dict[str, torch.Tensor]:
        prefix = self._layers[name]
        part = {p: self.inner.get(f"{prefix}.{p}") for p in _PARTS[self.config.method]}
        if self.config.method == "fp8" and part["weight"].dtype != torch.float8_e4m3fn:
            raise ValueError(f"{prefix}.weight is {part['weight'].dtype}, not float8_e4m3fn")
        return part

    def get(self, name: str) -> torch.Tensor:
        if name not in self._layers:
            return self.inner.get(name)
        part = self._parts(name)
        c = self.config
        if c.method == "fp8":
            return dequant_fp8(part["weight"], part["weight_scale_inv"], c.block)
        if c.method == "awq":
            return dequant_awq(part["qweight"], part["qzeros"], part["scales"], c.group_size)
        return dequant_gptq(part["qweight"], part["qzeros"], part["scales"], part["g_idx"])


def refuse_unrecognised_quantization(source, where: str):
    """A checkpoint whose config.json declares no quantization must hold no quantization tensors."""
    found = sorted(n for n in source.names() if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES)
    if found:
        raise ValueError(f"{where} holds quantization tensors ({', '.join(found[:3])}) but its config.json "
                         "has no quantization_config; pipespec will not load them as plain weights")
    return source
