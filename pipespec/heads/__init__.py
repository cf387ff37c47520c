"""MTP draft heads bundled with pipespec (safetensors files in this folder)."""
from __future__ import annotations

import os
from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_HEAD = "smollm2-135m-instruct-mtp.safetensors"


def default_model_head_path() -> Path:
    """The MTP head trained for the default model (SmolLM2-135M-Instruct)."""
    return HEADS_DIR / DEFAULT_MODEL_HEAD


def bundled_head_path(model: str | os.PathLike | None = None) -> Path | None:
    """The bundled MTP head for `model` (None: the default model), or None when none is bundled.

    A model given by path gets the default model's head only when it is the default model's file.
    """
    path = default_model_head_path()
    if not path.exists():
        return None
    if model is None:
        return path
    from pipespec.checkpoint.source import default_model_path

    try:
        default = default_model_path().resolve()
    except FileNotFoundError:
        return None
    return path if Path(model).expanduser().resolve() == default else None
