"""Automatic prefix caching end to end on the default model: outputs (greedy and seeded sampling)
equal with the cache on and off, with MTP K = 0, 2, 3 at PP = 1, 2 and 3 and under async
scheduling, and the cache really hit; the MTP entry of a reused block made with the right next
token; a block shared by running requests surviving one of them being aborted or preempted; a workload larger than the cache staying correct;
stats, reset and the switch."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.speculative.staggered import run_staggered

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short paragraph, name the "
          "ingredients you use, and never suggest anything with nuts because the shop is nut free. ")
QUESTIONS = ["How do I make a sourdough starter?", "What goes into a good croissant?",
             "Why did my bread not rise?", "Suggest a cake for a birthday."]
FOLLOW_UP = " Thanks! And how long does that keep?"


def _spec(k: int) -> dict | None:
    return {"method": "mtp", "num_speculative_tokens": k} if k else None


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampling side by side."""
    # 8 tokens: each first turn (42-44 tokens) ends past its third block, as it did with 12
    return [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=8, ignore_eos=True)
            for i in range(len(QUESTIONS))]


@pytest.fixture(scope="module")
def first_turn(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]


def _two_turns(llm: LLM, first_turn, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Each conversation's first turn, then its second (first prompt + answer + a new line, all
    cached but the new line) staggered beside a repeat of the first prompt cut to a whole number of
    blocks (all of it cached: its last token must still be computed)."""
    first = run_staggered(llm, first_turn, _params())
    follow = tokenizer.encode(FOLLOW_UP)
    second_turn = [p + out + follow for p, out in zip(first_turn, first)]
    bs = DEFAULT_LLM_KWARGS["block_size"]
    whole = first_turn[0][:len(first_turn[0]) // bs * bs]
    second = run_staggered(llm, second_turn + [whole], _params() + [_params()[0]])
    return first, second


@pytest.fixture(scope="module")
def reference(first_turn, tokenizer):
    """Per K, the outputs with the cache off at PP = 1 (seeded sampling under speculation depends on K),
    each computed once a module."""
    done: dict[int, tuple] = {}

    def get(k: int):
        if k not in done:
            with LLM(**DEFAULT_LLM_KWARGS, enable_prefix_caching=False, speculative_config=_spec(k)) as llm:
                done[k] = _two_turns(llm, first_turn, tokenizer)
                assert "prefix_cache" not in llm.stats()
        return done[k]
    return get


@pytest.mark.parametrize("pp,k,overlap", [(1, 0, False), (2, 2, False), (3, 3, False), (1, 2, True)])
def test_outputs_equal_with_cache_on_and_off(pp, k, overlap, first_turn, tokenizer, reference):
    """`overlap`: async scheduling (a request continued before its step returns)."""
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=_spec(k),
             async_scheduling=overlap or None) as llm:
        got = _two_turns(llm, first_turn, tokenizer)
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == reference(k)
    cache = stats["prefix_cache"]
    # every second turn reuses its whole first turn (prompt and answer) but the tokens of the last block
    prompt_tokens = sum(len(p) for p in first_turn)
    assert cache["hits"] >= prompt_tokens, cache
    assert cache["queries"] > cache["hits"] > 0 and 0 < cache["hit_rate"] < 1
    assert cache["cached_blocks"] > 0
    if k:       # drafts both accepted and rejected (a rejected draft's KV sits in blocks the cache keeps)
        spec = stats["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    if overlap:
        assert stats["num_carried_rows"] > 0, "no step was scheduled ahead: async scheduling did not run"


def test_mtp_entry_of_a_reused_block_was_made_with_its_next_token(tokenizer):
    """Two prompts share two whole blocks and differ in the token after them. The MTP layer's KV at
    the shared part's last position depends on that token, so the second prompt must not reuse the
    first one's block there: its MTP entries equal those of a run without the cache."""
    bs = DEFAULT_LLM_KWARGS["block_size"]
    base = tokenizer.encode(SYSTEM * 2)[:2 * bs]
    a, b = base + tokenizer.encode(" apples and pears"), base + tokenizer.encode(" bread and butter")
    assert a[2 * bs] != b[2 * bs]
    params = SamplingParams(temperature=0, max_tokens=1)
    entries = {}
    for caching in (True, False):
        with LLM(**DEFAULT_LLM_KWARGS, enable_prefix_caching=caching, speculative_config=_spec(2)) as llm:
            eng = llm.engine
            llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)
            schedule, seen = eng.scheduler.schedule, {}

            def spy():                              # the blocks of b's first step
                batch = schedule()
                for r in batch.requests if batch else ():
                    seen.setdefault(r.request_id, list(r.block_ids[:2]))
                return batch
            eng.scheduler.schedule = spy
            llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)
            blocks = seen.popitem()[1]
            cache = eng.executor.stage.drafter.kv_caches[0].key      # [slots, heads, dim]
            entries[caching] = torch.cat([cache[blk * bs:(blk + 1) * bs].clone() for blk in blocks])
            hits = llm.stats()["prefix_cache"]["hits"] if caching else hits
    torch.testing.assert_close(entries[True], entries[False], rtol=1e-4, atol=1e-5)
    assert hits == bs, "the first block must be reused, the second (other next token) not"


