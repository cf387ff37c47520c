"""Where the engine runs and in what dtype: resolved from the config before any stage is built (the
GGUF cache is written in the weights' dtype)."""
from __future__ import annotations

import torch

from pipespec.config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


def weights_dtype(config: EngineConfig) -> torch.dtype:
    """Every stage resolves the same (stages of one pipeline run on one kind of device)."""
    return resolve_dtype(config.model.dtype, resolve_device(config.model.device))
