"""Penalties, logit_bias, min_tokens and bad_words through the official `openai` client."""
import pytest
from openai import BadRequestError

from pipespec import SamplingParams

PROMPT = "The cat sat on the mat. The cat"


def test_penalties_equal_the_engines(client, model, _session_llm):
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.2}, **kw)
    want = _session_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        repetition_penalty=1.2, **kw), use_tqdm=False)[0]
    assert r.choices[0].text == want.outputs[0].text
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text != r.choices[0].text


def test_logit_bias_min_tokens_bad_words(client, model, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                                       temperature=0, logit_bias={str(token): 100})
    assert r.choices[0].message.content == tokenizer.decode([token] * 4)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"bad_words": ["cat"], "min_tokens": 20})
    assert "cat" not in r.choices[0].text and r.usage.completion_tokens == 20
    with pytest.raises(BadRequestError, match="vocabulary"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"10000000": 1})
