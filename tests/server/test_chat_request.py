"""The chat request's tools, tool_choice, template kwargs and tool-call history, checked before the
engine sees the request (each refusal a 400 naming the field)."""
import pytest

from pipespec.server.chat_request import ChatOptions, prepare_chat, schema_problem
from pipespec.server.protocol import ApiError, ChatCompletionRequest

AUTO = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**kw):
    return ChatCompletionRequest(**{"messages": USER, **kw})


def refused(options, match, **kw) -> ApiError:
    with pytest.raises(ApiError, match=match) as e:
        prepare_chat(body(**kw), options)
    assert e.value.status == 400
    return e.value


def test_auto_with_tools_parses_calls():
    plan = prepare_chat(body(tools=[TOOL]), AUTO)
    assert plan.parse_tools and plan.tools == [TOOL] and plan.parallel_tool_calls
    assert plan.output_parser(AUTO, "<think>\n") is not None


def test_none_renders_tools_but_parses_no_calls():
    plan = prepare_chat(body(tools=[TOOL], tool_choice="none"), ChatOptions())
    assert plan.tools == [TOOL] and not plan.parse_tools
    assert plan.output_parser(ChatOptions(), "") is None          # no parser at all: text as it is
    assert plan.output_parser(ChatOptions(reasoning_parser="qwen3"), "") is not None


def test_auto_without_the_server_flag_is_refused_as_vllm_does():
    err = refused(ChatOptions(), "--enable-auto-tool-choice", tools=[TOOL])          # implied "auto"
    assert err.param == "tool_choice"
    refused(ChatOptions(), "--enable-auto-tool-choice", tools=[TOOL], tool_choice="auto")


def test_required_and_named_choices_need_constrained_decoding():
    refused(AUTO, 'tool_choice "required" needs constrained decoding', tools=[TOOL], tool_choice="required")
    refused(AUTO, "naming a function .'get_weather'. needs constrained decoding", tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    refused(AUTO, "names function 'nope', which is not among the tools", tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    refused(AUTO, "'auto' needs tools", tool_choice="auto")
    refused(AUTO, "'sometimes' is not one of", tools=[TOOL], tool_choice="sometimes")


@pytest.mark.parametrize("tools,match", [
    ([{"type": "retrieval"}], "only {\"type\": \"function\"} tools"),
    ([{"type": "function"}], r"tools\[0\].function: missing"),
    ([{"type": "function", "function": {"name": "has space"}}], "is not a function name"),
    ([TOOL, TOOL], "'get_weather' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
     "not a valid JSON Schema: type 'strnig' is not a JSON Schema type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": 3}}}}}],
     "properties.a.type 3"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}], "required must be a list"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "not a valid JSON Schema"),
])
def test_bad_tools_are_refused_naming_the_problem(tools, match):
    assert refused(AUTO, match, tools=tools).param == "tools"


def test_schema_problem_accepts_real_schemas():
    assert schema_problem(TOOL["function"]["parameters"]) is None
    assert schema_problem({"type": ["string", "null"], "anyOf": [{"type": "string"}, True],
                           "items": {"type": "integer"}, "additionalProperties": False, "enum": ["a"]}) is None


def test_history_with_tool_calls_and_results_reaches_the_template():
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 22 C."}], "reasoning_content": "easy"}]
    plan = prepare_chat(body(messages=messages, tools=[TOOL]), AUTO)
    assert plan.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert plan.messages[2] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}
    assert plan.messages[3] == {"role": "assistant", "content": "It is 22 C.", "reasoning_content": "easy"}


@pytest.mark.parametrize("message,match", [
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     r"messages\[1\].tool_calls\[0\].function.arguments: is not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "must be a JSON object"),
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant messages carry tool calls"),
    ({"role": "assistant", "content": None}, r"messages\[1\].content: missing"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "image_url content is not"),
])
def test_bad_history_is_refused(message, match):
    refused(AUTO, match, messages=USER + [message])


def test_template_kwargs_pass_through_but_cannot_replace_the_servers_variables():
    plan = prepare_chat(body(chat_template_kwargs={"enable_thinking": False}), AUTO)
    assert plan.template_kwargs == {"enable_thinking": False}
    refused(AUTO, "'tools' is set by the server", chat_template_kwargs={"tools": []})


def test_server_options_refuse_bad_combinations():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser hermes is used with --enable-auto-tool-choice"):
        ChatOptions(tool_call_parser="hermes")
    with pytest.raises(ValueError, match="--reasoning-parser 'r2' is not known"):
        ChatOptions(reasoning_parser="r2")
