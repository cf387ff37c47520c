"""Tool-call parsers: each family's call markup in the output text becomes OpenAI tool calls.

A parser finds call blocks between a start and an end tag; the text outside them is content. Facts
about the formats (each checked against the model's published chat template and the reference
parsers of vLLM/SGLang, nothing copied):

- hermes (Qwen2.5, Qwen3, Qwen3-Next): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one per call.
- qwen3_coder (Qwen3-Coder, Qwen3.5/3.6): `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n
  </parameter>\\n</function>\\n</tool_call>`; V is raw text, typed by the tool's JSON schema.
- qwen3 (recent vLLM's name for the Qwen family): either of the two forms above, call by call.
- glm45 (GLM-4.5/4.6) and glm47 (GLM-4.7/5): `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V
  </arg_value>\\n</tool_call>` (glm47 writes no newlines); V is raw text for string parameters, JSON
  otherwise.
- deepseek_v3 (V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v31 (V3.1): as V3 but `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- deepseek_v32 (V3.2): `<｜DSML｜function_calls>` holding `<｜DSML｜invoke name="N">` with
  `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` (string="true": V is raw
  text, else JSON), closed by `</｜DSML｜invoke>` and `</｜DSML｜function_calls>`.

A block that does not parse as a call is returned as content, with a warning log line. The
parameter formats (qwen3_coder, glm45/47, deepseek_v32) stream each call as it is written: its name
once whole, then its arguments a parameter at a time; the JSON formats give a call when it closes."""
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


@dataclasses.dataclass(frozen=True)
class CallStart:
    """A call streamed as it is written: its name is known (its arguments follow as `CallArgs`)."""
    name: str


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The next fragment of the arguments (a JSON object) of the latest `CallStart`."""
    text: str


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


def _member(key: str, value) -> str:
    """One `"key": value` of an arguments object, as json.dumps writes it inside the braces."""
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _scan_calls(pattern: re.Pattern, close_tag: str, block: str, final: bool, members, what: str) -> list:
    """The calls of a block so far, each (name, its complete parameters as JSON members, closed), for
    formats that wrap each call in `pattern` (group 1 its name, group 2 its body, ending at
    `close_tag` or the block's end). On a growing block (final=False) the result only grows: a call
    appears once its name is whole, a parameter once `members(name, body, closed)` sees its end,
    and nothing seen changes later. `what`: the format, for the error of a final block that is not."""
    calls = []
    for m in pattern.finditer(block):
        try:
            name = _name(m.group(1))
        except BadCall:
            if final:
                raise
            break
        closed = final or m.group(0).endswith(close_tag)
        calls.append((name, members(name, m.group(2), closed), closed))
    if final and (not calls or pattern.sub("", block).strip()):
        raise BadCall(what)
    return calls


def _scan_qwen3_coder(block: str, schemas: dict, final: bool) -> list[tuple[str, list[str], bool]]:
    """<function=NAME><parameter=K>V</parameter>...</function> calls (`_scan_calls`)."""
    def members(name: str, body: str, closed: bool) -> list[str]:
        props, out, seen = schemas.get(name, {}), [], set()
        for p in _PARAMETER.finditer(body):
            if not (closed or p.group(0).endswith("</parameter>") or p.end() < len(body)):
                break                                  # the value may still grow
            key = p.group(1).strip()
            if key not in seen:                        # a repeated parameter: the first one counts
                seen.add(key)
                out.append(_member(key, typed_value(_strip_one_newline(p.group(2)), props.get(key),
                                                    default_json=False)))
        return out

    return _scan_calls(_FUNCTION, "</function>", block, final, members, "not <function=NAME>...</function>")


def _scan_qwen3(block: str, schemas: dict, final: bool) -> list[tuple[str, list[str], bool]]:
    """Either Qwen form: JSON (Qwen3, Qwen3-Next; whole at the block's end) or <function=...>
    (Qwen3.5/3.6, Qwen3-Coder; streamed)."""
    if block.lstrip().startswith("{"):
        if not final:
            return []
        return [(c.name, [_member(k, v) for k, v in json.loads(c.arguments).items()], True)
                for c in _parse_hermes(block.strip(), schemas)]
    return _scan_qwen3_coder(block, schemas, final)


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _scan_glm(block: str, schemas: dict, final: bool) -> list[tuple[str, list[str], bool]]:
    """One call per block; its name is whole at the first <arg_key> (or the block's end), each
    argument at its </arg_value> (as `_scan_calls`: the result only grows with the block)."""
    head, key_tag, _ = block.partition("<arg_key>")
    if not key_tag and not final:
        return []
    try:
        name = _name(head)
    except BadCall:
        if final:
            raise
        return []
    props, members, seen = schemas.get(name, {}), [], set()
    rest = block[len(head):]
    for m in _ARG.finditer(rest):
        key = m.group(1).strip()
        if key not in seen:
            seen.add(key)
            members.append(_member(key, typed_value(m.group(2), props.get(key), default_json=True)))
    if final and _ARG.sub("", rest).strip():
        raise BadCall("not NAME<arg_key>K</arg_key><arg_value>V</arg_value>...")
    return [(name, members, final)]


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


_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)(?:</｜DSML｜invoke>|\Z)', re.S)
_DSML_PARAM = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>',
                         re.S)


def _scan_deepseek_v32(block: str, schemas: dict, final: bool) -> list[tuple[str, list[str], bool]]:
    """<｜DSML｜invoke name="NAME"> calls of <｜DSML｜parameter> members (`_scan_calls`)."""
    def members(name: str, body: str, closed: bool) -> list[str]:
        out, seen = [], set()
        for p in _DSML_PARAM.finditer(body):
            key, raw = p.group(1), p.group(3)
            if p.group(2) == "true":
                value = raw
            else:
                try:
                    value = json.loads(raw)
                except ValueError:
                    if final:
                        raise BadCall(f"parameter {key!r} (string=\"false\") is not JSON") from None
                    break
            if key not in seen:
                seen.add(key)
                out.append(_member(key, value))
        if final and _DSML_PARAM.sub("", body).strip():
            raise BadCall('not a sequence of <｜DSML｜parameter name="K" string="..."> parameters')
        return out

    return _scan_calls(_INVOKE, "</｜DSML｜invoke>", block, final, members,
                       'not a sequence of <｜DSML｜invoke name="NAME"> calls')


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str
    end: str
    # formats parsed when their block closes: (block, schemas) -> the calls
    parse: Callable[[str, dict], list[ParsedCall]] | None = None
    # formats whose calls stream as they are written: (block so far, schemas, final) -> the calls
    # so far (see _scan_qwen3_coder)
    scan: Callable[[str, dict, bool], list[tuple[str, list[str], bool]]] | None = None

    def __post_init__(self):
        if (self.parse is None) == (self.scan is None):
            raise ValueError(f"tool-call format {self.name}: give either parse or scan")

    def stream(self, tools: list[dict] | None = None) -> "ToolCallStream":
        return ToolCallStream(self, tools)

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole output."""
        s = self.stream(tools)
        return collect(s.feed(text) + s.finish())


def collect(events: list) -> tuple[str, list[ParsedCall]]:
    """(content, calls) from a stream's events: text, whole calls, and calls started then grown by
    argument fragments."""
    content, calls = [], []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif isinstance(e, ParsedCall):
            calls.append(e)
        elif isinstance(e, CallStart):
            calls.append(ParsedCall(e.name, ""))
        else:
            calls[-1] = ParsedCall(calls[-1].name, calls[-1].arguments + e.text)
    return "".join(content), calls


TOOL_CALL_PARSERS = {f.name: f for f in (
    ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _parse_hermes),
    ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", scan=_scan_qwen3_coder),
    ToolCallFormat("qwen3", "<tool_call>", "</tool_call>", scan=_scan_qwen3),
    ToolCallFormat("glm45", "<tool_call>", "</tool_call>", scan=_scan_glm),
    ToolCallFormat("glm47", "<tool_call>", "</tool_call>", scan=_scan_glm),
    ToolCallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v3),
    ToolCallFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek_v31),
    ToolCallFormat("deepseek_v32", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", scan=_scan_deepseek_v32),
)}


def tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]


