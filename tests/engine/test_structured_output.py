"""Structured output on the default model: outputs follow their JSON schema, regex, choices or grammar
and end when it is complete; the driver's masks through the drafts; greedy output with grammars equal
with and without MTP at PP = 1 and 2 (and under async scheduling); a grammar that does not compile is
refused by name."""
from __future__ import annotations

import dataclasses
import json
import re
import sys

import jsonschema
import pytest

from pipespec import LLM, SamplingParams, StructuredOutputsParams
from pipespec.engine.structured import GrammarCompiler, grammar_inputs
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.helpers import make_request
from tests.speculative.staggered import run_staggered

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                       "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["Paris", "London", "Berlin"]
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'


def _chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [_chat(tokenizer, t) for t in ("Describe a programmer as JSON.", "Give me a code like 123-abc.",
                                          "What is the capital of France?",
                                          'Return {"city": <the capital of France>} as JSON.',
                                          "How many legs do 3 spiders have?", "Describe a programmer as JSON.")]


def _params(max_tokens: int) -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=s)
            for s in (so(json=PERSON), so(regex=REGEX), so(choice=CHOICES), so(json_object=True), so(grammar=LARK))] + [
        SamplingParams(temperature=0, max_tokens=max_tokens)]          # one unconstrained beside them


def test_outputs_follow_their_grammars(llm, prompts):
    params = _params(60)
    params[-1] = dataclasses.replace(params[-1], max_tokens=8)     # (the free one need not run to 60)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    person, code, city, obj, answer, free = outs
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(REGEX, code.text), code.text
    assert city.text in CHOICES
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", answer.text), answer.text
    # each ended as its grammar completed, without waiting for an end token
    assert all(o.finish_reason == "stop" and o.stop_reason is None for o in outs[:5])
    assert free.token_ids                       # (an unconstrained request in the same steps)


