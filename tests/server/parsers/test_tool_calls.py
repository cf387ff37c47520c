import json
import logging

import pytest

from pipespec.server.parsers.tool_calls import (TOOL_CALL_PARSERS, CallArgs, CallStart, ParsedCall, collect,
                                                tool_call_format, typed_value)
from tests.server.parsers.conftest import splits

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "tags": {"type": "array"}, "where": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]
WEATHER = {"city": "Zürich 天气", "days": 3}
SEARCH = {"query": "42"}           # a string parameter that looks like a number stays a string

SAMPLES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 天气", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "42"}}\n</tool_call>',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 天气\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
                   "<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>",
    "glm45": "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich 天气</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>search\n<arg_key>query"
             "</arg_key>\n<arg_value>42</arg_value>\n</tool_call>",
    "glm47": "Let me check.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich 天气</arg_value>"
             "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>search<arg_key>query"
             "</arg_key><arg_value>42</arg_value></tool_call>",
    "deepseek_v3": "Let me check.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   "```json\n{\"city\": \"Zürich 天气\", \"days\": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>"
                   "function<｜tool▁sep｜>search\n```json\n{\"query\": \"42\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": "Let me check.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    "{\"city\": \"Zürich 天气\", \"days\": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
                    "{\"query\": \"42\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v32": "Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                    "<｜DSML｜parameter name=\"city\" string=\"true\">Zürich 天气</｜DSML｜parameter>\n"
                    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                    "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">42"
                    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
}


def streamed(fmt, pieces):
    s = fmt.stream(TOOLS)
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    for e in events:
        if isinstance(e, str):
            assert "<tool_call" not in e and "｜" not in e, f"markup leaked into content: {e!r}"
        elif not isinstance(e, (ParsedCall, CallStart)):
            assert isinstance(e, CallArgs) and e.text
    return collect(events)


SAMPLES["qwen3"] = (SAMPLES["hermes"].rsplit("<tool_call>", 1)[0]                  # one call of each form
                    + SAMPLES["qwen3_coder"].split("</tool_call>\n", 1)[1])


def test_every_format_has_a_sample():
    assert set(SAMPLES) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_calls_whole_and_in_every_split(name):
    fmt = tool_call_format(name)
    content, calls = fmt.extract(SAMPLES[name], TOOLS)
    assert content.strip() == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert [json.loads(c.arguments) for c in calls] == [WEATHER, SEARCH]
    for pieces in splits(SAMPLES[name], random_splits=40):
        assert streamed(fmt, pieces) == (content, calls), pieces


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_text_without_calls_is_content(name):
    text = "Just an answer, with a < sign and a <tag>."
    assert tool_call_format(name).extract(text, TOOLS) == (text, [])


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "glm45", "deepseek_v31", "deepseek_v32"])
def test_a_malformed_call_is_content_with_a_warning(name, caplog):
    fmt = tool_call_format(name)
    bad = f"{fmt.start}this is not a call{fmt.end}"
    with caplog.at_level(logging.WARNING, logger="pipespec.server.parsers.tool_calls"):
        content, calls = fmt.extract("before " + bad, TOOLS)
    assert calls == [] and content == "before " + bad
    assert "not a valid call" in caplog.text


def test_an_unclosed_call_at_the_end_is_still_a_call():
    content, calls = tool_call_format("hermes").extract('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}')
    assert content == "" and calls == [ParsedCall("search", '{"query": "x"}')]


def test_qwen3_coder_types_arguments_by_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n 12 \n</parameter>\n<parameter=days>\n7\n"
            "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
            "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n"
            "<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>")
    _, [call] = tool_call_format("qwen3_coder").extract(text, TOOLS)
    assert json.loads(call.arguments) == {"city": " 12 ", "days": 7, "metric": True, "scale": 1.5,
                                          "tags": ["a", "b"], "where": {"lat": 1}, "extra": "5"}


