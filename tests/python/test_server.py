"""The OpenAI-compatible server (``pagedcore serve``) as a real process on the
default model: the official ``openai`` client against every endpoint, a table of
bad requests (status, OpenAI error shape, the field and the limit named), 64
concurrent streams of which a quarter hang up mid-stream (every block comes
back), a non-streamed request whose client gives up (aborted at once), and
SIGTERM draining an in-flight stream before a clean exit."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
transformers = pytest.importorskip("transformers")
try:
    import httpx
except ImportError:  # the openai client of this environment ships httpx as `httpx2`
    httpx = pytest.importorskip("httpx2")

import pagedcore

API_KEY = "test-key-123"
MODEL = "smol"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 256
STARTUP_TIMEOUT_S = 120
EXIT_TIMEOUT_S = 60


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(log: Path, *extra: str) -> Server:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "pagedcore", "serve", "--port", str(port), "--served-model-name", MODEL,
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN), *extra,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", port, proc, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"no /health after {STARTUP_TIMEOUT_S} s:\n{server.log_text()}")
        time.sleep(0.25)


def _sigterm_and_wait(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        raise AssertionError(f"server still running {EXIT_TIMEOUT_S} s after SIGTERM:\n{server.log_text()}")


def _check_log(server: Server) -> None:
    text = server.log_text()
    assert "# KV cache blocks: " in text, text
    assert f"http://127.0.0.1:{server.port}" in text, text
    # No request (bad input, disconnects) may have ended in an unhandled exception.
    assert "Traceback" not in text, text


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = _start_server(tmp_path_factory.mktemp("server") / "serve.log",
                        "--api-key", API_KEY, "--max-queue-len", "1000")
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            code = _sigterm_and_wait(srv)
        else:
            code = srv.proc.returncode
    assert code == 0, srv.log_text()
    _check_log(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(pagedcore.default_model_path())


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    # What the server does: the template's text (special tokens included), no BOS added.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("pagedcore_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def sse_payloads(lines) -> list[str]:
    """The data of each server-sent event, checking the framing: `data: ...` lines
    separated by blank lines, nothing else."""
    payloads = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), repr(line)
        payloads.append(line[len("data: "):])
    return payloads


PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ---- the openai client ---------------------------------------------------------------


def test_the_chunks_json_equals_json_dumps() -> None:
    # app._dumps (a shared encoder; str by the C function json.dumps calls) writes
    # what json.dumps(value, ensure_ascii=False) writes, for what the chunks hold.
    from pagedcore.server import app

    values = ["", " tok", 'quote " backslash \\ slash /', "\n\t\r\x00\x1f\x7f", "é ü 中文 \u2028 \u2029 😀 \ud800",
              None, 0, -3, 2.5, 1e-7, float("nan"), float("inf"), True,
              {"prompt_tokens": 5, "completion_tokens": 17, "total_tokens": 22},
              [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}, None]]
    for value in values:
        assert app._dumps(value) == json.dumps(value, ensure_ascii=False), value
    # The usage of a streamed completion's chunk, by its f-string.
    for prompt_tokens, completion_tokens in ((0, 0), (5, 17), (4096, 123456)):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        assert app._usage_field(prompt_tokens, completion_tokens) == ', "usage": ' + json.dumps(usage)


def test_models_lists_the_served_name(client, http) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").status_code == 200


def test_completion(client, tokenizer) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_completion_usage_counts_generated_tokens(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 7 == len(choice.logprobs.tokens)


def test_chat(client, tokenizer) -> None:
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    assert out.object == "chat.completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, QUESTION))
    assert 1 <= out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_equals_non_streamed(client) -> None:
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content and text
    finals = [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason is not None]
    assert finals == [whole.choices[0].finish_reason]
    assert content[-1].choices[0].finish_reason is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_raw_stream_is_sse_ending_with_done(http) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    whole = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_n_2(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0.8, seed=7,
                                    logprobs=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=6, temperature=0.8,
                                          seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.content for c in chat.choices)


def test_stop_string(client) -> None:
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args).choices[0].text
    # A stop string from the second half of the greedy text: the output is the text before it.
    start = len(full) // 2
    stop = full[start:start + 3]
    assert stop.strip(), full
    expected = full[:full.index(stop)]
    out = client.completions.create(**args, stop=[stop])
    [choice] = out.choices
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert getattr(choice, "stop_reason", None) == stop
    streamed = client.completions.create(**args, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    [choice] = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # (fewer when two tokens decode to the same text)
        assert all(v <= 0 for v in top.values()) and logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert token in top and top[token] == pytest.approx(max(top.values()))
        assert logprob == pytest.approx(top[token])


def test_chat_logprobs(client) -> None:
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    [choice] = out.choices
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        best, second = entry.top_logprobs
        assert best.logprob >= second.logprob
        assert entry.token == best.token and entry.logprob == pytest.approx(best.logprob)


def test_token_id_prompts(client, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    other = tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    both = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=5, temperature=0)
    assert sorted(c.index for c in both.choices) == [0, 1]
    assert min(both.choices, key=lambda c: c.index).text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + len(other)
    texts = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=5,
                                      temperature=0)
    assert sorted(c.index for c in texts.choices) == [0, 1]
    assert texts.usage.prompt_tokens == len(ids) + len(other)


def test_echo(client) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.model_dump() == plain.usage.model_dump()
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- bad requests ------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OVERSIZED = json.dumps({**OK_C, "prompt": "a" * (9 << 20)}).encode()

# (id, path, body: dict or raw bytes, headers, status, param, words the message must hold)
BAD_REQUESTS = [
    ("temperature -1", C, {**OK_C, "temperature": -1}, None, 400, "temperature", ["temperature", "-1"]),
    ("top_p 0", C, {**OK_C, "top_p": 0}, None, 400, "top_p", ["top_p", "(0, 1]"]),
    ("top_p 1.5", C, {**OK_C, "top_p": 1.5}, None, 400, "top_p", ["top_p", "1.5"]),
    ("top_k -5", C, {**OK_C, "top_k": -5}, None, 400, "top_k", ["top_k", "-5"]),
    ("top_k over int32", C, {**OK_C, "top_k": 2**40}, None, 400, "top_k", ["top_k", str(2**31 - 1)]),
    ("min_p 2", C, {**OK_C, "min_p": 2}, None, 400, "min_p", ["min_p", "[0, 1]"]),
    ("n 0", C, {**OK_C, "n": 0}, None, 400, "n", ["n must be", "0"]),
    ("n over max_num_seqs", C, {**OK_C, "n": 1000}, None, 400, "n", ["max_num_seqs", "1000"]),
    ("n 2 greedy", C, {**OK_C, "n": 2, "temperature": 0}, None, 400, "n", ["greedy"]),
    ("max_tokens 0", C, {**OK_C, "max_tokens": 0}, None, 400, "max_tokens", ["max_tokens", "at least 1"]),
    ("presence_penalty 3", C, {**OK_C, "presence_penalty": 3}, None, 400, "presence_penalty",
     ["presence_penalty", "[-2, 2]"]),
    ("logprobs 50", C, {**OK_C, "logprobs": 50}, None, 400, "logprobs", ["logprobs", "20", "50"]),
    ("top_logprobs 50", CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs",
     ["20", "50"]),
    ("seed x", C, {**OK_C, "seed": "x"}, None, 400, "seed", ["seed"]),
    ("n two", C, {**OK_C, "n": "two"}, None, 400, "n", ["n"]),
    ("stop empty", C, {**OK_C, "stop": [""]}, None, 400, "stop", ["stop"]),
    ("messages string", CHAT, {**OK_CHAT, "messages": "hi"}, None, 400, "messages", ["messages"]),
    ("malformed json", C, b'{"model": "smol", "prompt": ', None, 400, None, ["JSON"]),
    ("json array", C, b"[1, 2]", None, 400, None, ["object"]),
    ("no model", C, {"prompt": "hi"}, None, 400, "model", ["model"]),
    ("no prompt", C, {"model": MODEL}, None, 400, "prompt", ["prompt"]),
    ("no messages", CHAT, {"model": MODEL}, None, 400, "messages", ["messages"]),
    ("empty prompt", C, {**OK_C, "prompt": ""}, None, 400, "prompt", ["empty"]),
    ("empty prompt list", C, {**OK_C, "prompt": []}, None, 400, "prompt", ["empty"]),
    ("bool token id", C, {**OK_C, "prompt": [True]}, None, 400, "prompt", ["prompt"]),
    ("token id out of vocab", C, {**OK_C, "prompt": [10**7]}, None, 400, "prompt", [str(10**7)]),
    ("prompt too long", C, {**OK_C, "prompt": list(range(100, 100 + MAX_MODEL_LEN + 1))}, None, 400, "prompt",
     [str(MAX_MODEL_LEN + 1), f"max_model_len ({MAX_MODEL_LEN})"]),
    ("max_tokens over what is left", C, {**OK_C, "prompt": [100, 101], "max_tokens": MAX_MODEL_LEN}, None, 400,
     "max_tokens", [f"max_tokens {MAX_MODEL_LEN}", f"max_model_len ({MAX_MODEL_LEN})", str(MAX_MODEL_LEN - 2)]),
    ("chat max_completion_tokens over what is left", CHAT, {**OK_CHAT, "max_completion_tokens": 10**6}, None, 400,
     "max_completion_tokens", [f"max_model_len ({MAX_MODEL_LEN})"]),
    ("unknown model", C, {**OK_C, "model": "gpt-4"}, None, 404, "model", ["gpt-4"]),
    ("unknown model chat", CHAT, {**OK_CHAT, "model": "gpt-4"}, None, 404, "model", ["gpt-4"]),
    ("missing key", C, OK_C, {"Authorization": ""}, 401, None, ["API key"]),
    ("wrong key", C, OK_C, {"Authorization": "Bearer wrong"}, 401, None, ["API key"]),
    ("oversized body", C, OVERSIZED, None, 413, None, [str(8 << 20)]),
    ("image content part", CHAT,
     {**OK_CHAT, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     None, 400, "messages", ["image_url"]),
    ("bad role", CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "hi"}]}, None, 400, "messages",
     ["role"]),
]


@pytest.mark.parametrize("path,body,headers,status,param,words",
                         [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS])
def test_bad_request(http, path, body, headers, status, param, words) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    else:
        r = http.post(path, json=body, headers=headers or {})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_unknown_route_and_method_have_openai_shape(http) -> None:
    for r, status in ((http.get("/v1/nothing"), 404), (http.get("/v1/completions"), 405)):
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_still_serving_after_bad_requests(http, client) -> None:
    assert http.get("/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens >= 1
    m = metrics(http)
    assert m["pagedcore_num_requests"] == 0


# ---- load, disconnects, metrics ------------------------------------------------------------


def wait_idle(http, timeout: float = 30.0) -> dict[str, float]:
    """Polls /metrics until every block is free and no request is left."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if (m["pagedcore_kv_blocks_free"] == m["pagedcore_kv_blocks_total"]
                and m["pagedcore_num_requests"] == 0 and m["pagedcore_num_requests_running"] == 0
                and m["pagedcore_num_requests_waiting"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout} s: {m}")
        time.sleep(0.05)


