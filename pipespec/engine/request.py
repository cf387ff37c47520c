"""The lean per-request object. The scheduler and engine own it; stages never see it (I1)."""
from __future__ import annotations

import enum
import secrets
from array import array

from pipespec.engine.logits_inputs import TokenCounts, static_bias
from pipespec.engine.outputs import LogprobRecords
from pipespec.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "token_ids", "num_prompt_tokens", "params", "seed",
                 "max_tokens", "stop_ids", "eos_ids", "status", "num_computed_tokens", "block_ids",
                 "in_flight", "num_pending_tokens", "num_pending_samples", "carry_row", "draft_ids",
                 "state_slot", "state_commit", "num_cached_blocks", "cache_parent", "snapshot_points",
                 "finish_reason", "stop_reason", "detokenizer", "sent_tokens", "sent_chars", "logprobs",
                 "prompt_logprobs", "num_prompt_logprob_rows", "token_counts", "bad_words_ids",
                 "static_bias", "static_bias_values", "row_bans", "penalty_values", "adjusts_logits",
                 "prefix_leader", "grammar", "preempted")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, max_tokens: int, eos_ids: frozenset[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)    # every output shares it: never changed
        self.token_ids = list(prompt_token_ids)     # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(params.stop_token_ids or ())
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0                # tokens whose KV is in the cache
        self.block_ids = array("q")                # KV block ids (an array: the plan's block table copies it in C)
        self.in_flight = 0                          # micro-batches holding it that have not returned
        # async scheduling: rows the steps in flight compute (no drafts among them) and tokens they
        # sample, and its row in the last step scheduled (whose sampled token a next step carries)
        self.num_pending_tokens = 0
        self.num_pending_samples = 0
        self.carry_row = -1
        self.draft_ids: list[int] = []              # MTP drafts to verify in the next step
        self.num_cached_blocks = 0                  # its first blocks registered in the prefix cache
        self.cache_parent = 0                       # the last one's cache id (0: none)
        self.snapshot_points: tuple[int, ...] = ()  # prefill positions to snapshot linear-attention states at
        self.state_slot: int | None = None          # linear-attention state slot while running
        self.state_commit = -1                      # candidate state the next plan commits (-1: none)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = None
        self.sent_tokens = self.sent_chars = 0      # output tokens and text characters DELTA outputs gave
        # with SamplingParams.logprobs: one packed record per output token (the engine names the
        # function that gives a token's text, for the {id: Logprob} dicts an output builds from them)
        self.logprobs = LogprobRecords(params.logprobs, str) if params.logprobs is not None else None
        # with SamplingParams.prompt_logprobs: None (the first token has none), then one {id: Logprob}
        # per prompt token; and how many prompt tokens a step scheduled so far scores (the first: 1)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.num_prompt_logprob_rows = 1
        # logits processing (`engine/logits_inputs.py`): its tokens' counts (penalties), the bad
        # words' token sequences, the biases and bans that hold at every row (`set_bad_words`)
        self.adjusts_logits = params.adjusts_logits
        self.token_counts = (TokenCounts(prompt_token_ids, params.repetition_penalty != 1.0)
                             if params.penalized else None)
        self.set_bad_words(())
        # n > 1: the first of its siblings, whose computed prompt blocks it takes from the prefix
        # cache (it waits to be admitted until they are cached); None: none
        self.prefix_leader: Request | None = None
        # structured output: its grammar matcher (`engine/structured.py`), at the end of its tokens
        self.grammar = None
        self.preempted = False     # ever preempted (comes back only when all its tokens fit)

    def set_bad_words(self, seqs: tuple[tuple[int, ...], ...]) -> None:
        """The bad words as token sequences (`logits_inputs.bad_words_token_ids`)."""
        p = self.params
        self.bad_words_ids = seqs
        self.static_bias, self.static_bias_values = static_bias(p, seqs)
        # whether some bans depend on the tokens before a row (`logits_inputs._row_bans`)
        self.row_bans = p.min_tokens > 0 or any(len(s) > 1 for s in seqs)
        self.penalty_values = array("f", (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)).tobytes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is in the cache or being computed by a step in flight."""
        return self.num_computed_tokens + self.num_pending_tokens

    @property
    def num_expected_tokens(self) -> int:
        """Tokens it will have once the steps in flight return (async scheduling samples ahead)."""
        return len(self.token_ids) + self.num_pending_samples

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")

# Seeds of requests that bring none. A request's samples are a pure function of its seed and
# positions, so a request with a seed draws the same tokens whatever batch it shares. A request
# without one gets a seed derived from the engine's seed and its arrival index: with an explicit
# engine seed a run repeats; without one (vLLM's default) every engine starts from fresh randomness,
# so two runs draw different text.

_MIX = 0x9E3779B97F4A7C15


def engine_seed_base(engine_seed: int | None) -> int:
    return engine_seed if engine_seed is not None else secrets.randbits(63)


def unseeded_request_seed(base: int, arrival: int) -> int:
    return (base * _MIX + arrival) % 2**63