def test_glm_values_are_json_unless_the_schema_says_string():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>true</arg_value><arg_key>days</arg_key>"
            "<arg_value>3</arg_value><arg_key>other</arg_key><arg_value>[1, 2]</arg_value><arg_key>word</arg_key>"
            "<arg_value>plain words</arg_value></tool_call>")
    _, [call] = tool_call_format("glm47").extract(text, TOOLS)
    assert json.loads(call.arguments) == {"city": "true", "days": 3, "other": [1, 2], "word": "plain words"}


def test_typed_value_falls_back_to_the_text():
    assert typed_value("abc", {"type": "integer"}, default_json=False) == "abc"
    assert typed_value("3", {"type": ["integer", "null"]}, default_json=False) == 3
    assert typed_value("null", {"type": ["integer", "null"]}, default_json=False) is None
    assert typed_value("3", None, default_json=False) == "3"
    assert typed_value("3", None, default_json=True) == 3
    assert typed_value("3", True, default_json=True) == 3          # a boolean schema has no type
    assert typed_value("3", {"enum": ["3", "4"]}, default_json=True) == "3"


def test_boolean_parameter_schemas_do_not_break_parsing():
    tools = [{"type": "function", "function": {"name": "f", "parameters": True}},
             {"type": "function", "function": {"name": "g", "parameters": {"properties": {"a": False}}}}]
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    assert tool_call_format("qwen3_coder").extract(text, tools)[1] == [ParsedCall("f", '{"a": "1"}')]
    text = "<tool_call>g<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert tool_call_format("glm47").extract(text, tools)[1] == [ParsedCall("g", '{"a": 1}')]


def test_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'.*hermes"):
        tool_call_format("mistral")


def test_a_streamed_call_that_goes_wrong_keeps_what_it_had_however_split(caplog):
    fmt = tool_call_format("qwen3_coder")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n4"
            "\n</parameter>\n</function>\nstray words\n</tool_call>")
    with caplog.at_level(logging.WARNING, logger="pipespec.server.parsers.tool_calls"):
        for pieces in splits(text, random_splits=40):
            assert streamed(fmt, pieces) == ("", [ParsedCall("get_weather", '{"city": "Paris", "days": 4}')]), pieces
    assert "went wrong after it started" in caplog.text
    # cut short by the end of the output: the call is closed with the parameters it has
    cut = text[:text.index("4")]
    for pieces in splits(cut, random_splits=20):
        assert streamed(fmt, pieces) == ("", [ParsedCall("get_weather", '{"city": "Paris", "days": ""}')]), pieces


def test_a_bad_function_name_is_content_however_split():
    text = "<tool_call>\n<function=get weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    for pieces in splits(text, random_splits=20):
        s = tool_call_format("qwen3_coder").stream(TOOLS)
        events = [e for p in pieces for e in s.feed(p)] + s.finish()
        assert all(isinstance(e, str) for e in events) and "".join(events) == text, pieces


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45", "glm47", "deepseek_v32"])
def test_xml_formats_stream_arguments_a_parameter_at_a_time(name):
    s = tool_call_format(name).stream(TOOLS)
    events = [e for ch in SAMPLES[name] for e in s.feed(ch)] + s.finish()
    calls = [e for e in events if isinstance(e, (CallStart, CallArgs, ParsedCall))]
    assert not any(isinstance(e, ParsedCall) for e in calls)
    first = calls[:calls.index(CallStart("search"))]
    # the name first, then the arguments as they are written: '{', "city", "days", then '}'
    assert first[0] == CallStart("get_weather")
    assert [e.text for e in first[1:]] == ["{", '"city": "Zürich 天气"', ', "days": 3', "}"]


def test_dsml_invoke_with_bad_json_after_it_started_keeps_what_it_had():
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
            'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">three'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    for pieces in splits(text, random_splits=20):
        assert streamed(tool_call_format("deepseek_v32"), pieces) == (
            "", [ParsedCall("get_weather", '{"city": "Paris"}')]), pieces
