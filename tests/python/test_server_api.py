"""The OpenAI-compatible server's handling of requests, checked end to end over
HTTP (the official ``openai`` client and raw httpx) against ``LLM.generate`` /
``LLM.chat`` on the same weights: every sampling field reaches the engine with
its value, seeds reproduce, several prompts with n > 1 map to OpenAI's choice
indices, chat content given as text parts, and what clients get when a step
fails mid-stream (async scheduling off and on) or the engine dies: its loop
raises (engine thread, and engine process), or the engine process is killed
while requests wait for admission.

The app and its engine thread run in this process, served by uvicorn on
127.0.0.1, over a tiny random Llama (float32, CPU) that reads SmolLM2's
tokenizer (its vocabulary and chat template), so that the tests take seconds.
Its weights are chosen so that outputs depend on the whole prompt and greedy
decoding repeats tokens: penalties change what it generates."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
try:
    import httpx
except ImportError:  # the openai client of this environment ships httpx as `httpx2`
    httpx = pytest.importorskip("httpx2")

import pagedcore  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from pagedcore.server.app import build_app  # noqa: E402
from pagedcore.server.async_engine import AsyncEngine  # noqa: E402

from server_faults import FaultInjector, kill_thread, nan_logits, stall  # noqa: E402

MODEL = "tiny"
ENGINE = dict(num_kv_blocks=64, max_model_len=256, device="cpu")
PROMPT = "A dog of France is"
PROMPTS = ["A dog of France is", "The capital of Spain was", "Once upon a time"]


# ---- the model, the reference and the server --------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # SmolLM2's vocabulary size, so that its tokenizer's ids are all in range.
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    """The reference: the same weights through ``LLM`` (no server code)."""
    return LLM(model=str(checkpoint), tokenizer=pagedcore.default_model_path(), **ENGINE)


@dataclass
class Served:
    url: str
    engine: AsyncEngine
    faults: FaultInjector | None  # (None: the engine is in a process of its own)
    loop: object  # the server's event loop


@contextmanager
def serving(async_engine, faults: FaultInjector | None = None) -> Iterator[Served]:
    """Serves the app over ``async_engine`` on 127.0.0.1 (uvicorn in a thread);
    shuts the engine down at the end."""
    try:
        server = uvicorn.Server(uvicorn.Config(build_app(async_engine, MODEL), host="127.0.0.1", port=0,
                                               log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            yield Served(f"http://127.0.0.1:{port}", async_engine, faults, server.servers[0].get_loop())
        finally:
            server.should_exit = True
            thread.join(30)
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def serve(checkpoint):
    """Builds a fresh engine (EngineArgs overrides as keywords) and app and serves
    them on 127.0.0.1 (a context manager)."""

    @contextmanager
    def start(**overrides) -> Iterator[Served]:
        engine = LLMEngine(EngineArgs(model=str(checkpoint), tokenizer=pagedcore.default_model_path(),
                                      **{**ENGINE, **overrides}))
        faults = FaultInjector(engine.runner)
        with serving(AsyncEngine(engine), faults) as served:
            yield served

    return start


@pytest.fixture(scope="module")
def server(serve) -> Iterator[Served]:
    with serve() as served:
        yield served


@pytest.fixture(scope="module")
def server_async_scheduling(serve) -> Iterator[Served]:
    """As ``server``, with async scheduling (step n+1 launched before step n's
    tokens reach the host; the default on CUDA)."""
    with serve(async_scheduling=True) as served:
        yield served


@pytest.fixture(params=["sync", "async scheduling"])
def faulty(request, server, server_async_scheduling) -> Iterator[tuple[Served, httpx.Client]]:
    """Each server (without and with async scheduling) and a client of it."""
    served = server if request.param == "sync" else server_async_scheduling
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield served, c


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


OPENAI_FIELDS = {"n", "temperature", "top_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty",
                 "stop", "logprobs"}


def openai_args(**fields) -> dict:
    """Keyword arguments of the openai client: pagedcore's own fields (top_k,
    min_p, ...) go in the request body through ``extra_body``."""
    extra = {k: v for k, v in fields.items() if k not in OPENAI_FIELDS}
    return {**{k: v for k, v in fields.items() if k in OPENAI_FIELDS}, "extra_body": extra}


def reference(llm: LLM, prompt, **params) -> list:
    """LLM.generate's completions (CompletionOutput list) of one prompt."""
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs


