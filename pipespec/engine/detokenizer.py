"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

from pipespec.checkpoint.tokenizer import Tokenizer

_CONTEXT = 5   # prompt tokens decoded with the output so the first word gets its leading space right
# tokens that may wait for the rest of a character: a UTF-8 character is at most 4 bytes and a token
# holds at least one, so more never make one (a model repeating a lone byte token, say)
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """A token's text is the decoded window [prefix, new) less the decoded [prefix, read): decoding
    the tokens alone would lose a word's leading space and split characters that span tokens. The
    window bookkeeping runs in the tokenizers library (`DecodeStream`: one call a token, where two
    decodes of Python-sliced windows cost several times more host time at every step of every
    request)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._tokenizer, self._skip_special = tokenizer, skip_special_tokens
        self._step = self._restart(prompt_ids[-_CONTEXT:])
        self._pending: list[int] = []                 # tokens since the last text, still partial
        self.text = ""

    def _restart(self, context: list[int]):
        step = self._tokenizer.decode_stream(self._skip_special)
        for token_id in context:                       # context only: their text is not the output's
            step(token_id)
        return step

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is still partial)."""
        delta = self._step(token_id)
        if delta is None:
            self._pending.append(token_id)
            if len(self._pending) < _MAX_PENDING:
                return ""
            # bytes that never make a character: give them out as replacement characters and decode
            # on past them, rather than re-decode a window that grows at every token
            delta = self._tokenizer.decode(self._pending, self._skip_special)
            self._step = self._restart(self._pending[-_CONTEXT:])
        self._pending.clear()
        if not delta:
            return ""
        # grown through a local name: CPython then extends the string in place when nothing else
        # holds it (`self.text += delta` copies the whole text at every token: quadratic)
        text, self.text = self.text, ""
        text += delta
        self.text = text
        return delta

    def find_stop(self, stops: tuple[str, ...], delta_len: int, include: bool) -> str | None:
        """If a stop string ends in the newest text, cut the text there and return that stop string."""
        for stop in stops:
            start = max(len(self.text) - delta_len - len(stop) + 1, 0)
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[:at + (len(stop) if include else 0)]
                return stop
        return None
