"""The dtype the engine runs the weights in, known before any stage is built (the GGUF cache is
written in it)."""
from __future__ import annotations

import torch

from pipespec.config import EngineConfig
from pipespec.model.runner import resolve_device, resolve_dtype


def weights_dtype(config: EngineConfig) -> torch.dtype:
    """Every stage resolves the same (stages of one pipeline run on one kind of device)."""
    return resolve_dtype(config.model.dtype, resolve_device(config.model.device))