def sse_payloads(response) -> list[str]:
    """The data of each server-sent event (`data: ...` lines between blank lines)."""
    payloads = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), repr(line)
            payloads.append(line[len("data: "):])
    return payloads


# ---- sampling fields reach the engine ---------------------------------------------------------

GREEDY = dict(temperature=0.0, max_tokens=10)
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=10)
THIRD = "the third token SAMPLED gives"  # a stop token met half-way (filled in by resolve)

# (id, the request's fields without the parameter, the parameter's fields).
# Each case's parameter changes the output of PROMPT on these weights (checked
# in the test): greedy decoding repeats its 4th token at the 5th, which positive
# penalties prevent, and negative presence and frequency penalties make it
# repeat in two different ways (swapping the two fails).
FIELD_CASES = [
    ("presence_penalty", GREEDY, dict(presence_penalty=2.0)),
    ("frequency_penalty", GREEDY, dict(frequency_penalty=2.0)),
    ("repetition_penalty", GREEDY, dict(repetition_penalty=2.0)),
    ("presence_penalty negative", GREEDY, dict(presence_penalty=-2.0)),
    ("frequency_penalty negative", GREEDY, dict(frequency_penalty=-2.0)),
    ("top_k", SAMPLED, dict(top_k=2)),
    ("min_p", SAMPLED, dict(min_p=0.05)),
    ("stop_token_ids", SAMPLED, dict(stop_token_ids=[THIRD])),
    # min_tokens keeps the stop token from ending the output before 4 tokens.
    ("min_tokens", {**SAMPLED, "stop_token_ids": [THIRD]}, dict(min_tokens=4)),
]


def resolve(llm, fields: dict) -> dict:
    """``fields`` with THIRD in stop_token_ids replaced by that token's id."""
    if fields.get("stop_token_ids") != [THIRD]:
        return fields
    third = reference(llm, PROMPT, **SAMPLED)[0].token_ids[2]
    return {**fields, "stop_token_ids": [third]}


@pytest.mark.parametrize("base,fields", [pytest.param(*case[1:], id=case[0]) for case in FIELD_CASES])
def test_sampling_field_reaches_the_engine(client, llm, base, fields) -> None:
    base, fields = resolve(llm, base), resolve(llm, fields)
    [expected] = reference(llm, PROMPT, **base, **fields)
    [without] = reference(llm, PROMPT, **base)
    assert expected.token_ids != without.token_ids, "the parameter must change the output on these weights"
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **openai_args(**base, **fields))
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks)
            finish_reason = chunks[-1].choices[0].finish_reason
        else:
            [choice] = out.choices
            text, finish_reason = choice.text, choice.finish_reason
        assert (text, finish_reason) == (expected.text, expected.finish_reason), (stream, fields)


def test_stop_token_id_ends_the_output_half_way(client, llm) -> None:
    base = reference(llm, PROMPT, **SAMPLED)[0]
    third = base.token_ids[2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED, extra_body={"stop_token_ids": [third]})
    [choice] = out.choices
    assert choice.finish_reason == "stop" and choice.stop_reason == third
    assert out.usage.completion_tokens == 3  # (the stop token counts; its text is not shown)
    assert choice.text == reference(llm, PROMPT, **{**SAMPLED, "max_tokens": 2})[0].text


def test_min_tokens_through_chat(client, llm) -> None:
    # The chat route builds its own SamplingParams: one field through it too.
    messages = [{"role": "user", "content": "Name a colour."}]
    params = dict(temperature=1.0, seed=5, max_tokens=8)
    third = llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids[2]
    [expected] = llm.chat(messages, SamplingParams(**params, stop_token_ids=[third], min_tokens=5),
                          use_tqdm=False)[0].outputs
    assert len(expected.token_ids) > 3
    out = client.chat.completions.create(model=MODEL, messages=messages, **params,
                                         extra_body={"stop_token_ids": [third], "min_tokens": 5})
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)


# ---- seeds -------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_over_http(client, llm) -> None:
    args = dict(model=MODEL, prompt=PROMPT, temperature=1.0, max_tokens=10)
    a = client.completions.create(**args, seed=5).choices[0].text
    again = client.completions.create(**args, seed=5).choices[0].text
    other = client.completions.create(**args, seed=6).choices[0].text
    assert a == again
    assert a != other
    assert a == reference(llm, PROMPT, temperature=1.0, max_tokens=10, seed=5)[0].text
    assert other == reference(llm, PROMPT, temperature=1.0, max_tokens=10, seed=6)[0].text


