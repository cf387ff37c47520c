"""Bad input raises ValueError naming the field, schedules nothing, and leaves the engine usable.

The `llm` fixture checks after every test that no request is left and no KV block is in use.
"""
from __future__ import annotations

import pytest

from pipespec import SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=2)


def _long_prompt(llm):
    return {"prompt_token_ids": [100] * llm.engine.max_model_len}


GENERATE_CASES = {
    "empty prompt": (lambda llm: llm.generate("", OK), "prompt is empty"),
    "empty prompt in a batch": (lambda llm: llm.generate(["fine", ""], OK), "prompt 1"),
    "empty token ids": (lambda llm: llm.generate({"prompt_token_ids": []}, OK), "prompt_token_ids"),
    "prompt too long": (lambda llm: llm.generate(_long_prompt(llm), OK), "max_model_len"),
    "text prompt too long": (lambda llm: llm.generate("hello " * 600, OK), "max_model_len"),
    "token id >= vocab": (lambda llm: llm.generate({"prompt_token_ids": [1, llm.engine.arch.vocab_size]}, OK),
                          "prompt_token_ids[1]"),
    "negative token id": (lambda llm: llm.generate({"prompt_token_ids": [-1, 5]}, OK), "prompt_token_ids[0]"),
    "string token id": (lambda llm: llm.generate({"prompt_token_ids": [5, "6"]}, OK), "prompt_token_ids[1]"),
    "bool token id": (lambda llm: llm.generate({"prompt_token_ids": [True]}, OK), "prompt_token_ids[0]"),
    "token ids not a list": (lambda llm: llm.generate({"prompt_token_ids": "1 2 3"}, OK), "prompt_token_ids"),
    "prompt is an int": (lambda llm: llm.generate(5, OK), "prompts"),
    "prompt in list is an int": (lambda llm: llm.generate([5], OK), "prompt must be a string"),
    "unknown prompt key": (lambda llm: llm.generate({"text": "hi"}, OK), "'prompt'"),
    "two prompt keys": (lambda llm: llm.generate({"prompt": "hi", "prompt_token_ids": [1]}, OK), "prompt_token_ids"),
    "params not SamplingParams": (lambda llm: llm.generate("hi", {"max_tokens": 3}), "sampling_params"),
    "params list wrong length": (lambda llm: llm.generate(["a", "b"], [OK]), "sampling_params"),
    "chat: missing content": (lambda llm: llm.chat([{"role": "user"}], OK), "content"),
    "chat: role not a string": (lambda llm: llm.chat([{"role": 1, "content": "hi"}], OK), "role"),
    "chat: no messages": (lambda llm: llm.chat([], OK), "messages"),
    "chat: not a list": (lambda llm: llm.chat("hello", OK), "messages"),
    "chat: message not a dict": (lambda llm: llm.chat([["user", "hi"]], OK), "message 0"),
    "chat: second conversation bad": (
        lambda llm: llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}]], OK),
        "conversation 1"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_bad_request_raises_value_error_naming_field(llm, case):
    call, field = GENERATE_CASES[case]
    arrivals_before = len(llm.engine.requests)
    with pytest.raises(ValueError) as info:
        call(llm)
    assert field in str(info.value), f"{case}: {info.value}"
    assert len(llm.engine.requests) == arrivals_before == 0


PARAM_CASES = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens="3"), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(n=1.5), "n"),
    (dict(n=0), "n"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=["2"]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=1), "skip_special_tokens"),
]


@pytest.mark.parametrize("kwargs,field", PARAM_CASES, ids=[f"{k}" for k, _ in PARAM_CASES])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_engine_usable_after_bad_input(llm, tokenizer):
    for call, _ in GENERATE_CASES.values():
        with pytest.raises(ValueError):
            call(llm)
    # and an abort of something unknown is harmless
    assert llm.engine.abort_request("no-such-request") is None
    outs = llm.generate(["The sky is", {"prompt_token_ids": tokenizer.encode("Two plus two is")}],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_prompt_of_max_model_len_minus_one_gets_one_token(llm):
    prompt = {"prompt_token_ids": [100] * (llm.engine.max_model_len - 1)}
    # max_tokens=None: up to max_model_len, which leaves room for one token
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)


def test_duplicate_request_id_rejected(llm):
    eng = llm.engine
    eng.add_request("dup", "Hello", OK)
    try:
        with pytest.raises(ValueError, match="dup"):
            eng.add_request("dup", "Hello again", OK)
    finally:
        aborted = eng.abort_request("dup")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"


def test_bad_engine_arguments():
    from pipespec import LLM
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float64")


def test_without_chunked_prefill_the_budget_must_cover_max_model_len():
    """Without chunked prefill, a prompt longer than the step budget could never be scheduled:
    generate() used to spin forever. The engine now refuses such a configuration up front."""
    from pipespec import LLM
    common = dict(dtype="float32", device="cpu", num_kv_blocks=8, max_model_len=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(max_num_batched_tokens=16, **common)
    with LLM(max_num_batched_tokens=64, **common) as llm:
        out = llm.generate({"prompt_token_ids": list(range(100, 140))},
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
