"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

from pipespec.model.tokenizer import Tokenizer

_CONTEXT = 5   # prompt tokens decoded with the output so the first word gets its leading space right


class IncrementalDetokenizer:
    """A token's text is the decoded window [prefix, new) less the decoded [prefix, read): decoding
    the tokens alone would lose a word's leading space and split characters that span tokens. The
    window bookkeeping runs in the tokenizers library (`DecodeStream`: one call a token, where two
    decodes of Python-sliced windows cost ~4x more host time at every step of every request)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._stream = tokenizer.decode_stream(skip_special_tokens)
        for token_id in prompt_ids[-_CONTEXT:]:        # context only: their text is not the output's
            self._stream.step(token_id)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is still partial)."""
        delta = self._stream.step(token_id)
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