def _shared_prefix_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(SYSTEM + SYSTEM + QUESTIONS[i % len(QUESTIONS)] + f" ({i})") for i in range(n)]


def test_a_shared_block_survives_one_sharer_being_aborted(llm, tokenizer):
    prompts = _shared_prefix_prompts(tokenizer, 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    eng = llm.engine
    reqs = [eng.add_request(f"share-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]
    eng.step()
    shared = set(reqs[0].block_ids) & set(reqs[1].block_ids) & set(reqs[2].block_ids)
    assert shared, "the requests should share their cached prefix"
    eng.abort_request("share-1")
    assert all(eng.scheduler.allocator.ref_count(b) >= 2 for b in shared)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"share-0": expected[0], "share-2": expected[2]}


@pytest.fixture(scope="module")
def tight_llm():
    """A KV cache that cannot hold the load: preemption, and cached blocks evicted."""
    with LLM(**dict(DEFAULT_LLM_KWARGS, num_kv_blocks=20, max_model_len=192, max_num_seqs=8)) as llm:
        yield llm


def test_preemption_with_shared_blocks_and_eviction_keep_outputs(llm, tight_llm, tokenizer):
    prompts = [{"prompt_token_ids": p} for p in _shared_prefix_prompts(tokenizer, 8)]
    # 8 prompts of 80-82 tokens sharing 4 blocks, 24 new tokens each: 4 + 8 * 3 blocks > 20
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sched = tight_llm.engine.scheduler
    before = sched.num_preemptions
    for _ in range(2):          # the second round finds what the first left cached, if it is still there
        tight = [o.outputs[0].token_ids for o in tight_llm.generate(prompts, params, use_tqdm=False)]
        assert tight == roomy
        assert_engine_clean(tight_llm)
    assert sched.num_preemptions > before, "the tiny cache never preempted: the test proves nothing"
    stats = tight_llm.stats()["prefix_cache"]
    assert stats["hits"] > 0 and stats["cached_blocks"] <= 20


def test_reset_prefix_cache(llm, tokenizer):
    prompt = {"prompt_token_ids": _shared_prefix_prompts(tokenizer, 1)[0]}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    hits = llm.stats()["prefix_cache"]["hits"]
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.stats()["prefix_cache"]["hits"] > hits
    req = llm.engine.add_request("busy", prompt, params)
    assert not llm.reset_prefix_cache(), "refused while a request runs"
    llm.engine.abort_request(req.request_id)
    assert llm.reset_prefix_cache()
    assert llm.stats()["prefix_cache"]["cached_blocks"] == 0
    hits = llm.stats()["prefix_cache"]["hits"]
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.stats()["prefix_cache"]["hits"] == hits, "a reset cache must not hit"


def test_switch_takes_only_true_or_false():
    # (hybrid models, on by default with state snapshots: tests/engine/test_prefix_caching_hybrid.py)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(**dict(DEFAULT_LLM_KWARGS, enable_prefix_caching="yes"))


def test_cli_and_serve_flags():
    from pipespec.cli import build_parser, engine_kwargs
    for command in (["generate", "hi"], ["serve"]):
        assert engine_kwargs(build_parser().parse_args(command))["enable_prefix_caching"] is True
        off = build_parser().parse_args([*command, "--no-enable-prefix-caching"])
        assert engine_kwargs(off)["enable_prefix_caching"] is False
