"""Reasoning parsers: the text of a `<think>...</think>` block goes to `reasoning_content`, the rest
to `content`, for whole outputs and for streams of pieces alike (one implementation for both, so a
streamed answer always joins to the non-streamed one).

Where reasoning starts is told by the prompt: templates that open the block themselves end the
generation prompt with `<think>` (Qwen3-2507 thinking, Qwen3.5/3.6, GLM-4.7/5, DeepSeek-V3.1/V3.2 in
thinking mode, DeepSeek-R1); with thinking off they end it with `</think>` (an empty block) or with
nothing, and the model answers directly. Older templates leave it to the model to write `<think>`
first (Qwen3, GLM-4.5/4.6)."""
from __future__ import annotations

import dataclasses

from pipespec.server.parsers.markup import Tag, TagSplitter


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # the output is reasoning until `end` even when neither the prompt nor the output opened the
    # block (DeepSeek-R1's template adds `<think>` only in some versions; the model never writes it)
    always_starts_inside: bool = False
    # tags that end the reasoning when the model skips `end` (they stay in the output, as content)
    implicit_ends: tuple[str, ...] = ()

    def stream(self, prompt: str = "") -> "ReasoningStream":
        return ReasoningStream(self, self.always_starts_inside or prompt.rstrip().endswith(self.start))

    def split(self, text: str, prompt: str = "") -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        s = self.stream(prompt)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return r1 + r2, c1 + c2


REASONING_PARSERS = {
    # Qwen3 models now and then open a tool call without closing the reasoning block first
    "qwen3": ReasoningFormat("qwen3", implicit_ends=("<tool_call>",)),
    "glm45": ReasoningFormat("glm45"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_starts_inside=True),
    # V3.1/V3.2: `thinking` in chat_template_kwargs makes the template end the prompt with `<think>`
    # (else with `</think>`); DeepSeek-V3 (no thinking) never opens a block
    "deepseek_v3": ReasoningFormat("deepseek_v3"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


_START, _REASONING, _AFTER, _CONTENT = "start", "reasoning", "after", "content"


class ReasoningStream:
    """One output's reasoning split, fed in pieces: `feed(piece)` and `finish()` return
    (reasoning delta, content delta). Blank lines around the reasoning are trimmed; a tag split
    across pieces is held back until it is whole."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self._split = TagSplitter((fmt.start, fmt.end, *fmt.implicit_ends))
        self._state = _REASONING if inside else _START
        self._pending = ""             # whitespace not yet placed (before the block, or reasoning's tail)
        self._reasoning_started = False

    def feed(self, piece: str) -> tuple[str, str]:
        return self._run(self._split.feed(piece))

    def finish(self) -> tuple[str, str]:
        reasoning, content = self._run(self._split.finish())
        if self._state == _START and self._pending:     # an output of whitespace only
            content += self._pending
        self._pending = ""
        return reasoning, content

    def _run(self, items: list) -> tuple[str, str]:
        reasoning, content = [], []
        for item in items:
            state = self._state
            if isinstance(item, Tag):
                if state == _START and item == self.fmt.start:
                    self._state, self._pending = _REASONING, ""
                elif state in (_START, _REASONING) and item == self.fmt.end:
                    self._state, self._pending = _AFTER, ""
                elif state == _REASONING and item in self.fmt.implicit_ends:
                    self._state, self._pending = _CONTENT, ""
                    content.append(str(item))
                elif state == _REASONING:
                    pass                       # a second opening tag inside the block: dropped
                else:
                    self._text(str(item), reasoning, content)
            else:
                self._text(item, reasoning, content)
        return "".join(reasoning), "".join(content)

    def _text(self, text: str, reasoning: list, content: list) -> None:
        state = self._state
        if state == _START:
            if not text.strip():
                self._pending += text
                return
            text, self._pending, self._state = self._pending + text, "", _CONTENT
            content.append(text)
        elif state == _REASONING:
            text = self._pending + text
            if not self._reasoning_started:
                text = text.lstrip()
                if not text:
                    self._pending = ""
                    return
                self._reasoning_started = True
            body = text.rstrip()
            self._pending = text[len(body):]
            if body:
                reasoning.append(body)
        elif state == _AFTER:
            text = text.lstrip()
            if text:
                self._state = _CONTENT
                content.append(text)
        else:
            content.append(text)
