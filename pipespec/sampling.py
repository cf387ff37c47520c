"""Sampling parameters (user side) and seeded sampling over logits (last-stage side).

Randomness is counter based: the uniform number used for token `v` of the token at position `p` of
a request with seed `s` is a hash of (s, p, v, stream). A request therefore draws the same tokens
whatever batch it shares, whatever the pipeline size, and after a preemption recomputes them; and no
generator object, host loop or host sync is needed on the device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# The most logprobs (top-N alternatives) a request may ask for per token, as vLLM's default max_logprobs.
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs hold, as vLLM names it. CUMULATIVE: at every step, all its text and
    tokens so far. DELTA: only what is new since its last output (text that may still turn out to
    start a stop string is held back until it does not). FINAL_ONLY: one output, when it finishes.
    Cumulative outputs copy a request's tokens at every step, which for long answers costs the driver
    more than the rest of a step's host work; the server streams deltas, `generate` waits for finals."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Structured output, as vLLM names it: exactly one of a JSON schema (`json`, a dict or its JSON
    text), a regular expression, a list of choices, a grammar (Lark or GBNF), or `json_object` (any
    JSON object). Compiled by the engine when the request is added (`pipespec.engine.structured`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        given = [name for name in self.KINDS if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("SamplingParams.structured_outputs: give exactly one of json, regex, choice, grammar "
                             f"or json_object, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (str, dict)), "regex": isinstance(value, str),
              "grammar": isinstance(value, str),
              "choice": isinstance(value, (list, tuple)) and all(isinstance(c, str) and c for c in value),
              "json_object": value is True}[kind]
        if not ok:
            want = {"json": "a JSON schema (a dict or its JSON text)", "regex": "a string", "grammar": "a string",
                    "choice": "a list of non-empty strings", "json_object": "True"}[kind]
            raise ValueError(f"SamplingParams.structured_outputs.{kind}: must be {want}, got {value!r}")

    @property
    def kind(self) -> str:
        return next(name for name in self.KINDS if getattr(self, name))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls, named as vLLM names them."""

    n: int = 1                      # sequences per prompt (the engine runs n requests sharing its KV)
    # (vLLM v0's) sequences generated per prompt, of which the n with the highest cumulative logprob
    # are returned; None: n
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16     # None: until max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # per generated token, the sampled token's logprob and the `logprobs` most likely tokens' (the raw
    # model log-softmax, before any penalty or temperature, as vLLM's default); None: none
    logprobs: int | None = None
    # per prompt token after the first, its logprob and the `prompt_logprobs` most likely tokens'
    prompt_logprobs: int | None = None
    # logits processing, in vLLM's order: logit_bias, min_tokens and bad_words first, then the
    # repetition penalty (over prompt and generated tokens: positive logits divided by it, negative
    # ones multiplied) and OpenAI's frequency and presence penalties (over generated tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0             # no EOS or stop token id before this many generated tokens
    bad_words: list[str] | None = None    # never generated (each as the model's tokens would spell it)
    # the output follows a JSON schema, regex, choice or grammar (masks on the last stage); it ends
    # ("stop") when the grammar is complete
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_hold: int = field(init=False, repr=False)      # characters a DELTA output holds back

    def __post_init__(self):
        def bad(name: str, why: str):
            raise ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            bad("best_of", f"must be None or an integer >= n ({self.n})")
        if not _is_number(self.temperature) or self.temperature < 0 or self.temperature != self.temperature:
            bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer, -1 or 0 to disable")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            bad("repetition_penalty", "must be a number in (0, 100]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(v) and -100.0 <= v <= 100.0 for t, v in self.logit_bias.items()):
                bad("logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be an integer >= 0 and at most max_tokens")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", f"must be one of {', '.join(f'RequestOutputKind.{k.name}' for k in RequestOutputKind)}")
        object.__setattr__(self, "stop_strings", tuple(stops))
        # the longest stop string less one: text that may still turn out to begin one
        object.__setattr__(self, "stop_hold", max(map(len, stops), default=1) - 1)

    @property
    def sequences(self) -> int:
        """How many sequences run for one prompt: best_of (when given), else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the repetition, presence or frequency penalty applies (they need token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (penalties, bias, bans)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)


# ----------------------------------------------------------------------------------------------
# Tensor side: runs on the last stage, on whatever device the logits live.


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors (rows = requests that sample)."""

    temperature: torch.Tensor   # float32 [B]; 0 means greedy
    top_k: torch.Tensor         # int64 [B]; <= 0 means disabled
    top_p: torch.Tensor         # float32 [B]
    min_p: torch.Tensor         # float32 [B]
    seed: torch.Tensor          # int64 [B]
    needs_sort: bool            # host-known: does any row use top-k or top-p?
    all_greedy: bool            # host-known: skip the random path entirely

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seed

    def to(self, device) -> "SamplingTensors":
        return SamplingTensors(*(to_device(t, device) for t in self.tensors()), self.needs_sort, self.all_greedy)

    def padded(self, rows: int) -> "SamplingTensors":
        """These rows, then greedy ones up to `rows` (temperature 0, no top-k, top-p 1, seed 0): a
        CUDA graph verifies a bucket's fixed number of rows, and what padding rows draw is never read."""
        def pad(t, fill):
            out = t.new_full((rows,), fill)
            out[:t.shape[0]] = t
            return out
        return SamplingTensors(*map(pad, self.tensors(), (0.0, 0, 1.0, 0.0, 0)), self.needs_sort, self.all_greedy)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A plan's host tensor on a stage's device without waiting for the work queued there. A copy
    from pageable memory may synchronize with the stream, i.e. with the step in flight, which undoes
    async scheduling (measured: ~0.5 ms a copy at batch 64, RESULTS.md); from pinned memory it is
    queued, and the caching host allocator keeps the pinned block until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (xorshift-multiply); int64 arithmetic masked to 32 bits, so the
    # wrap-around of the products does not matter.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_keyed(seed: torch.Tensor, position: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """Uniform floats in (0, 1), shape [B, width], a pure function of (seed, position, column, stream)."""
    lo = seed & _M32
    hi = (seed >> 32) & _M32
    key = _mix32(_mix32(_mix32(lo) ^ hi) ^ (position & _M32))
    key = _mix32(key ^ ((stream * _GOLDEN) & _M32))
    cols = (torch.arange(width, device=seed.device, dtype=torch.int64) * _GOLDEN) & _M32
    bits = _mix32((key[:, None] + cols[None, :]) & _M32)
    # odd multiples of 2^-24 from 23 bits: exact in float32 and strictly inside (0, 1). (24 bits + 0.5
    # rounded the top value up to 1.0, and -log(1) = 0 made a filtered token win the race as NaN.)
    return ((bits >> 9) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k, top-p and min-p applied (rows sum to 1).

    Greedy rows get a one-hot distribution on their argmax, so callers can treat every row alike.
    """
    logits = logits.float()
    greedy = st.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]
    if st.needs_sort:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab))
        drop = rank >= k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= st.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    min_p = st.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    probs = torch.where(probs < min_p, torch.zeros_like(probs), probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def draw(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One token per row from `probs`, by the exponential race argmax(p / E), E ~ Exp(1) keyed."""
    u = uniform_keyed(seed, position, probs.shape[-1], stream)
    return (probs / -torch.log(u)).argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor) -> torch.Tensor:
    """Sample one token per row; `position` is the position the sampled token will occupy."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    return draw(processed_probs(logits, st), st.seed, position)


# ----------------------------------------------------------------------------------------------
# Logprobs: what a result row carries for each verify row, packed into int64 columns (I2: their
# number follows from the plan's `num_logprobs` and K alone). Per row: the token's logprob (float64
# bits), its rank (1 = the most likely), then N top ids and their N logprobs (float64 bits).


def logprob_width(num_logprobs: int) -> int:
    """int64 columns one verify row's logprobs take (`num_logprobs` < 0: none asked, 0 columns)."""
    return 0 if num_logprobs < 0 else 2 + 2 * num_logprobs