def test_seeded_chat_equals_llm_chat(client, llm) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, max_tokens=8, seed=9)
    expected = llm.chat(messages, SamplingParams(temperature=1.0, max_tokens=8, seed=9), use_tqdm=False)
    assert out.choices[0].message.content == expected[0].outputs[0].text
    other = llm.chat(messages, SamplingParams(temperature=1.0, max_tokens=8, seed=10), use_tqdm=False)
    assert other[0].outputs[0].text != expected[0].outputs[0].text  # (the seed decides the text)


# ---- several prompts, n > 1 --------------------------------------------------------------------


def test_several_prompts_with_n_map_to_openai_choice_indices(client, llm) -> None:
    n = 2
    params = dict(n=n, temperature=1.0, seed=11, max_tokens=6)
    outputs = llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    # OpenAI's order: choice index = prompt index * n + sample index.
    expected = {i * n + j: outputs[i].outputs[j].text for i in range(len(PROMPTS)) for j in range(n)}
    assert len(set(expected.values())) == len(expected)  # (else a wrong mapping could pass)

    out = client.completions.create(model=MODEL, prompt=PROMPTS, **params)
    assert len(out.choices) == len(expected)
    assert {c.index: c.text for c in out.choices} == expected

    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **params):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == expected


# ---- chat content as text parts -------------------------------------------------------------------


def test_chat_content_as_text_parts_is_the_joined_string(client, llm) -> None:
    pieces = ["What is the capital", " of France?", " Answer in one word."]
    joined = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "".join(pieces)}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
             {"role": "user", "content": [{"type": "text", "text": p} for p in pieces]}]
    expected = llm.chat(joined, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    # The reply depends on the words of the question (else the check below proves nothing).
    first_only = [joined[0], {"role": "user", "content": pieces[0]}]
    assert llm.chat(first_only, SamplingParams(temperature=0.0, max_tokens=8),
                    use_tqdm=False)[0].outputs[0].text != expected.outputs[0].text
    for messages in (joined, parts):
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
        assert out.choices[0].message.content == expected.outputs[0].text
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


@pytest.mark.parametrize("part,words", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, ["input_audio"]),
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, ["image_url"]),
    ({"text": "no type"}, ["None"]),
    ({"type": "text", "text": 5}, ["text", "5"]),
])
def test_chat_content_part_that_is_not_text_is_refused(http, part, words) -> None:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, part]}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error


# ---- a step that fails mid-stream -------------------------------------------------------------------


STREAMS = {
    "completions": ("/v1/completions", {"prompt": PROMPT}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
}


def _text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else (choice["delta"].get("content") or "")


@pytest.mark.parametrize("route", list(STREAMS))
def test_a_step_failing_mid_stream_sends_an_error_event_then_done(faulty, llm, route) -> None:
    server, http = faulty
    path, fields = STREAMS[route]
    body = {"model": MODEL, "temperature": 0, "max_tokens": 20, "ignore_eos": True, "stream": True, **fields}
    # The prefill and 2 decode steps go well (3 tokens); the 4th forward pass gives NaN logits.
    # (With async scheduling the 5th is launched before the 4th's NaN is seen: still 3 tokens.)
    server.faults.arm(3, nan_logits)
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])
    assert error == {"error": {
        "message": "generation failed: engine step failed: the model produced logits with nothing to sample (NaN?)",
        "type": "internal_error", "param": None, "code": None}}
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    text = "".join(_text_of(c) for c in chunks)
    if route == "chat":
        [expected] = llm.chat(fields["messages"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                              use_tqdm=False)[0].outputs
    else:
        [expected] = reference(llm, PROMPT, temperature=0, max_tokens=3, ignore_eos=True)
    assert text == expected.text and text
    # The failed step dropped its requests; the server goes on serving.
    assert http.get("/health").status_code == 200
    again = http.post(path, json={**body, "stream": False, "max_tokens": 3})
    assert again.status_code == 200


@pytest.mark.parametrize("route", list(STREAMS))
def test_a_stream_read_late_gets_its_tokens_merged_into_one_chunk(server, http, llm, route) -> None:
    # The server's event loop stalls from the 2nd forward pass until the engine has
    # made every token: the stream's handler then finds ~60 outputs waiting and
    # must send them as one chunk whose text is theirs joined (detokenized on the
    # HTTP side, as one piece) and whose usage counts each token.
    path, fields = STREAMS[route]
    max_tokens = 64
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **fields}

    def stall_the_loop() -> None:  # (on the server's loop)
        deadline = time.monotonic() + 30
        while server.engine.stats.get("num_requests", 1) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # (the last step's hand-over follows its stats)

    def stall_from_here(logits: torch.Tensor) -> torch.Tensor:  # (on the engine thread)
        server.loop.call_soon_threadsafe(stall_the_loop)
        return logits

    server.faults.arm(1, stall_from_here)
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == max_tokens
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    per_chunk = [b - a for a, b in zip([0, *counts], counts) if b > a]
    assert sum(per_chunk) == max_tokens and len(per_chunk) <= 3 and max(per_chunk) >= max_tokens - 4, per_chunk
    text = "".join(_text_of(c) for c in chunks)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if route == "chat":
        [expected] = llm.chat(fields["messages"], params, use_tqdm=False)[0].outputs
    else:
        [expected] = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert len(expected.token_ids) == max_tokens
    assert text == expected.text


