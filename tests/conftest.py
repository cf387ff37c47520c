"""Shared fixtures: the default model loaded once per session, the transformers oracle, tiny random
checkpoints of each supported family, and a guard that every engine test leaves the engine clean.

Everything runs on CPU in float32.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pipespec import LLM

# Engine settings of the shared default-model engine. A small step budget makes long prompts go
# through chunked prefill, mixed with other requests' decodes.
DEFAULT_LLM_KWARGS = dict(dtype="float32", device="cpu", max_model_len=512, block_size=16,
                          num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)

TINY_FAMILIES = ("llama", "qwen2", "qwen3")


def pytest_configure(config):
    # One intra-op thread by default: on a small shared machine two OpenMP threads stall whenever the
    # other core is busy (a long prefill then takes 5-10x longer); PIPESPEC_TEST_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("PIPESPEC_TEST_THREADS", "1")))
    torch.manual_seed(0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def assert_engine_clean(llm: LLM) -> None:
    """No request left anywhere and every KV block back in the free list."""
    eng = llm.engine
    sched = eng.scheduler
    assert not eng.has_unfinished_requests(), f"requests left: {list(eng.requests)}"
    assert not sched.running and not sched.waiting, (sched.running, list(sched.waiting))
    assert sched.allocator.num_free == sched.allocator.num_blocks, \
        f"{sched.allocator.num_blocks - sched.allocator.num_free} KV blocks leaked"


# -- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_path() -> Path:
    from pipespec.model.source import default_model_path
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
def hf_model(model_path):
    """transformers' own reading of the same GGUF: the oracle for logits and greedy text."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                 dtype=torch.float32)
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
    from pipespec.model.source import resolve_model
    from tests.speculative.mtp_tiny import tiny_head
    folder = tiny_models["llama"][0]
    head = tmp_path_factory.mktemp("tiny_head") / "head.safetensors"
    save_mtp(head, tiny_head(resolve_model(str(folder)).arch, seed=5), "tiny-llama")
    return folder, head