async def _stream_one(client, k: int, hang_up_after: int | None) -> dict:
    chat = k % 2 == 1
    words = " ".join(["alpha", "beta", "gamma", "delta"][j % 4] for j in range(3 + 5 * (k % 7)))
    if chat:
        path = CHAT
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Client {k}: {words}"}],
                "max_tokens": 24, "temperature": 0.7, "seed": k, "ignore_eos": True, "stream": True}
    else:
        path = C
        body = {"model": MODEL, "prompt": f"Client {k}: {words}", "max_tokens": 24, "temperature": 0.7,
                "seed": k, "ignore_eos": True, "stream": True}
    chunks: list[dict] = []
    done = False
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            assert not done, "data after [DONE]"
            chunks.append(json.loads(data))
            if hang_up_after is not None and len(chunks) == hang_up_after:
                break  # leaving the block closes the connection mid-stream
    return {"chat": chat, "chunks": chunks, "done": done}


async def _load(url: str, num_clients: int, hang_up_every: int) -> list[dict]:
    limits = httpx.Limits(max_connections=2 * num_clients, max_keepalive_connections=2 * num_clients)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=180,
                                 limits=limits) as client:
        return await asyncio.gather(*[
            _stream_one(client, k, 3 if k % hang_up_every == 0 else None) for k in range(num_clients)])