def _scrape(http) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pagedcore_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_count_each_step_of_a_request_and_the_loop_lag(server, http) -> None:
    # One request alone, greedy, 12 tokens: its prefill step gives the first token,
    # then each of 11 decode steps one more (the engine steps only while it runs).
    before = _scrape(http)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
                                           "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    # (the step counts are published before the last token is handed over: exact at once)
    after = _scrape(http)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew('pagedcore_engine_step_seconds_count{kind="prefill"}') == 1
    assert grew('pagedcore_engine_step_seconds_count{kind="decode"}') == 11
    inf_decode = 'pagedcore_engine_step_seconds_bucket{kind="decode",le="+Inf"}'
    assert grew(inf_decode) == 11 and grew('pagedcore_engine_step_seconds_sum{kind="decode"}') > 0
    # The lag watcher wakes every 10 ms, later on a loaded host: polled, not slept for.
    deadline = time.monotonic() + 30
    while grew("pagedcore_event_loop_lag_seconds_count") < 3:
        assert time.monotonic() < deadline, "the event loop's lag watcher did not record 3 wake-ups in 30 s"
        time.sleep(0.01)
        after = _scrape(http)


def test_a_step_failing_under_a_non_streamed_request_is_500(faulty, caplog) -> None:
    server, http = faulty
    server.faults.arm(2, nan_logits)
    with caplog.at_level("ERROR", logger="uvicorn.error"):
        r = http.post("/v1/completions",
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 500
    assert r.json() == {"error": {
        "message": "generation failed: engine step failed: the model produced logits with nothing to sample (NaN?)",
        "type": "internal_error", "param": None, "code": None}}
    # A handled error: no traceback from the ASGI server, and the connection stays open.
    assert [rec.getMessage() for rec in caplog.records if rec.name == "uvicorn.error"] == []
    assert http.get("/health").status_code == 200


# ---- the engine dies ----------------------------------------------------------------------------------

DIED = "engine died: the engine loop raised EngineThreadKilled: injected"


def _refused_as_dead(http, message: str) -> None:
    """/health and new requests (each route) get 503 with ``message``, at once."""
    r = http.get("/health")
    assert r.status_code == 503
    assert r.json()["error"] == {"message": message, "type": "service_unavailable", "param": None,
                                 "code": "engine_dead"}
    for path, fields in STREAMS.values():
        r = http.post(path, json={"model": MODEL, "max_tokens": 2, **fields})
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": message, "type": "service_unavailable", "param": None,
                                     "code": "engine_dead"}


@contextmanager
def engine_process(checkpoint, fault, healthy: int) -> Iterator[Served]:
    """The server with its engine in a process of its own (``serve --engine-process``):
    the real engine there, its forward pass after ``healthy`` good ones failing with
    ``fault`` (built in that process: server_faults.FaultyEngine)."""
    from pagedcore.server.engine_process import EngineProcess

    from server_faults import FaultyEngine

    args = EngineArgs(model=str(checkpoint), tokenizer=pagedcore.default_model_path(), **ENGINE)
    engine = EngineProcess(args, "WARNING", engine_factory=FaultyEngine(healthy, fault))
    try:
        with serving(engine) as served:
            yield served
    finally:
        engine._proc.kill()  # (a stalled one would take the shutdown's timeouts)


