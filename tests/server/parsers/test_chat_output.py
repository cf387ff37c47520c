import json

import pytest

from pipespec.server.parsers.chat_output import ChatOutputParser, assemble
from pipespec.server.parsers.reasoning import reasoning_format
from pipespec.server.parsers.tool_calls import tool_call_format
from tests.server.parsers.conftest import splits
from tests.server.parsers.test_tool_calls import SAMPLES, TOOLS

QWEN_ANSWER = ("I need the weather first.\n</think>\n\n" + SAMPLES["qwen3_coder"])


def parser(reasoning="qwen3", tools="qwen3_coder", prompt="<|im_start|>assistant\n<think>\n", **kw):
    return ChatOutputParser(reasoning_format(reasoning) if reasoning else None,
                            tool_call_format(tools) if tools else None, prompt, TOOLS, **kw)


def without_ids(msg):
    for call in msg.get("tool_calls", ()):
        assert call["id"].startswith("call_")
        call["id"] = None
    return msg


def test_message_has_reasoning_content_and_calls():
    msg, finish = parser().message(QWEN_ANSWER, "stop")
    assert finish == "tool_calls"
    assert msg["reasoning_content"] == "I need the weather first."
    assert msg["content"] == "Let me check."      # blank text around calls is dropped
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] \
        == [("function", "get_weather", {"city": "Zürich 天气", "days": 3}), ("function", "search", {"query": "42"})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2


def test_streamed_deltas_join_to_the_message_for_every_split():
    want, _ = parser().message(QWEN_ANSWER, "stop")
    want = without_ids(want)
    for pieces in splits(QWEN_ANSWER, random_splits=60):
        p = parser()
        deltas = [d for piece in pieces for d in p.feed(piece)]
        more, finish = p.finish("stop")
        deltas += more
        assert finish == "tool_calls"
        kinds = [next(iter(d)) for d in deltas]
        # reasoning first, then the rest; never an empty delta
        assert kinds[0] == "reasoning_content" and "reasoning_content" not in kinds[kinds.index("content"):]
        assert all(next(iter(d.values())) for d in deltas)
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        # each call: index, id, type and name (empty arguments) first, then its arguments in fragments
        # (a parameter at a time: the call streams as it is written)
        starts = [(i, c["index"], c["function"]["name"]) for i, c in enumerate(calls) if "id" in c]
        assert [s[1:] for s in starts] == [(0, "get_weather"), (1, "search")]
        assert starts[0][0] == 0 and all("name" not in c["function"] and c["function"]["arguments"]
                                         for c in calls if "id" not in c)
        assert [c["index"] for c in calls] == sorted(c["index"] for c in calls)
        assert without_ids(assemble(deltas, True)) == want, pieces


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_tool_format_through_the_combined_parser(name):
    reasoning = "deepseek_r1" if name.startswith("deepseek") else "glm45" if name.startswith("glm") else "qwen3"
    text = "<think>plan</think>" + SAMPLES[name]
    msg, finish = ChatOutputParser(reasoning_format(reasoning), tool_call_format(name), "", TOOLS).message(text, "stop")
    assert finish == "tool_calls" and msg["reasoning_content"] == "plan"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "search"]
    assert msg["content"].strip() == "Let me check."


def test_answer_without_calls_keeps_its_finish_reason_and_content():
    msg, finish = parser().message("ok</think>\n\nThe answer is 4.", "stop")
    assert (msg, finish) == ({"role": "assistant", "content": "The answer is 4.", "reasoning_content": "ok"}, "stop")
    msg, finish = parser().message("still thinking when cut", "length")
    assert (msg["content"], msg["reasoning_content"], finish) == ("", "still thinking when cut", "length")


def test_calls_only_content_is_null_and_length_stays_length():
    msg, finish = parser(reasoning=None, tools="hermes", prompt="").message(SAMPLES["hermes"].split("\n", 1)[1],
                                                                           "length")
    assert msg["content"] is None and "reasoning_content" not in msg and finish == "length"


def test_parallel_tool_calls_false_keeps_the_first_call():
    msg, _ = parser(parallel_tool_calls=False).message(QWEN_ANSWER, "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_reasoning_only_passes_tool_markup_through_as_content():
    msg, finish = parser(tools=None).message("hm</think>" + SAMPLES["hermes"], "stop")
    assert msg["content"] == SAMPLES["hermes"] and finish == "stop" and "tool_calls" not in msg


def test_qwen3_coder_arguments_stream_a_parameter_at_a_time():
    p = parser(reasoning=None, prompt="")

    def args(deltas):
        return [d["tool_calls"][0]["function"]["arguments"] for d in deltas]

    first = p.feed("<tool_call>\n<function=get_weather>")
    assert first[0]["tool_calls"][0]["function"]["name"] == "get_weather" and args(first) == ["", "{"]
    assert p.feed("\n<parameter=city>\nPar") == []                 # the value may still grow
    assert args(p.feed("is\n</parameter>\n<parameter=days>\n3\n</parameter>")) == ['"city": "Paris", "days": 3']
    assert args(p.feed("\n</function>\n</tool_call>")) == ["}"]
    assert p.finish("stop") == ([], "tool_calls")


def test_a_call_that_skips_the_end_of_reasoning_is_still_a_call():
    text = 'I should look it up.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    for pieces in splits(text, random_splits=20):
        p = parser(tools="hermes")
        deltas = [d for piece in pieces for d in p.feed(piece)]
        more, finish = p.finish("stop")
        msg = assemble(deltas + more, True)
        assert finish == "tool_calls" and msg["reasoning_content"] == "I should look it up."
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["search"] and msg["content"] is None
