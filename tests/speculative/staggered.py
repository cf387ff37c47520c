"""Requests arriving at different steps (continuous batching) on the default model: how the
speculative tests that must equal plain decoding run their requests."""
from __future__ import annotations

from pipespec import LLM, SamplingParams

CHATS = ["Write a short poem about the sea.", "Explain what a CPU does.", "List three fruits and their colours.",
         "How do I reverse a list in Python?", "Give me a tip for learning to cook."]


def run_staggered(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Requests arrive at different steps (continuous batching); returns each one's output ids."""
    eng = llm.engine
    done: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, params)))
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, (ids, p) = pending.pop(0)
            eng.add_request(f"r{i}", {"prompt_token_ids": ids}, p)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 5000
    return [done[f"r{i}"] for i in range(len(prompts))]

