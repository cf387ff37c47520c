"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

from pipespec.model.tokenizer import Tokenizer

_CONTEXT = 5   # prompt tokens decoded with the output so the first word gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is still partial)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
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
