"""Shared fixtures: the default model loaded once per session, the transformers oracle, tiny random
checkpoints of each supported family, and a guard that every engine test leaves the engine clean;
and the one place GPU tests are skipped where they cannot run (the `gpu` marker).

Everything else runs on CPU in float32.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from pipespec import LLM
from tests.helpers import INTERPRET

# Engine settings of the shared default-model engine. A small step budget makes long prompts go
# through chunked prefill, mixed with other requests' decodes.
DEFAULT_LLM_KWARGS = dict(dtype="float32", device="cpu", max_model_len=512, block_size=16,
                          num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)

TINY_FAMILIES = ("llama", "qwen2", "qwen3")


def pytest_configure(config):
    # One intra-op thread by default: on a small shared machine two OpenMP threads stall whenever the
    # other core is busy (a long prefill then takes 5-10x longer); PIPESPEC_TEST_THREADS overrides.
    threads = os.environ.get("PIPESPEC_TEST_THREADS", "1")
    torch.set_num_threads(int(threads))
    # The same for the processes tests start (servers, the CLI, training, benchmark scripts), whose
    # torch takes its thread count from OMP_NUM_THREADS at import, wherever another xdist worker keeps
    # the other core busy (or the count is asked for): a train-mtp run beside another test took 90 s
    # with two threads, 55 s with one (benchmarks/RESULTS.md, 2026-12-06).
    if os.environ.get("PYTEST_XDIST_WORKER") or "PIPESPEC_TEST_THREADS" in os.environ:
        os.environ.setdefault("OMP_NUM_THREADS", threads)
    torch.manual_seed(0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- where GPU tests run ---------------------------------------------------------------------------
#
# @pytest.mark.gpu                     a CUDA device running compiled kernels (not TRITON_INTERPRET=1)
# @pytest.mark.gpu(devices=2)          that many CUDA devices
# @pytest.mark.gpu(capability=9)       a device of at least that compute capability (major): sm_90+
# @pytest.mark.gpu(interpret=True)     Triton kernels the interpreter runs too: also on CPU under
#                                      TRITON_INTERPRET=1 (with triton installed)
# The closest marker wins: a function's own gpu marker replaces its module's.
# A GPU test that needs the default model (marked default_model, or using the `model_path` fixture or
# the shared engine) is skipped, naming the model, where it is not installed; on CPU it stays required.

GPU_MARKER_ARGS = {"devices", "capability", "interpret"}


def gpu_skip_reason(marker, num_devices: int, capability, interpret: bool = INTERPRET) -> str | None:
    """Why a test with this gpu marker cannot run here (None: it can). `capability`: a callable giving
    the first device's (major, minor); `interpret`: whether Triton runs under its interpreter."""
    unknown = set(marker.kwargs) - GPU_MARKER_ARGS
    if marker.args or unknown:
        raise pytest.UsageError(f"@pytest.mark.gpu takes keywords {sorted(GPU_MARKER_ARGS)}; got "
                                f"{marker.args or ''} {sorted(unknown) or ''}")
    need = marker.kwargs.get("devices", 1)
    if marker.kwargs.get("interpret") and interpret and num_devices == 0:
        return None
    if interpret and not marker.kwargs.get("interpret"):
        return "runs compiled kernels: not under TRITON_INTERPRET=1"
    if num_devices < need:
        where = "a CUDA device" if need == 1 else f"{need} CUDA devices"
        if marker.kwargs.get("interpret"):
            where += " (or TRITON_INTERPRET=1 with triton on CPU)"
        return f"needs {where}"
    major = marker.kwargs.get("capability")
    if major is not None and capability()[0] < major:
        return f"needs an sm_{major}0+ GPU"
    return None


def default_model_missing() -> str | None:
    """Why the default model cannot be loaded here (None: it can)."""
    from pipespec.checkpoint.source import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        return str(e)
    return None if path.exists() else f"the default model {path} ($PIPESPEC_DEFAULT_MODEL) does not exist"


# fixtures that load the default model (the shared engine, the tokenizer and the tiny checkpoints
# all go through _session_llm)
DEFAULT_MODEL_FIXTURES = {"model_path", "_session_llm"}


