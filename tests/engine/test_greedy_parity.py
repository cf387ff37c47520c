"""Greedy text is token-for-token the text transformers' greedy decoding produces (SmolLM2, fp32)."""
from __future__ import annotations

from pipespec import SamplingParams
from tests.helpers import hf_greedy

NEW_TOKENS = 24          # (every answer still runs into a new KV block: 16 tokens a block)

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never left home. Every morning he wound the clocks on the walls of his shop, one after "
    "another, and listened to them tick. The village children liked to press their faces to the window "
    "and count the pendulums, and the baker brought him bread every Sunday in exchange for keeping the "
    "church bell on time. One day a stranger came to the door and asked",
]


def test_greedy_matches_transformers(llm, hf_model, tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "List three uses of copper."}], True)
    prompts = PROMPTS + [{"prompt_token_ids": tokenizer.encode(chat, add_special_tokens=False)}]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # the long prompt is longer than the step budget, so it is prefilled in chunks
    assert max(len(o.prompt_token_ids) for o in outs) > llm.engine.config.scheduler.max_num_batched_tokens
    for prompt, out in zip(prompts, outs):
        ids = out.prompt_token_ids
        if isinstance(prompt, str):
            assert ids == tokenizer.encode(prompt)
        comp = out.outputs[0]
        assert len(comp.token_ids) == NEW_TOKENS and comp.finish_reason == "length"
        assert comp.token_ids == hf_greedy(hf_model, ids, NEW_TOKENS), f"prompt {prompt!r}"
        assert comp.text == tokenizer.decode(comp.token_ids)