def test_64_concurrent_streams_with_hang_ups(server, http) -> None:
    before = metrics(http)
    results = asyncio.run(_load(server.url, num_clients=64, hang_up_every=4))
    hung_up = results[::4]
    finished = [r for k, r in enumerate(results) if k % 4 != 0]
    assert len(hung_up) == 16 and len(finished) == 48
    for r in hung_up:
        assert len(r["chunks"]) == 3 and not r["done"]
    for r in finished:
        assert r["done"], r
        reasons = [c["choices"][0]["finish_reason"] for c in r["chunks"] if c["choices"]]
        assert reasons[-1] == "length" and reasons.count("length") == 1
        if r["chat"]:
            assert r["chunks"][0]["choices"][0]["delta"]["role"] == "assistant"
        else:
            assert "".join(c["choices"][0]["text"] for c in r["chunks"])
    after = wait_idle(http)
    generated = after["pagedcore_generation_tokens_total"] - before["pagedcore_generation_tokens_total"]
    # 48 x 24 tokens, plus a few for each of the 16 that hung up (far fewer than 24 each
    # if they were aborted).
    assert 48 * 24 + 16 <= generated < 48 * 24 + 16 * 16
    assert after["pagedcore_time_to_first_token_seconds_count"] >= before.get(
        "pagedcore_time_to_first_token_seconds_count", 0) + 64
    assert after["pagedcore_e2e_request_latency_seconds_count"] >= before.get(
        "pagedcore_e2e_request_latency_seconds_count", 0) + 48
    text = http.get("/metrics").text
    for name, kind in (("pagedcore_kv_blocks_total", "gauge"), ("pagedcore_kv_blocks_free", "gauge"),
                       ("pagedcore_num_requests_running", "gauge"), ("pagedcore_num_requests_waiting", "gauge"),
                       ("pagedcore_preemptions", "counter"), ("pagedcore_prompt_tokens", "counter"),
                       ("pagedcore_generation_tokens", "counter"), ("pagedcore_prefix_cache_queries", "counter"),
                       ("pagedcore_prefix_cache_hits", "counter"),
                       ("pagedcore_time_to_first_token_seconds", "histogram"),
                       ("pagedcore_inter_token_latency_seconds", "histogram"),
                       ("pagedcore_e2e_request_latency_seconds", "histogram")):
        # (a counter's TYPE line carries the _total suffix or not, by prometheus_client version)
        assert re.search(rf"^# TYPE {name}(_total)? {kind}$", text, re.MULTILINE), name
    assert after["pagedcore_kv_blocks_total"] == NUM_KV_BLOCKS


