"""A chat answer's text as OpenAI message fields: reasoning first, then content and tool calls.

`ChatOutputParser` runs the request's reasoning parser and then its tool-call parser (on the text
after the reasoning block) over the text as it is generated. `feed` returns the streamed deltas
(dicts for `choices[0].delta`); `message` builds the non-streamed message from the same deltas, so
both ways give the same fields."""
from __future__ import annotations

import uuid

from pipespec.server.parsers.reasoning import ReasoningFormat
from pipespec.server.parsers.tool_calls import CallArgs, CallStart, ParsedCall, ToolCallFormat


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    """`reasoning`, `tools`: the formats to parse (None: that part is off); `prompt`: the rendered
    prompt (it tells whether the template opened the reasoning block); `tool_defs`: the request's
    tools (their schemas type the arguments); `parallel_tool_calls=False` keeps the first call only."""

    def __init__(self, reasoning: ReasoningFormat | None, tools: ToolCallFormat | None, prompt: str = "",
                 tool_defs: list[dict] | None = None, parallel_tool_calls: bool = True):
        self._reasoning = reasoning.stream(prompt) if reasoning is not None else None
        self._tools = tools.stream(tool_defs) if tools is not None else None
        self.has_reasoning = reasoning is not None
        self.parallel_tool_calls = parallel_tool_calls
        self.num_calls = 0
        self._dropping = False           # a streamed call past the first, with parallel_tool_calls=False
        self._ws = ""                    # content's trailing whitespace, held until text follows it

    def feed(self, text: str) -> list[dict]:
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
        else:
            reasoning, content = "", text
        return self._deltas(reasoning, content, final=False)

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas still held at the end, and the finish reason ("tool_calls" for an answer that
        called tools and stopped by itself)."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        deltas = self._deltas(reasoning, content, final=True)
        if self.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self._tools is None:
            if content:
                out.append({"content": content})
            return out
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        for e in events:
            if isinstance(e, (ParsedCall, CallStart)):         # a call's index, id and name
                self._ws = ""
                self._dropping = bool(self.num_calls and not self.parallel_tool_calls)
                if self._dropping:
                    continue
                self.num_calls += 1
                out.append({"tool_calls": [{"index": self.num_calls - 1, "id": tool_call_id(), "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
                if isinstance(e, ParsedCall):
                    out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": e.arguments}}]})
            elif isinstance(e, CallArgs):                      # then its arguments, fragment by fragment
                if not self._dropping:
                    out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": e.text}}]})
            elif e:
                # trailing blank text is held: blank text around calls is never content
                text = self._ws + e
                body = text.rstrip()
                self._ws = text[len(body):]
                if not body:
                    continue
                text = body
                if out and "content" in out[-1]:
                    out[-1]["content"] += text
                else:
                    out.append({"content": text})
        return out

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer as a message, and its finish reason."""
        deltas = self.feed(text)
        more, finish_reason = self.finish(finish_reason)
        return assemble(deltas + more, self.has_reasoning), finish_reason


def assemble(deltas: list[dict], has_reasoning: bool) -> dict:
    """A message from its deltas (what a client joining the stream would build)."""
    reasoning, content, calls = [], [], {}
    for d in deltas:
        reasoning.append(d.get("reasoning_content") or "")
        content.append(d.get("content") or "")
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = tc.get("id") or call["id"]
            fn = tc.get("function", {})
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    text = "".join(content)
    msg = {"role": "assistant", "content": text if text or not calls else None}
    if has_reasoning:
        msg["reasoning_content"] = "".join(reasoning) or None
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg
