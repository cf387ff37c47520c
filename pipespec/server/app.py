"""The FastAPI application: OpenAI-compatible routes, health, version and metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pipespec
from pipespec.engine.llm_engine import EngineDeadError
from pipespec.engine.outputs import Logprob, best_of
from pipespec.server.async_engine import AsyncEngine, QueueFullError
from pipespec.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from pipespec.server.chat_request import ChatOptions, prepare_chat
from pipespec.server.metrics import Metrics
from pipespec.server.request_log import log_request
from pipespec.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_requests: bool = False,
              model_aliases: tuple[str, ...] = (), chat_options: ChatOptions = ChatOptions()) -> FastAPI:
    """`log_requests`: one INFO line per finished request; `model_aliases`: more names the API
    accepts for the model (vLLM's several --served-model-name); `chat_options`: tools and reasoning."""
    app = FastAPI(title="pipespec", version=pipespec.__version__)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)    # inside the API-key check below
    metrics = Metrics(model_name)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            err = ApiError(400, "request body is not valid JSON")
            return JSONResponse(err.body(), status_code=400)
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            required = _REQUIRED.get(request.url.path, ())
            err = ApiError(400, f"request body is missing; {' and '.join(required) or 'a JSON object'} "
                                "is required", required[0] if required else None)
            return JSONResponse(err.body(), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        field = loc[0] if loc else None
        # a union field reports one error per member type; name the field, not the member
        where = ".".join(x for x in loc if not x.isidentifier() or x == field or x in _FIELDS) or field
        msg = first.get("msg", "invalid request")
        err = ApiError(400, f"{where}: {msg}" if where else msg, field)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                err = ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               kind="authentication_error")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name and name not in model_aliases:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           "model", kind="not_found_error")

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "error", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": pipespec.__version__}

    @app.get("/metrics")
    async def prometheus():
        metrics.update_engine(engine.stats)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget the prefix cache (for benchmarks: the next requests start cold); 409 while requests run."""
        if not await engine.reset_prefix_cache():
            raise ApiError(409, "requests are running; reset the prefix cache when the server is idle",
                           kind="conflict_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pipespec", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = completion_prompts(body.prompt)
        params = body.sampling_params(body.max_tokens, 16)
        if len(prompts) > 1 or params.sequences > 1:
            return await _respond_many(body, prompts, params, chat=False)
        return await _respond(request, body, prompts[0], params, chat=False)

    def render_chat(plan, add_generation_prompt: bool) -> tuple[dict, str]:
        """Tokens and text of a conversation (run off the event loop: it can take seconds)."""
        try:
            text = tokenizer.apply_chat_template(plan.messages, add_generation_prompt, tools=plan.tools,
                                                 **plan.template_kwargs)
        except Exception as e:     # a template that raises on this conversation is the client's problem
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, text

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        plan = prepare_chat(body, chat_options)
        prompt, text = await engine.run_blocking(render_chat, plan, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, None)
        parser = plan.output_parser(chat_options, text)
        if parser is not None:          # the markup may be special tokens: keep them in the text to parse
            if params.n > 1:
                raise ApiError(400, "n > 1 with tool calls or reasoning parsing is not supported", "n")
            params = dataclasses.replace(params, skip_special_tokens=False)
        if params.n > 1:
            return await _respond_many(body, [prompt], params, chat=True)
        return await _respond(request, body, prompt, params, chat=True, parser=parser)

    async def start(body, prompt, params, id_prefix: str, index: int | None = None) -> list[_Generation]:
        """Admit one prompt's requests (params.n), or raise the API error its refusal maps to
        (`index`: its place in a list of prompts, named in a 400)."""
        try:
            streams, prompt_ids = await engine.add_request(prompt, params, id_prefix)
        except ValueError as e:
            if str(e).startswith("structured_outputs"):     # the grammar does not compile, or no library
                raise body.structured_error(str(e)) from None
            if index is None:
                raise ApiError(400, str(e), _param_of(str(e))) from None
            raise ApiError(400, f"prompt[{index}]: {e}", "prompt") from None
        except QueueFullError as e:
            raise ApiError(503, str(e), kind="server_overloaded") from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), kind="engine_error") from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        gens = [_Generation(engine, metrics, request_id, outputs, len(prompt_ids), log_requests, params.logprobs,
                            getattr(body, "prompt_logprobs", None) is not None)
                for request_id, outputs in streams]
        if getattr(body, "echo", False):        # completions: the text (and logprobs) start with the prompt
            text = prompt if isinstance(prompt, str) else await engine.run_blocking(tokenizer.decode, prompt_ids, False)
            first = tokenizer.decode(prompt_ids[:1], skip_special_tokens=False)
            for gen in gens:
                gen.echo = (text, first)
        return gens

    async def _respond(request: Request, body, prompt, params, chat: bool, parser=None):
        gen, = await start(body, prompt, params, "chatcmpl" if chat else "cmpl")
        object_name = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(gen, chat, model_name, object_name + ".chunk" if chat else object_name,
                                          include_usage, parser), media_type="text/event-stream")
        try:
            text, finish = await gen.collect()
        finally:
            gen.close()
        if parser is not None:          # reasoning and tool calls parsed out of the text
            message, finish = parser.message(text, finish)
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
        choice["logprobs"] = gen.format_logprobs(gen.logprobs, chat)
        if gen.prompt_logprobs is not None:
            choice["prompt_logprobs"] = gen.prompt_logprobs
        return {"id": gen.request_id, "object": object_name, "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": gen.usage()}

    async def _respond_many(body, prompts: list, params, chat: bool):
        """Several choices run side by side: n per prompt, index = the prompt's place in the list
        times n plus the sequence's (the first of them keeps the id of the whole response)."""
        groups: list[list[_Generation]] = []      # each prompt's
        gens: list[_Generation] = []
        try:
            for i, prompt in enumerate(prompts):
                groups.append(await start(body, prompt, params, "chatcmpl" if chat else "cmpl",
                                          i if len(prompts) > 1 else None))
                gens += groups[-1]
        except BaseException:
            for gen in gens:
                gen.close()
            raise
        object_name = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse_many(gens, model_name, include_usage, chat,
                                               object_name + ".chunk" if chat else object_name),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(gen.collect() for gen in gens))
        finally:
            for gen in gens:
                gen.close()
        usage = _total_usage(gens)          # (with best_of: of every sequence run)
        if params.sequences > params.n:     # best_of (never streamed): each prompt's n most likely sequences
            results = dict(zip(map(id, gens), results))
            gens = [group[i] for group in groups for i in best_of([g.cumulative_logprob for g in group], params.n)]
            results = [results[id(gen)] for gen in gens]
        choices = [{"index": i, "finish_reason": finish, "logprobs": gen.format_logprobs(gen.logprobs, chat),
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                    **({"prompt_logprobs": gen.prompt_logprobs} if gen.prompt_logprobs is not None else {})}
                   for i, (gen, (text, finish)) in enumerate(zip(gens, results))]
        return {"id": gens[0].request_id, "object": object_name, "created": int(time.time()),
                "model": model_name, "choices": choices, "usage": usage}

    app.state.metrics = metrics
    return app


