"""The server through the official `openai` client and raw HTTP: behaviour a user relies on."""
import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError, OpenAI

from pipespec import LLM, SamplingParams
from tests.live_server import metric

KEY = "sk-test"


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]


def test_completion_and_usage(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == 13
    assert r.choices[0].text.strip()


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=24, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and "4" in msg.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 20      # the chat template's system prompt is counted


def test_streaming_matches_non_streaming(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client, model):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                            max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string_cuts_the_text(client, model):
    kwargs = dict(model=model, prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=30, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    assert " 9," in free, free                 # the greedy continuation counts on
    r = client.completions.create(stop=[" 9,"], **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(" 9,")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[" 9,"], stream=True, **kwargs))
    assert streamed == r.choices[0].text      # held-back text never leaks a partial stop string


def test_seed_reproducible(client, model):
    kwargs = dict(model=model, prompt="My favourite colour is", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (8, 9, 10)}
    assert a == b
    assert len(others | {a}) > 1


def test_api_key_required(server):
    bad = OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200      # health stays open


def test_greedy_matches_offline_llm(client, model):
    prompt = "def fibonacci(n):"
    served = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    with LLM() as llm:
        offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
    assert served == offline


def test_concurrent_streams_with_aborts_free_every_block(server, model):
    async def one(i: int, client: AsyncOpenAI) -> int:
        stream = await client.completions.create(model=model, prompt=f"Story number {i}:", max_tokens=24,
                                                 temperature=0.7, seed=i, stream=True,
                                                 extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            n += 1
            if i % 4 == 0 and n == 3:           # every fourth client walks away mid-stream
                await stream.close()
                return -1
        return n

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0)
        return await asyncio.gather(*(one(i, client) for i in range(32)))

    results = asyncio.run(main())
    assert results.count(-1) == 8
    assert all(r > 3 for r in results if r != -1)
    usage = None
    for _ in range(100):                       # aborts reach the engine thread asynchronously
        text = httpx.get(f"{server.url}/metrics").text
        usage = metric(text, "pipespec:kv_cache_usage_perc")
        if usage == 0.0 and metric(text, "pipespec:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert usage == 0.0
    aborted = [line for line in text.splitlines()
               if line.startswith("pipespec:request_success_total{") and 'finished_reason="abort"' in line]
    assert aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 8
    assert metric(text, "pipespec:generation_tokens_total") > 0
    assert "pipespec:time_to_first_token_seconds_bucket" in text
    assert "pipespec:inter_token_latency_seconds_bucket" in text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_version(server):
    assert httpx.get(f"{server.url}/version").json()["version"]


# -- several prompts in one /v1/completions request (vLLM and OpenAI accept lists) -----------------


def _one(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw).choices[0].text


def test_list_of_prompts_gets_one_choice_per_prompt(client, model):
    prompts = ["The capital of France is", "1, 2, 3,", "Hello"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [_one(client, model, p) for p in prompts]
    assert all(c.finish_reason == "length" for c in r.choices)
    singles = [client.completions.create(model=model, prompt=p, max_tokens=1) for p in prompts]
    assert r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_token_id_prompts(client, model):
    from pipespec.checkpoint.source import resolve_model
    tok = resolve_model(None).tokenizer()
    a, b = tok.encode("The capital of France is"), tok.encode("Hello")
    single = client.completions.create(model=model, prompt=a, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    many = client.completions.create(model=model, prompt=[a, b], max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert single.choices[0].text == many.choices[0].text == _one(client, model, "The capital of France is")
    assert many.choices[1].text == _one(client, model, "Hello")
    assert many.usage.prompt_tokens == len(a) + len(b)


def test_list_of_prompts_streams_with_indexes(client, model):
    prompts = ["Once upon a time", "def add(a, b):"]
    chunks = list(client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts, finish = ["", ""], [None, None]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert finish == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 16


def test_bad_prompt_in_a_list_names_its_index(server):
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": ["fine", ""], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": [], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"], r.text
