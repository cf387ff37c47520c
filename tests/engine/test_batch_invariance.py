"""A request's tokens do not depend on the batch it shares: alone, or among 8 prompts of mixed
lengths that arrive at different steps (so prefill chunks, decodes and arrivals interleave)."""
from __future__ import annotations

import pytest

from pipespec import SamplingParams

NEW_TOKENS = 8

_STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a "
          "logbook and a thermos of tea. From the gallery he could see the fishing boats returning, the "
          "gulls circling the harbour and, on clear nights, the lights of the town across the bay. ")

TEXTS = [
    "Hi",
    "Water boils at",
    "Here is a list of fruits: apple, banana,",
    "Question: What is the largest planet in the solar system?\nAnswer:",
    _STORY + "One night, the lamp",
    "import numpy as np\n\ndef softmax(x):\n",
    (_STORY * 2) + "He wrote in the logbook:",
    "1, 1, 2, 3, 5, 8, 13,",
]
ARRIVAL_STEPS = [0, 0, 1, 2, 3, 4, 6, 8]      # all within the first requests' 8 decodes


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def seeded(i: int, seed_base: int = 1234):
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed_base + i,
                          max_tokens=NEW_TOKENS, ignore_eos=True)


def run_staggered(llm, prompts, params) -> list[list[int]]:
    """Feed prompt i to the engine at step ARRIVAL_STEPS[i]; return each request's output ids."""
    eng = llm.engine
    done: dict[str, list[int]] = {}
    max_batch = 0
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(ARRIVAL_STEPS):
            if at == step:
                eng.add_request(f"stagger-{i}", prompts[i], params[i])
        for out in eng.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                done[out.request_id] = out.outputs[0].token_ids
        max_batch = max(max_batch, len(eng.scheduler.running))
        step += 1
        assert step < 500
    assert max_batch >= 6, f"requests barely overlapped (at most {max_batch} running at once)"
    return [done[f"stagger-{i}"] for i in range(len(prompts))]


def run_alone(llm, prompts, params) -> list[list[int]]:
    return [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    lengths = sorted(len(x) for x in ids)
    assert lengths[0] <= 2 and lengths[-1] > 100, lengths   # mixed lengths, one needs several chunks
    return [{"prompt_token_ids": x} for x in ids]


@pytest.fixture(scope="module")
def alone_greedy(_session_llm, prompts):
    return run_alone(_session_llm, prompts, [greedy()] * len(prompts))


@pytest.fixture(scope="module")
def alone_seeded(_session_llm, prompts):
    return run_alone(_session_llm, prompts, [seeded(i) for i in range(len(prompts))])


def test_greedy_is_batch_invariant(llm, prompts, alone_greedy):
    assert all(len(x) == NEW_TOKENS for x in alone_greedy)
    batched = run_staggered(llm, prompts, [greedy()] * len(prompts))
    for i, (a, b) in enumerate(zip(alone_greedy, batched)):
        assert a == b, f"prompt {i}: alone {a} != batched {b}"


def test_seeded_sampling_is_batch_invariant(llm, prompts, alone_seeded, alone_greedy):
    batched = run_staggered(llm, prompts, [seeded(i) for i in range(len(prompts))])
    for i, (a, b) in enumerate(zip(alone_seeded, batched)):
        assert a == b, f"prompt {i}: alone {a} != batched {b}"
    # it really sampled: the seeded text is not the greedy text
    assert sum(s != g for s, g in zip(alone_seeded, alone_greedy)) >= 4


def test_mixed_greedy_and_seeded_batch(llm, prompts, alone_greedy, alone_seeded):
    params = [greedy() if i % 2 else seeded(i) for i in range(len(prompts))]
    batched = run_staggered(llm, prompts, params)
    expected = [alone_greedy[i] if i % 2 else alone_seeded[i] for i in range(len(prompts))]
    assert batched == expected


def test_seed_changes_samples_and_is_reproducible(llm, prompts):
    p = prompts[3]
    first = llm.generate(p, seeded(0, seed_base=7), use_tqdm=False)[0].outputs[0].token_ids
    # the same seed again in a later call, beside three other seeds (one batch: outputs are batch invariant)
    outs = llm.generate([p] * 4, [seeded(0, seed_base=s) for s in (7, 8, 9, 10)], use_tqdm=False)
    again, *others = [o.outputs[0].token_ids for o in outs]
    assert first == again
    assert len({tuple(x) for x in others} | {tuple(first)}) >= 2, "different seeds should give different samples"
