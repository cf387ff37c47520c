"""Tool-call parsers: each family's call markup in the output text becomes OpenAI tool calls.

A parser finds call blocks between a start and an end tag; the text outside them is content. Facts
about the formats (each checked against the model's published chat template and the reference
parsers of vLLM/SGLang, nothing copied):

- hermes (Qwen2.5, Qwen3): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one per call.
- qwen3_coder (Qwen3-Coder, Qwen3.5/3.6, Qwen3-Next): `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n
  </parameter>\\n</function>\\n</tool_call>`; V is raw text, typed by the tool's JSON schema.
- glm45 (GLM-4.5/4.6) and glm47 (GLM-4.7/5): `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V
  </arg_value>\\n</tool_call>` (glm47 writes no newlines); V is raw text for string parameters, JSON
  otherwise.
- deepseek_v3 (V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v31 (V3.1): as V3 but `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- deepseek_v32 (V3.2): `<｜DSML｜function_calls>` holding `<｜DSML｜invoke name="N">` with
  `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` (string="true": V is raw
  text, else JSON), closed by `</｜DSML｜invoke>` and `</｜DSML｜function_calls>`.

A block that does not parse as a call is returned as content, with a warning log line."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Callable

from pipespec.server.parsers.markup import Tag, TagSplitter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str        # a JSON object, as the OpenAI API carries it


class BadCall(ValueError):
    """A call block that is not a call in the expected format."""


# -- argument typing -----------------------------------------------------------------------------

def param_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: {parameter: its JSON schema}} of a request's tools."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") or {}
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn.get("name")] = props if isinstance(props, dict) else {}
    return out


def typed_value(raw: str, schema: dict | None, default_json: bool):
    """A raw parameter text as the value its schema's type asks for. Without a type, JSON when
    `default_json` and the text parses, else the text."""
    schema = schema if isinstance(schema, dict) else {}        # (true/false are schemas too)
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or ())
    if not types:
        if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
            return raw
        if not default_json:
            return raw
        types = ["json"]
    if "string" in types:
        return raw
    text = raw.strip()
    for t in types:
        if t == "integer":
            try:
                return int(text)
            except ValueError:
                try:
                    f = float(text)
                    if f.is_integer():
                        return int(f)
                except ValueError:
                    pass
        elif t == "number":
            try:
                f = float(text)
                return int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
            except ValueError:
                pass
        elif t == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        elif t == "null":
            if text.lower() in ("null", "none"):
                return None
        else:                                  # object, array, or untyped: JSON
            try:
                return json.loads(text)
            except ValueError:
                pass
    return raw


def _arguments(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise BadCall(f"arguments are not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadCall("arguments are not a JSON object")
    return value


def _name(text: str) -> str:
    name = text.strip()
    if not name or any(c.isspace() for c in name) or "<" in name:
        raise BadCall(f"not a function name: {text!r}")
    return name


# -- the formats ---------------------------------------------------------------------------------

def _parse_hermes(block: str, schemas: dict) -> list[ParsedCall]:
    try:
        obj = json.loads(block)
    except ValueError as e:
        raise BadCall(f"not a JSON object: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise BadCall('not a {"name": ..., "arguments": {...}} object')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json_object(args)
    if not isinstance(args, dict):
        raise BadCall("arguments are not a JSON object")
    return [ParsedCall(_name(obj["name"]), _arguments(args))]


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parse_qwen3_coder(block: str, schemas: dict) -> list[ParsedCall]:
    calls = []
    for m in _FUNCTION.finditer(block):
        name = _name(m.group(1))
        props = schemas.get(name, {})
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            args[key] = typed_value(_strip_one_newline(p.group(2)), props.get(key), default_json=False)
        calls.append(ParsedCall(name, _arguments(args)))
    if not calls or _FUNCTION.sub("", block).strip():
        raise BadCall("not <function=NAME>...</function>")
    return calls


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _parse_glm(block: str, schemas: dict) -> list[ParsedCall]:
    head, _, _ = block.partition("<arg_key>")
    name = _name(head)
    props = schemas.get(name, {})
    rest = block[len(head):]
    args = {m.group(1).strip(): typed_value(m.group(2), props.get(m.group(1).strip()), default_json=True)
            for m in _ARG.finditer(rest)}
    if _ARG.sub("", rest).strip():
        raise BadCall("not NAME<arg_key>K</arg_key><arg_value>V</arg_value>...")
    return [ParsedCall(name, _arguments(args))]


_V3_CALL = re.compile(r"<｜tool▁call▁begin｜>\s*(\w+)\s*<｜tool▁sep｜>([^\n`]*?)\s*```(?:json)?\s*(.*?)\s*```\s*"
                      r"<｜tool▁call▁end｜>", re.S)
_V31_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)


def _all_matched(pattern: re.Pattern, block: str, what: str) -> list[re.Match]:
    matches = list(pattern.finditer(block))
    if not matches or pattern.sub("", block).strip():
        raise BadCall(f"not a sequence of {what}")
    return matches


def _parse_deepseek_v3(block: str, schemas: dict) -> list[ParsedCall]:
    return [ParsedCall(_name(m.group(2)), _arguments(_json_object(m.group(3))))
            for m in _all_matched(_V3_CALL, block, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json``` calls")]


def _parse_deepseek_v31(block: str, schemas: dict) -> list[ParsedCall]:
    return [ParsedCall(_name(m.group(1)), _arguments(_json_object(m.group(2))))
            for m in _all_matched(_V31_CALL, block, "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...} calls")]


_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)</｜DSML｜invoke>', re.S)
_DSML_PARAM = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
                         re.S)


def _parse_deepseek_v32(block: str, schemas: dict) -> list[ParsedCall]:
    calls = []
    for m in _all_matched(_INVOKE, block, '<｜DSML｜invoke name="NAME"> calls'):
        name = _name(m.group(1))
        body = m.group(2)
        if _DSML_PARAM.sub("", body).strip():
            raise BadCall('not a sequence of <｜DSML｜parameter name="K" string="..."> parameters')
        args = {}
        for p in _DSML_PARAM.finditer(body):
            if p.group(2) == "true":
                args[p.group(1)] = p.group(3)
            else:
                try:
                    args[p.group(1)] = json.loads(p.group(3))
                except ValueError:
                    raise BadCall(f"parameter {p.group(1)!r} (string=\"false\") is not JSON") from None
        calls.append(ParsedCall(name, _arguments(args)))
    return calls


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str
    end: str
    parse: Callable[[str, dict], list[ParsedCall]]

    def stream(self, tools: list[dict] | None = None) -> "ToolCallStream":
        return ToolCallStream(self, tools)

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole output."""
        s = self.stream(tools)
        events = s.feed(text) + s.finish()
        return ("".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ParsedCall)])