def logprob_columns(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: int) -> torch.Tensor:
    """Packed logprobs of `tokens` under `logits`; no host read (graph-capturable).

    logits [S, R, V] (raw model logits of each verify row), tokens [S, R] (-1 where the row sampled
    nothing: its columns are then meaningless). Returns int64 [S, R * logprob_width(N)]."""
    s, r, _ = logits.shape
    logits = logits.float()
    # logprob = logit - logsumexp: one reduction, no [S, R, V] log-softmax written out
    lse = logits.logsumexp(dim=-1, keepdim=True)
    tok_logit = logits.gather(-1, tokens.clamp_min(0)[..., None])                     # [S, R, 1]
    # rank as vLLM counts it: 1 + the tokens strictly more likely
    rank = (logits > tok_logit).sum(dim=-1, keepdim=True) + 1
    parts = [(tok_logit - lse).double().view(torch.int64), rank]
    if num_logprobs > 0:
        top, top_ids = logits.topk(num_logprobs, dim=-1)
        parts += [top_ids, (top - lse).double().view(torch.int64)]
    return torch.cat(parts, dim=-1).reshape(s, r * logprob_width(num_logprobs))


def append_logprobs(data: torch.Tensor, logits: torch.Tensor, sampling_reqs: torch.Tensor, num_spec_tokens: int,
                    num_logprobs: int) -> torch.Tensor:
    """A StepResult's data [B, result_width(K)] with each sampling request's packed logprobs appended
    (`pipespec.plan.result_width(K, num_logprobs)` columns in all); logits [S, K+1, V] of its verify
    rows, the tokens read from the data's first K+1 columns (rows of requests that do not sample: 0)."""
    k = num_spec_tokens
    tokens = data[sampling_reqs, :k + 1]
    extra = torch.zeros(data.shape[0], (k + 1) * logprob_width(num_logprobs), dtype=torch.int64, device=data.device)
    extra[sampling_reqs] = logprob_columns(logits, tokens, num_logprobs)
    return torch.cat((data, extra), dim=1)


