"""A GGUF's converted copy is cached in the dtype the engine runs, and a reload does not hash the
whole file again."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from pipespec.checkpoint import source as source_mod
from pipespec.checkpoint.source import resolve_model


def _dtypes(folder) -> set[torch.dtype]:
    out = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out |= {f.get_slice(n).get_dtype() for n in f.keys()}
    return out


def test_gguf_is_cached_in_the_engine_dtype(model_path, tmp_path, monkeypatch):
    fp32 = resolve_model(model_path)                      # the shared cache, written by earlier loads
    monkeypatch.setenv("PIPESPEC_CACHE_DIR", str(tmp_path))
    bf16 = resolve_model(model_path, torch.bfloat16)
    assert bf16.folder.parent == tmp_path and bf16.folder.name.endswith("-bfloat16")
    assert _dtypes(bf16.folder) == {"BF16"}
    assert json.loads((bf16.folder / "pipespec.json").read_text())["dtype"] == "bfloat16"
    size = sum(p.stat().st_size for p in bf16.folder.glob("*.safetensors"))
    fp32_size = sum(p.stat().st_size for p in fp32.folder.glob("*.safetensors"))
    assert size < 0.55 * fp32_size
    # the same values the engine got from the fp32 copy after its own cast
    for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(bf16.weights().get(name), fp32.weights().get(name).to(torch.bfloat16))
    assert bf16.arch == fp32.arch


def test_reload_skips_hashing_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1 << 20))
    hashed = []
    real_hash = source_mod._file_hash
    monkeypatch.setattr(source_mod, "_file_hash", lambda p: hashed.append(p) or real_hash(p))
    first = source_mod._file_digest(gguf)
    assert source_mod._file_digest(gguf) == first and len(hashed) == 1       # remembered
    os.utime(gguf, ns=(0, 0))                                                 # touched: hash again
    assert source_mod._file_digest(gguf) == first and len(hashed) == 2
