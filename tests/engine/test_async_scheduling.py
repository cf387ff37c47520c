"""Async scheduling end to end on the default model: with two steps in flight and sampled tokens
carried on the stage, outputs equal the synchronous engine's (the shared `llm`, which on the CPU
schedules synchronously) for greedy and seeded requests, stops, length limits and aborts."""
from __future__ import annotations

import pytest

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean

PROMPTS = [
    "The best way to learn a new language is",
    "Write a haiku about the sea.",
    "In computer science, a hash table is",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
]


@pytest.fixture(scope="module")
def async_llm():
    llm = LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True))
    yield llm
    llm.shutdown()


GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(_session_llm):
    """Plain decoding of PROMPTS, 24 tokens each: the reference of the tests below, computed once."""
    return texts(_session_llm.generate(PROMPTS, GREEDY_24, use_tqdm=False))


SEEDED_17 = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=17, ignore_eos=True)
             for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain_seeded(_session_llm):
    """Seeded sampling of PROMPTS without speculation, computed once: seeded output does not depend on
    speculation (tests/speculative/test_seeded_speculation.py), so it is every speculative engine's too."""
    return texts(_session_llm.generate(PROMPTS, SEEDED_17, use_tqdm=False))


def params():
    return [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=0.0, max_tokens=24)]


def texts(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_async_engine_equals_the_sync_one_and_carries_tokens(llm, async_llm):
    assert async_llm.engine.executor.async_scheduling and not llm.engine.executor.async_scheduling
    want = texts(llm.generate(PROMPTS, params(), use_tqdm=False))
    got = texts(async_llm.generate(PROMPTS, params(), use_tqdm=False))
    assert got == want
    assert async_llm.engine.stats()["num_carried_rows"] > 0
    assert_engine_clean(async_llm)


def test_stops_end_where_the_sync_engine_ends(llm, async_llm, plain_greedy):
    ref_ids, ref_text, _ = plain_greedy[0]
    stop_id = ref_ids[6]
    stop_text = ref_text[len(ref_text) // 2:][:3]
    stops = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_text], ignore_eos=True)]
    assert_stops_end_alike(llm, async_llm, stops)
    assert_engine_clean(async_llm)


def assert_stops_end_alike(llm, engine_llm, stops: list[SamplingParams]) -> None:
    """PROMPTS[0] once per stopping rule, in one batch (each request stops on its own while the others
    run on): every one stops before its length limit, where the synchronous engine `llm` stops it."""
    want = [o.outputs[0] for o in llm.generate([PROMPTS[0]] * len(stops), stops, use_tqdm=False)]
    got = [o.outputs[0] for o in engine_llm.generate([PROMPTS[0]] * len(stops), stops, use_tqdm=False)]
    for sp, w, g in zip(stops, want, got):
        assert w.finish_reason == "stop" and len(w.token_ids) < sp.max_tokens, (sp, w)
        assert (g.token_ids, g.text, g.stop_reason) == (w.token_ids, w.text, w.stop_reason), sp


def abort_while_out(llm, engine_llm, at_step: int) -> None:
    """Three requests; a1 aborted after `at_step` engine steps, while the step ahead holding it is
    out: the other two end as in the synchronous engine `llm`."""
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = texts(llm.generate(PROMPTS[:3], sp, use_tqdm=False))
    eng = engine_llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"a{i}", p, sp)
    done = {}
    for step in range(200):
        if step == at_step:
            # between steps one is out: the step ahead, holding a1 already
            assert [r.request_id for r in eng._in_flight[0].requests] == ["a0", "a1", "a2"]
            eng.abort_request("a1")
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    assert sorted(done) == ["a0", "a2"]
    assert [texts([done["a0"]])[0], texts([done["a2"]])[0]] == [want[0], want[2]]


def test_an_abort_while_its_next_step_is_out_leaves_the_others_untouched(llm, async_llm):
    abort_while_out(llm, async_llm, 3)
    assert_engine_clean(async_llm)


