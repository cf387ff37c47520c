"""Drafting over a draft vocabulary: output unchanged at every pipeline size, drafts only from its
tokens (fewer accepted the fewer it holds), the head's rows taken from their owner, clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipespec import LLM
from pipespec.heads import bundled_head_path
from pipespec.speculative.draft_vocab import DRAFT_VOCAB_TENSOR, DraftVocab, read_draft_vocab
from pipespec.train.data import load_samples, most_frequent_tokens
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.speculative.staggered import run_staggered

CHECK_SET = Path(__file__).parents[1] / "train" / "data" / "smollm2_mtp_check.json"


def _bundled_head_with(folder: Path, vocab: torch.Tensor | None) -> Path:
    """The bundled head's weights and metadata with `vocab` as its draft vocabulary (None: none)."""
    with safe_open(str(bundled_head_path()), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors.pop(DRAFT_VOCAB_TENSOR, None)
    if vocab is not None:
        tensors[DRAFT_VOCAB_TENSOR] = vocab
    path = folder / ("head.safetensors" if vocab is not None else "no_vocab.safetensors")
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.fixture(scope="module")
def vocab_head(tmp_path_factory, tokenizer) -> Path:
    """The bundled head with a draft vocabulary: the tokens most frequent in the check set's answers."""
    vocab = most_frequent_tokens(load_samples(CHECK_SET), tokenizer.vocab_size, 2048)
    return _bundled_head_with(tmp_path_factory.mktemp("head"), vocab)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory) -> Path:
    """`pipespec draft-vocab` over a data cache whose training answers are the check set's."""
    import gzip
    import json
    import os
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("vocab")
    answers = json.loads(CHECK_SET.read_text())
    cache = {"chat": answers, "text": [], "heldout": []}
    (folder / "data.json.gz").write_bytes(gzip.compress(json.dumps(cache).encode()))
    out = folder / "vocab.safetensors"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run([sys.executable, "-m", "pipespec", "draft-vocab", "--data", str(folder / "data.json.gz"),
                           "--size", "2048", "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}: the 2048 tokens most frequent in 8 answers" in proc.stdout, proc.stdout
    with safe_open(str(out), framework="pt") as f:
        listed = f.get_tensor(DRAFT_VOCAB_TENSOR)
    assert torch.equal(listed, most_frequent_tokens(load_samples(CHECK_SET), 49152, 2048))
    return out


def test_the_bundled_head_carries_a_draft_vocabulary(tokenizer):
    ids = read_draft_vocab(bundled_head_path(), 16384, 49152)
    assert ids.numel() == 16384 and ids.unique().numel() == 16384 and 0 <= ids.min() <= ids.max() < 49152
    # the most frequent answer tokens: the chat template's own tokens and plain words are among them
    words = {tokenizer.decode([i]) for i in read_draft_vocab(bundled_head_path(), 200, 49152).tolist()}
    assert {" the", ".", ","} <= words, sorted(words)[:40]


def _spec(head: Path, size: int | None, k: int = 2) -> dict:
    """The head file's own draft vocabulary cut to `size` tokens (None: the whole vocabulary)."""
    spec = {"method": "mtp", "num_speculative_tokens": k, "model": str(head)}
    return spec | ({"draft_vocab": "full"} if size is None else {"draft_vocab_size": size})


def test_a_head_drafts_over_its_own_vocabulary_by_default_and_full_turns_it_off(chat_prompts, mixed_params,
                                                                                 reference):
    sizes = {}
    for extra in ({}, {"draft_vocab": "full"}):
        spec = {"method": "mtp", "num_speculative_tokens": 2, **extra}
        with LLM(**DEFAULT_LLM_KWARGS, speculative_config=spec) as llm:
            assert run_staggered(llm, chat_prompts, mixed_params) == reference
            vocab = llm.engine.executor.stage.drafter.draft_vocab
            sizes[bool(extra)] = None if vocab is None else vocab.ids.numel()
            assert llm.stats()["spec_decode"]["draft_acceptance_rate"] > 0.2
    assert sizes == {False: 16384, True: None}          # the bundled head's 16,384 of 49,152 tokens
    with pytest.raises(ValueError, match="draft_vocab 'full' drafts over the whole vocabulary"):
        LLM(speculative_config={"method": "mtp", "draft_vocab": "full", "draft_vocab_size": 8})


@pytest.mark.parametrize("pp", [1, 2])
def test_greedy_output_is_unchanged_and_drafts_are_still_accepted(pp, vocab_file, chat_prompts, mixed_params,
                                                                   reference):
    # PP = 1: the bundled head (no "model" given) and its own list; PP = 2: the check set's 2,048 tokens
    # in a file of their own beside the bundled head
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": 8192}
    if pp == 2:
        spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab": str(vocab_file)}
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec) as llm:
        got = run_staggered(llm, chat_prompts, mixed_params)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == reference
    assert stats["draft_acceptance_rate"] > 0.2, stats


def test_a_smaller_draft_vocabulary_drafts_only_its_tokens(vocab_head, chat_prompts, mixed_params, reference):
    rates = {}
    for size in (None, 4):
        with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(vocab_head, size)) as llm:
            assert run_staggered(llm, chat_prompts, mixed_params) == reference
            rates[size] = llm.stats()["spec_decode"]["draft_acceptance_rate"]
            if size:
                drafter = llm.engine.executor.stage.drafter
                assert drafter.draft_vocab.ids.tolist() == sorted(read_draft_vocab(vocab_head, 4, 49152).tolist())
    assert rates[4] < 0.5 * rates[None], rates         # 4 tokens: a draft is right only on those