TOOL_CALL_PARSERS = {f.name: f for f in (
    ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _parse_hermes),
    ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", _parse_qwen3_coder),
    ToolCallFormat("glm45", "<tool_call>", "</tool_call>", _parse_glm),
    ToolCallFormat("glm47", "<tool_call>", "</tool_call>", _parse_glm),
    ToolCallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v3),
    ToolCallFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v31),
    ToolCallFormat("deepseek_v32", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _parse_deepseek_v32),
)}


def tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]


class ToolCallStream:
    """One output's tool calls, fed in pieces. `feed(piece)` and `finish()` return events in output
    order: strings (content) and `ParsedCall`s. A call block is held until its end tag arrives (or
    the output ends: a block cut short is still tried as a call, then given back as content)."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None):
        self.fmt = fmt
        self._schemas = param_schemas(tools)
        self._split = TagSplitter((fmt.start, fmt.end))
        self._block: str | None = None          # the text of the open call block

    def feed(self, piece: str) -> list:
        return self._run(self._split.feed(piece))

    def finish(self) -> list:
        events = self._run(self._split.finish())
        if self._block is not None:
            block, self._block = self._block, None
            events += self._close(block, complete=False)
        return events

    def _run(self, items: list) -> list:
        events = []
        for item in items:
            if self._block is None:
                if isinstance(item, Tag) and item == self.fmt.start:
                    self._block = ""
                else:
                    events.append(str(item))
            elif isinstance(item, Tag) and item == self.fmt.end:
                block, self._block = self._block, None
                events += self._close(block, complete=True)
            else:
                self._block += str(item)
        return events

    def _close(self, block: str, complete: bool) -> list:
        try:
            return list(self.fmt.parse(block.strip(), self._schemas))
        except BadCall as e:
            logger.warning("%s tool-call parser: a call block that is not a valid call is returned as "
                           "content (%s)", self.fmt.name, e)
            return [self.fmt.start + block + (self.fmt.end if complete else "")]
