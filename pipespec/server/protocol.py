"""Request bodies of the OpenAI API (the fields pipespec honours, and the ones it refuses)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pipespec.sampling import MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # completions: an int (top alternatives per token); chat: a bool, with `top_logprobs` the count
    logprobs: Optional[Union[bool, int]] = None
    top_logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None     # vLLM's extension: each prompt token's logprob and top N
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None     # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    bad_words: Optional[list[str]] = None
    user: Optional[str] = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs (json, regex, choice,
    # grammar, json_object) and its older guided_* names; at most one of them
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: Optional[int], default_max_tokens: Optional[int]) -> SamplingParams:
        self.refuse_unsupported()
        kwargs = dict(max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p,
                      top_k=-1 if self.top_k is None else self.top_k,
                      min_p=0.0 if self.min_p is None else self.min_p,
                      n=self.n, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                      logprobs=self.num_logprobs(),
                      presence_penalty=self.presence_penalty or 0.0,
                      frequency_penalty=self.frequency_penalty or 0.0,
                      repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                      logit_bias=_token_bias(self.logit_bias), min_tokens=self.min_tokens,
                      bad_words=self.bad_words,
                      prompt_logprobs=(None if self.prompt_logprobs is None
                                       else _check_count(self.prompt_logprobs, "prompt_logprobs")),
                      structured_outputs=self.structured_outputs_params(),
                      output_kind=RequestOutputKind.DELTA)      # what is new each step: no copies
        kwargs.update(self.route_kwargs(kwargs))
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            param = str(e).split(":", 1)[0].removeprefix("SamplingParams.")
            raise ApiError(400, str(e).removeprefix("SamplingParams."), param) from None

    def structured_field(self) -> Optional[str]:
        """The body field that asks for structured output (None: none does); ApiError if several do."""
        given = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.get("type") == "text":
            given.remove("response_format")      # OpenAI's default: plain text
        if len(given) > 1:
            raise ApiError(400, f"{' and '.join(given)}: give at most one way of structuring the output", given[1])
        return given[0] if given else None

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        name = self.structured_field()
        if name is None:
            return None
        if name == "response_format":
            spec = _response_format(self.response_format)
        elif name == "structured_outputs":
            unknown = set(self.structured_outputs) - _STRUCTURED_KINDS
            if unknown:
                raise ApiError(400, f"structured_outputs: unknown keys {sorted(unknown)} (pipespec takes "
                                    f"{', '.join(sorted(_STRUCTURED_KINDS))})", name)
            spec = {k: v for k, v in self.structured_outputs.items() if v is not None}
        else:
            spec = {name.removeprefix("guided_"): getattr(self, name)}
        try:
            return StructuredOutputsParams(**spec)
        except ValueError as e:
            raise ApiError(400, f"{name}: {str(e).split(': ', 1)[1]}", name) from None

    def structured_error(self, message: str) -> ApiError:
        """The engine's refusal of the grammar ("structured_outputs.<kind>: ..."), named by the field the
        body gave it in."""
        name = self.structured_field()
        engine_where, detail = message.split(": ", 1)
        if name == "structured_outputs":
            where = engine_where                 # the body's own names
        elif name == "response_format" and engine_where == "structured_outputs.json":
            where = "response_format.json_schema.schema"
        else:
            where = name
        return ApiError(400, f"{where}: {detail}", name)


    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs: how many top alternatives each token's logprobs list (None: none)."""
        raise NotImplementedError

    def route_kwargs(self, kwargs: dict) -> dict:
        """SamplingParams fields only one route's body has."""
        return {}


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
_STRUCTURED_KINDS = set(StructuredOutputsParams.KINDS)


def _response_format(rf: dict) -> dict:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "response_format.json_schema.schema: a JSON schema object is required "
                            "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})",
                       "response_format")
    return {"json": spec["schema"]}


def _token_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias (token ids as JSON keys, so strings) with integer keys."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
    return out


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
    return value


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def route_kwargs(self, kwargs: dict) -> dict:
        if self.suffix:
            raise ApiError(400, "suffix is not supported by pipespec", "suffix")
        if self.best_of is not None and self.stream:
            raise ApiError(400, "best_of cannot be used with stream=true", "best_of")
        out = {"best_of": self.best_of}
        if self.echo and kwargs["logprobs"] is not None:     # the echoed prompt's tokens carry logprobs
            out["prompt_logprobs"] = max(kwargs["logprobs"], kwargs["prompt_logprobs"] or 0)
        return out

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is a chat completions field; /v1/completions takes "
                                "logprobs: <count>", "top_logprobs")
        return None if self.logprobs is None else _check_count(self.logprobs, "logprobs")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict]]] = None    # None: an assistant message with tool_calls
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    # tools and reasoning (checked by pipespec.server.chat_request, against the server's flags)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict] = None

    def num_logprobs(self) -> Optional[int]:
        if self.logprobs not in (None, True, False):
            raise ApiError(400, f"logprobs must be a boolean in chat completions (top_logprobs gives the "
                                f"count), got {self.logprobs!r}", "logprobs")
        if self.top_logprobs is not None:
            _check_count(self.top_logprobs, "top_logprobs")
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
