"""Hub ids (`org/name`) resolve through huggingface_hub: from a local Hub cache (HF_HUB_CACHE or
--download-dir) when offline or when the Hub cannot be reached, with a clear error when the model is
not there. No network is used: the cache is a tmp folder in the Hub's own layout, holding a real
(tiny) model folder."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec import LLM, SamplingParams
from pipespec.checkpoint.hub import looks_like_repo_id
from pipespec.checkpoint.source import resolve_model

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = dict(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32, max_num_seqs=4)


def hub_cache(root: Path, folder: Path, repo_id: str = REPO_ID, refs=("main",)) -> Path:
    """A Hugging Face Hub cache at `root` holding `folder` as `repo_id` at COMMIT, named by `refs`."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(COMMIT)
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def cache(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    snapshot = hub_cache(root, tiny_models["qwen2"][0], refs=("main", "v1"))
    return root, snapshot


@pytest.fixture
def offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache[0]))
    return cache


def test_repo_ids_and_paths():
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_repo_id("org/name.v2")
    for path in ("./org/name", "/models/qwen", "~/m", "a/b/c", "../x", "model.gguf", "org/model.gguf", "plain"):
        assert not looks_like_repo_id(path), path


def test_offline_hub_id_resolves_from_the_cache(offline):
    _, snapshot = offline
    source = resolve_model(REPO_ID)
    assert source.folder == snapshot and source.name == REPO_ID
    assert resolve_model(REPO_ID, revision="v1").folder == snapshot


def test_hub_id_serves_the_same_model_as_its_folder(offline, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=REPO_ID, **TINY) as llm:
        assert llm.engine.model_name == REPO_ID
        by_id = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=str(tiny_models["qwen2"][0]), **TINY) as llm:
        by_folder = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert by_id == by_folder


def test_offline_and_not_cached_is_a_clear_error(offline):
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE=1"):
        resolve_model("other-org/not-downloaded")
    with pytest.raises(FileNotFoundError, match="revision nope"):
        resolve_model(REPO_ID, revision="nope")


def test_download_dir_is_the_cache(cache, tmp_path, monkeypatch, tiny_models):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError):
        resolve_model(REPO_ID)
    assert resolve_model(REPO_ID, download_dir=str(cache[0])).folder == cache[1]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", **env)
    return subprocess.run([sys.executable, "-m", "pipespec", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=180)


def test_cli_with_a_hub_id_when_the_hub_is_unreachable(cache):
    """Online mode, but the Hub's address answers nothing: the cached snapshot is used (huggingface_hub
    falls back to it itself; pipespec's own fallback covers the errors it raises instead)."""
    proc = _cli("generate", "--model", REPO_ID, "--device", "cpu", "--max-tokens", "3", "--max-model-len", "64",
                "Hello", HF_HUB_CACHE=str(cache[0]), HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### 3 tokens" in proc.stdout
    assert f"model {REPO_ID}: {cache[1]}" in proc.stderr


def test_cli_hub_id_missing_offline_exits_2_with_one_message(tmp_path):
    proc = _cli("generate", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "Hello", HF_HUB_CACHE=str(tmp_path),
                HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Qwen/Qwen2.5-0.5B-Instruct is not a local path and is not in the Hugging Face cache" in proc.stderr
