"""n > 1 through the official `openai` client: n choices, seeded as n requests with seeds seed + i."""


def test_completions_n(client, model):
    kw = dict(model=model, prompt="My favourite colour is", max_tokens=8, temperature=1.0)
    r = client.completions.create(n=3, seed=21, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens > 8    # all three counted
    singles = [client.completions.create(seed=21 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    # two prompts, n = 2: index = prompt * n + sequence
    r2 = client.completions.create(model=model, prompt=["My favourite colour is", "Hello"], n=2, seed=21,
                                   max_tokens=8, temperature=1.0)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3] and r2.choices[1].text == singles[1]


def test_chat_n_whole_and_streamed(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "Name an animal."}], max_tokens=8,
              temperature=1.0, seed=3, n=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.role == "assistant" for c in r.choices)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]
