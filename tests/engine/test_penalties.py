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
    plain_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # (with and without the penalty in one batch)
    outs = llm.generate(PROMPTS[:2] * 2, [params, params, plain_params, plain_params], use_tqdm=False)
    outs, plain = outs[:2], outs[2:]
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for out in outs:
        # teacher-forced: greedy decoding with the processor gives these tokens iff each is the argmax
        # after the ones before it, and one causal pass over the whole text has every prefix's logits
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        logits, n = hf_logits(hf_model, ids), len(out.prompt_token_ids)
        assert len(ids) == n + 20
        for j in range(n, len(ids)):
            scores = proc(torch.tensor([ids[:j]]), logits[j - 1:j].clone())
            assert int(scores.argmax()) == ids[j], (j - n, out.outputs[0].token_ids)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]   # it mattered


@torch.inference_mode()
def test_presence_and_frequency_equal_a_reference_processor(llm, hf_model):
    presence, frequency = 0.8, 0.6
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=presence, frequency_penalty=frequency,
                            ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        # teacher-forced, as above: one causal pass gives the logits after every prefix of the answer
        ids, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        logits = hf_logits(hf_model, ids + gen)[len(ids) - 1:-1]
        assert len(gen) == 16
        for j in range(16):
            scores = logits[j].clone()
            for t in set(gen[:j]):      # OpenAI's: generated tokens only
                scores[t] -= frequency * gen[:j].count(t) + presence
            assert int(scores.argmax()) == gen[j], (j, gen)


def test_logit_bias_min_tokens_and_bad_words(llm, tokenizer):
    eos = sorted(tokenizer.eos_token_ids)[0]
    words = ["cat", "happy"]
    # the three requests in one batch: each keeps its own rules
    params = [SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100.0}, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)]
    out, plain, banned = [o.outputs[0] for o in llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[1]], params,
                                                             use_tqdm=False)]
    # min_tokens: EOS is pushed to the top, yet not before the 5th token
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    # bad words: a word the plain output has never comes, as one token or several
    assert " cat" in plain.text
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


# the first and last are the same prompt, with and without a repetition penalty
MIXED = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.2, frequency_penalty=0.7),
         SamplingParams(temperature=0, max_tokens=20, bad_words=["the", "a"], min_tokens=14, logit_bias={13: 2.0}),
         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]


@pytest.fixture(scope="module")
def reference(_session_llm, chat_prompts):
    # the shared engine has the settings the speculative runs compare with, without speculation
    assert_engine_clean(_session_llm)
    ref = run_staggered(_session_llm, chat_prompts + chat_prompts[:1], MIXED)
    assert_engine_clean(_session_llm)
    return ref


@pytest.mark.parametrize("pp,k", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 3)])
def test_greedy_with_penalties_lossless_under_mtp(pp, k, chat_prompts, reference):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec) as llm:
        got = run_staggered(llm, chat_prompts + chat_prompts[:1], MIXED)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == reference
    assert reference[0] != reference[3]                 # the penalty changed the answer
    # drafts both accepted (rows past the first decide) and rejected
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