def test_head_rows_come_from_the_owner_at_call_time():
    weight = torch.randn(10, 3)
    vocab = DraftVocab(torch.tensor([1, 4, 7]))
    rows = vocab.head_rows(weight)
    assert torch.equal(rows, weight[[1, 4, 7]]) and vocab.head_rows(weight) is rows       # kept while unchanged
    weight.mul_(2)                                                                        # written in place
    assert torch.equal(vocab.head_rows(weight), weight[[1, 4, 7]])
    other = torch.randn(10, 3)                                                            # another tensor
    assert torch.equal(vocab.head_rows(other), other[[1, 4, 7]])
    assert vocab.tokens(torch.tensor([2, 0])).tolist() == [7, 1]


def test_draft_vocabulary_errors_are_clear(vocab_head, tmp_path):
    with safe_open(str(vocab_head), framework="pt") as f:
        listed = f.get_tensor(DRAFT_VOCAB_TENSOR)
    assert read_draft_vocab(vocab_head, 3, 49152).tolist() == listed[:3].tolist()     # the most frequent 3
    bare = _bundled_head_with(tmp_path, None)
    with pytest.raises(ValueError, match="has none; write one with `pipespec train-mtp --draft-vocab N`"):
        read_draft_vocab(bare, 8, 49152)
    with pytest.raises(ValueError, match="draft_vocab_size is 4096, but .* holds 2048 tokens"):
        read_draft_vocab(vocab_head, 4096, 49152)
    for bad in (0, -3, True, "8", 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size must be a positive integer"):
            LLM(speculative_config=_spec(vocab_head, bad))
    with pytest.raises(ValueError, match="draft vocabulary file .*nowhere.safetensors: no such file"):
        LLM(**DEFAULT_LLM_KWARGS,
            speculative_config={"method": "mtp", "draft_vocab": str(tmp_path / "nowhere.safetensors")})
    with pytest.raises(ValueError, match="draft_vocab must be a file's path"):
        LLM(speculative_config={"method": "mtp", "draft_vocab": 7})
    with pytest.raises(ValueError, match="draft_vocab / draft_vocab_size need tensor_parallel_size 1"):
        LLM(tensor_parallel_size=2, speculative_config=_spec(vocab_head, 8))
    with pytest.raises(ValueError, match="no_vocab.safetensors has none; write one"):   # at engine start
        LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(bare, 8))
