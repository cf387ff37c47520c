"""What generate() returns, named as vLLM names it."""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None               # 1: the most likely token
    decoded_token: str | None = None


class LogprobRecords:
    """A request's logprobs as the driver receives them, a step at a time: per token one packed record
    of 2 + 2N int64 columns (its logprob as float64 bits, its rank, the top N ids, their logprobs as
    float64 bits: `sampling.logprob_columns` cut to the request's N). Building vLLM's {id: Logprob}
    dicts (N + 1 objects a token, each token's text looked up) on the step path cost more than the
    rest of the driver's step (RESULTS.md); they are built from these records when an output is read
    (`SampleLogprobs`)."""

    __slots__ = ("num_logprobs", "columns", "token_text", "_summed", "_sum")

    def __init__(self, num_logprobs: int, token_text: Callable[[int], str]):
        self.num_logprobs = num_logprobs
        self.columns = array("q")
        self.token_text = token_text          # a token's text (the engine's cache)
        self._summed, self._sum = 0, 0.0       # records summed so far, and their logprobs' sum

    def __len__(self) -> int:
        return len(self.columns) // (2 + 2 * self.num_logprobs)

    def cumulative(self) -> float:
        """The sum of every record's logprob, added token by token in order (as a running sum would)."""
        n = len(self)
        if n > self._summed:
            w = 2 + 2 * self.num_logprobs
            doubles = array("d", self.columns[self._summed * w:n * w].tobytes())
            total = self._sum
            for lp in doubles[::w]:
                total += lp
            self._summed, self._sum = n, total
        return self._sum

    def entries(self, start: int, token_ids: list[int]) -> list[dict[int, Logprob]]:
        """The {id: Logprob} of records start.. (one per id of `token_ids`, the tokens sampled there):
        the top N's, then the sampled token's (its own rank, also when it is among them)."""
        n, text = self.num_logprobs, self.token_text
        w = 2 + 2 * n
        ints = self.columns[start * w:(start + len(token_ids)) * w]
        doubles = array("d", ints.tobytes())
        out = []
        for at, token in zip(range(0, len(ints), w), token_ids):
            entry = {t: Logprob(doubles[at + 2 + n + r], r + 1, text(t)) for r, t in enumerate(ints[at + 2:at + 2 + n])}
            entry[token] = Logprob(doubles[at], ints[at + 1], text(token))
            out.append(entry)
        return out


class SampleLogprobs(Sequence):
    """A completion's logprobs: one {token id: Logprob} per generated token (the sampled token's and
    the top N's), as a list; built on first access from the request's records (`LogprobRecords`).
    Pickled as a plain list."""

    __slots__ = ("_records", "_start", "_token_ids", "_entries")

    def __init__(self, records: LogprobRecords, start: int, token_ids: list[int]):
        self._records, self._start, self._token_ids = records, start, token_ids
        self._entries: list[dict[int, Logprob]] | None = None

    def _list(self) -> list[dict[int, Logprob]]:
        if self._entries is None:
            self._entries = self._records.entries(self._start, self._token_ids)
        return self._entries

    def __len__(self) -> int:
        return len(self._token_ids)

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return list(self) == (list(other) if isinstance(other, (list, SampleLogprobs)) else other)

    def __repr__(self) -> str:
        return repr(self._list())

    def __reduce__(self):
        return list, (self._list(),)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None        # of `token_ids`, when SamplingParams.logprobs asked
    cumulative_logprob: float | None = None       # their sum over all tokens so far (with logprobs)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None              # set when an engine failure ended the request
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each one's {id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def best_of(cumulative_logprobs: list[float], n: int) -> list[int]:
    """best_of: the places of the n sequences with the highest cumulative logprob, best first (the
    earlier sequence first on a tie)."""
    return sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])[:n]
