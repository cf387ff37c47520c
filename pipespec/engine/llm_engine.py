"""LLMEngine: the driver. Validates and admits requests, schedules steps, applies their results.

It owns all request state (I1). Stages are reached only through an Executor, with StepPlans out and
StepResults back, so the same loop drives one process or a pipeline of them.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque

from pipespec.config import EngineConfig
from pipespec.engine.detokenizer import IncrementalDetokenizer
from pipespec.engine.outputs import CompletionOutput, RequestOutput
from pipespec.engine.request import Request
from pipespec.engine.scheduler import ScheduledBatch, Scheduler
from pipespec.model.runner import StageRunner
from pipespec.model.source import resolve_model
from pipespec.runtime.executor import LocalExecutor
from pipespec.sampling import SamplingParams

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.perf_counter()
        source = resolve_model(config.model.model)
        self.model_name = source.name
        self.arch = source.arch
        self.tokenizer = source.tokenizer()
        self.max_model_len = self._max_model_len(config.model.max_model_len, source.arch.max_position)
        self.executor = LocalExecutor(functools.partial(
            StageRunner, source, config, (0, source.arch.num_layers), self.max_model_len))
        num_blocks = self.executor.available_kv_blocks()
        block_size = config.cache.block_size
        if num_blocks * block_size < self.max_model_len:
            if config.model.max_model_len is not None or num_blocks < 2:
                raise ValueError(f"the KV cache holds {num_blocks * block_size} tokens, fewer than "
                                 f"max_model_len={self.max_model_len}; give it more memory or lower max_model_len")
            logger.warning("KV cache holds %d tokens; lowering max_model_len from %d to fit",
                           num_blocks * block_size, self.max_model_len)
            self.max_model_len = num_blocks * block_size
        self.executor.allocate_kv_cache(num_blocks)
        self.scheduler = Scheduler(config.scheduler, block_size, num_blocks, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._in_flight: deque[ScheduledBatch] = deque()
        self._arrivals = itertools.count()
        logger.info("engine ready: %s, %d layers, max_model_len=%d, %d KV blocks, in %.1fs",
                    self.model_name, source.arch.num_layers, self.max_model_len, num_blocks,
                    time.perf_counter() - t0)

    @staticmethod
    def _max_model_len(asked: int | None, model_max: int) -> int:
        if asked is None:
            return model_max
        if asked > model_max:
            raise ValueError(f"max_model_len={asked} exceeds the model's context length {model_max}")
        return asked

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
            max_tokens = min(max_tokens, params.max_tokens)
        arrival = next(self._arrivals)
        seed = params.seed if params.seed is not None else (self.config.model.seed * _SEED_MIX + arrival) % 2**63
        req = Request(request_id, text, ids, params, seed, max_tokens,
                      frozenset(self.tokenizer.eos_token_ids), arrival)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return req

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> Request:
        return self.submit(self.make_request(request_id, prompt, params))

    def submit(self, req: Request) -> Request:
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
        """Keep the pipeline full, then apply the oldest result; returns outputs that changed."""
        while len(self._in_flight) < self.executor.max_in_flight:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            self.executor.submit(batch.plan)
            self._in_flight.append(batch)
        if not self._in_flight:
            return []
        batch = self._in_flight.popleft()
        result = self.executor.receive(timeout=self.config.parallel.stage_timeout)
        if result.step_id != batch.plan.step_id:
            raise RuntimeError(f"result of step {result.step_id} arrived for step {batch.plan.step_id}")
        self.scheduler.complete(batch)
        outputs = []
        for row, req in enumerate(batch.requests):
            if req.finished:        # aborted while in flight
                continue
            tokens = result.tokens(row)
            if tokens:
                self._append(req, tokens)
                outputs.append(self._output(req))
                if req.finished:
                    self.requests.pop(req.request_id, None)
        return outputs

    def _append(self, req: Request, tokens: list[int]) -> None:
        params = req.params
        for token in tokens:
            req.token_ids.append(token)
            delta = req.detokenizer.add(token)
            if token in req.eos_ids:
                return self.scheduler.finish(req, "stop")
            if token in req.stop_ids:
                return self.scheduler.finish(req, "stop", token)
            if params.stop_strings and delta:
                stop = req.detokenizer.find_stop(params.stop_strings, len(delta),
                                                 params.include_stop_str_in_output)
                if stop is not None:
                    return self.scheduler.finish(req, "stop", stop)
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                return self.scheduler.finish(req, "length")

    @staticmethod
    def _output(req: Request) -> RequestOutput:
        completion = CompletionOutput(0, req.detokenizer.text, req.output_token_ids, req.finish_reason,
                                      req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.token_ids[:req.num_prompt_tokens],
                             [completion], req.finished)

    def stats(self) -> dict:
        s = self.scheduler
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "kv_cache_usage": s.allocator.usage, "num_preemptions": s.num_preemptions}

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
