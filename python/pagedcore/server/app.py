"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both
streaming as server-sent events), /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..outputs import CompletionOutput, RequestOutput
from .async_engine import AsyncEngine, QueueFullError
from .metrics import Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_error,
    parse_body,
    sampling_params,
)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="pagedcore", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(engine)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {e}", "internal_error").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"the model `{name}` does not exist", "not_found_error", "model", "model_not_found")

    async def body_of(request: Request, cls):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > (8 << 20):
            raise APIError(413, f"request body of {length} bytes is over the {8 << 20}-byte limit")
        return parse_body(await request.body(), cls)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "pagedcore",
            "max_model_len": max_model_len,
        }]})

    # ---- shared machinery ----------------------------------------------------------

    async def run(prompts: list[tuple[str | None, list[int] | None]], params, special: bool, prompt_field: str,
                  request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Starts one engine request per prompt (all validated before any output)
        and yields (prompt index, delta output) as they come."""
        gens = []
        try:
            for i, (text, ids) in enumerate(prompts):
                gen = engine.generate(f"{request_id}-{i}", text, ids, params, add_special_tokens=special)
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                except QueueFullError as e:
                    raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
                except ValueError as e:
                    raise engine_error(e, prompt_field) from None
                gens.append((i, gen, first))
        except BaseException:
            for _, gen, _ in gens:
                await gen.aclose()
            raise
        return_queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen, first) -> None:
            try:
                if first is not None:
                    await return_queue.put((i, first))
                async for out in gen:
                    await return_queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await return_queue.put((i, e))
            finally:
                await return_queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, gen, first)) for i, gen, first in gens]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await return_queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for _, gen, _ in gens:
                await gen.aclose()

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def completion_logprobs(out: CompletionOutput, offset: int, top: int) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(out.token_ids, out.logprobs or []):
            lp = entry[tid]
            text = lp.decoded_token or ""
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            # The entry holds the top `top` tokens, plus the sampled one when it ranks lower.
            tops.append({(v.decoded_token or ""): v.logprob for v in entry.values()
                         if v.rank is not None and v.rank <= top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(out: CompletionOutput, top: int) -> dict[str, Any]:
        content = []
        for tid, entry in zip(out.token_ids, out.logprobs or []):
            lp = entry[tid]
            text = lp.decoded_token or ""
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                  "bytes": list((v.decoded_token or "").encode())} for _, v in ranked],
            })
        return {"content": content}

    # ---- /v1/completions --------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body: CompletionRequest = await body_of(request, CompletionRequest)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [(prompt, None)]
        elif not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], str):
            prompts = [(p, None) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [(None, list(prompt))]
        else:
            prompts = [(None, list(p)) for p in prompt]
        params = sampling_params(body, body.logprobs, body.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        arrival = time.monotonic()
        stream = run(prompts, params, True, "prompt", request_id)
        first = await _first(stream)
        timer = metrics.request_timer(arrival)

        def prompt_text(i: int, out: RequestOutput) -> str:
            return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)

        if not body.stream:
            texts = [[""] * n for _ in prompts]
            finals: dict[tuple[int, int], CompletionOutput] = {}
            tokens: dict[tuple[int, int], list] = {}
            prompt_tokens = [0] * len(prompts)
            echo: dict[int, str] = {}
            async for i, out in _chain(first, stream):
                timer.observe(out)
                prompt_tokens[i] = len(out.prompt_token_ids)
                if body.echo and i not in echo:
                    echo[i] = prompt_text(i, out)
                for c in out.outputs:
                    texts[i][c.index] += c.text
                    acc = tokens.setdefault((i, c.index), CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None))
                    acc.token_ids += c.token_ids
                    if c.logprobs is not None:
                        acc.logprobs += c.logprobs
                    if c.finish_reason is not None:
                        finals[(i, c.index)] = c
            timer.done()
            choices = []
            completion_tokens = 0
            for i in range(len(prompts)):
                for j in range(n):
                    acc, final = tokens.get((i, j)), finals.get((i, j))
                    completion_tokens += len(acc.token_ids) if acc else 0
                    prefix = echo.get(i, "")
                    choices.append({
                        "index": i * n + j, "text": prefix + texts[i][j],
                        "logprobs": completion_logprobs(acc, len(prefix), body.logprobs or 0)
                        if acc is not None and acc.logprobs is not None else None,
                        "finish_reason": final.finish_reason if final else None,
                        "stop_reason": final.stop_reason if final else None,
                    })
            return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                                 "model": served_model_name, "choices": choices,
                                 "usage": usage(sum(prompt_tokens), completion_tokens)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            prompt_tokens: dict[int, int] = {}
            completion_tokens = 0
            echoed: set[int] = set()
            async for i, out in _chain(first, stream):
                timer.observe(out)
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    if body.echo and (i, c.index) not in echoed:
                        echoed.add((i, c.index))
                        text = prompt_text(i, out) + text
                    yield sse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                               "model": served_model_name, "choices": [{
                                   "index": i * n + c.index, "text": text,
                                   "logprobs": completion_logprobs(c, 0, body.logprobs or 0)
                                   if c.logprobs is not None else None,
                                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            timer.done()
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                           "model": served_model_name, "choices": [],
                           "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- /v1/chat/completions -----------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_auth(request)
        body: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise APIError(400, f"unsupported content part type {part.get('type')!r}", param="messages")
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            messages.append({"role": m.role, "content": content or ""})
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs or 0
        params = sampling_params(body, top if body.logprobs else None, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        stream = run([(prompt, None)], params, False, "messages", request_id)
        first = await _first(stream)
        timer = metrics.request_timer(arrival)

        if not body.stream:
            texts = [""] * params.n
            acc: dict[int, CompletionOutput] = {}
            finals: dict[int, CompletionOutput] = {}
            prompt_tokens = 0
            async for _, out in _chain(first, stream):
                timer.observe(out)
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    texts[c.index] += c.text
                    a = acc.setdefault(c.index, CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None))
                    a.token_ids += c.token_ids
                    if c.logprobs is not None:
                        a.logprobs += c.logprobs
                    if c.finish_reason is not None:
                        finals[c.index] = c
            timer.done()
            choices = [{
                "index": j, "message": {"role": "assistant", "content": texts[j]},
                "logprobs": chat_logprobs(acc[j], top) if j in acc and acc[j].logprobs is not None else None,
                "finish_reason": finals[j].finish_reason if j in finals else None,
                "stop_reason": finals[j].stop_reason if j in finals else None,
            } for j in range(params.n)]
            completion_tokens = sum(len(a.token_ids) for a in acc.values())
            return JSONResponse({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                                 "model": served_model_name, "choices": choices,
                                 "usage": usage(prompt_tokens, completion_tokens)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            started: set[int] = set()
            prompt_tokens = completion_tokens = 0
            base = {"id": request_id, "object": "chat.completion.chunk", "model": served_model_name}
            async for _, out in _chain(first, stream):
                timer.observe(out)
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if c.index not in started:
                        started.add(c.index)
                        yield sse({**base, "created": int(time.time()), "choices": [
                            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]})
                    if c.text or c.logprobs:  # (an EOS token alone is no content)
                        yield sse({**base, "created": int(time.time()), "choices": [{
                            "index": c.index, "delta": {"content": c.text},
                            "logprobs": chat_logprobs(c, top) if c.logprobs is not None else None,
                            "finish_reason": None}]})
                    if c.finish_reason is not None:
                        yield sse({**base, "created": int(time.time()), "choices": [
                            {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}]})
            timer.done()
            if include_usage:
                yield sse({**base, "created": int(time.time()), "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _first(stream):
    """The first item of an async generator, or None; errors (400, 429) come out here,
    before any response is sent."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, stream):
    if first is not None:
        yield first
        async for item in stream:
            yield item
