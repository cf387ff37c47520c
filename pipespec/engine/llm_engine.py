"""LLMEngine: the driver. Validates and admits requests, schedules steps, applies their results.

It owns all request state (I1). Stages are reached only through an Executor, with StepPlans out and
StepResults back, so the same loop drives one process or a pipeline of them: with P stages it keeps
up to P micro-batches in flight. A failed stage is final: every pending request ends with
finish_reason "abort" and an error, every process stops, and `step` raises EngineDeadError.

Async scheduling (one stage; on by default on a GPU) keeps two steps in flight so the host's work for
step n + 1 -- applying step n - 1's result, detokenizing, scheduling, building and uploading the
plan -- runs while the device runs step n. Step n + 1 may continue a request of step n before that
step's result is known: its plan names the result row (`StepPlan.carried`), holds placeholders for
the token step n samples and the K drafts it proposes, and puts the line where it would start had no
draft been accepted; the stage fills the ids in and moves the line on by the drafts accepted, on the
device (`layout.carry_in`). The invariants hold: the driver still owns every request's state (I1):
it decides what is carried and from where, and records from step n's result the very token, drafts
and acceptance the stage used; shapes are fixed by the plan alone (I2); and the one stage embeds and
verifies the same draft rows, read back after the fill (I4). A request that step n ends (a stop
token, EOS, or its accepted drafts reaching max_tokens) wastes its rows of step n + 1, which are
dropped on return; the host's count of its tokens never crosses a length limit, and a continued
line's drafts never cross max_model_len.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque

from pipespec.checkpoint.source import engine_tokenizer, resolve_model
from pipespec.config import EngineConfig
from pipespec.engine.adaptive_k import make_policy
from pipespec.engine.detokenizer import IncrementalDetokenizer
from pipespec.engine.logits_inputs import bad_words_token_ids
from pipespec.engine.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from pipespec.engine.request import Request, engine_seed_base, unseeded_request_seed
from pipespec.engine.scheduler import ScheduledBatch, Scheduler
from pipespec.engine.spec_stats import SpecDecodeStats
from pipespec.engine.stages import build_executor, check_max_model_len
from pipespec.engine.structured import GrammarCompiler
from pipespec.placement import weights_dtype
from pipespec.plan import StepResult, position_margin
from pipespec.runtime.pipeline_executor import PipelineExecutor
from pipespec.runtime.transport import StageError
from pipespec.sampling import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A pipeline stage failed; the engine has stopped. `outputs` are the requests it aborted."""

    def __init__(self, message: str, outputs=()):
        super().__init__(message)
        self.outputs = list(outputs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        source = resolve_model(config.model.model, weights_dtype(config), config.model.revision,
                               config.model.download_dir)
        self.model_name = source.name
        self.arch = source.arch
        self.tokenizer = engine_tokenizer(source, config.model)
        self.max_model_len = check_max_model_len(config.model.max_model_len, source.arch.max_position)
        self.layer_ranges = config.parallel.layer_ranges(source.arch.num_layers)
        self._dead: str | None = None
        self.executor = build_executor(config, source, self.max_model_len)
        try:
            sizes = self.executor.available_cache()
            num_blocks = sizes.kv_blocks
            block_size = config.cache.block_size
            # one request alone must always fit, drafted positions (up to 2K past the end) included
            margin = position_margin(config.num_spec_tokens)
            if num_blocks * block_size < self.max_model_len + margin:
                if config.model.max_model_len is not None or num_blocks * block_size <= margin + 1:
                    raise ValueError(f"the KV cache holds {num_blocks * block_size} tokens, fewer than "
                                     f"max_model_len={self.max_model_len}" + (f" + {margin} drafted" if margin else "")
                                     + "; give it more memory or lower max_model_len")
                logger.warning("KV cache holds %d tokens; lowering max_model_len from %d to fit",
                               num_blocks * block_size, self.max_model_len)
                self.max_model_len = num_blocks * block_size - margin
            sched = config.scheduler
            if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
                # a longer prompt (or a preempted request's recompute) could never be scheduled
                raise ValueError(f"max_num_batched_tokens={sched.max_num_batched_tokens} is below max_model_len="
                                 f"{self.max_model_len}, which needs chunked prefill; raise "
                                 "max_num_batched_tokens, lower max_model_len or enable chunked prefill")
            self.executor.allocate_kv_cache(num_blocks, sizes.state_snapshots or 0)
        except BaseException:
            self.executor.shutdown()
            raise
        async_scheduling = self.executor.async_scheduling
        micro_batches = 1 if async_scheduling else self.executor.max_in_flight
        # adaptive K (speculative_config.adaptive): the policy picks each step's K; None: K is fixed
        self.k_policy = make_policy(config.speculative, micro_batches)
        caching, snapshots = config.cache.enable_prefix_caching, 0
        if caching and source.arch.hybrid is not None:
            # a prefix's KV is not enough here: its linear-attention layers need their recurrent and
            # conv states at the prefix's end, kept as snapshots (scheduler.py, "Linear-attention states")
            snapshots = sizes.state_snapshots or 0
            if snapshots:
                logger.info("prefix caching of %s's linear-attention (Gated DeltaNet) states: %d snapshots "
                            "(--prefix-cache-state-snapshots), taken at block boundaries of prompts",
                            self.model_name, snapshots)
            else:
                logger.info("prefix caching off: %s has linear-attention (Gated DeltaNet) layers and no "
                            "room for snapshots of them (prefix_cache_state_snapshots %s)", self.model_name,
                            config.cache.prefix_cache_state_snapshots)
                caching = False
        self.scheduler = Scheduler(config.scheduler, block_size, num_blocks, self.max_model_len,
                                   num_micro_batches=micro_batches,
                                   num_spec_tokens=config.num_spec_tokens,
                                   choose_k=self.k_policy.choose if self.k_policy else None,
                                   drafting=self.k_policy.drafting if self.k_policy else None,
                                   async_scheduling=async_scheduling, enable_prefix_caching=caching,
                                   num_state_snapshots=snapshots)
        self.spec_stats = SpecDecodeStats(config.num_spec_tokens, self.k_policy)
        self._last_result_at = 0.0
        self.requests: dict[str, Request] = {}
        self._in_flight: deque[ScheduledBatch] = deque()
        self._arrivals = itertools.count()
        self._seed_base = engine_seed_base(config.model.seed)
        self._token_texts: dict[int, str] = {}       # token id -> its text, for logprobs
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)    # structured output
        logger.info("engine ready: %s, %d layers, max_model_len=%d, %d KV blocks, async scheduling %s, "
                    "prefix caching %s, in %.1fs", self.model_name, source.arch.num_layers, self.max_model_len,
                    num_blocks, "on" if async_scheduling else "off", "on" if caching else "off", time.perf_counter() - t0)

    # -- admission --------------------------------------------------------------------------

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Text or token ids of a prompt, checked; ValueError names what is wrong."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError("a prompt dict takes exactly one of 'prompt' or 'prompt_token_ids'"
                                 + (f"; unknown keys: {sorted(unknown)}" if unknown else ""))
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                return None, self._check_token_ids(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return prompt, ids

    def _check_token_ids(self, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.arch.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt_token_ids[{i}] must be an integer, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}]={t} is not a token id (vocabulary size {vocab})")
        return list(ids)

    def make_request(self, request_id: str, prompt, params: SamplingParams) -> Request:
        """Validate everything about a request without touching the scheduler."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len}, "
                             "which leaves no room to generate")
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            if params.max_tokens > max_tokens:
                raise ValueError(f"max_tokens={params.max_tokens} does not fit: the prompt has {len(ids)} "
                                 f"tokens and max_model_len is {self.max_model_len}, leaving {max_tokens}")
            max_tokens = params.max_tokens
        arrival = next(self._arrivals)
        seed = params.seed if params.seed is not None else unseeded_request_seed(self._seed_base, arrival)
        req = Request(request_id, text, ids, params, seed, max_tokens, frozenset(self.tokenizer.eos_token_ids))
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if req.logprobs is not None:
            req.logprobs.token_text = self._token_text
        vocab = self.arch.vocab_size
        for t in params.logit_bias or ():
            if t >= vocab:
                raise ValueError(f"logit_bias names token id {t}, outside the vocabulary (size {vocab})")
        req.set_bad_words(bad_words_token_ids(self.tokenizer, params.bad_words))
        if params.structured_outputs is not None:
            req.grammar = self.grammars.compile(params.structured_outputs)
        return req

    def make_requests(self, request_id: str, prompt, params: SamplingParams) -> list[Request]:
        """The requests of one prompt: `params.sequences` of them (`request_id`-0 .. -{k-1}) when more
        than one, each drawing as a request of its own with seed `seed + i` would, the later ones
        taking the first one's prompt KV blocks from the prefix cache (`Request.prefix_leader`). With
        best_of > n each one keeps its sampled tokens' logprobs (logprobs=0 at least), which rank them
        (`outputs.best_of`)."""
        n = params.sequences if isinstance(params, SamplingParams) else 1
        if n == 1:
            return [self.make_request(request_id, prompt, params)]
        limit = self.config.scheduler.max_num_seqs
        if n > limit:
            name = "n" if n == params.n else "best_of"
            raise ValueError(f"{name}={n} is more sequences than the engine runs at once (max_num_seqs={limit})")
        if any(f"{request_id}-{i}" in self.requests for i in range(n)):
            raise ValueError(f"request id {request_id!r} is already in use")
        ranked = n > params.n
        reqs = []
        for i in range(n):
            child = dataclasses.replace(params, n=1, best_of=None,
                                        seed=None if params.seed is None else params.seed + i,
                                        logprobs=0 if ranked and params.logprobs is None else params.logprobs)
            reqs.append(self.make_request(f"{request_id}-{i}", prompt, child))
        if self.scheduler.enable_prefix_caching:
            for req in reqs[1:]:
                req.prefix_leader = reqs[0]
        return reqs

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> Request:
        return self.submit(self.make_request(request_id, prompt, params))

    def submit(self, req: Request) -> Request:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Keep the pipeline full, then apply the oldest result; returns the outputs of the requests
        it changed, as their `output_kind` asks (FINAL_ONLY: only of those that finished)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        with self._failures():
            while len(self._in_flight) < self.executor.max_in_flight:
                batch = self.scheduler.schedule()
                if batch is None:
                    break
                self._in_flight.append(batch)
                batch.submitted_at = time.perf_counter()
                try:
                    self.executor.submit(batch.plan)
                except BaseException:
                    if not isinstance(self.executor, PipelineExecutor):
                        self._in_flight.pop()      # a local stage never took it
                    raise
            if not self._in_flight:
                return []
        batch, result = self._receive()
        outputs = self._apply(batch, result)
        while self._in_flight and not self.requests:
            self._receive()        # async scheduling: a step ahead of requests that have all ended
        return outputs

    @contextlib.contextmanager
    def _failures(self):
        """A stage failure kills the engine (`_die`); an interrupt mid-step leaves it dead too."""
        try:
            yield
        except StageError as e:
            raise self._die(str(e)) from None
        except BaseException as e:
            if getattr(self.executor, "failed", False):   # interrupted mid-step: the pipeline is gone
                self._die(f"interrupted ({type(e).__name__})", level=logging.DEBUG)   # the user knows
            raise

    def _receive(self) -> tuple[ScheduledBatch, StepResult]:
        """The oldest step's result, its batch completed in the scheduler."""
        with self._failures():
            result = self.executor.receive(timeout=self.config.parallel.stage_timeout)
            batch = self._in_flight.popleft()
        if result.step_id != batch.plan.step_id:
            raise RuntimeError(f"result of step {result.step_id} arrived for step {batch.plan.step_id}")
        self._measure_step(batch)
        self.scheduler.complete(batch, result)
        return batch, result

    def _apply(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Append each request's new tokens; the outputs that changed."""
        outputs = []
        if batch.prompt_logprob_rows is not None:
            self._add_prompt_logprobs(batch, result)
        for row, (req, d) in enumerate(zip(batch.requests, batch.num_drafts)):
            if req.finished:        # ended while in flight (aborted; with async scheduling, stopped)
                continue
            tokens = result.tokens(row)
            if d:
                self.spec_stats.record(d, len(tokens) - 1)
                if self.k_policy is not None:
                    self.k_policy.record_acceptance(d, len(tokens) - 1)
            if tokens:
                before = len(req.token_ids)
                self._append(req, tokens)
                if req.logprobs is not None:      # (of the tokens appended: a stop may end it early)
                    req.logprobs.columns.frombytes(result.logprob_records(row, len(req.token_ids) - before,
                                                                          req.logprobs.num_logprobs))
                if req.finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    outputs.append(self._output(req))
                if req.finished:
                    self.requests.pop(req.request_id, None)
                else:
                    req.draft_ids = result.drafts(row)
        if self.spec_stats.num_spec_tokens:      # (also when adaptive K runs without drafts for a while)
            self._maybe_log_spec()
        if not self.requests:
            self._last_result_at = 0.0            # idle until new requests: no step spans the gap
        return outputs

    def _measure_step(self, batch: ScheduledBatch) -> None:
        """Adaptive K's cost of a step, steady steps only: the time since the previous result, i.e.
        the driver's work and the device's together, overlapped or not (a full pipeline's
        throughput; async scheduling's K = 0 steps), so every K pays for its host time alike; or
        since its submission when the engine had gone idle (`_apply` forgets the last result)."""
        now = time.perf_counter()
        start, self._last_result_at = self._last_result_at or batch.submitted_at, now
        if self.k_policy is not None and batch.steady:
            self.k_policy.record_step(len(batch.requests), batch.plan.num_spec_tokens, now - start)

    def _append(self, req: Request, tokens: list[int]) -> None:
        params = req.params
        for token in tokens:
            req.token_ids.append(token)
            if req.token_counts is not None:
                req.token_counts.add(token)
            if token in req.eos_ids:       # before its text: an end token's text is never output
                return self.scheduler.finish(req, "stop")
            delta = req.detokenizer.add(token)
            if token in req.stop_ids:
                return self.scheduler.finish(req, "stop", token)
            if req.grammar is not None:
                if not req.grammar.advance(token):
                    logger.error("request %s: its grammar refused token %d, which its mask allowed: %s",
                                 req.request_id, token, req.grammar.error)
                    return self.scheduler.finish(req, "abort")
                if req.grammar.complete:       # the output is whole: nothing but an end token could follow
                    return self.scheduler.finish(req, "stop")
            if params.stop_strings and delta:
                stop = req.detokenizer.find_stop(params.stop_strings, len(delta),
                                                 params.include_stop_str_in_output)
                if stop is not None:
                    return self.scheduler.finish(req, "stop", stop)
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                return self.scheduler.finish(req, "length")

    def _add_prompt_logprobs(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Each line's scored prompt tokens, in plan order (`StepPlan.prompt_logprob_rows`)."""
        first = 0
        for req, count in zip(batch.requests, batch.prompt_logprob_rows):
            if not count:
                continue
            n = req.params.prompt_logprobs
            for lp, rank, top_ids, top_lps in result.prompt_logprobs(first, count):
                token = req.prompt_token_ids[len(req.prompt_logprobs)]
                entry = {t: Logprob(v, r + 1, self._token_text(t)) for r, (t, v) in enumerate(zip(top_ids[:n], top_lps[:n]))}
                entry[token] = Logprob(lp, rank, self._token_text(token))
                req.prompt_logprobs.append(entry)
            first += count

    def _token_text(self, token: int) -> str:
        """One token's text, as logprobs name it (cached: a top-N list repeats the same few ids)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    @staticmethod
    def _output(req: Request, error: str | None = None) -> RequestOutput:
        """The request's output now, as its output_kind asks; a DELTA output moves its marks on."""
        text, first = req.detokenizer.text, req.num_prompt_tokens
        # prompt logprobs: complete once a token was sampled; a DELTA output gives them once, first
        prompt_logprobs = req.prompt_logprobs
        if req.params.output_kind is RequestOutputKind.DELTA:
            if req.sent_tokens:
                prompt_logprobs = None
            # (a stop string found later never cuts into what was sent: see SamplingParams.stop_hold)
            end = len(text) if req.finished else max(len(text) - req.params.stop_hold, req.sent_chars)
            text, req.sent_chars = text[req.sent_chars:end], end
            first += req.sent_tokens
            req.sent_tokens = req.num_output_tokens
        completion = CompletionOutput(0, text, req.token_ids[first:], req.finish_reason, req.stop_reason)
        if req.logprobs is not None:      # (the {id: Logprob} dicts are built when they are read)
            completion.logprobs = SampleLogprobs(req.logprobs, first - req.num_prompt_tokens, completion.token_ids)
            completion.cumulative_logprob = req.logprobs.cumulative()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.finished, error,
                             prompt_logprobs)

    def _die(self, reason: str, level: int = logging.ERROR) -> EngineDeadError:
        """A stage failed: abort every pending request with the error, stop all stages."""
        message = f"pipeline failure: {reason}"
        outputs = []
        for req in list(self.requests.values()):
            if not req.finished:
                self.scheduler.finish(req, "abort")
                outputs.append(self._output(req, error=message))
        for batch in self._in_flight:       # their results will never come: give their blocks back
            self.scheduler.complete(batch)
        self._in_flight.clear()
        self.requests.clear()
        self._dead = message
        try:
            self.executor.shutdown()
        except Exception as e:   # noqa: BLE001 - the first failure is the one to report
            logger.warning("while shutting down after the failure: %s", e)
        logger.log(level, "%s; %d requests aborted", message, len(outputs))
        return EngineDeadError(f"{message} ({len(outputs)} pending requests aborted)", outputs)

    def _maybe_log_spec(self, every: float = 10.0) -> None:
        if self.spec_stats.log_due(time.monotonic(), every):
            logger.info("%s", self.spec_stats.summary())

    def stats(self) -> dict:
        s = self.scheduler
        stats = {"num_running": len(s.running), "num_waiting": len(s.waiting),
                 "kv_cache_usage": s.allocator.usage, "num_preemptions": s.num_preemptions}
        if s.enable_prefix_caching:        # in tokens: looked up on admission, and of them reused
            stats["prefix_cache"] = s.prefix_cache_stats()
        if s.async_scheduling:     # rows scheduled before the step giving their input token returned
            stats["num_carried_rows"] = s.num_carried_rows
        if self.spec_stats.num_spec_tokens:
            stats["spec_decode"] = self.spec_stats.as_dict()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (for benchmarks: the next requests start cold). False, and
        nothing done, while requests are unfinished (they may hold cached blocks)."""
        if self.requests or self.scheduler.has_work():
            return False
        n = self.scheduler.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", n)
        return True

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
