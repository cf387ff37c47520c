"""The offline API, named as vLLM names it: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm.auto import tqdm

from pipespec.checkpoint.tokenizer import read_chat_template
from pipespec.config import EngineConfig
from pipespec.engine.llm_engine import LLMEngine
from pipespec.engine.outputs import RequestOutput, best_of
from pipespec.sampling import RequestOutputKind, SamplingParams


class LLM:
    """An engine for offline batched generation.

    `LLM(model=None)` loads the default model; every other keyword is an engine setting
    (dtype, device, max_model_len, block_size, num_kv_blocks, kv_cache_memory, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, ...), see `pipespec.config`.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in the order of the prompts.

        Prompts are strings, {"prompt": str} or {"prompt_token_ids": [...]}. Every prompt is checked
        before any is scheduled: a bad one raises ValueError naming it, and nothing runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
        params = self._params_list(sampling_params, len(prompts))
        groups = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                groups.append(self.engine.make_requests(f"gen-{next(self._ids)}", prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        done = self._run([req for group in groups for req in group], use_tqdm)
        outputs, at = [], 0
        for group, p in zip(groups, params):     # n > 1: one output with a completion per sequence
            outs, at = done[at:at + len(group)], at + len(group)
            if len(group) > p.n:        # best_of: the n with the highest cumulative logprob
                outs = [outs[i] for i in best_of([out.outputs[0].cumulative_logprob for out in outs], p.n)]
                if p.logprobs is None:  # (kept only to rank them)
                    for out in outs:
                        out.outputs[0].logprobs = None
            if len(group) > 1:
                for i, out in enumerate(outs):
                    out.outputs[0].index = i
                outs[0].request_id = group[0].request_id.rsplit("-", 1)[0]
                outs[0].outputs = [out.outputs[0] for out in outs]
            outputs.append(outs[0])
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or a list of them.

        `tools`: OpenAI tool definitions the template lists for the model; `chat_template_kwargs`:
        more template variables (e.g. {"enable_thinking": False}); `chat_template`: a Jinja template
        (or a file holding one) used instead of the model's. Assistant messages may carry
        `tool_calls` (arguments as objects) and `role: "tool"` messages the results. The output is
        the raw text: the server's parsers (pipespec.server.parsers) split out reasoning and calls."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        tokenizer = self.engine.tokenizer
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(read_chat_template(chat_template))
        prompts = []
        for i, conv in enumerate(conversations):
            _check_messages(conv, i)
            text = tokenizer.apply_chat_template(list(conv), add_generation_prompt, tools=tools,
                                                 **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        """One SamplingParams a prompt, each asking for its final output only (what generate returns)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [_final_only(sampling_params)] * n
        if isinstance(sampling_params, (list, tuple)) and len(sampling_params) == n:
            # (anything else is refused by make_request, naming the prompt)
            return [_final_only(p) if isinstance(p, SamplingParams) else p for p in sampling_params]
        raise ValueError("sampling_params must be a SamplingParams or a list with one per prompt")

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        for req in requests:
            engine.submit(req)
        order = {req.request_id: i for i, req in enumerate(requests)}
        done: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm or None,
                   leave=False)
        try:
            while any(d is None for d in done):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        done[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for req in requests:        # leave the engine clean for the next call
                engine.abort_request(req.request_id)
            raise
        finally:
            bar.close()
        return done

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block of the prefix cache; False (nothing done) while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _check_messages(conv, index: int) -> None:
    where = f"conversation {index}"
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    for j, msg in enumerate(conv):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not (isinstance(msg.get("content"), str) or msg.get("tool_calls") and msg.get("content") is None):
            raise ValueError(f"{where}, message {j}: needs a string 'role' and a string 'content' "
                             "(content may be None in an assistant message with tool_calls)")