def append_prompt_logprobs(data: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor,
                           num_logprobs: int) -> torch.Tensor:
    """A StepResult's data [B, W] with one row per prompt-logprob row appended: logits [L, V] of the
    rows whose next prompt token is token_ids [L]; [B + L, max(W, logprob_width(N))]."""
    rows = logprob_columns(logits[:, None], token_ids[:, None], num_logprobs)
    width = max(data.shape[1], rows.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))         # noqa: E731
    return torch.cat((pad(data), pad(rows)))


def unpack_logprobs(columns: list[int], count: int, num_logprobs: int) -> list[tuple[float, int, list[int], list[float]]]:
    """The first `count` rows of one result row's packed logprob columns (`logprob_columns`), as
    (logprob, rank, top ids, top logprobs) per row."""
    w, n = logprob_width(num_logprobs), num_logprobs
    doubles = torch.tensor(columns[:count * w], dtype=torch.int64).view(torch.float64).tolist()
    out = []
    for j in range(count):
        at = j * w
        out.append((doubles[at], columns[at + 1], columns[at + 2:at + 2 + n], doubles[at + 2 + n:at + w]))
    return out


# ----------------------------------------------------------------------------------------------
# Logits processing on the last stage. Each verify row of a line sees the request's tokens as of its
# own position: the driver's counts (every accepted token; a line continued under async scheduling
# adds the tokens its step in flight sampled, which only the stage knows yet), then the drafts before
# that row, which are accepted exactly when the row's output is used. Bans and biases come per row from the driver,
# which knows the drafts it sent (bad words whose prefix a draft completes, min_tokens by row).