def completion_prompts(prompt) -> list:
    """/v1/completions' prompt as a list of engine prompts: a string, a list of token ids, or a list
    of either (one choice each)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _total_usage(gens) -> dict:
    usages = [gen.usage() for gen in gens]
    return {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


# required fields of each route's body, named when the body is missing altogether
_REQUIRED = {route: tuple(name for name, f in model.model_fields.items() if f.is_required())
             for route, model in (("/v1/completions", CompletionRequest),
                                  ("/v1/chat/completions", ChatCompletionRequest))}
_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {"role", "content"}


def _param_of(message: str) -> str | None:
    for name in ("n", "best_of"):
        if message.startswith(f"{name}="):
            return name
    for name in ("prompt_token_ids", "prompt", "max_tokens", "messages", "logit_bias"):
        if name in message:
            return name
    return None


class _Generation:
    """Turns one request's engine outputs (DELTA: what is new, stop-string text already held back by
    the engine) into text deltas, and keeps its metrics."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, request_id: str, outputs: asyncio.Queue,
                 num_prompt_tokens: int, log_requests: bool = False, num_logprobs: int | None = None,
                 want_prompt_logprobs: bool = False):
        self.engine, self.metrics, self.request_id, self.outputs = engine, metrics, request_id, outputs
        self.num_logprobs = num_logprobs     # SamplingParams.logprobs (None: no logprobs in the answer)
        self.logprobs: list = []              # (token id, {id: Logprob}) of every token, for a whole response
        self.delta_logprobs: list = []        # those of the last delta
        self.text_offset = 0                  # completions' text_offset of the next token
        self.prompt_logprobs = None           # vLLM's form of them, from the first output (when asked)
        self.want_prompt_logprobs = want_prompt_logprobs    # (echo asks the engine for them on its own)
        self.echo: tuple[str, str] | None = None     # (prompt text, its first token's) to put before the first delta
        self.cumulative_logprob = 0.0         # of the tokens so far (best_of ranks by it)
        self.num_prompt_tokens = num_prompt_tokens
        self.log_requests = log_requests
        self.num_tokens = 0
        self.parts: list[str] = []          # the deltas, joined once for a whole response
        self.finish_reason = None
        self.error: str | None = None
        self.done = False
        self.arrival = time.perf_counter()
        self.last_token_time = None

    async def deltas(self):
        """Yield (text delta, finish_reason or None) until the request finishes."""
        while not self.done:
            out = await self.outputs.get()
            if isinstance(out, Exception):
                self.error = str(out)
                raise ApiError(500, f"the engine failed: {out}", kind="engine_error")
            completion = out.outputs[0]
            text = completion.text
            if out.prompt_logprobs is not None and self.prompt_logprobs is None and self.want_prompt_logprobs:
                self.prompt_logprobs = [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                                         "decoded_token": lp.decoded_token}
                                                                for t, lp in e.items()}
                                        for e in out.prompt_logprobs]
            self._count(len(completion.token_ids))
            self.num_tokens += len(completion.token_ids)
            if completion.cumulative_logprob is not None:
                self.cumulative_logprob = completion.cumulative_logprob
            self.delta_logprobs = ([] if completion.logprobs is None
                                   else list(zip(completion.token_ids, completion.logprobs)))
            if self.echo is not None:        # the prompt's tokens first: the first one has no logprob
                text, first = self.echo[0] + text, self.echo[1]
                self.echo = None
                if out.prompt_logprobs is not None:
                    ids = out.prompt_token_ids
                    self.delta_logprobs[:0] = [(ids[0], Logprob(None, None, first))] + list(
                        zip(ids[1:], out.prompt_logprobs[1:]))
            self.logprobs += self.delta_logprobs
            self.parts.append(text)
            if out.finished:
                self.done = True
                self.finish_reason = completion.finish_reason
                self.metrics.finished(self.finish_reason)
                self.metrics.e2e.observe(time.perf_counter() - self.arrival)
            yield text, self.finish_reason

    def _count(self, new_tokens: int) -> None:
        if new_tokens <= 0:
            return
        now = time.perf_counter()
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe((now - self.last_token_time) / new_tokens)
        self.last_token_time = now
        self.metrics.generation_tokens.inc(new_tokens)

    async def collect(self) -> tuple[str, str]:
        async for _ in self.deltas():
            pass
        return "".join(self.parts), self.finish_reason

    def format_logprobs(self, tokens: list, chat: bool) -> dict | None:
        """OpenAI's logprobs object for these (token id, {id: Logprob}) pairs, None when not asked
        for: chat's {"content": [...]}, or completions' tokens / token_logprobs / top_logprobs /
        text_offset (offsets into the choice's text, counted on from the previous chunk's)."""
        n = self.num_logprobs
        if n is None:
            return None
        rows = [(entry, None) if isinstance(entry, Logprob) else      # an echoed prompt's first token
                (entry[token], sorted((lp for t, lp in entry.items()
                                       if lp.rank <= n and (t != token or len(entry) <= n)),
                                      key=lambda lp: lp.rank)[:n])
                for token, entry in tokens]
        if chat:
            def item(lp):
                text = lp.decoded_token or ""
                return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [dict(item(c), top_logprobs=[item(t) for t in top]) for c, top in rows]}
        offsets = []
        for chosen, _ in rows:
            offsets.append(self.text_offset)
            self.text_offset += len(chosen.decoded_token or "")
        return {"tokens": [c.decoded_token for c, _ in rows], "token_logprobs": [c.logprob for c, _ in rows],
                "top_logprobs": [None if top is None else {t.decoded_token: t.logprob for t in top} for _, top in rows],
                "text_offset": offsets}

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

    def close(self) -> None:
        """Abort the request unless it finished (a client that went away frees its blocks)."""
        if not self.done:
            self.engine.abort(self.request_id)
            self.metrics.finished("abort")
        if self.log_requests:
            self.log_requests = False      # once
            log_request(self.request_id, self.num_prompt_tokens, self.num_tokens,
                        self.finish_reason if self.done else "abort (client gone)",
                        time.perf_counter() - self.arrival, self.error)