def test_adaptive_k_overlaps_its_k0_steps_and_stays_lossless(llm):
    """A forced K sequence holding K = 2, then 0, then 1: greedy output equals plain decoding, drafts
    were verified, and K = 0 steps continued with carried tokens."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": True,
            "k_sequence": [2] * 3 + [0] * 5 + [1] * 3}
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = texts(llm.generate(PROMPTS[:2], sp, use_tqdm=False))
    with LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True, speculative_config=spec)) as spec_llm:
        assert spec_llm.engine.executor.async_scheduling
        assert texts(spec_llm.generate(PROMPTS[:2], sp, use_tqdm=False)) == want
        stats = spec_llm.engine.stats()
        assert stats["num_carried_rows"] > 0 and stats["spec_decode"]["num_drafts"] > 0, stats
        assert_engine_clean(spec_llm)


@pytest.mark.parametrize("k", [1, 3])
def test_fixed_k_speculation_continues_verify_steps_and_stays_lossless(llm, plain_greedy, plain_seeded, k):
    """Steps that verify drafts are continued too: the next line takes the token, the drafts and the
    shift from the result on the device. Greedy and seeded output equal the synchronous engine's
    without speculation (which the synchronous speculative engine's equals)."""
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True, speculative_config=spec)) as spec_llm:
        assert spec_llm.engine.executor.async_scheduling
        assert texts(spec_llm.generate(PROMPTS, GREEDY_24, use_tqdm=False)) == plain_greedy
        assert texts(spec_llm.generate(PROMPTS, SEEDED_17, use_tqdm=False)) == plain_seeded
        stats = spec_llm.engine.stats()
        assert stats["num_carried_rows"] > 0 and stats["spec_decode"]["num_accepted_tokens"] > 0, stats
        assert_engine_clean(spec_llm)


def test_with_drafts_stops_and_aborts_end_where_the_sync_engine_ends(llm, plain_greedy):
    """K = 3 with steps continued before the verify step ahead returns: a stop token (at three places,
    so a step may bring it among accepted drafts, with tokens after it) or a stop string ends the
    request where plain decoding does (the continued step's rows are dropped); an abort while its
    next step is out leaves the others untouched; nothing leaks."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    ref_ids, ref_text, _ = plain_greedy[0]
    stops = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref_ids[i]], ignore_eos=True)
             for i in (5, 9, 14)]
    stops.append(SamplingParams(temperature=0.0, max_tokens=24, stop=[ref_text[len(ref_text) // 2:][:3]],
                                ignore_eos=True))
    with LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True, speculative_config=spec)) as spec_llm:
        assert_stops_end_alike(llm, spec_llm, stops)
        abort_while_out(llm, spec_llm, 2)
        assert spec_llm.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert_engine_clean(spec_llm)


@pytest.fixture(scope="module")
def penalized(_session_llm, plain_greedy):
    """(params, synchronous output without speculation): PROMPTS with a penalty or a logit bias each,
    every setting changing the greedy output; the reference of both cases below, computed once."""
    ids = [t for t, _, _ in plain_greedy]
    sps = [SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=1.2, frequency_penalty=0.7, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=1.5, ignore_eos=True,
                          logit_bias={ids[2][1]: -100.0, ids[2][6]: 4.0}),
           SamplingParams(temperature=0.0, max_tokens=24, logit_bias={ids[3][4]: -100.0}, ignore_eos=True)]
    want = texts(_session_llm.generate(PROMPTS, sps, use_tqdm=False))
    assert all(w[0] != i for w, i in zip(want, ids))                  # each setting mattered
    return sps, want


@pytest.mark.parametrize("k", [0, 2])
def test_penalties_and_logit_bias_continue_and_stay_lossless(llm, async_llm, penalized, k):
    """Penalized and biased requests are continued too: the stage counts the tokens the step in flight
    sampled (and at K = 2 the drafts it accepted), which the plan's counts lack. Greedy output equals
    the synchronous engine's without speculation, every request carried rows, and each setting
    changed the output."""
    sps, want = penalized
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    engine_llm = async_llm if not k else LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True, **spec))
    try:
        before = engine_llm.engine.stats()["num_carried_rows"]
        for i, sp in enumerate(sps):          # one at a time: each request's own lines carried
            assert texts(engine_llm.generate(PROMPTS[i], sp, use_tqdm=False)) == want[i:i + 1]
            now = engine_llm.engine.stats()["num_carried_rows"]
            assert now > before, (i, sp)
            before = now
        assert texts(engine_llm.generate(PROMPTS, sps, use_tqdm=False)) == want      # batched
        if k:
            assert engine_llm.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert_engine_clean(engine_llm)
    finally:
        if k:
            engine_llm.shutdown()


def test_async_scheduling_with_a_pipeline_is_refused_by_name():
    with pytest.raises(ValueError, match="one stage"):
        LLM(model=None, **dict(DEFAULT_LLM_KWARGS, async_scheduling=True, pipeline_parallel_size=2))