class ToolCallStream:
    """One output's tool calls, fed in pieces. `feed(piece)` and `finish()` return events in output
    order: strings (content), and calls: `ParsedCall`s, or for formats that stream calls, a
    `CallStart` and `CallArgs` fragments (joined: the arguments). A call block that is not a valid
    call is given back as content (a block cut short by the end of the output is still tried as a
    call); a streamed call found invalid after it started is closed with what it has."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None):
        self.fmt = fmt
        self._schemas = param_schemas(tools)
        self._split = TagSplitter((fmt.start, fmt.end))
        self._block: list[str] | None = None    # the text of the open call block, in pieces
        self._sent: list[str] = []              # arguments sent so far of each streamed call of the block
        self._closed = False                    # whether the latest streamed call's arguments are whole

    def feed(self, piece: str) -> list:
        return self._run(self._split.feed(piece))

    def finish(self) -> list:
        events = self._run(self._split.finish())
        if self._block is not None:
            events += self._close(complete=False)
        return events

    def _run(self, items: list) -> list:
        events = []
        for item in items:
            if self._block is None:
                if isinstance(item, Tag) and item == self.fmt.start:
                    self._block, self._sent = [], []
                else:
                    events.append(str(item))
            elif isinstance(item, Tag) and item == self.fmt.end:
                events += self._close(complete=True)
            else:
                self._block.append(str(item))
                if self.fmt.scan is not None and ">" in item:     # (a call or parameter ends at a '>')
                    events += self._grow(self.fmt.scan("".join(self._block), self._schemas, False))
        return events

    def _grow(self, calls: list) -> list:
        """Events that bring the streamed calls up to `calls` (which extend what was sent)."""
        events = []
        for i, (name, members, closed) in enumerate(calls):
            if i == len(self._sent):
                events.append(CallStart(name))
                self._sent.append("")
            args = "{" + ", ".join(members) + ("}" if closed else "")
            if len(args) > len(self._sent[i]):
                events.append(CallArgs(args[len(self._sent[i]):]))
                self._sent[i] = args
            self._closed = closed
        return events

    def _close(self, complete: bool) -> list:
        block, self._block = "".join(self._block), None
        if self.fmt.scan is not None:
            # what the whole block streams, then its end: the same however the text was split
            events = self._grow(self.fmt.scan(block, self._schemas, False))
            try:
                return events + self._grow(self.fmt.scan(block, self._schemas, True))
            except BadCall as e:
                if self._sent:
                    logger.warning("%s tool-call parser: a call went wrong after it started; it ends with "
                                   "the arguments it had (%s)", self.fmt.name, e)
                    return events + ([] if self._closed else [CallArgs("}")])
                return self._as_content(block, complete, e)
        try:
            return list(self.fmt.parse(block.strip(), self._schemas))
        except BadCall as e:
            return self._as_content(block, complete, e)

    def _as_content(self, block: str, complete: bool, error: BadCall) -> list:
        logger.warning("%s tool-call parser: a call block that is not a valid call is returned as "
                       "content (%s)", self.fmt.name, error)
        return [self.fmt.start + block + (self.fmt.end if complete else "")]
