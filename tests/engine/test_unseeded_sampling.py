"""Requests without a seed draw fresh randomness in every engine (so every run), unless the engine
itself is given a seed; requests with a seed draw the same tokens in any engine."""
from __future__ import annotations

from pipespec import LLM, SamplingParams

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16, max_num_seqs=4,
              max_num_batched_tokens=64)
PROMPT = "Once upon a time"


def run_engine(engine_seed: int | None) -> tuple[list[int], list[int]]:
    """(unseeded request's tokens, seeded request's tokens) from a fresh engine."""
    sample = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    with LLM(model=None, seed=engine_seed, **KWARGS) as llm:
        outs = llm.generate([PROMPT, PROMPT], [SamplingParams(**sample), SamplingParams(seed=7, **sample)],
                            use_tqdm=False)
    return outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids


def test_unseeded_requests_differ_between_engines_seeded_ones_do_not():
    unseeded_a, seeded_a = run_engine(None)
    unseeded_b, seeded_b = run_engine(None)
    # 24 tokens at temperature 1: equal by chance with negligible probability
    assert unseeded_a != unseeded_b
    assert seeded_a == seeded_b


def test_an_engine_seed_makes_unseeded_requests_repeat():
    assert run_engine(1234) == run_engine(1234)
