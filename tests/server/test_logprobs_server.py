"""Logprobs through the official `openai` client: completions' `logprobs: N` and chat's
`logprobs: true, top_logprobs: N`, whole and streamed, equal to the engine's own."""
import pytest

from pipespec import SamplingParams

PROMPT = "The capital of France is"


def test_completion_logprobs_equal_the_engines(client, model, _session_llm):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 8
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    want = _session_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
    for j, (token, entry) in enumerate(zip(want.token_ids, want.logprobs)):
        assert lp.tokens[j] == entry[token].decoded_token
        assert lp.token_logprobs[j] == pytest.approx(entry[token].logprob, abs=1e-4)
        top = sorted(entry.values(), key=lambda x: x.rank)[:3]
        assert list(lp.top_logprobs[j]) == [t.decoded_token for t in top]
        assert max(lp.top_logprobs[j].values()) == pytest.approx(lp.token_logprobs[j])    # greedy: the top one
    # streamed: the same logprobs, chunk by chunk
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs_whole_and_streamed(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
                  temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.token == item.top_logprobs[0].token and item.logprob == item.top_logprobs[0].logprob
        assert bytes(item.bytes).decode("utf-8") == item.token
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    # (the second request's prompt comes from the prefix cache: its logits may differ in the last bits)
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-4)
    # logprobs alone: the sampled token's, no alternatives; none asked: none given
    r = client.chat.completions.create(**dict(kwargs, top_logprobs=None))
    assert r.choices[0].logprobs.content and all(i.top_logprobs == [] for i in r.choices[0].logprobs.content)
    assert client.chat.completions.create(**dict(kwargs, logprobs=None, top_logprobs=None)).choices[0].logprobs is None


def test_sampled_logprobs_are_the_raw_models(client, model):
    """A sampled token's logprob is the model's log-softmax, not the temperature-scaled one."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, logprobs=1, seed=5)
    hot = client.completions.create(temperature=1.5, **kw).choices[0].logprobs
    cold = client.completions.create(temperature=0, **kw).choices[0].logprobs
    assert hot.tokens[0] in hot.top_logprobs[0] or hot.token_logprobs[0] < min(hot.top_logprobs[0].values())
    assert hot.top_logprobs[0] == pytest.approx(cold.top_logprobs[0], abs=1e-5)   # same position, same raw model


def test_prompt_logprobs_extension(client, model):
    """vLLM's `prompt_logprobs`: None for the first prompt token, then each one's, keyed by token id."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    r = client.completions.create(**kw).model_dump()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in e.values()) for e in plp[1:]), plp
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **kw)]
    firsts = [c["choices"][0].get("prompt_logprobs") for c in chunks if c["choices"]]
    assert firsts[0] is not None and [e and sorted(e) for e in firsts[0]] == [e and sorted(e) for e in plp]
    assert all(f is None for f in firsts[1:]), firsts[1:]