@pytest.mark.parametrize("mode", ["thread", "thread, async scheduling", "engine process"])
def test_health_is_503_with_the_reason_after_the_engine_loop_died(serve, checkpoint, mode, caplog, capfd) -> None:
    if mode == "engine process":
        started = engine_process(checkpoint, kill_thread, healthy=2)
    else:
        started = serve(async_scheduling=mode.endswith("async scheduling"))
    with started as served, httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        if served.faults is not None:
            served.faults.arm(2, kill_thread)
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 20, "ignore_eos": True,
                "stream": True, "stream_options": {"continuous_usage_stats": True}}
        with caplog.at_level("INFO"), http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            payloads = sse_payloads(r)
        # The stream in flight ends with an error event and [DONE] (it does not hang).
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"] == {"message": DIED, "type": "service_unavailable",
                                                     "param": None, "code": "engine_dead"}
        # The tokens of the 2 healthy forward passes; with async scheduling the 3rd pass
        # fails before the 2nd's tokens reach the host. (Counted by the chunks' usage: a
        # handler that fell behind sends both tokens in one chunk.)
        assert json.loads(payloads[-3])["usage"]["completion_tokens"] == (1 if mode.endswith("async scheduling") else 2)
        # /health says why; new requests are refused at once rather than queued for a loop that is gone.
        _refused_as_dead(http, DIED)
    # The log says it once, with the reason (the engine process logs it there).
    died = [rec for rec in caplog.records if "engine died" in rec.getMessage()]
    child = [line for line in capfd.readouterr().err.splitlines() if "engine died" in line]
    if mode == "engine process":
        assert (len(died), child) == (0, [f"ERROR {child[0][6:14]} pagedcore.server: {DIED}"]), child
    else:
        assert [(rec.name, rec.levelname, rec.getMessage()) for rec in died] == [("pagedcore.server", "ERROR", DIED)]


def test_requests_waiting_for_admission_when_the_engine_process_dies_get_503(checkpoint, caplog) -> None:
    # The engine process's loop hangs in its 3rd forward pass (2 tokens streamed);
    # two requests wait for admission, then the process is killed.
    with engine_process(checkpoint, stall, healthy=2) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http, caplog.at_level("INFO"):
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 20, "ignore_eos": True}
        answers: dict[str, httpx.Response] = {}

        def post(name: str, path: str, fields: dict) -> None:
            with httpx.Client(base_url=served.url, timeout=30) as own:
                answers[name] = own.post(path, json={**body, "stream": False, **fields})

        stream = {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}}
        with http.stream("POST", "/v1/completions", json=stream) as r:
            lines = r.iter_lines()
            streamed, tokens = [], 0
            while tokens < 2:  # (by the chunks' usage: a handler that fell behind merges tokens into one chunk)
                line = next(lines)
                if line:
                    streamed.append(line)
                    tokens = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
            assert tokens == 2
            waiting = [threading.Thread(target=post, args=(route, *STREAMS[route])) for route in STREAMS]
            for t in waiting:
                t.start()
            deadline = time.monotonic() + 20
            while served.engine._pending < len(waiting):
                assert time.monotonic() < deadline, "the requests did not reach the engine"
                time.sleep(0.01)
            pid = served.engine._proc.pid
            os.kill(pid, signal.SIGKILL)
            for t in waiting:
                t.join(30)
            payloads = streamed + [line for line in lines if line]
        message = "engine died: the engine process exited with code -9 (SIGKILL)"
        error = {"message": message, "type": "service_unavailable", "param": None, "code": "engine_dead"}
        # Each waiting request: a clean 503 saying why, in OpenAI's shape.
        for route in STREAMS:
            assert (answers[route].status_code, answers[route].json()) == (503, {"error": error}), route
        # The stream in flight: its 2 tokens, then the error event and [DONE].
        assert payloads[len(streamed):] == [f"data: {json.dumps({'error': error})}", "data: [DONE]"]
        _refused_as_dead(http, message)
    # No traceback (the ASGI server logs one for an unhandled error), and the death said once.
    assert [rec.getMessage() for rec in caplog.records if rec.name.startswith("uvicorn")] == []
    died = [(rec.name, rec.levelname, rec.getMessage()) for rec in caplog.records if "engine died" in rec.getMessage()]
    assert died == [("pagedcore.server", "ERROR", message)]
