"""`echo` and `best_of` on /v1/completions through the official `openai` client: the echoed prompt
(with prompt logprobs, the first one null, as vLLM gives them) and the n most likely of best_of
sequences, ranked by cumulative logprob; SamplingParams.best_of in the engine too."""
import openai
import pytest

from pipespec import SamplingParams

PROMPT = "The capital of France is"
GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


def test_echo_text_is_the_prompt_then_the_completion(client, model, _session_llm):
    plain = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, **GREEDY)
    assert plain and r.choices[0].text == PROMPT + plain
    assert r.usage.completion_tokens == 8          # the prompt is not counted as generated
    # a prompt of token ids echoes as its text; several prompts each echo their own
    ids = _session_llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    assert client.completions.create(model=model, prompt=ids, echo=True, **GREEDY).choices[0].text == PROMPT + plain
    both = client.completions.create(model=model, prompt=[PROMPT, "Hello"], echo=True, **GREEDY).choices
    assert both[0].text == PROMPT + plain and both[1].text.startswith("Hello") and len(both[1].text) > 5


def test_echo_with_logprobs_covers_prompt_and_completion(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, **GREEDY)
    c, usage = r.choices[0], r.usage
    lp = c.logprobs
    total = usage.prompt_tokens + usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == total
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(total)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None      # nothing precedes the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert "prompt_logprobs" not in c.model_dump() or c.model_dump()["prompt_logprobs"] is None   # not asked
    # the prompt's logprobs are vLLM's prompt_logprobs; the completion's those of a request without echo
    n = usage.prompt_tokens
    plp = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]["prompt_logprobs"]
    ids = [next(t for t, v in e.items() if v["decoded_token"] == tok) for e, tok in zip(plp[1:], lp.tokens[1:n])]
    assert lp.token_logprobs[1:n] == pytest.approx([e[t]["logprob"] for e, t in zip(plp[1:], ids)], abs=1e-4)
    plain = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert lp.tokens[n:] == plain.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs, abs=1e-4)


def test_echo_streamed_puts_the_prompt_in_the_first_chunk(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, **GREEDY).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1,
                                                              stream=True, **GREEDY) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == whole.logprobs.tokens
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == whole.logprobs.text_offset


def _cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_returns_the_most_likely_of_the_sequences(client, model):
    # a seed whose first sequence is not the most likely, so that taking the first would fail
    for seed in range(11, 31):
        kw = dict(model=model, prompt="My favourite animal is", max_tokens=6, temperature=1.0, seed=seed)
        all3 = client.completions.create(n=3, logprobs=0, **kw).choices
        ranked = sorted(all3, key=_cumulative, reverse=True)
        if ranked[0].text != all3[0].text:
            break
    assert ranked[0].text != all3[0].text, "no seed in 11..30 drew a first sequence below the best"
    best = client.completions.create(best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].text == ranked[0].text
    assert best.choices[0].logprobs is None          # ranked by logprobs nobody asked to see
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in all3)   # all three were run
    two = client.completions.create(best_of=3, n=2, logprobs=1, **kw).choices
    assert [c.index for c in two] == [0, 1] and [c.text for c in two] == [c.text for c in ranked[:2]]
    assert _cumulative(two[0]) >= _cumulative(two[1])


def test_best_of_in_the_engine(_session_llm):
    kw = dict(max_tokens=6, temperature=1.0, seed=11)
    all3 = _session_llm.generate(PROMPT, SamplingParams(n=3, logprobs=0, **kw), use_tqdm=False)[0].outputs
    best = _session_llm.generate(PROMPT, SamplingParams(best_of=3, **kw), use_tqdm=False)[0].outputs
    top = max(all3, key=lambda c: c.cumulative_logprob)
    assert len(best) == 1 and best[0].text == top.text and best[0].logprobs is None
    assert best[0].cumulative_logprob == pytest.approx(top.cumulative_logprob, abs=1e-4)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


@pytest.mark.parametrize("extra, message", [
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=2, stream=True), "stream"),
    (dict(best_of=1000), "max_num_seqs"),
    (dict(suffix="end"), "suffix"),
])
def test_bad_best_of_and_suffix_are_named(client, model, extra, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, **extra)
    body = e.value.body
    assert message in body["message"] and body["param"] == ("suffix" if "suffix" in extra else "best_of")
