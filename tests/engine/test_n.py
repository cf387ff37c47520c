"""n sequences per prompt: each draws as a request of its own with seed + i would, the same at every
PP size, and the later ones take the prompt's KV blocks from the first one instead of prefilling them."""
from __future__ import annotations

import pytest

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean

LONG = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who had never left home. Every morning he wound the clocks on the walls of his shop, one after another.")


def test_n_sequences_share_the_prompt_and_draw_as_derived_seeds(llm):
    eng = llm.engine
    assert llm.reset_prefix_cache()
    hits0 = eng.scheduler.prefix_cache_hits
    out = llm.generate([LONG, "Hi"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=1),
                       use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert out[0].request_id.startswith("gen-") and out[0].request_id.count("-") == 1
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in out[0].outputs)
    # the two later sequences of the long prompt took its full blocks from the first one's
    bs = eng.config.cache.block_size
    shared = (len(out[0].prompt_token_ids) - 1) // bs * bs
    assert shared > 0 and eng.scheduler.prefix_cache_hits - hits0 == 2 * shared
    assert llm.reset_prefix_cache()
    single = llm.generate([LONG] * 3, [SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8) for i in range(3)],
                          use_tqdm=False)
    assert [c.token_ids for c in out[0].outputs] == [o.outputs[0].token_ids for o in single]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


def test_n_same_at_pp2_with_mtp_and_bounded(llm):
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=10)
    want = [c.token_ids for c in llm.generate(LONG, params, use_tqdm=False)[0].outputs]
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=2,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as pp:
        got = [c.token_ids for c in pp.generate(LONG, params, use_tqdm=False)[0].outputs]
        assert_engine_clean(pp)
    assert got == want
    with pytest.raises(ValueError, match="n=17.*max_num_seqs=16"):
        llm.generate("hi", SamplingParams(n=17), use_tqdm=False)
