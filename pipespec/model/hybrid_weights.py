"""A Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint seen under the names the target and MTP modules use.

- Qwen3.5/3.6 checkpoints are vision-language models: the text decoder is under
  `model.language_model.` (shown here as `model.`) and the vision tower under `model.visual.`, which
  text-only serving never reads (hidden, with one log line).
- Expert weights come per expert (`mlp.experts.{e}.gate_proj.weight`, what transformers'
  save_pretrained writes) or fused 3-D (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
  [E, H, I]); fused ones are shown as the per-expert names, sliced on read.
"""
from __future__ import annotations

import logging
import re

import torch

logger = logging.getLogger(__name__)

_TEXT, _VISION = "model.language_model.", "model.visual."
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class HybridWeights:
    def __init__(self, source, nested: bool):
        self.source = source
        self._map: dict[str, tuple[str, tuple | None]] = {}
        vision = 0
        for name in source.names():
            shown = name
            if nested:
                if name.startswith(_VISION):
                    vision += 1
                    continue
                if name.startswith(_TEXT):
                    shown = "model." + name.removeprefix(_TEXT)
            fused = _FUSED_EXPERTS.match(shown)
            if fused:
                self._add_fused(name, fused.group(1), fused.group(2))
            else:
                self._map[shown] = (name, None)
        if vision:
            logger.info("skipping the vision tower (%d tensors under %s): pipespec serves text only",
                        vision, _VISION)

    def _add_fused(self, name: str, prefix: str, kind: str) -> None:
        shape = self._slice(name).get_shape()      # [E, 2I, H] or [E, H, I]
        for e in range(shape[0]):
            if kind == "down_proj":
                self._map[f"{prefix}.{e}.down_proj.weight"] = (name, (e, None))
            else:
                half = shape[1] // 2
                self._map[f"{prefix}.{e}.gate_proj.weight"] = (name, (e, slice(0, half)))
                self._map[f"{prefix}.{e}.up_proj.weight"] = (name, (e, slice(half, None)))

    def names(self) -> set[str]:
        return set(self._map)

    def get(self, name: str) -> torch.Tensor:
        real, part = self._map[name]
        if part is None:
            return self.source.get(real)
        expert, rows = part
        tensor = self._slice(real)[expert]           # reads one expert, not the whole fused tensor
        return (tensor if rows is None else tensor[rows]).contiguous()

    def get_slice(self, name: str):
        """A lazy view of one tensor (a tensor-parallel rank reads its rows only)."""
        real, part = self._map[name]
        return self._slice(real) if part is None else _Whole(self.get(name))

    def _slice(self, name: str):
        if hasattr(self.source, "get_slice"):
            return self.source.get_slice(name)
        return _Whole(self.source.get(name))


class _Whole:
    """`get_slice` over a tensor read whole (sources without lazy slices)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]
