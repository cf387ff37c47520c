"""Logits processing end to end: repetition penalty as transformers applies it, presence and frequency
penalties as a reference processor does, logit_bias, min_tokens and bad_words; greedy output equal
with and without MTP at every PP size (each verify row seeing its own context)."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.helpers import hf_logits, make_request
from tests.speculative.staggered import run_staggered

PROMPTS = ["Count: 1, 2, 3, 4, 5, 6,", "The cat sat on the mat. The cat", "Write a list of fruits:"]


@torch.inference_mode()
def test_repetition_penalty_equals_transformers(llm, hf_model):
    from transformers import RepetitionPenaltyLogitsProcessor
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for out in outs:
        ids = list(out.prompt_token_ids)
        for _ in range(20):
            scores = proc(torch.tensor([ids]), hf_logits(hf_model, ids)[-1:].clone())
            ids.append(int(scores.argmax()))
        assert out.outputs[0].token_ids == ids[len(out.prompt_token_ids):]
    plain = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]   # it mattered


@torch.inference_mode()
def test_presence_and_frequency_equal_a_reference_processor(llm, hf_model):
    presence, frequency = 0.8, 0.6
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=presence, frequency_penalty=frequency,
                            ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        ids, gen = list(out.prompt_token_ids), []
        for _ in range(16):
            scores = hf_logits(hf_model, ids + gen)[-1].clone()
            for t in set(gen):          # OpenAI's: generated tokens only
                scores[t] -= frequency * gen.count(t) + presence
            gen.append(int(scores.argmax()))
        assert out.outputs[0].token_ids == gen


def test_logit_bias_min_tokens_and_bad_words(llm, tokenizer):
    eos = sorted(tokenizer.eos_token_ids)[0]
    # min_tokens: EOS is pushed to the top, yet not before the 5th token
    p = SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    # bad words: a word the plain output has never comes, as one token or several
    plain = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    assert " cat" in plain
    words = ["cat", "happy"]
    banned = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words),
                          use_tqdm=False)[0].outputs[0]
    assert all(w not in banned.text for w in words), banned.text
    with pytest.raises(ValueError, match="logit_bias.*vocabulary"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_multi_token_bad_word_bans_its_last_token_per_row():
    """The driver bans a multi-token bad word's last token at exactly the rows whose context (the
    generated tokens, then the line's drafts before the row) ends with the rest of it."""
    from pipespec.engine.logits_inputs import logits_inputs
    req = make_request("r", [1, 2, 3], params=SamplingParams(temperature=0, bad_words=["x"]))
    req.set_bad_words(((7, 8, 9), (4,)))
    req.token_ids += [5, 7]                    # generated: 5, 7
    fields = logits_inputs([req], [[8, 7, 8]], 4)
    entries = fields["bias_entries"].tolist()
    assert [e for e in entries if e[1] == 9] == [[0, 9, 1, 2], [0, 9, 3, 4]]     # rows after "7 8"
    assert [0, 4, 0, 1 << 30] in entries and fields["bias_values"].isinf().all() and "penalties" not in fields


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    chats = ["Write a short poem about the sea.", "List three fruits and their colours.", "Explain what a CPU does."]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
            for c in chats]


MIXED = [SamplingParams(temperature=0, max_tokens=28, repetition_penalty=1.2, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=28, presence_penalty=1.2, frequency_penalty=0.7),
         SamplingParams(temperature=0, max_tokens=28, bad_words=["the", "a"], min_tokens=20, logit_bias={13: 2.0}),
         SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)]


@pytest.fixture(scope="module")
def reference(chat_prompts):
    with LLM(**DEFAULT_LLM_KWARGS) as llm:
        return run_staggered(llm, chat_prompts + chat_prompts[:1], MIXED)


@pytest.mark.parametrize("pp,k", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 3)])
def test_greedy_with_penalties_lossless_under_mtp(pp, k, chat_prompts, reference):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec) as llm:
        got = run_staggered(llm, chat_prompts + chat_prompts[:1], MIXED)
        accepted = llm.stats()["spec_decode"]["num_accepted_tokens"]
        assert_engine_clean(llm)
    assert got == reference
    assert accepted > 0
