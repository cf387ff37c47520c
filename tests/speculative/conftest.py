"""Chat prompts, mixed stopping rules and their greedy reference without speculation, for the
speculative tests that must reproduce it: computed once a session (per xdist worker), not once a module."""
from __future__ import annotations

import pytest

from pipespec import LLM, SamplingParams
from tests.conftest import DEFAULT_LLM_KWARGS
from tests.speculative.staggered import CHATS, run_staggered


@pytest.fixture(scope="session")
def chat_prompts(tokenizer):
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]),
                             add_special_tokens=False) for c in CHATS]


@pytest.fixture(scope="session")
def mixed_params():
    # greedy; some finish mid-draft on max_tokens, one on a stop string, one runs on
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop)
            for n, stop in ((29, None), (5, None), (40, ["\n\n"]), (17, None), (7, None))]


@pytest.fixture(scope="session")
def reference(chat_prompts, mixed_params):
    with LLM(**DEFAULT_LLM_KWARGS) as llm:
        return run_staggered(llm, chat_prompts, mixed_params)
