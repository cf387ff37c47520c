"""What the last stage needs to process a step's logits (`pipespec.sampling.apply_penalties`), built by
the driver from the request state it owns (I1): each sampling line's penalties, its tokens' counts
before the line's first row, and per-row biases and bans. Bans that depend on the tokens before a row
(min_tokens, bad words) are worked out here for every verify row, the line's drafts included, since
the driver knows the drafts it sends: a row's output is used only when every draft before it is.

A step sends every penalized request's whole count table (a stage keeps nothing between steps), so
each request keeps its table as a flat C array updated token by token (`TokenCounts`), and a plan
joins the arrays: the per-step cost is a copy, not a Python loop over the tokens; likewise each
request keeps its penalties and the biases that hold at every row packed (`Request.set_bad_words`).
"""
from __future__ import annotations

from array import array

import numpy as np
import torch

_BANNED = float("-inf")
_ALL_ROWS = 1 << 30          # an end row past any line: the entry holds at every row


class TokenCounts:
    """A penalized request's distinct tokens: (token, times generated, 1 if in the prompt) triples."""

    __slots__ = ("index", "entries")

    def __init__(self, prompt_token_ids, with_prompt: bool):
        self.index: dict[int, int] = {}
        self.entries = array("q")
        if with_prompt:                  # the repetition penalty also covers the prompt's tokens
            for t in dict.fromkeys(prompt_token_ids):
                self.index[t] = len(self.entries) + 1
                self.entries.extend((t, 0, 1))

    def add(self, token: int) -> None:
        at = self.index.get(token)
        if at is None:
            self.index[token] = len(self.entries) + 1
            self.entries.extend((token, 1, 0))
        else:
            self.entries[at] += 1


def static_bias(params, tokenizer_bad_words: tuple[tuple[int, ...], ...]) -> tuple[array, array]:
    """The entries that hold at every row of every step: logit_bias and one-token bad words, as
    (token, first row, end row) triples and their values."""
    entries, values = array("q"), array("f")
    for t, b in (params.logit_bias or {}).items():
        entries.extend((t, 0, _ALL_ROWS))
        values.append(b)
    for seq in tokenizer_bad_words:
        if len(seq) == 1:
            entries.extend((seq[0], 0, _ALL_ROWS))
            values.append(_BANNED)
    return entries, values


def bad_words_token_ids(tokenizer, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the model would spell it, alone and after a space (as vLLM does)."""
    seqs = []
    for word in words or ():
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return tuple(seqs)


def _with_lines(flat: bytes, width: int, per_line) -> np.ndarray:
    """int64 [P, 1 + width]: the lines' concatenated `width`-wide rows, each led by its line index."""
    rows = np.frombuffer(flat, dtype=np.int64).reshape(-1, width)
    lines = np.repeat(np.arange(len(per_line), dtype=np.int64), per_line)
    return np.concatenate((lines[:, None], rows), axis=1)


def _row_bans(req, line_drafts: list[int], entries: array, values: array) -> None:
    """The bans of `req`'s verify rows that depend on the tokens before each row: end tokens while
    min_tokens is not reached, the last token of a bad word whose other tokens precede the row."""
    left = req.params.min_tokens - req.num_output_tokens
    if left > 0:
        for t in req.eos_ids | req.stop_ids:
            entries.extend((t, 0, left))
            values.append(_BANNED)
    if req.bad_words_ids:
        out = req.token_ids[req.num_prompt_tokens:]
        for seq in req.bad_words_ids:
            if len(seq) == 1:
                continue                                # (a static entry)
            prefix = list(seq[:-1])
            for j in range(len(line_drafts) + 1):       # row j follows the first j drafts
                ctx = out + line_drafts[:j] if j else out
                if len(ctx) >= len(prefix) and ctx[len(ctx) - len(prefix):] == prefix:
                    entries.extend((seq[-1], j, j + 1))
                    values.append(_BANNED)


def logits_inputs(samplers: list, drafts: list[list[int]], num_rows: int) -> dict:
    """StepPlan fields (`penalties`, `penalty_tokens`, `bias_entries`, `bias_values`) for sampling
    lines `samplers` verifying `drafts` (each line's real drafts), lines of `num_rows` = 1 + K rows;
    empty when no sampler adjusts its logits.

    A step of many penalized requests costs a few C-level joins of the arrays they keep (their
    counts, their static biases): per request, only list comprehensions, and Python work only for
    the requests whose bans change from row to row (`_row_bans`)."""
    if not any(r.adjusts_logits for r in samplers):
        return {}
    fields = {}
    static = [r.static_bias for r in samplers]
    entries = _with_lines(b"".join(static), 3, [len(e) // 3 for e in static])
    values = b"".join([r.static_bias_values for r in samplers])
    varying = [(line, r, d) for line, (r, d) in enumerate(zip(samplers, drafts)) if r.row_bans]
    if varying:
        more, more_values, more_lines = array("q"), array("f"), []
        for line, req, line_drafts in varying:
            n0 = len(more_values)
            _row_bans(req, line_drafts, more, more_values)
            more_lines += [line] * (len(more_values) - n0)
        rows = np.frombuffer(more, dtype=np.int64).reshape(-1, 3)
        entries = np.concatenate((entries, np.concatenate((np.array(more_lines, dtype=np.int64)[:, None], rows), 1)))
        values += more_values.tobytes()
    fields["bias_entries"] = torch.from_numpy(entries)
    fields["bias_values"] = torch.frombuffer(bytearray(values), dtype=torch.float32) if values else torch.empty(0)
    if any(r.token_counts is not None for r in samplers):
        tables = [r.token_counts.entries if r.token_counts is not None else _NO_COUNTS for r in samplers]
        fields["penalties"] = torch.frombuffer(bytearray(b"".join([r.penalty_values for r in samplers])),
                                               dtype=torch.float32).view(-1, 3)
        fields["penalty_tokens"] = torch.from_numpy(_with_lines(b"".join(tables), 3, [len(t) // 3 for t in tables]))
    return fields


_NO_COUNTS = array("q")
