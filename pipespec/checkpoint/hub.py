"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) to a local folder, through `huggingface_hub`.

Online, `snapshot_download` fetches what a load reads (config, tokenizer, safetensors) into the
Hub's cache (or `download_dir`) and returns the snapshot folder; a second call finds it there.
Offline (HF_HUB_OFFLINE=1), or when the Hub cannot be reached, the cached snapshot is used; if there
is none, the error says so and how to get one.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# what a load reads: no PyTorch .bin / .pt duplicates, no GGUF, no ONNX exports
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_repo_id(name: str) -> bool:
    """`org/name` that is not a local path (no leading ./ ~ /, one slash)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".gguf")


def _offline() -> bool:
    from huggingface_hub import constants
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:          # read now: tests and users may set it after huggingface_hub was imported
        return env.strip().lower() in ("1", "on", "yes", "true")
    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir(download_dir: str | os.PathLike | None) -> str:
    if download_dir is not None:
        return str(Path(download_dir).expanduser())
    from huggingface_hub import constants
    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def hub_snapshot(repo_id: str, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None) -> Path:
    """The local folder of `repo_id` at `revision` (default: main), downloaded if needed and allowed.
    FileNotFoundError names what is missing and how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache = _cache_dir(download_dir)
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    kwargs = dict(revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS)
    if _offline():
        try:
            return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"{where} is not a local path and is not in the Hugging Face cache at {cache}, and "
                f"HF_HUB_OFFLINE=1 forbids downloading it; download it once online (`hf download {repo_id}`), "
                "point HF_HUB_CACHE or --download-dir at a cache that holds it, or pass a local folder") from None
    try:
        folder = Path(snapshot_download(repo_id, **kwargs))
        logger.info("model %s: %s", where, folder)
        return folder
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"{where} is not a local path, and the Hugging Face Hub refused it: "
                                f"{str(e).splitlines()[0]}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        # the Hub is unreachable: what the cache holds is as good as it gets
        try:
            folder = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(f"{where} is not a local path, could not be downloaded "
                                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}) and is not "
                                    f"in the Hugging Face cache at {cache}") from None
        logger.warning("could not reach the Hugging Face Hub (%s); using the cached %s", type(e).__name__, folder)
        return folder
