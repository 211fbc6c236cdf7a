"""The POST routes that app.py's _App takes ahead of FastAPI's middleware and
router: in-process over ASGI, each request goes once through the front and
once through FastAPI's own stack (the same routes, registered there too), and
the answers must be the same, status, headers and body; an unexpected error
gives OpenAI's 500 shape and still reaches the server; other methods and paths
are FastAPI's as before."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from pagedcore.server.app import _App, build_app  # noqa: E402
from pagedcore.server.async_engine import (  # noqa: E402
    RequestStream,
    _CompactRebuilder,
    _CompactStream,
    _Finish,
)
from pagedcore.server.protocol import MAX_BODY_BYTES  # noqa: E402

API_KEY = "k-123"


class Engine:
    """What build_app uses of an engine; each request gets the token ids of
    ``script`` then finishes ("length"); no tokenizer (the text is the engine's:
    empty here)."""

    def __init__(self, script=(5, 6, 7), fail: Exception | None = None) -> None:
        self.engine = SimpleNamespace(tokenizer=None, max_model_len=64)
        self.stats = {"num_requests": 0, "num_waiting_seqs": 0}
        self.script, self.fail = script, fail
        self.aborted: list[str] = []

    def health_error(self):
        return None

    async def add(self, request_id, prompt, prompt_token_ids, params, add_special_tokens=True):
        if self.fail is not None:
            raise self.fail
        stream = _CompactStream(asyncio.get_running_loop(), request_id, 0)
        *tokens, last = self.script
        for t in tokens:
            stream.put(t)
        stream.put(_Finish(last, 2, -1))
        return RequestStream(self, request_id, stream, None,
                             _CompactRebuilder(request_id, prompt, prompt_token_ids or [1]))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def call(app, method: str, path: str, body: bytes = b"", headers=()) -> tuple[int, dict, bytes]:
    """One request through an ASGI app (its body read, then a client that stays
    until the response ends)."""
    sent: list[dict] = []
    done = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    await app(scope, receive, send)
    start = sent[0]
    return (start["status"], dict(start["headers"]),
            b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def both(engine: Engine):
    """The app, and FastAPI's own stack of the same app (no front)."""
    app = build_app(engine, "m", api_key=API_KEY)
    assert isinstance(app, _App) and set(app.hot_routes) == {"/v1/completions", "/v1/chat/completions"}
    fastapi_stack = super(_App, app).build_middleware_stack()

    async def plain(scope, receive, send):
        scope["app"] = app
        await fastapi_stack(scope, receive, send)

    return app, plain


AUTH = ((b"authorization", f"Bearer {API_KEY}".encode()),)
CASES = [
    ("no key", "/v1/completions", {"model": "m", "prompt": "hi"}, ()),
    ("wrong model", "/v1/completions", {"model": "x", "prompt": "hi"}, AUTH),
    ("bad field", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, AUTH),
    ("max_tokens 0", "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 0}, AUTH),
    ("not JSON", "/v1/completions", None, AUTH),
    ("chat echo", "/v1/chat/completions", {"model": "m", "messages": [], "echo": True}, AUTH),
    ("chat, no messages field", "/v1/chat/completions", {"model": "m"}, AUTH),
]


@pytest.mark.parametrize("name,path,payload,headers", CASES, ids=[c[0] for c in CASES])
def test_the_front_answers_bad_requests_as_fastapi_does(name, path, payload, headers) -> None:
    async def main():
        app, plain = both(Engine())
        body = b"{not json" if payload is None else json.dumps(payload).encode()
        ours = await call(app, "POST", path, body, headers)
        theirs = await call(plain, "POST", path, body, headers)
        assert ours == theirs
        assert 400 <= ours[0] < 500, ours
        assert set(json.loads(ours[2])["error"]) >= {"message", "type", "param", "code"}

    asyncio.run(main())


def test_a_body_over_the_limit_is_refused_by_both() -> None:
    async def main():
        app, plain = both(Engine())
        body = b" " * (MAX_BODY_BYTES + 1)
        ours = await call(app, "POST", "/v1/completions", body, AUTH)
        assert ours == await call(plain, "POST", "/v1/completions", body, AUTH)
        assert ours[0] == 413

    asyncio.run(main())


def test_a_request_answers_alike_through_the_front_and_fastapi() -> None:
    async def main():
        for stream in (False, True):
            app, plain = both(Engine())
            payload = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream,
                                  "stream_options": {"include_usage": True} if stream else None}).encode()
            ours = await call(app, "POST", "/v1/completions", payload, AUTH)
            theirs = await call(plain, "POST", "/v1/completions", payload, AUTH)
            assert ours[0] == theirs[0] == 200 and ours[1] == theirs[1]

            ours_text, theirs_text = ours[2].decode(), theirs[2].decode()
            if stream:
                assert ours_text.endswith("data: [DONE]\n\n") and theirs_text.endswith("data: [DONE]\n\n")
                chunks = [json.loads(e[6:]) for e in ours_text.split("\n\n") if e.startswith("data: {")]
                others = [json.loads(e[6:]) for e in theirs_text.split("\n\n") if e.startswith("data: {")]
            else:
                chunks, others = [json.loads(ours_text)], [json.loads(theirs_text)]
            for c in chunks + others:
                c.pop("id"), c.pop("created")
            assert chunks == others
            assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}

    asyncio.run(main())


def test_an_unexpected_error_answers_500_and_reaches_the_server() -> None:
    async def main():
        app, _ = both(Engine(fail=RuntimeError("boom")))
        payload = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
        sent: list[dict] = []
        messages = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive():  # (the body, then a client that stays)
            if messages:
                return messages.pop()
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                 "headers": [(b"content-type", b"application/json"), *AUTH]}
        with pytest.raises(RuntimeError, match="boom"):
            await app(scope, receive, send)
        assert sent[0]["status"] == 500
        error = json.loads(sent[1]["body"])["error"]
        assert error["message"] == "internal error: boom" and error["type"] == "internal_error"
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # (the hang-up watch ended with it)

    asyncio.run(main())


def test_other_methods_and_paths_stay_fastapis() -> None:
    async def main():
        app, plain = both(Engine())
        for method, path in (("GET", "/v1/completions"), ("POST", "/v1/nothing"), ("GET", "/health"),
                             ("POST", "/v1/completions/")):
            ours = await call(app, method, path, b"", AUTH)
            assert ours == await call(plain, method, path, b"", AUTH)
        assert (await call(app, "GET", "/v1/completions", b"", AUTH))[0] == 405
        assert (await call(app, "GET", "/health", b"", AUTH))[0] == 200

    asyncio.run(main())