def test_non_streamed_request_of_a_client_that_gives_up_is_aborted(server, http) -> None:
    before = metrics(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{C}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.5)
    # The whole request would take ~500 steps (15 s or more here); aborted, it is gone soon.
    # (The bound below tells; the wait is generous for a loaded host: a request left
    # running would finish, or outlast it, and fail either way.)
    after = wait_idle(http)
    generated = after["pagedcore_generation_tokens_total"] - before["pagedcore_generation_tokens_total"]
    assert 1 <= generated < MAX_MODEL_LEN - 16


# ---- SIGTERM drains -----------------------------------------------------------------------


def test_sigterm_drains_an_in_flight_stream(tmp_path) -> None:
    # A second, key-less process: requests need no Authorization header there.
    srv = _start_server(tmp_path / "serve.log", "--shutdown-timeout", "30")
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{srv.url}{C}", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            payloads = []
            for line in lines:
                if line:
                    payloads.append(line)
                if len(payloads) == 2:
                    break
            srv.proc.send_signal(signal.SIGTERM)
            # While it drains, the server takes no new connection.
            deadline = time.monotonic() + 10
            while True:
                try:
                    httpx.get(f"{srv.url}/health", timeout=5.0)
                except httpx.ConnectError:
                    break
                except (httpx.TimeoutException, httpx.ReadError, httpx.RemoteProtocolError):
                    pass  # (a slow answer on a loaded host, or a connection dropped as the socket closed)
                assert time.monotonic() < deadline, "still accepting connections 10 s after SIGTERM"
                time.sleep(0.05)
            payloads += list(lines)
        data = sse_payloads(payloads)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(p) for p in data[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        code = srv.proc.wait(EXIT_TIMEOUT_S)
        assert code == 0, srv.log_text()
        _check_log(srv)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_a_full_queue_is_429_and_the_server_keeps_serving() -> None:
    # In process (the routes and the engine thread are the real ones): with
    # max_queue_len 0 every admission finds the queue full.
    from starlette.testclient import TestClient

    from pagedcore.llm_engine import EngineArgs, LLMEngine
    from pagedcore.server.app import build_app
    from pagedcore.server.async_engine import AsyncEngine

    engine = AsyncEngine(LLMEngine(EngineArgs(model=pagedcore.default_model_path(), num_kv_blocks=64)),
                         max_queue_len=0)
    try:
        with TestClient(build_app(engine, "smol")) as client:
            r = client.post("/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "max_queue_len 0" in r.json()["error"]["message"]
            assert client.get("/health").status_code == 200
            engine.max_queue_len = None
            r = client.post("/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        engine.shutdown()
