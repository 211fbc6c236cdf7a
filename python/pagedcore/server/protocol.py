"""OpenAI request bodies, their validation into SamplingParams, and errors.

Every invalid field becomes an :class:`APIError` with HTTP status 400 and
OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from ..sampling_params import SamplingParams
from ..structured_outputs import StructuredOutputsParams

MAX_BODY_BYTES = 8 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # Fields OpenAI clients send that pagedcore does not use (user, ...) are ignored.
    model_config = ConfigDict(extra="ignore", strict=False)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (completion_tokens
    # counts the tokens streamed up to and with it; a chunk may carry several).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # (the schema is always enforced)


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs`` request field (its StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # May come alone, with response_format or guided_json: it applies to that.
    disable_any_whitespace: bool = False


class _SamplingFields(_Body):
    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    # NOTE: strict ints: in lax mode pydantic would take `[true]` as token id 1.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # echo + logprobs: the prompt's tokens with their logprobs come first (max_tokens 0:
    # only them). vLLM's prompt_logprobs field is refused, not ignored: use these.
    echo: bool = False
    prompt_logprobs: int | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM extensions that pagedcore does not serve for chat: refused with a 400.
    echo: bool = False
    prompt_logprobs: int | None = None


def parse_body(raw: bytes, model_cls: type[_Body]) -> Any:
    import json

    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {len(raw)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    ids = data.get("prompt")
    if model_cls is CompletionRequest and type(ids) is list and ids and set(map(type, ids)) == {int}:
        # NOTE: a prompt of token ids (a benchmark's, lm-eval's) is checked here, a
        # plain loop: pydantic's check of the union, per id, costs ~0.3 us an id, on
        # the event loop that streams every other response. What passes is what
        # list[StrictInt] takes (ints, not bools); pydantic checks the rest.
        data = {**data, "prompt": [0]}
    else:
        ids = None
    try:
        body = model_cls.model_validate(data)
        if ids is not None:
            body.prompt = ids
        return body
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        # The param is the request's field; the path inside it (messages.0.role,
        # or a union member such as prompt.str) stays in the message.
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{where}: {err['msg']}" if where else err["msg"], param=param) from None


_FIELD = re.compile(r"^(\w+)")

# NOTE: the engine keeps these in int32 arrays (per-slot sampling arrays, the C++
# RequestParams). A larger value would fail *after* the C++ engine accepted the
# request, leaving it there unknown to the Python side, and every later step fails.
_INT32_MAX = 2**31 - 1
_INT32_FIELDS = ("n", "max_tokens", "top_k", "min_tokens")


def structured_outputs(body: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; an invalid or doubled one is a 400
    naming the request field it came from."""
    sources: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        sources.append(("response_format", dict(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        sources.append(("response_format", dict(json=rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None}
        if kinds or not so.disable_any_whitespace:
            sources.append(("structured_outputs", kinds))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise APIError(400, f"give at most one structured-output constraint, got {names}", param=sources[1][0])
    name, kwargs = sources[0]
    if so is not None and so.disable_any_whitespace:
        kwargs = {**kwargs, "disable_any_whitespace": True}
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


def sampling_params(body: _SamplingFields, logprobs: int | None, max_tokens: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from a request body; ValueError -> 400 naming the field."""
    kwargs: dict[str, Any] = dict(
        n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        structured_outputs=structured_outputs(body),
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    for name in _INT32_FIELDS:
        value = kwargs.get(name)
        if isinstance(value, int) and value > _INT32_MAX:
            raise APIError(400, f"{name} must be at most {_INT32_MAX}, got {value}", param=name)
    for t in body.stop_token_ids or []:
        if isinstance(t, int) and t > _INT32_MAX:
            raise APIError(400, f"stop_token_ids must hold token ids, got {t}", param="stop_token_ids")
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        match = _FIELD.match(str(e))
        param = match.group(1) if match and match.group(1) in kwargs else None
        if param == "logprobs" and isinstance(body, ChatCompletionRequest):
            param = "top_logprobs"
        if param == "prompt_logprobs":  # (from echo's logprobs: /v1/completions has no such field)
            param = "logprobs"
        raise APIError(400, str(e), param=param) from None


def engine_error(e: ValueError, prompt_field: str, body: _SamplingFields) -> APIError:
    """An LLMEngine.add_request ValueError as a 400 naming the field (the
    message's first word when it is a field of the request, like "n must be
    <= max_num_seqs" or "max_tokens 600 is larger ...", else the prompt)."""
    message = str(e)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"
    if param not in type(body).model_fields or param in ("prompt", "messages"):
        param = prompt_field
    return APIError(400, message, param=param)