async def _sse(gen: _Generation, chat: bool, model: str, object_name: str, include_usage: bool, parser=None):
    created = int(time.time())

    def chunk(choice: dict | None, usage: dict | None = None) -> str:
        payload = {"id": gen.request_id, "object": object_name, "created": created, "model": model,
                   "choices": [choice] if choice is not None else []}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        async for delta, finish in gen.deltas():
            # this delta's tokens' logprobs (None when not asked for), on its first chunk
            logprobs = gen.format_logprobs(gen.delta_logprobs, chat)
            gen.delta_logprobs = []
            if parser is not None:      # reasoning and tool calls: parsed deltas, then the finish reason
                parsed = list(parser.feed(delta)) if delta else []
                if finish is not None:
                    more, finish = parser.finish(finish)
                    parsed += more
                if logprobs is not None and logprobs["content"] and not parsed:
                    parsed = [{}]                     # tokens with no text out yet: their logprobs still go
                for i, d in enumerate(parsed):
                    yield chunk({"index": 0, "delta": d, "finish_reason": None,
                                 **({"logprobs": logprobs} if i == 0 and logprobs is not None else {})})
                if finish is not None:
                    yield chunk({"index": 0, "delta": {}, "finish_reason": finish})
                continue
            if not delta and finish is None and not (logprobs and (logprobs.get("content") or logprobs.get("tokens"))):
                continue
            choice = ({"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
                      if chat else {"index": 0, "text": delta, "finish_reason": finish})
            choice["logprobs"] = logprobs
            if gen.prompt_logprobs:       # (vLLM's extension) on the first chunk only (then False)
                choice["prompt_logprobs"], gen.prompt_logprobs = gen.prompt_logprobs, False
            yield chunk(choice)
        if include_usage:
            yield chunk(None, gen.usage())
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:           # also when the client went away and the response was cancelled
        gen.close()


async def _sse_many(gens: list[_Generation], model: str, include_usage: bool, chat: bool = False,
                    object_name: str = "text_completion"):
    """Several choices' streams in one: each chunk carries one choice, with its index."""
    created = int(time.time())
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: _Generation):
        try:
            async for delta, finish in gen.deltas():
                logprobs = gen.format_logprobs(gen.delta_logprobs, chat)
                gen.delta_logprobs = []
                if delta or finish is not None or (logprobs and (logprobs.get("tokens") or logprobs.get("content"))):
                    await merged.put((index, delta, finish, None, logprobs))
        except ApiError as e:
            await merged.put((index, "", None, e, None))
        finally:
            await merged.put((index, None, None, None, None))      # this prompt is over

    def chunk(choices: list, usage: dict | None = None) -> str:
        payload = {"id": gens[0].request_id, "object": object_name, "created": created, "model": model,
                   "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(gens))])
        open_streams, error = len(gens), None
        while open_streams:
            index, delta, finish, err, logprobs = await merged.get()
            if delta is None:
                open_streams -= 1
            elif err is not None:
                error = error or err
            else:
                yield chunk([{"index": index, "finish_reason": finish, "logprobs": logprobs,
                              **({"delta": {"content": delta} if delta else {}} if chat else {"text": delta})}])
        if error is not None:
            yield f"data: {json.dumps(error.body())}\n\n"
        elif include_usage:
            yield chunk([], _total_usage(gens))
        yield "data: [DONE]\n\n"
    finally:           # also when the client went away and the response was cancelled
        for task in tasks:
            task.cancel()
        for gen in gens:
            gen.close()
