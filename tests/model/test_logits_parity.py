"""The model's logits equal transformers' at every position, in float32 (docs/architecture.md, Testing).

SmolLM2 is read by both from the same GGUF; the tiny random Llama / Qwen2 / Qwen3 checkpoints are
written by transformers' save_pretrained and compared with the very model objects that wrote them.
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.helpers import engine_logits, hf_greedy, hf_logits

TOL = 1e-4

PARITY_TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
               "its crew numbered three.\nWhat happened next?")


@pytest.fixture(scope="module")
def parity_ids(tokenizer):
    ids = tokenizer.encode(PARITY_TEXT)
    assert 25 <= len(ids) <= 48, len(ids)
    return ids


def test_smollm2_logits_match_transformers(llm, hf_model, parity_ids):
    ours = engine_logits(llm, parity_ids)
    ref = hf_logits(hf_model, parity_ids)
    assert ours.shape == ref.shape == (len(parity_ids), llm.engine.arch.vocab_size)
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_chunked_prefill_logits_match_transformers(llm, hf_model, parity_ids):
    # 16-token chunks: the second and later plans attend to KV written by earlier plans
    ours = engine_logits(llm, parity_ids, chunk=16)
    ref = hf_logits(hf_model, parity_ids)
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max |logit diff| {diff:.2e}"


@pytest.fixture(scope="module")
def tiny_llms(tiny_models):
    llms = {family: LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128,
                        num_kv_blocks=16, max_num_batched_tokens=64)
            for family, (folder, _) in tiny_models.items()}
    yield llms
    for llm in llms.values():
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_logits_match_transformers(family, tiny_models, tiny_llms, parity_ids):
    _, hf = tiny_models[family]
    llm = tiny_llms[family]
    arch = llm.engine.arch
    assert arch.model_type == family
    assert arch.tie_word_embeddings == hf.config.tie_word_embeddings
    ref = hf_logits(hf, parity_ids)
    assert ref.abs().max() > 1.0, "random weights too small for a meaningful comparison"
    for chunk in (None, 13):
        ours = engine_logits(llm, parity_ids, chunk=chunk)
        diff = (ours - ref).abs().max().item()
        assert diff < TOL, f"{family} chunk={chunk}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_greedy_matches_transformers(family, tiny_models, tiny_llms, parity_ids):
    _, hf = tiny_models[family]
    llm = tiny_llms[family]
    prompt = parity_ids[:20]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


def test_tiny_llama_rope_scaling_is_read(tiny_llms):
    rs = tiny_llms["llama"].engine.arch.rope_scaling
    assert rs is not None and rs.kind == "llama3" and rs.factor == 8.0 and rs.original_max_position == 64
