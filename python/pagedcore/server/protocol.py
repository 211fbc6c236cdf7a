"""OpenAI request bodies, their validation into SamplingParams, and errors.

Every invalid field becomes an :class:`APIError` with HTTP status 400 and
OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling_params import SamplingParams

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


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


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
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


_FIELD = re.compile(r"^(\w+)")


def sampling_params(body: _SamplingFields, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
    """SamplingParams from a request body; ValueError -> 400 naming the field."""
    kwargs: dict[str, Any] = dict(
        n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        match = _FIELD.match(str(e))
        param = match.group(1) if match and match.group(1) in kwargs else None
        if param == "logprobs" and isinstance(body, ChatCompletionRequest):
            param = "top_logprobs"
        raise APIError(400, str(e), param=param) from None


def engine_error(e: ValueError, prompt_field: str) -> APIError:
    """An LLMEngine.add_request ValueError as a 400 naming the field."""
    message = str(e)
    if message.startswith("max_tokens"):
        return APIError(400, message, param="max_tokens")
    return APIError(400, message, param=prompt_field)
