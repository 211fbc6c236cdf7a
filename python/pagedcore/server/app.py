"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both
streaming as server-sent events), /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from ..outputs import CompletionOutput, RequestOutput
from .async_engine import SHUTTING_DOWN, AsyncEngine, EngineDeadError, EngineDiedError, QueueFullError, merge_outputs
from .event_stream import EventStream, Hangup
from .metrics import Metrics
from .protocol import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_error,
    parse_body,
    sampling_params,
)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = Metrics(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watcher = asyncio.create_task(metrics.watch_loop_lag())
        try:
            yield
        finally:
            watcher.cancel()

    app = _App(title="pagedcore", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        # Routing errors (unknown path 404, wrong method 405) in OpenAI's shape too.
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return _internal_error(e)

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
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
        # NOTE: read in chunks and stop at the limit: a chunked body has no
        # content-length, and request.body() would hold all of it first.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"request body is over the {MAX_BODY_BYTES}-byte limit")
            chunks.append(chunk)
        return parse_body(b"".join(chunks), cls)

    async def until_disconnect(request: Request, work) -> Response:
        """Awaits ``work`` (the coroutine that makes the response) unless the client
        goes away first; then cancels it, which aborts its engine requests and frees
        their blocks at once. A streamed response takes the watch over until its end."""
        hangup = Hangup(request.receive)
        try:
            answered, response = await hangup.guard(work)
        except BaseException:
            hangup.stop()
            raise
        if not answered:
            hangup.stop()
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(response, EventStream):
            response.hangup = hangup
        else:
            hangup.stop()
        return response

    @app.get("/health")
    async def health() -> Response:
        # (engine died: <reason> -- its loop raised, its process exited, a tensor-parallel
        # worker died -- or the server is shutting down)
        reason = engine.health_error()
        if reason is not None:
            raise APIError(503, reason, "service_unavailable",
                           code="server_shutting_down" if reason == SHUTTING_DOWN else "engine_dead")
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
                  request_id: str, body) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Starts one engine request per prompt (all validated before any output)
        and yields lists of (prompt index, delta output): for each request, what
        has arrived since the last list merged into one output (one engine step's
        delta when the consumer keeps up, several steps' when it fell behind)."""
        # Every prompt is admitted (validated) before any output is awaited.
        gens = []
        try:
            for i, (text, ids) in enumerate(prompts):
                try:
                    gen = await engine.add(f"{request_id}-{i}", text, ids, params, add_special_tokens=special)
                except QueueFullError as e:
                    raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
                except EngineDeadError as e:
                    raise _unavailable(e) from None
                except ValueError as e:
                    raise engine_error(e, prompt_field, body) from None
                gens.append((i, gen))
        except BaseException:
            for i, _ in gens:
                engine.abort(f"{request_id}-{i}")
            raise
        try:
            if len(gens) == 1:  # (the common case: no task, no queue in between)
                i, gen = gens[0]
                try:
                    async for out in gen.merged():
                        yield [(i, out)]
                except Exception as e:  # noqa: BLE001 - the engine's end of the request
                    raise _generation_error(e) from e
                return
            return_queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, gen) -> None:
                try:
                    async for out in gen.merged():
                        return_queue.put_nowait((i, out))
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    return_queue.put_nowait((i, e))
                finally:
                    return_queue.put_nowait((i, None))

            tasks = [asyncio.create_task(pump(i, gen)) for i, gen in gens]
            try:
                remaining = len(tasks)
                while remaining:
                    got = [await return_queue.get()]
                    while not return_queue.empty():
                        got.append(return_queue.get_nowait())
                    by_prompt: dict[int, list[RequestOutput]] = {}
                    for i, item in got:
                        if item is None:
                            remaining -= 1
                        elif isinstance(item, Exception):
                            raise _generation_error(item) from item
                        elif isinstance(item, BaseException):
                            raise item
                        else:
                            by_prompt.setdefault(i, []).append(item)
                    if by_prompt:
                        yield [(i, merge_outputs(outs)) for i, outs in by_prompt.items()]
            finally:
                for task in tasks:
                    task.cancel()
        finally:
            # NOTE: no gen.aclose() here: a pump task may be inside its generator
            # right now ("aclose(): asynchronous generator is already running"),
            # and on a client disconnect this runs in a cancelled scope. Abort by
            # id (no await; a no-op for requests that finished).
            for i, _ in gens:
                engine.abort(f"{request_id}-{i}")

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {_ENCODER.encode(payload)}\n\n"

    def chunk_head(request_id: str, object_: str, created_at: int) -> str:
        """The start of every streamed chunk of a response, up to its choice's
        index: the same bytes as sse() gives for these leading fields, made once
        per response (the hot path then encodes only the text)."""
        return (f'data: {{"id": {_dumps(request_id)}, "object": "{object_}", "created": {created_at}, '
                f'"model": {_dumps(served_model_name)}, "choices": [{{"index": ')

    def legacy_logprobs(token_ids: list[int], entries: list, offset: int, top: int) -> dict[str, Any]:
        """OpenAI's legacy completion logprobs of tokens whose text starts at
        character ``offset`` of the choice's text. An entry of None (the first
        prompt token: nothing scores it) gives None logprob and top_logprobs."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                text = tokenizer.decode([tid])
                token_logprobs.append(None)
                tops.append(None)
            else:
                lp = entry[tid]
                text = lp.decoded_token or ""
                token_logprobs.append(_finite(lp.logprob))
                # The `top` most likely tokens and the token itself (OpenAI: "up to
                # logprobs + 1 elements"); the entry holds exactly those.
                tops.append({(v.decoded_token or ""): _finite(v.logprob) for v in entry.values()
                             if v is lp or (v.rank is not None and v.rank <= top)})
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def completion_logprobs(out: CompletionOutput, offset: int, top: int) -> dict[str, Any]:
        return legacy_logprobs(out.token_ids, out.logprobs or [], offset, top)

    def echo_logprobs(prompt_ids: list[int], prompt_lps: list | None, out: CompletionOutput | None,
                      offset: int, top: int) -> dict[str, Any]:
        """The prompt's tokens (text from character 0), then out's (from ``offset``)."""
        if prompt_lps is None or len(prompt_lps) != len(prompt_ids):
            # NOTE: never a silently shorter list: lm-eval indexes it by token count.
            raise APIError(500, "internal error: the prompt's logprobs are missing", "internal_error")
        merged = legacy_logprobs(prompt_ids, prompt_lps, 0, top)
        if out is not None:
            for key, values in completion_logprobs(out, offset, top).items():
                merged[key] += values
        return merged

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
        return await until_disconnect(request, _completions(body))

    async def _completions(body: CompletionRequest) -> Response:
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
        if body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported by /v1/completions: ask for the prompt's "
                                "logprobs with echo=true and logprobs=k", param="prompt_logprobs")
        # NOTE: echo with max_tokens 0 returns the prompt alone (as vLLM does): the
        # engine computes it and samples one token, which is dropped.
        echo_only = body.echo and body.max_tokens == 0
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo=true), got 0", param="max_tokens")
        echo_logprobs_k = body.logprobs if body.echo else None
        params = sampling_params(body, body.logprobs, 1 if echo_only else body.max_tokens,
                                 prompt_logprobs=echo_logprobs_k)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        arrival = time.monotonic()
        stream = run(prompts, params, True, "prompt", request_id, body)
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
            prompt_ids: dict[int, list[int]] = {}
            prompt_lps: dict[int, list] = {}
            async for i, out in _flat(first, stream):
                timer.observe(out)
                prompt_tokens[i] = len(out.prompt_token_ids)
                if body.echo and i not in echo:
                    echo[i] = prompt_text(i, out)
                    prompt_ids[i] = out.prompt_token_ids
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
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
                    prefix = echo.get(i, "")
                    if echo_only:  # the prompt alone; the token sampled for it is dropped
                        text, acc = prefix, None
                    else:
                        text = prefix + texts[i][j]
                        completion_tokens += len(acc.token_ids) if acc else 0
                    if body.logprobs is None:
                        logprobs = None
                    elif body.echo:
                        logprobs = echo_logprobs(prompt_ids[i], prompt_lps.get(i), acc, len(prefix), body.logprobs)
                    else:
                        logprobs = completion_logprobs(acc, 0, body.logprobs) if acc is not None else None
                    if echo_only:  # (max_tokens 0 is reached, whatever token was dropped)
                        finish_reason, stop_reason = "length", None
                    else:
                        finish_reason = final.finish_reason if final else None
                        stop_reason = final.stop_reason if final else None
                    choices.append({
                        "index": i * n + j, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": stop_reason,
                    })
            return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                                 "model": served_model_name, "choices": choices,
                                 "usage": usage(sum(prompt_tokens), completion_tokens)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        created_at = int(time.time())  # (one for all chunks of the response, as OpenAI's)
        head = chunk_head(request_id, "text_completion", created_at)
        plain = body.logprobs is None and not body.echo  # chunks of text only: the pre-built form

        async def events() -> AsyncIterator[str]:
            prompt_tokens: dict[int, int] = {}
            completion_tokens = 0
            echoed: set[int] = set()
            offsets: dict[int, int] = {}  # choice -> characters sent so far (logprobs' text_offset)
            prompt_lps: dict[int, list] = {}
            async for batch in _chain(first, stream):
                for i, out in batch:
                    timer.observe(out)
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    if out.prompt_logprobs is not None:  # (with the first output of the prompt)
                        prompt_lps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        index = i * n + c.index
                        if echo_only:
                            # The prompt alone, once per choice; the sampled token is dropped.
                            if (i, c.index) in echoed:
                                continue
                            echoed.add((i, c.index))
                            logprobs = (echo_logprobs(out.prompt_token_ids, prompt_lps.get(i), None, 0, body.logprobs)
                                        if body.logprobs is not None else None)
                            yield sse({"id": request_id, "object": "text_completion", "created": created_at,
                                       "model": served_model_name, "choices": [{
                                           "index": index, "text": prompt_text(i, out), "logprobs": logprobs,
                                           "finish_reason": "length", "stop_reason": None}]})
                            continue
                        completion_tokens += len(c.token_ids)
                        if plain:
                            so_far = (_usage_field(sum(prompt_tokens.values()), completion_tokens)
                                      if continuous else "")
                            yield (f'{head}{index}, "text": {_dumps(c.text)}, "logprobs": null, "finish_reason": '
                                   f'{_null_or(c.finish_reason)}, "stop_reason": {_null_or(c.stop_reason)}}}]{so_far}}}\n\n')
                            continue
                        text = c.text
                        first_of_echo = body.echo and (i, c.index) not in echoed
                        if first_of_echo:
                            echoed.add((i, c.index))
                            text = prompt_text(i, out) + text
                        offset = offsets.get(index, 0) + len(text) - len(c.text)
                        offsets[index] = offset + len(c.text)
                        if body.logprobs is None:
                            logprobs = None
                        elif first_of_echo:
                            logprobs = echo_logprobs(out.prompt_token_ids, prompt_lps.get(i), c, offset, body.logprobs)
                        else:
                            logprobs = completion_logprobs(c, offset, body.logprobs)
                        chunk = {"id": request_id, "object": "text_completion", "created": created_at,
                                 "model": served_model_name, "choices": [{
                                     "index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                        if continuous:
                            chunk["usage"] = usage(sum(prompt_tokens.values()), completion_tokens)
                        yield sse(chunk)
                yield _FLUSH
            timer.done()
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created_at,
                           "model": served_model_name, "choices": [],
                           "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
            yield "data: [DONE]\n\n"

        return EventStream(_guarded(_coalesced(events())), closing=stream)

    # ---- /v1/chat/completions -----------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_auth(request)
        body: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        return await until_disconnect(request, _chat(body))

    async def _chat(body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported by /v1/chat/completions", param="echo")
        if body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported by /v1/chat/completions", param="prompt_logprobs")
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
                    text = part.get("text")
                    if not isinstance(text, str):  # (str() would send `None` or `5` to the model)
                        raise APIError(400, f"a text content part needs a string `text`, got {text!r}",
                                       param="messages")
                    parts.append(text)
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
        stream = run([(prompt, None)], params, False, "messages", request_id, body)
        first = await _first(stream)
        timer = metrics.request_timer(arrival)

        if not body.stream:
            texts = [""] * params.n
            acc: dict[int, CompletionOutput] = {}
            finals: dict[int, CompletionOutput] = {}
            prompt_tokens = 0
            async for _, out in _flat(first, stream):
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

        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        created_at = int(time.time())  # (one for all chunks of the response, as OpenAI's)
        head = chunk_head(request_id, "chat.completion.chunk", created_at)

        async def events() -> AsyncIterator[str]:
            started: set[int] = set()
            prompt_tokens = completion_tokens = 0
            base = {"id": request_id, "object": "chat.completion.chunk", "created": created_at,
                    "model": served_model_name}
            async for batch in _chain(first, stream):
                for _, out in batch:
                    timer.observe(out)
                    prompt_tokens = len(out.prompt_token_ids)
                    for c in out.outputs:
                        if c.index not in started:
                            started.add(c.index)
                            extra = {"usage": usage(prompt_tokens, completion_tokens)} if continuous else {}
                            yield sse({**base, "choices": [
                                {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **extra})
                        completion_tokens += len(c.token_ids)
                        extra = {"usage": usage(prompt_tokens, completion_tokens)} if continuous else {}
                        if c.logprobs is not None or continuous:
                            if c.text or c.logprobs:  # (an EOS token alone is no content)
                                yield sse({**base, "choices": [{
                                    "index": c.index, "delta": {"content": c.text},
                                    "logprobs": chat_logprobs(c, top) if c.logprobs is not None else None,
                                    "finish_reason": None}], **extra})
                        elif c.text:
                            yield (f'{head}{c.index}, "delta": {{"content": {_dumps(c.text)}}}, "logprobs": null, '
                                   f'"finish_reason": null}}]}}\n\n')
                        if c.finish_reason is not None:
                            yield sse({**base, "choices": [
                                {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}], **extra})
                yield _FLUSH
            timer.done()
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

        return EventStream(_guarded(_coalesced(events())), closing=stream)

    app.hot_routes = {"/v1/completions": completions, "/v1/chat/completions": chat}
    return app


class _App(FastAPI):
    """FastAPI with its POST routes of ``hot_routes`` taken ahead of its middleware
    and router: a request there goes to its handler (and its errors to the
    handlers' JSON) directly. NOTE: Starlette's middleware chain, FastAPI's
    routing and its parameter solving were ~30% of a request's cost in the HTTP
    process, and each chunk of a stream passed through two of their send
    wrappers (bench_server_fanout.py, alternating runs on the 2-core CPU machine:
    ~410 -> ~280 us a one-token request at 512 streams, ~29.6 -> ~26.8 us a
    token at 256 streams of 64). The routes stay registered with FastAPI too:
    its answers to other methods (405) are unchanged, and test_server_front.py
    checks that both ways answer alike."""

    hot_routes: dict[str, Any] = {}

    def build_middleware_stack(self):
        stack = super().build_middleware_stack()
        routes = self.hot_routes

        async def front(scope, receive, send) -> None:
            route = routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
            if route is None:
                await stack(scope, receive, send)
                return
            try:
                response = await route(Request(scope, receive))
            except APIError as e:
                response = JSONResponse(e.body(), status_code=e.status)
            except Exception as e:
                # (as Starlette's outermost middleware does: the 500 answer, then the
                # error goes on to the server, which logs it)
                await _internal_error(e)(scope, receive, send)
                raise
            await response(scope, receive, send)

        return front


def _internal_error(e: Exception) -> JSONResponse:
    return JSONResponse(APIError(500, f"internal error: {e}", "internal_error").body(), status_code=500)


# What json.dumps(value, ensure_ascii=False) gives, without the encoder it builds per
# call (with ensure_ascii=False it does not take its shared default one); a str by
# the C function that encoder calls for one. NOTE: measured on the 2-core CPU
# machine: a streamed chunk's text 0.76 -> 0.09 us, a usage dict 2.51 -> 1.75.
_ENCODER = json.JSONEncoder(ensure_ascii=False)
_encode_str = json.encoder.encode_basestring


def _dumps(value: Any) -> str:
    """A JSON value as sse() writes it."""
    return _encode_str(value) if type(value) is str else _ENCODER.encode(value)


def _usage_field(prompt_tokens: int, completion_tokens: int) -> str:
    """``, "usage": {...}`` as _dumps(usage(...)) writes it, by one f-string
    (a streamed chunk's, with continuous_usage_stats: ~1 us less a chunk)."""
    return (f', "usage": {{"prompt_tokens": {prompt_tokens}, "completion_tokens": {completion_tokens}, '
            f'"total_tokens": {prompt_tokens + completion_tokens}}}')


def _null_or(value: Any) -> str:
    """_dumps for a value that is None in most chunks."""
    return "null" if value is None else _dumps(value)


def _generation_error(e: Exception) -> APIError:
    """The engine's end of a request as the error the client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDiedError):
        return _unavailable(e)
    if isinstance(e, EngineDeadError):  # cut by the server's shutdown
        return APIError(503, f"request cut: {e}", "service_unavailable", code="server_shutting_down")
    # NOTE: as an APIError it is a handled 500 (an error event, mid-stream);
    # anything else would reach the ASGI server, which logs a traceback and
    # drops the client's keep-alive connection.
    return APIError(500, f"generation failed: {e}", "internal_error")


def _unavailable(e: EngineDeadError) -> APIError:
    """A request refused, or cut, because the engine has stopped: 503, as the
    server cannot serve it (now, or ever again: ``engine died: <reason>``)."""
    code = "engine_dead" if isinstance(e, EngineDiedError) else "server_shutting_down"
    return APIError(503, str(e), "service_unavailable", code=code)


def _finite(logprob: float) -> float:
    """-inf as OpenAI sends it (JSON has no infinity)."""
    return max(logprob, -9999.0)


async def _guarded(events):
    """Server-sent events that end with an error event and [DONE] if generation
    fails half-way, rather than a stream cut short."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:  # noqa: BLE001 - reported to the client in OpenAI's shape
        error = e if isinstance(e, APIError) else APIError(500, f"generation failed: {e}", "internal_error")
        yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"


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


async def _flat(first, stream):
    """The (prompt index, output) pairs of run()'s lists, one by one."""
    async for batch in _chain(first, stream):
        for pair in batch:
            yield pair


_FLUSH = object()  # events(): the chunks of one list of outputs are complete


async def _coalesced(events):
    """Joins the server-sent events made for one list of outputs into one
    write (a stream that fell behind by several steps catches up at once)."""
    parts: list[str] = []
    try:
        async for chunk in events:
            if chunk is _FLUSH:
                if parts:
                    yield "".join(parts)
                    parts = []
            else:
                parts.append(chunk)
    except Exception:
        if parts:  # what was made before the failure goes out before its error event
            yield "".join(parts)
        raise
    if parts:
        yield "".join(parts)
