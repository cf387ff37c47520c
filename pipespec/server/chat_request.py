"""The chat-specific parts of a /v1/chat/completions request: messages as the chat template takes
them (tool calls and tool results included), `tools` and `tool_choice` checked against the server's
tool and reasoning settings, and the parser of the answer (`ChatOutputParser`)."""
from __future__ import annotations

import dataclasses
import json
import re

from pipespec.server.parsers.chat_output import ChatOutputParser
from pipespec.server.parsers.reasoning import REASONING_PARSERS, reasoning_format
from pipespec.server.parsers.tool_calls import TOOL_CALL_PARSERS, tool_call_format
from pipespec.server.protocol import ApiError

_MEDIA = ("image", "video", "audio")     # image_url, input_image, video_url, input_audio, ...
# names the chat template is rendered with: chat_template_kwargs cannot replace them
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """The server's settings for chat answers (vLLM's flags of the same names)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known; "
                             f"choose one of: {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not known; "
                             f"choose one of: {', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's call format: "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} is used with --enable-auto-tool-choice "
                             "(tool_choice \"required\" and named functions need constrained decoding, which "
                             "pipespec does not have yet)")

    @classmethod
    def from_args(cls, enable_auto_tool_choice: bool, tool_call_parser: str | None,
                  reasoning_parser: str | None) -> "ChatOptions":
        """(--chat-template is an engine flag: the tokenizer renders with it everywhere.)"""
        return cls(enable_auto_tool_choice, tool_call_parser, reasoning_parser)


@dataclasses.dataclass(frozen=True)
class ChatPlan:
    """What a checked chat request renders and how its answer is parsed."""
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    parse_tools: bool
    parallel_tool_calls: bool

    def output_parser(self, options: ChatOptions, prompt: str) -> ChatOutputParser | None:
        """The parser of this request's answer (None: the text is the content, as it is)."""
        reasoning = reasoning_format(options.reasoning_parser) if options.reasoning_parser else None
        tools = tool_call_format(options.tool_call_parser) if self.parse_tools else None
        if reasoning is None and tools is None:
            return None
        return ChatOutputParser(reasoning, tools, prompt, self.tools, self.parallel_tool_calls)


def prepare_chat(body, options: ChatOptions) -> ChatPlan:
    """Check a ChatCompletionRequest's chat fields; raise ApiError (400) naming the first bad one."""
    tools = _check_tools(body.tools)
    parse_tools = _check_tool_choice(body.tool_choice, tools, options)
    kwargs = body.chat_template_kwargs or {}
    for key in kwargs:
        if key in _RESERVED:
            raise ApiError(400, f"chat_template_kwargs: {key!r} is set by the server and cannot be passed",
                           "chat_template_kwargs")
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ChatPlan(messages, tools, dict(kwargs), parse_tools, parallel)


def _check_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    seen = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, f"{where}: only {{\"type\": \"function\"}} tools are supported", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function: missing (an object with a name and parameters)", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise ApiError(400, f"{where}.function.name: {name!r} is not a function name (letters, digits, "
                           "'_', '-', '.', ':', at most 128)", "tools")
        if name in seen:
            raise ApiError(400, f"{where}.function.name: {name!r} is defined twice", "tools")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(400, f"{where}.function.description: must be a string", "tools")
        params = fn.get("parameters")
        if params is not None:
            problem = schema_problem(params)
            if problem is not None:
                raise ApiError(400, f"{where}.function.parameters: not a valid JSON Schema: {problem}", "tools")
        out.append({"type": "function", "function": fn})
    return out


def schema_problem(schema, where: str = "") -> str | None:
    """Why `schema` is not a valid JSON Schema (the structural rules a tool schema relies on), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where or 'the schema'} is a {type(schema).__name__}, not an object"
    t = schema.get("type")
    if t is not None:
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or any(x not in _JSON_TYPES for x in types):
            return f"{where}type {t!r} is not a JSON Schema type ({', '.join(sorted(_JSON_TYPES))})"
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            return f"{where}properties must be an object"
        for key, sub in props.items():
            problem = schema_problem(sub, f"{where}properties.{key}.")
            if problem:
                return problem
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        return f"{where}required must be a list of strings"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}enum must be a list"
    for key in ("items", "additionalProperties", "not"):
        if key in schema and not isinstance(schema[key], list):
            problem = schema_problem(schema[key], f"{where}{key}.")
            if problem:
                return problem
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                return f"{where}{key} must be a non-empty list"
            for j, sub in enumerate(schema[key]):
                problem = schema_problem(sub, f"{where}{key}[{j}].")
                if problem:
                    return problem
    return None


def _check_tool_choice(choice, tools: list[dict] | None, options: ChatOptions) -> bool:
    """Whether the answer is parsed for tool calls."""
    names = [t["function"]["name"] for t in tools or ()]
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return False
    if not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                           "tool_choice")
        if name not in names:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools "
                           f"({', '.join(names)})", "tool_choice")
        raise ApiError(400, f"tool_choice naming a function ({name!r}) needs constrained decoding, which "
                       "pipespec does not support yet; use \"auto\"", "tool_choice")
    if choice == "required":
        raise ApiError(400, 'tool_choice "required" needs constrained decoding, which pipespec does not '
                       'support yet; use "auto"', "tool_choice")
    if choice != "auto":
        raise ApiError(400, f"tool_choice {choice!r} is not one of \"none\", \"auto\", \"required\" or a "
                       "named function", "tool_choice")
    if not options.enable_auto_tool_choice:
        raise ApiError(400, '"auto" tool choice (the default when tools are given) requires the server to '
                       "run with --enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    return True


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    extra = m.model_extra or {}
    content = m.content
    if isinstance(content, list):
        media = next((p.get("type") for p in content if isinstance(p, dict)
                      and any(x in str(p.get("type", "")) for x in _MEDIA)), None)
        if media is not None:       # e.g. Qwen3.5's vision tower is not loaded: text only
            raise ApiError(400, f"{where}.content: {media} content is not supported: pipespec serves text "
                           "only (a multimodal model's vision tower is not loaded)", f"{where}.content")
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    msg = {"role": m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    calls = extra.get("tool_calls")
    if calls is not None:
        if m.role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls", f"{where}.tool_calls")
        if not isinstance(calls, list):
            _bad(f"{where}.tool_calls", "must be a list")
        msg["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if content is None and not (m.role == "assistant" and msg.get("tool_calls")):
        raise ApiError(400, f"{where}.content: missing (only an assistant message with tool_calls may omit it)",
                       f"{where}.content")
    if m.role == "tool":
        call_id = extra.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ApiError(400, f"{where}.tool_call_id: must be a string", f"{where}.tool_call_id")
        msg["tool_call_id"] = call_id
    if isinstance(extra.get("reasoning_content"), str):      # templates that replay earlier reasoning
        msg["reasoning_content"] = extra["reasoning_content"]
    return msg


def _bad(where: str, what: str):
    raise ApiError(400, f"{where}: {what}", where)


def _history_call(where: str, call) -> dict:
    """An earlier answer's tool call, its arguments as an object (the templates iterate over them)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        _bad(where, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        _bad(f"{where}.function.name", "must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            _bad(f"{where}.function.arguments", "is not valid JSON")
    if not isinstance(args, dict):
        _bad(f"{where}.function.arguments", "must be a JSON object")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