def apply_penalties(logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                    penalties: torch.Tensor | None, penalty_tokens: torch.Tensor | None,
                    bias_entries: torch.Tensor | None, bias_values: torch.Tensor | None,
                    carried: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Processed copy of logits [S, R, V] (R = 1 + K verify rows, float32; written into `out` when
    given: a CUDA graph's buffer).

    draft_ids [S, K] the drafts the rows after the first embed, num_drafts [S] how many are real;
    penalties float32 [S, 3]: (repetition, presence, frequency) of each line (neutral: 1, 0, 0);
    penalty_tokens int64 [P, 4]: (line, token id, times generated, 1 if in the prompt else 0), the
    request's distinct tokens before the line's first row;
    bias_entries int64 [Q, 4]: (line, token id, first row, end row) with bias_values float32 [Q]
    (-inf: banned) added at rows first..end-1;
    carried int64 [S, C] (async scheduling, `stage.carry.carried_tokens`): generated tokens before the
    line's first row that penalty_tokens does not count yet (-1: none), counted at every row.

    Penalties touch only the tokens a row has seen: each known token at every row, and each draft at
    every row. Their logits are gathered, processed and written back (an entry named twice gets the
    same value twice: each is a function of its line, row and token alone), so the work is the
    number of tokens seen, not [S, R, V]. Every write is a scatter into a flat view (index_put_ with
    accumulate=True waited for the GPU: ~0.15 ms a call, RESULTS.md). No host read: a CUDA graph
    captures it over tables padded with (line 0, token 0) entries of no count and no bias, which
    change nothing (`stage.cuda_graphs`).
    """
    s, r, v = logits.shape
    out = logits.float().clone(memory_format=torch.contiguous_format) if out is None else out.copy_(logits)
    flat = out.view(-1)
    device = out.device
    rows = torch.arange(r, device=device)
    if bias_entries is not None and bias_entries.shape[0]:
        e = bias_entries
        inside = (rows[None, :] >= e[:, 2:3]) & (rows[None, :] < e[:, 3:4])                    # [Q, R]
        value = torch.where(inside, bias_values[:, None], torch.zeros((), device=device))
        flat.scatter_add_(0, ((e[:, 0:1] * r + rows[None, :]) * v + e[:, 1:2]).reshape(-1), value.reshape(-1))
    if penalties is None:
        return out
    k = r - 1
    known = penalty_tokens if penalty_tokens is not None else torch.zeros(0, 4, dtype=torch.int64, device=device)
    # the entries (line, row, token): every known token at every row, every draft (and carried token) at every row
    unknown = draft_ids if carried is None else torch.cat((draft_ids, carried), dim=1)
    u = unknown.shape[1]
    line = torch.cat((known[:, 0].repeat_interleave(r), torch.arange(s, device=device).repeat_interleave(u * r)))
    row = torch.cat((rows.repeat(known.shape[0]), rows.repeat(s * u)))
    tok = torch.cat((known[:, 1].repeat_interleave(r), unknown.clamp(0, v - 1).repeat_interleave(r, dim=1).reshape(-1)))
    # each line's counts before its first row, and which tokens its prompt holds, at those entries
    base = torch.zeros(s * v, device=device)            # [S, V] flat, as `prompt`
    prompt = torch.zeros(s * v, device=device)          # (summed, not set: a padding entry adds 0)
    base.scatter_add_(0, known[:, 0] * v + known[:, 1], known[:, 2].float())
    if carried is not None:
        at = torch.arange(s, device=device)[:, None] * v + carried.clamp(0, v - 1)
        base.scatter_add_(0, at.reshape(-1), (carried >= 0).float().reshape(-1))
    prompt.scatter_add_(0, known[:, 0] * v + known[:, 1], known[:, 3].float())
    # ... plus the real drafts before the entry's row
    before = (torch.arange(k, device=device)[None, :] < torch.minimum(row, num_drafts[line])[:, None])   # [N, K]
    at = line * v + tok
    count = base[at] + ((draft_ids[line] == tok[:, None]) & before).sum(-1).float()
    seen = (prompt[at] > 0) | (count > 0)
    at = (line * r + row) * v + tok
    x = flat[at]
    rep, presence, frequency = penalties[line].unbind(-1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    flat.scatter_(0, at, x - frequency * count - presence * (count > 0).float())
    return out


def padded_logits_tables(penalties: torch.Tensor | None, penalty_tokens: torch.Tensor | None,
                         bias_entries: torch.Tensor | None, bias_values: torch.Tensor | None, lines: int,
                         token_rows: int, bias_rows: int) -> tuple:
    """`apply_penalties`' tables (host tensors; None stays None) at fixed sizes, as a CUDA graph
    captured them: `lines` lines, the added ones neutral (1, 0, 0); `token_rows` count entries and
    `bias_rows` bias entries, the added ones (line 0, token 0) with no count, not in the prompt, and
    bias 0 at no row. The processed logits of the real lines are those of the tables as they were."""
    def pad(t, rows, fill):
        if t is None:
            return None
        out = t.new_full((rows, *t.shape[1:]), fill)
        out[:t.shape[0]] = t
        return out
    neutral = None if penalties is None else pad(penalties, lines, 0.0)
    if neutral is not None:
        neutral[penalties.shape[0]:, 0] = 1.0
    return neutral, pad(penalty_tokens, token_rows, 0), pad(bias_entries, bias_rows, 0), pad(bias_values, bias_rows, 0.0)


def apply_token_bitmask(logits: torch.Tensor, lines: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Structured output: logits [S, R, V] (a float32 copy the caller owns) with -inf at every token
    the grammar forbids at each verify row of lines [G] (indices into S); masks int32 [G * R, ceil(V / 32)]
    (bit t % 32 of word t // 32 set: token t allowed; `pipespec.engine.structured`)."""
    g, r, v = lines.shape[0], logits.shape[1], logits.shape[2]
    bits = torch.arange(32, device=masks.device, dtype=torch.int32)
    allowed = ((masks[:, :, None] >> bits) & 1).bool().reshape(g, r, -1)[:, :, :v]
    logits[lines] = logits[lines].masked_fill(~allowed, float("-inf"))
    return logits
