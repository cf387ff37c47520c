"""The FastAPI application: OpenAI-compatible routes, health, version and metrics."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pipespec
from pipespec.engine.llm_engine import EngineDeadError
from pipespec.server.async_engine import AsyncEngine, QueueFullError
from pipespec.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from pipespec.server.metrics import Metrics
from pipespec.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
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
        if name is not None and name != model_name:
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
        if body.echo or body.suffix or (body.best_of not in (None, 1)):
            param = "echo" if body.echo else "suffix" if body.suffix else "best_of"
            raise ApiError(400, f"{param} is not supported by pipespec", param)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "a list of several prompts is not supported; send one request per prompt",
                               "prompt")
            prompt = prompt[0]
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        params = body.sampling_params(body.max_tokens, 16)
        return await _respond(request, body, prompt, params, chat=False)

    def render_chat(messages: list[dict], add_generation_prompt: bool) -> dict:
        """Template and tokens of a conversation (run off the event loop: it can take seconds)."""
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt)
        except Exception as e:     # a template that raises on this conversation is the client's problem
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                media = next((p.get("type") for p in content if isinstance(p, dict)
                              and any(m in str(p.get("type", "")) for m in _MEDIA)), None)
                if media is not None:       # e.g. Qwen3.5's vision tower is not loaded: text only
                    raise ApiError(400, f"messages[{i}].content: {media} content is not supported: pipespec "
                                   "serves text only (a multimodal model's vision tower is not loaded)",
                                   f"messages[{i}].content")
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            messages.append({"role": m.role, "content": content})
        prompt = await engine.run_blocking(render_chat, messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, None)
        return await _respond(request, body, prompt, params, chat=True)

    async def _respond(request: Request, body, prompt, params, chat: bool):
        try:
            request_id, outputs, prompt_ids = await engine.add_request(prompt, params,
                                                                       "chatcmpl" if chat else "cmpl")
        except ValueError as e:
            raise ApiError(400, str(e), _param_of(str(e))) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), kind="server_overloaded") from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), kind="engine_error") from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        gen = _Generation(engine, metrics, request_id, outputs, len(prompt_ids))
        object_name = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(gen, chat, model_name, object_name + ".chunk" if chat else object_name,
                                          include_usage), media_type="text/event-stream")
        try:
            text, finish = await gen.collect()
        finally:
            gen.close()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return {"id": request_id, "object": object_name, "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": gen.usage()}

    app.state.metrics = metrics
    return app


# required fields of each route's body, named when the body is missing altogether
_REQUIRED = {route: tuple(name for name, f in model.model_fields.items() if f.is_required())
             for route, model in (("/v1/completions", CompletionRequest),
                                  ("/v1/chat/completions", ChatCompletionRequest))}
_MEDIA = ("image", "video", "audio")     # image_url, input_image, video_url, input_audio, ...
_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {"role", "content"}


def _param_of(message: str) -> str | None:
    for name in ("prompt_token_ids", "prompt", "max_tokens", "messages"):
        if name in message:
            return name
    return None


class _Generation:
    """Turns one request's engine outputs (DELTA: what is new, stop-string text already held back by
    the engine) into text deltas, and keeps its metrics."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, request_id: str, outputs: asyncio.Queue,
                 num_prompt_tokens: int):
        self.engine, self.metrics, self.request_id, self.outputs = engine, metrics, request_id, outputs
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        self.parts: list[str] = []          # the deltas, joined once for a whole response
        self.finish_reason = None
        self.done = False
        self.arrival = time.perf_counter()
        self.last_token_time = None

    async def deltas(self):
        """Yield (text delta, finish_reason or None) until the request finishes."""
        while not self.done:
            out = await self.outputs.get()
            if isinstance(out, Exception):
                raise ApiError(500, f"the engine failed: {out}", kind="engine_error")
            completion = out.outputs[0]
            self._count(len(completion.token_ids))
            self.num_tokens += len(completion.token_ids)
            self.parts.append(completion.text)
            if out.finished:
                self.done = True
                self.finish_reason = completion.finish_reason
                self.metrics.finished(self.finish_reason)
                self.metrics.e2e.observe(time.perf_counter() - self.arrival)
            yield completion.text, self.finish_reason

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

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

    def close(self) -> None:
        """Abort the request unless it finished (a client that went away frees its blocks)."""
        if not self.done:
            self.engine.abort(self.request_id)
            self.metrics.finished("abort")


async def _sse(gen: _Generation, chat: bool, model: str, object_name: str, include_usage: bool):
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
            if not delta and finish is None:
                continue
            choice = ({"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
                      if chat else {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None})
            yield chunk(choice)
        if include_usage:
            yield chunk(None, gen.usage())
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:           # also when the client went away and the response was cancelled
        gen.close()
