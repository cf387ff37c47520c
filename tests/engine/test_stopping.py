"""Stop strings, stop token ids, EOS, max_tokens, and the streamed text (incremental detokenizer)."""
from __future__ import annotations

import pytest

from pipespec import SamplingParams
from pipespec.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Here is a short story about a cat named Tom. Tom"
N = 16


def gen(llm, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", N)
    return llm.generate(prompt, SamplingParams(temperature=0.0, **kw), use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def reference(_session_llm):
    """The unconstrained greedy continuation the stop tests cut."""
    out = gen(_session_llm, ignore_eos=True)
    assert len(out.token_ids) == N and out.finish_reason == "length"
    return out


def _stop_string(text: str) -> str:
    """A 4-character stop string whose first match starts well inside the text (never in the first word)."""
    for start in range(len(text) // 3, len(text) - 4):
        cand = text[start:start + 4]
        if cand.strip() == cand and cand.isprintable() and text.find(cand) >= 8:
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


def test_max_tokens_gives_length(llm, reference):
    for n in (1, 5):
        out = gen(llm, max_tokens=n, ignore_eos=True)
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == reference.token_ids[:n]


def test_stop_string_cuts_text(llm, tokenizer, reference):
    stop = _stop_string(reference.text)
    at = reference.text.find(stop)
    out = gen(llm, stop=stop, ignore_eos=True)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == reference.text[:at]
    # generation ended on the token that completed the stop string
    n = len(out.token_ids)
    assert out.token_ids == reference.token_ids[:n] and n < N
    assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(out.token_ids[:-1])


def test_stop_string_included_on_request(llm, reference):
    stop = _stop_string(reference.text)
    at = reference.text.find(stop)
    out = gen(llm, stop=["#never-appears#", stop], include_stop_str_in_output=True, ignore_eos=True)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == reference.text[:at + len(stop)]


def test_stop_token_id(llm, reference):
    idx = 6
    stop_id = reference.token_ids[idx]
    first = reference.token_ids.index(stop_id)
    out = gen(llm, stop_token_ids=[stop_id], ignore_eos=True)
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == reference.token_ids[:first + 1]


def test_eos_stops_unless_ignored(llm, tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], True)
    prompt = {"prompt_token_ids": tokenizer.encode(chat, add_special_tokens=False)}
    out = gen(llm, prompt, max_tokens=48)
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in tokenizer.eos_token_ids
    assert tokenizer.eos_token not in out.text         # special tokens are skipped in the text
    assert out.text == tokenizer.decode(out.token_ids)
    longer = len(out.token_ids) + 3
    ignored = gen(llm, prompt, max_tokens=longer, ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == longer
    assert ignored.token_ids[:len(out.token_ids)] == out.token_ids


def test_streamed_deltas_concatenate_to_decode(llm, tokenizer):
    eng = llm.engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    eng.add_request("stream", "Write a sentence with an emoji and some Chinese: ", params)
    texts, last = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts.append(out.outputs[0].text)
            last = out
    assert last.finished and len(last.outputs[0].token_ids) == 24
    deltas, prev = [], ""
    for t in texts:
        assert t.startswith(prev), "the text only ever grows"
        deltas.append(t[len(prev):])
        prev = t
    assert "".join(deltas) == tokenizer.decode(last.outputs[0].token_ids)
    assert all("\ufffd" not in d for d in deltas)


UNICODE_TEXTS = ["naïve café – déjà vu", "日本語のテキストです。", "rocket 🚀 party 🎉🎊 done", "tab\tnew\nline  ",
                 "Ünïcödé ✓ ∑ αβγ 👩‍👩‍👧"]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_incremental_detokenizer_is_exact(tokenizer, text):
    prompt = tokenizer.encode("Translate:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas), "a partial UTF-8 character leaked out"
    if any("\ufffd" in tokenizer.decode([t]) for t in ids):
        assert "" in deltas, "a token ending inside a character must hold its text back"


def test_some_characters_span_several_tokens(tokenizer):
    # so the hold-back path above is really exercised
    ids = tokenizer.encode(UNICODE_TEXTS[2])
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        text = "".join(detok.add(t) for t in ids)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in text) != skip


def test_find_stop_across_deltas(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    found = None
    for t in tokenizer.encode("alpha beta gamma delta"):
        delta = detok.add(t)
        if delta:
            found = detok.find_stop(("ta ga",), len(delta), include=False)
            if found:
                break
    assert found == "ta ga" and detok.text == "alpha be"


def test_bytes_that_never_make_a_character_are_given_out_and_decoding_goes_on(tokenizer):
    """A model repeating a lone byte token (a dummy model does) makes no character: its text comes
    out as replacement characters every few tokens instead of being held (and re-decoded) forever."""
    byte = next(t for t in range(256, 1024) if tokenizer.decode([t]) == "\ufffd")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), skip_special_tokens=True)
    deltas = [detok.add(byte) for _ in range(100)]
    assert sum(map(len, deltas)) >= 90 and set(detok.text) == {"\ufffd"}, "bytes held back without end"
    assert max(len(d) for d in deltas) <= 8 and deltas.count("") >= 80
    words = tokenizer.encode(" and then plain words")
    assert "".join(detok.add(t) for t in words).endswith("and then plain words")
