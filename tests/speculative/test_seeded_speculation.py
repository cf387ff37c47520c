"""Seeded sampling does not depend on speculation: with the MTP head's deterministic drafts, each
verify row draws the token plain decoding draws at its position and a draft is accepted exactly when
it is that token, so seeded output is identical with and without MTP, at every K and PP size."""
from __future__ import annotations

import pytest

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.speculative.staggered import run_staggered

PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24),
          SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=24, presence_penalty=0.5),
          SamplingParams(temperature=0.6, min_p=0.05, seed=13, max_tokens=24, repetition_penalty=1.2),
          SamplingParams(temperature=0, max_tokens=24)]


@pytest.fixture(scope="module")
def plain(chat_prompts):
    with LLM(**DEFAULT_LLM_KWARGS) as llm:
        return run_staggered(llm, chat_prompts[:4], PARAMS)


@pytest.mark.parametrize("pp,k", [(1, 1), (1, 3), (2, 2)])
def test_seeded_output_identical_with_and_without_mtp(pp, k, chat_prompts, plain):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec) as llm:
        got = run_staggered(llm, chat_prompts[:4], PARAMS)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == plain
    assert stats["num_accepted_tokens"] > 0
