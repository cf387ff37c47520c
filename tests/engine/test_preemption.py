"""A KV cache far too small for the load forces preemption by recompute; the outputs must not change."""
from __future__ import annotations

import pytest

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean

NEW_TOKENS = 24

TEXTS = [
    "The best way to learn a new language is",
    "Write a haiku about the sea.",
    "In computer science, a hash table is",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
    "The French Revolution began in 1789 when",
    "Photosynthesis converts sunlight into",
]


@pytest.fixture(scope="module")
def tiny_cache_llm():
    kwargs = dict(DEFAULT_LLM_KWARGS, num_kv_blocks=12, max_model_len=192, max_num_seqs=8)
    llm = LLM(model=None, **kwargs)
    yield llm
    llm.shutdown()


def params():
    # greedy and seeded sampling side by side; seeds make the sampled tokens reproducible
    return [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True) if i % 2 else
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99 + i, max_tokens=NEW_TOKENS,
                           ignore_eos=True)
            for i in range(len(TEXTS))]


def test_preemption_keeps_outputs(llm, tiny_cache_llm):
    sched = tiny_cache_llm.engine.scheduler
    assert sched.allocator.num_blocks == 12 and sched.block_size == 16
    need = sum(-(-(len(tiny_cache_llm.get_tokenizer().encode(t)) + NEW_TOKENS) // 16) for t in TEXTS)
    assert need > 12, "the load must not fit in the cache"
    before = sched.num_preemptions

    roomy = llm.generate(TEXTS, params(), use_tqdm=False)
    tight = tiny_cache_llm.generate(TEXTS, params(), use_tqdm=False)

    assert sched.num_preemptions > before, "the tiny cache never preempted: the test proves nothing"
    for text, a, b in zip(TEXTS, roomy, tight):
        assert b.outputs[0].finish_reason == "length" and len(b.outputs[0].token_ids) == NEW_TOKENS
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, text
        assert a.outputs[0].text == b.outputs[0].text
    assert_engine_clean(tiny_cache_llm)