def pytest_collection_modifyitems(config, items):
    num_devices = torch.cuda.device_count()
    model_missing = functools.cache(default_model_missing)     # looked up once, if a GPU test needs it
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        reason = gpu_skip_reason(marker, num_devices, lambda: torch.cuda.get_device_capability(0))
        if reason is None and (item.get_closest_marker("default_model")
                               or DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))):
            reason = model_missing()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def assert_engine_clean(llm: LLM) -> None:
    """No request left anywhere and every KV block back in the free list."""
    eng = llm.engine
    sched = eng.scheduler
    assert not eng.has_unfinished_requests(), f"requests left: {list(eng.requests)}"
    assert not sched.running and not sched.waiting, (sched.running, list(sched.waiting))
    assert sched.allocator.num_free == sched.allocator.num_blocks, \
        f"{sched.allocator.num_blocks - sched.allocator.num_free} KV blocks leaked"
    snapshots = sched.state_snapshots       # (hybrid models' prefix cache: none held between steps)
    assert snapshots is None or snapshots.num_free == snapshots.num_blocks, "state snapshot slots leaked"


# -- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_path() -> Path:
    from pipespec.checkpoint.source import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def _session_llm():
    llm = LLM(model=None, **DEFAULT_LLM_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture
def llm(_session_llm):
    """The shared engine; each test must leave it without requests or used blocks."""
    assert_engine_clean(_session_llm)
    yield _session_llm
    assert_engine_clean(_session_llm)


@pytest.fixture(scope="session")
def tokenizer(_session_llm):
    return _session_llm.get_tokenizer()


@pytest.fixture(scope="session")
def hf_model(model_path, pytestconfig):
    """transformers' own reading of the same GGUF: the oracle for logits and greedy text.

    Reading the GGUF (de-quantizing every tensor) takes tens of seconds of CPU, and every xdist worker
    needs the oracle: the first to get here saves transformers' reading in pytest's cache folder (keyed
    by the file and the transformers version) and the others, and later runs, load that copy."""
    import transformers
    from filelock import FileLock
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    def read_gguf():
        return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                    dtype=torch.float32).eval()
    if getattr(pytestconfig, "cache", None) is None:          # -p no:cacheprovider
        return read_gguf()
    stat = model_path.stat()
    key = f"{model_path.stem}-{stat.st_size}-{int(stat.st_mtime)}-transformers-{transformers.__version__}"
    folder = pytestconfig.cache.mkdir("hf_oracle") / key
    with FileLock(str(folder) + ".lock", timeout=600):
        if not folder.exists():
            model = read_gguf()
            # (save_pretrained refuses a model read from a GGUF: its config and weights as they are)
            partial = folder.with_name(folder.name + ".partial")      # renamed when whole
            model.config.save_pretrained(partial)
            save_model(model, str(partial / "model.safetensors"))
            partial.rename(folder)
            return model
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    load_model(model, str(folder / "model.safetensors"))
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


# -- tiny random checkpoints ---------------------------------------------------------------------


def _tiny_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        # untied head; Llama-3 rope scaling whose band falls inside the head's wavelengths
        return LlamaConfig(**common, num_hidden_layers=3, max_position_embeddings=256,
                           tie_word_embeddings=False, rope_theta=10000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":
        # q/k/v bias, tied head
        return Qwen2Config(**common, num_hidden_layers=2, max_position_embeddings=256,
                           tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":
        # q/k norm, head_dim != hidden / heads, untied head
        return Qwen3Config(**common, num_hidden_layers=2, head_dim=32, max_position_embeddings=256,
                           tie_word_embeddings=False, rope_theta=1000000.0)
    raise KeyError(family)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that logits are O(1) and every tensor (norms and biases too) matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)


def write_tokenizer_files(folder: Path, tokenizer) -> None:
    tokenizer.save_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": tokenizer.chat_template}))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer):
    """{family: (folder, transformers model)} for llama, qwen2 and qwen3; llama is saved sharded."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for i, family in enumerate(TINY_FAMILIES):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(_tiny_config(family), dtype=torch.float32).eval()
        _randomize(model, seed=100 + i)
        folder = root / family
        model.save_pretrained(folder, max_shard_size="2MB" if family == "llama" else "1GB")
        write_tokenizer_files(folder, tokenizer)
        out[family] = (folder, model)
    assert (out["llama"][0] / "model.safetensors.index.json").exists()
    return out


@pytest.fixture(scope="session")
def tiny_llama_head(tiny_models, tmp_path_factory):
    """(folder, head file): the tiny llama and a random DeepSeek-style MTP head for it."""
    from pipespec.model.mtp import save_mtp
    from pipespec.checkpoint.source import resolve_model
    from tests.speculative.mtp_tiny import tiny_head
    folder = tiny_models["llama"][0]
    head = tmp_path_factory.mktemp("tiny_head") / "head.safetensors"
    save_mtp(head, tiny_head(resolve_model(str(folder)).arch, seed=5), "tiny-llama")
    return folder, head
