"""What step() returns: every request's output as it grows, or (final_only) only the finished ones."""
from __future__ import annotations

from pipespec import SamplingParams


def _run(eng, final_only: bool) -> list:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 6)]
    for i, p in enumerate(params):
        eng.add_request(f"out-{final_only}-{i}", f"Count to {i + 5}:", p)
    seen = []
    while eng.has_unfinished_requests():
        seen += eng.step(final_only=final_only)
    return seen


def test_final_only_returns_each_request_once_when_it_finishes(llm):
    every = _run(llm.engine, final_only=False)
    final = _run(llm.engine, final_only=True)
    assert any(not o.finished for o in every), "without it, running requests report every step"
    assert all(o.finished for o in final) and len(final) == 3
    done = {o.request_id.split("-")[-1]: o for o in every if o.finished}
    for o in final:
        ref = done[o.request_id.split("-")[-1]]
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids and o.outputs[0].text == ref.outputs[0].text
        assert o.prompt_token_ids == ref.prompt_token_ids and o.outputs[0].finish_reason == "length"


def test_outputs_of_one_request_share_its_prompt_ids_but_not_its_output_ids(llm):
    eng = llm.engine
    eng.add_request("shared", "Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert len(outs) == 4 and all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4], "earlier outputs do not grow"
