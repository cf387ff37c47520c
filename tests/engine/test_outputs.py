"""What step() returns for each output_kind: cumulative outputs at every step (the default), deltas,
or only final outputs; and generate() returns whole answers whatever kind it is given."""
from __future__ import annotations

import pytest

from pipespec import RequestOutputKind, SamplingParams

PROMPTS = ["Count to five:", "Name three colours:", "Say hello in French:"]


def _run(eng, kind: RequestOutputKind, tag: str, **params) -> dict[str, list]:
    """{prompt index: outputs in order} of PROMPTS run together with max_tokens 3, 9, 6."""
    for i, (prompt, n) in enumerate(zip(PROMPTS, (3, 9, 6))):
        eng.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                             output_kind=kind, **params))
    seen: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id.rsplit("-", 1)[1]].append(out)
    return seen


def _final(outs) -> tuple[str, list[int], str]:
    c = outs[-1].outputs[0]
    return c.text, c.token_ids, c.finish_reason


def test_each_kind_gives_the_same_answers(llm):
    cumulative = _run(llm.engine, RequestOutputKind.CUMULATIVE, "cum")
    final = _run(llm.engine, RequestOutputKind.FINAL_ONLY, "fin")
    delta = _run(llm.engine, RequestOutputKind.DELTA, "del")
    for i, outs in cumulative.items():
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(outs) + 1)), \
            "a cumulative output is a snapshot: an earlier one does not grow"
        assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
        assert len(final[i]) == 1 and final[i][0].finished, "FINAL_ONLY: one output, when it finishes"
        assert _final(final[i]) == _final(outs)
        assert len(delta[i]) == len(outs) and delta[i][-1].finished
        text, ids, reason = _final(outs)
        assert "".join(o.outputs[0].text for o in delta[i]) == text
        assert [t for o in delta[i] for t in o.outputs[0].token_ids] == ids
        assert all(len(o.outputs[0].token_ids) == 1 for o in delta[i]), "a delta holds the new token only"
        assert delta[i][-1].outputs[0].finish_reason == reason


def test_deltas_never_send_text_a_stop_string_then_cuts(llm):
    """A stop string that spans two steps' text: the deltas hold back what could start it, so their
    concatenation is the cut text, never more."""
    eng = llm.engine
    ref = _run(eng, RequestOutputKind.CUMULATIVE, "ref")
    text = _final(ref["1"])[0]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert len(stop) == 4 and stop.strip(), text
    cumulative = _run(eng, RequestOutputKind.CUMULATIVE, "cut", stop=[stop])
    delta = _run(eng, RequestOutputKind.DELTA, "dcut", stop=[stop])
    cut = _final(cumulative["1"])
    assert cut[2] == "stop" and not cut[0].endswith(stop) and len(cut[0]) < len(text)
    sent = ""
    for out in delta["1"]:
        sent += out.outputs[0].text
        assert cut[0].startswith(sent), "a delta sent text that the stop string cut away"
    assert sent == cut[0] and delta["1"][-1].outputs[0].stop_reason == stop


def test_an_aborted_delta_request_gets_its_held_text(llm):
    eng = llm.engine
    stop = "a stop string this prompt never makes"          # holds back its length less one characters
    eng.add_request("held", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                       stop=[stop], output_kind=RequestOutputKind.DELTA))
    sent, ids = "", []
    while len(ids) < 6:
        for out in eng.step():
            sent += out.outputs[0].text
            ids += out.outputs[0].token_ids
    last = eng.abort_request("held")
    assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
    whole = eng.tokenizer.decode(ids)
    assert len(whole) - len(sent) == min(len(stop) - 1, len(whole)), "the held text is the stop's length - 1"
    assert sent + last.outputs[0].text == whole


def test_generate_returns_whole_answers_whatever_kind_it_is_given(llm):
    p = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate(PROMPTS[0], SamplingParams(**p, output_kind=kind), use_tqdm=False)[0].outputs[0]
            for kind in RequestOutputKind]
    assert len(outs[0].token_ids) == 8
    assert all((o.text, o.token_ids) == (outs[0].text, outs[0].token_ids) for o in outs)


def test_an_output_kind_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
