"""Logprobs of generated tokens: the raw model log-softmax (transformers' on the same weights), the
sampled token's and the top N, whatever the sampling; equal with and without MTP at every PP size."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.helpers import hf_logits

PROMPTS = ["The three primary colors are", "def add(a, b):\n", "Paris is the capital of"]


def _check_against(logp: torch.Tensor, comp, n: int) -> None:
    """`comp`'s logprobs against log-softmax rows `logp` [len(tokens), V] of the same positions."""
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        top_lp, top_ids = logp[j].topk(n)
        want = {int(t): float(v) for t, v in zip(top_ids, top_lp)}
        want[token] = float(logp[j, token])
        assert set(entry) == set(want), (j, sorted(entry), sorted(want))
        for t, lp in entry.items():
            assert abs(lp.logprob - want[t]) < 1e-4, (j, t, lp.logprob, want[t])
        assert entry[token].rank == int((logp[j] > logp[j, token]).sum()) + 1
        assert [entry[int(t)].rank for t in top_ids] == list(range(1, n + 1))
        total += entry[token].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_transformers_log_softmax(llm, hf_model, tokenizer, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, logprobs=4, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        ids = out.prompt_token_ids + comp.token_ids
        # raw logits: no temperature, whatever the request samples with (vLLM's default)
        logp = hf_logits(hf_model, ids).log_softmax(-1)[len(out.prompt_token_ids) - 1:-1]
        _check_against(logp, comp, 4)
        assert all(e[t].decoded_token == tokenizer.decode([t], skip_special_tokens=False)
                   for t, e in zip(comp.token_ids, comp.logprobs))


def test_logprobs_per_request_and_zero(llm):
    """In one batch: no logprobs, the sampled token's only (0), and top 2: each gets its own."""
    ps = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=n) for n in (None, 0, 2)]
    outs = llm.generate(PROMPTS, ps, use_tqdm=False)
    assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None
    assert all(len(e) == 1 for e in outs[1].outputs[0].logprobs)
    assert all(2 <= len(e) <= 3 for e in outs[2].outputs[0].logprobs)
    # greedy: the sampled token is the top one
    assert all(e[t].rank == 1 for t, e in zip(outs[2].outputs[0].token_ids, outs[2].outputs[0].logprobs))


def test_logprobs_validated():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


def _spec_llm(pp: int, k: int) -> LLM:
    return LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp,
               speculative_config={"method": "mtp", "num_speculative_tokens": k})


def _generate(llm: LLM, params) -> list:
    before = llm.stats()["spec_decode"]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = llm.stats()["spec_decode"]
    assert_engine_clean(llm)
    accepted, drafted = (after[key] - before[key] for key in ("num_accepted_tokens", "num_draft_tokens"))
    assert 0 < accepted < drafted       # verify rows past the first were read, and rows past a rejection dropped
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def no_spec(_session_llm):
    # the shared engine: the settings of the speculative runs, without speculation
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    assert_engine_clean(_session_llm)
    outs = _session_llm.generate(PROMPTS, params, use_tqdm=False)
    assert_engine_clean(_session_llm)
    return params, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def mtp_k2():
    """PP = 1, K = 2: one engine for the two tests that run it (each leaves it clean)."""
    with _spec_llm(1, 2) as llm:
        yield llm


@pytest.mark.parametrize("pp,k", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 3)])
def test_logprobs_with_speculation_equal_plain_decoding(pp, k, no_spec, request):
    params, want = no_spec
    if (pp, k) == (1, 2):
        got = _generate(request.getfixturevalue("mtp_k2"), params)
    else:
        with _spec_llm(pp, k) as llm:
            got = _generate(llm, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert set(ea) == set(eb)
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 and ea[t].rank == eb[t].rank for t in ea)


LONG = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who had never left home. Every morning he wound the clocks on the walls of his shop, one after another, "
        "and listened to them tick.")


def _check_prompt_logprobs(out, hf_model, n: int) -> None:
    ids = out.prompt_token_ids
    logp = hf_logits(hf_model, ids).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry, row = out.prompt_logprobs[i], logp[i - 1]
        top_lp, top_ids = row.topk(n)
        assert set(entry) == set(top_ids.tolist()) | {ids[i]}
        assert abs(entry[ids[i]].logprob - float(row[ids[i]])) < 1e-4
        assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        assert all(abs(entry[int(t)].logprob - float(v)) < 1e-4 for t, v in zip(top_ids, top_lp))


def test_prompt_logprobs_equal_transformers_in_chunks_and_with_prefix_caching(hf_model):
    """A prompt longer than a step's chunk (several plans score its rows), beside another request;
    a second run whose prompt blocks are in the prefix cache still scores every prompt token."""
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=1)]
    with LLM(**DEFAULT_LLM_KWARGS, enable_prefix_caching=True) as llm:
        for _ in range(2):
            outs = llm.generate([LONG, PROMPTS[0]], params, use_tqdm=False)
            assert len(outs[0].prompt_token_ids) > llm.engine.config.scheduler.max_num_batched_tokens // 4
            _check_prompt_logprobs(outs[0], hf_model, 2)
            _check_prompt_logprobs(outs[1], hf_model, 0)
            assert outs[1].outputs[0].logprobs is not None
        cache = llm.stats()["prefix_cache"]
        assert_engine_clean(llm)
    assert cache["hits"] == 0            # prompts still to score are never taken from the cache
    plain = SamplingParams(temperature=0, max_tokens=3)
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=2,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        outs = llm.generate([LONG, PROMPTS[0]], [params[0], plain], use_tqdm=False)
    _check_prompt_logprobs(outs[0], hf_model, 2)
    assert outs[1].prompt_logprobs is None


def test_logprobs_of_deltas_a_stop_and_pickling(no_spec, mtp_k2):
    """Logprobs are kept packed and read into {id: Logprob} when an output is read: a DELTA stream's
    pieces join into the whole answer's; a stop token that ends a request in the middle of a step's
    accepted drafts leaves one entry per token kept; a pickled output holds a plain list."""
    import pickle
    from pipespec import RequestOutputKind
    params, want = no_spec
    stop = want[0].token_ids[5]          # a token the first answer samples (with drafts before and after it)
    llm, eng = mtp_k2, mtp_k2.engine
    assert_engine_clean(llm)
    eng.add_request("delta", PROMPTS[1], dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    eng.add_request("stop", PROMPTS[0], dataclasses.replace(params, stop_token_ids=[stop]))
    pieces, last = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
            if out.request_id == "delta":
                pieces.append(out.outputs[0])
    assert_engine_clean(llm)
    ids = [t for p in pieces for t in p.token_ids]
    entries = [e for p in pieces for e in p.logprobs]
    assert ids == want[1].token_ids and len(pieces) > 2
    assert len(entries) == len(ids)
    for a, b in zip(entries, want[1].logprobs):
        assert set(a) == set(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    assert pieces[-1].cumulative_logprob == pytest.approx(want[1].cumulative_logprob, abs=1e-4)
    stopped = last["stop"].outputs[0]
    cut = want[0].token_ids.index(stop) + 1
    assert stopped.finish_reason == "stop" and stopped.token_ids == want[0].token_ids[:cut]
    assert len(stopped.logprobs) == cut and stopped.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(stopped.token_ids, stopped.logprobs)), abs=1e-9)
    for t, a, b in zip(stopped.token_ids, stopped.logprobs, want[0].logprobs):
        assert set(a) == set(b) and abs(a[t].logprob - b[t].logprob) < 1e-4
    copy = pickle.loads(pickle.dumps(stopped))
    assert type(copy.logprobs) is list and copy.logprobs == stopped.logprobs