def test_regex_with_a_sampled_request(llm, prompts):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX))
    outs = llm.generate([{"prompt_token_ids": prompts[1]}] * 3, [p, dataclasses.replace(p, seed=8), p], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert texts[0] == texts[2]                                   # seeded: the same draw


@pytest.mark.parametrize("spec, error", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     r"structured_outputs\.json: does not compile.*nonsense"),
    (StructuredOutputsParams(json="{not json"), r"structured_outputs\.json: "),
    (StructuredOutputsParams(regex="[a-"), r"structured_outputs\.regex: does not compile"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), r"structured_outputs\.grammar: does not compile"),
])
def test_a_grammar_that_does_not_compile_is_refused_by_name(llm, spec, error):
    with pytest.raises(ValueError, match=error):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert llm.generate("hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar or json_object"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: must be a list of non-empty strings"):
        StructuredOutputsParams(choice="abc")


def test_without_the_library_a_request_is_refused_naming_it(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "llguidance", None)          # what a missing package does to `import`
    with pytest.raises(ValueError, match=r"needs the llguidance library.*pip install 'pipespec\[structured\]'"):
        GrammarCompiler(tokenizer, 49152).compile(StructuredOutputsParams(regex="a+"))


def _allowed(masks, row: int, token: int) -> bool:
    return bool((int(masks[row, token // 32]) >> (token % 32)) & 1)


def test_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(tokenizer):
    """Row j's mask is the grammar's after the line's first j drafts; past a draft the grammar refuses
    every row allows everything (it is never used); the matcher ends where it began."""
    compiler = GrammarCompiler(tokenizer, 49152)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)           # noqa: E731
    digit, dash, letter = enc("1")[0], enc("-")[0], enc("x")[0]
    req = make_request("r", [1, 2], params=SamplingParams(temperature=0))
    req.grammar = compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"))
    plain = make_request("p", [1, 2], params=SamplingParams(temperature=0))
    assert req.grammar.advance(digit)                           # accepted so far: "1"
    # line 0 unconstrained; line 1 verifies drafts "1", "x" (refused), "1"
    fields = grammar_inputs([plain, req], [[5, 6, 7], [digit, letter, digit]], 4)
    assert fields["grammar_lines"].tolist() == [1]
    m = fields["grammar_masks"].numpy()
    assert m.shape == (4, 49152 // 32)
    assert _allowed(m, 0, digit) and not _allowed(m, 0, dash) and not _allowed(m, 0, letter)     # after "1"
    assert _allowed(m, 1, digit) and not _allowed(m, 1, dash)                                   # after "11"
    assert (m[2:] == -1).all()                                  # after the refused draft: never used
    # the matcher is still after "1": "1", "1", "-" complete the prefix
    assert all(req.grammar.advance(t) for t in (digit, digit, dash, letter)) and not req.grammar.complete


def test_a_grammar_met_again_is_copied_not_compiled_and_the_copies_are_independent(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)[0]     # noqa: E731
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.cache_hits == 0
    second = compiler.compile(StructuredOutputsParams(json=dict(reversed(schema.items()))))   # (same schema)
    assert compiler.cache_hits == 1 and second.matcher is not first.matcher
    assert first.advance(enc("{"))
    # the copy is still at the start: it takes "{" too, and the cached matcher stays fresh for a third
    assert second.advance(enc("{"))
    third = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.cache_hits == 2 and third.advance(enc("{"))
    compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
    assert compiler.cache_hits == 2                             # another grammar: compiled


MTP_TOKENS = 24          # (the choice, regex and grammar requests end before it, on their grammars)


@pytest.fixture(scope="module")
def reference(llm_module, prompts):
    return run_staggered(llm_module, prompts, _params(MTP_TOKENS))


@pytest.fixture(scope="module")
def llm_module(_session_llm):
    assert_engine_clean(_session_llm)
    yield _session_llm
    assert_engine_clean(_session_llm)


@pytest.mark.parametrize("pp,k,async_scheduling", [(1, 1, False), (1, 2, True), (1, 3, False), (2, 2, False)])
def test_greedy_with_grammars_lossless_under_mtp(pp, k, async_scheduling, prompts, reference):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    kwargs = dict(DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec)
    if async_scheduling:
        kwargs["async_scheduling"] = True
    with LLM(**kwargs) as llm:
        got = run_staggered(llm, prompts, _params(MTP_TOKENS))
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == reference
    spec_stats = stats["spec_decode"]
    assert 0 < spec_stats["num_accepted_tokens"] < spec_stats["num_draft_tokens"]    # accepted and rejected
    if async_scheduling:          # the unconstrained request still ran ahead
        assert stats["num_carried_rows"] > 0


@pytest.mark.gpu
def test_on_a_gpu_masks_through_cuda_graphs(prompts):
    """On a GPU (bf16, CUDA graphs): the outputs follow their grammars, and greedy output with the
    masks is the same with and without MTP (K = 2), drafts accepted."""
    outs = {}
    for k in (0, 2):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        with LLM(device="cuda", gpu_memory_utilization=0.1, speculative_config=spec) as llm:
            outs[k] = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                _params(60), use_tqdm=False)]
            assert llm.engine.executor.stage.graphs.replays > 0
            if k:
                assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    person, code, city, obj, answer, _ = outs[0]
    jsonschema.validate(json.loads(person), PERSON)
    assert re.fullmatch(REGEX, code) and city in CHOICES and isinstance(json.loads(obj), dict)
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", answer), answer
    assert outs[2] == outs[0]


def test_constrained_requests_share_steps_under_async_scheduling(tokenizer):
    """Eight constrained requests whose prefill the step budget splits: under async scheduling they
    run step for step with their results (their masks need the token in flight), and they share each
    step as without it, instead of alternating in two half batches (twice the steps); same output."""
    prompt = _chat(tokenizer, "Describe a programmer in a few words please.")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+)*"))
    runs = {}
    for async_scheduling in (False, True):
        with LLM(**dict(DEFAULT_LLM_KWARGS, async_scheduling=async_scheduling, enable_prefix_caching=False)) as llm:
            outs = llm.generate([{"prompt_token_ids": prompt}] * 8, params, use_tqdm=False)
            runs[async_scheduling] = ([o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_steps)
    assert 8 * len(prompt) > 2 * DEFAULT_LLM_KWARGS["max_num_batched_tokens"]      # the prefill is split
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] <= runs[False][1] + 1, runs
