"""What generate() returns, named as vLLM names it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None               # 1: the most likely token
    decoded_token: str | None = None


# one per generated token: the sampled token's Logprob and those of the top-N tokens, by token id
SampleLogprobs = list[dict[int, Logprob]]


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
