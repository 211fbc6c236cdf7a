#!/usr/bin/env python3
"""Serving benchmark: the OpenAI-compatible server under an open-loop load, with
the fields ``vllm bench serve`` prints, the offline ``LLM.generate`` on the same
requests, clients that hang up mid-stream, and SIGTERM with streams in flight.

Workload (all seeded): N requests of random token ids (so each prompt length is
exact and any vocabulary works) whose own part has a lognormal length; a
fraction of them start with one of K shared system prompts (the prefix cache's
case). Arrivals are a Poisson process at each --request-rate: a number of
requests per second, ``Nx`` for N times the saturation rate (the request
throughput of the ``inf`` run, made first), or ``inf`` (all at once). Every
request is a streamed /v1/completions request with a fixed max_tokens and
ignore_eos, sent from an asyncio loop by the raw client (--client raw, the
default: bare asyncio connections and one json.loads per event, so that the
load generator is not what limits the run), by the ``openai`` client
(AsyncOpenAI) or by plain httpx; with --client-processes N, N processes share
the requests and their results are merged. Each rate draws its own prompts (its
own part; the system prompts are shared by all), so one rate finds nothing of
another's in the prefix cache but the system prompts.

Measured on the client, as vLLM's benchmark does: TTFT (request sent -> first
streamed chunk), TPOT per request ((E2E - TTFT) / (output tokens - 1), output
tokens from the usage), ITL (the gap between chunks). The server merges the
tokens a stream has pending into one chunk when its writer is behind; the raw
client asks for continuous_usage_stats and so knows each chunk's tokens
("tokens per chunk": 1.0 when every token had its own chunk). Each run also
prints the CPU time of the clients and of the own server's processes over the
run's wall time (a client-bound run shows as a client near 1.0 core per
process), and the server's step times (steps in which prompt tokens ran
apart: async_engine.StepTimes), event-loop lag and the garbage collections
of the engine's and the HTTP processes from /metrics: what long inter-token gaps come from.

--offline runs ``LLM.generate`` on the requests of the ``inf`` run (in a child
process, before the server starts, with the same engine flags) and prints the
online/offline output-throughput ratio (issue 14's target: >= 0.9).
--saturation-repeats N runs the ``inf`` rate N times, each on prompts of its own,
and ``LLM.generate`` on the same N sets in the same order (one engine each
side): the ratio from the summed tokens and times, each pair's beside it (a
single SmolLM2 saturation run lasts ~0.6 s on one GPU, and single runs' ratios
spread 0.77-1.12 at one commit).
--disconnect-fraction F with --disconnect-streams S: S streams at once, a
fraction F of whose clients close the stream after a random number of tokens;
then /metrics must come back to every KV block free and no request left, no
response may be 5xx (nor an error event), /health 200.
--sigterm-streams S: S streams in flight, SIGTERM to the server: each must end
with finish_reason length and [DONE] (drained, not cut), the server exit 0
within --shutdown-timeout.

By default the script starts its own ``pagedcore serve`` on a free port (the
default model, --model-path DIR, or --shape NAME: a config.json of that shape
served with random weights, --load-format dummy) and stops it with SIGTERM at
the end; --base-url targets a running server instead (no offline or SIGTERM
runs then). --json writes a summary.

Usage:
  bench/bench_serving.py --shape smollm2 --num-requests 512 --max-tokens 128 \\
      --request-rate 0.5x inf --offline --disconnect-fraction 0.25 --sigterm-streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import multiprocessing
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

try:  # httpx2 where the openai client brought it (the GPU machine's carried wheels: it does
    # not lean on that image's own httpx and httpcore), httpx otherwise
    import httpx2 as httpx
except ImportError:
    import httpx

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Result:
    prompt_len: int
    ok: bool = False
    status: int = 0  # HTTP status (0: no response); an error event mid-stream sets error
    error: str = ""
    cancelled: bool = False  # the client hung up on purpose
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # seconds between chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens of each chunk (the raw client's)
    finish_reason: str | None = None
    end: float = 0.0  # time.perf_counter() of the answer's end (this process's clock)


# ---- the workload ----------------------------------------------------------------------------


def make_prompts(n: int, seed: int, vocab: int, median: float, sigma: float, max_len: int,
                 shared_fraction: float = 0.0, num_shared: int = 1, shared_len: int = 0) -> list[list[int]]:
    """n prompts of random token ids in [3, vocab): a lognormal own part (median
    `median`, shape `sigma`, at least 4 tokens), after one of `num_shared`
    system prompts of `shared_len` tokens for a `shared_fraction` of them
    (every 1/fraction-th request, round robin over the system prompts); each
    cut to `max_len` tokens. The system prompts depend on `seed` alone."""
    system_rng = random.Random(f"{seed}-system")
    systems = [[system_rng.randrange(3, vocab) for _ in range(shared_len)] for _ in range(num_shared)]
    rng = random.Random(seed)
    prompts, shared_seen = [], 0.0
    for i in range(n):
        own = max(4, int(rng.lognormvariate(math.log(median), sigma)))
        ids = [rng.randrange(3, vocab) for _ in range(own)]
        if shared_len and shared_fraction > 0 and (i + 1) * shared_fraction >= shared_seen + 1:
            ids = systems[int(shared_seen) % num_shared] + ids
            shared_seen += 1
        prompts.append(ids[:max_len])
    return prompts


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps of mean 1/rate (all at 0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---- the clients -------------------------------------------------------------------------------


def _body(model: str, prompt: list[int], max_tokens: int, continuous_usage: bool = False) -> dict:
    # continuous_usage_stats (vLLM's extension): each chunk says how many tokens it
    # carries (the server merges a stream's tokens into one chunk when it is behind).
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True} if continuous_usage
            else {"include_usage": True}}


def _raw_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return _body(model, prompt, max_tokens, continuous_usage=True)


def _finish(result: Result, start: float, chunk_times: list[float], usage_tokens: int | None) -> Result:
    result.end = time.perf_counter()
    result.e2e = result.end - start
    if chunk_times:
        result.ttft = chunk_times[0] - start
        result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    result.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    return result


async def request_openai(client, model: str, prompt: list[int], max_tokens: int, cancel_after: int | None) -> Result:
    """One streamed completion through AsyncOpenAI; with cancel_after, the stream
    is closed once that many tokens have come (the connection goes away
    mid-stream). NOTE: tokens, not chunks: a chunk carries several tokens when
    the server's writer is behind, and a stream of fewer chunks than
    cancel_after would end whole, not hang up (each chunk tells its tokens:
    continuous_usage_stats, asked for then)."""
    import openai

    result = Result(prompt_len=len(prompt))
    body = _body(model, prompt, max_tokens, continuous_usage=cancel_after is not None)
    chunk_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options=body["stream_options"], extra_body={"ignore_eos": True})
        result.status = 200
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    chunk_times.append(time.perf_counter())
                    if chunk.choices[0].finish_reason is not None:
                        result.finish_reason = chunk.choices[0].finish_reason
                    received = usage_tokens if usage_tokens is not None else len(chunk_times)
                    if cancel_after is not None and received >= cancel_after:
                        result.cancelled = True
                        break
        finally:
            await stream.close()
        result.ok = not result.cancelled
    except openai.APIStatusError as e:
        result.status, result.error = e.status_code, f"HTTP {e.status_code}: {e.message}"
    except openai.APIError as e:  # an error event mid-stream, or the connection failed
        result.error = f"{type(e).__name__}: {e}"
    return _finish(result, start, chunk_times, usage_tokens)


async def request_httpx(client, model: str, prompt: list[int], max_tokens: int, cancel_after: int | None) -> Result:
    """The same request with plain httpx and a minimal server-sent-event parser
    (cancel_after: tokens, as request_openai)."""
    result = Result(prompt_len=len(prompt))
    chunk_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        body = _body(model, prompt, max_tokens, continuous_usage=cancel_after is not None)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return _finish(result, start, chunk_times, usage_tokens)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    break
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    chunk_times.append(time.perf_counter())
                    reason = chunk["choices"][0].get("finish_reason")
                    if reason is not None:
                        result.finish_reason = reason
                    received = usage_tokens if usage_tokens is not None else len(chunk_times)
                    if cancel_after is not None and received >= cancel_after:
                        result.cancelled = True
                        break
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return _finish(result, start, chunk_times, usage_tokens)


class _RawConnection:
    """One HTTP/1.1 connection over asyncio streams: what the raw client needs
    (a POST, a status line, headers, a chunked or sized body), no more."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, host: str, path: str, payload: bytes, api_key: str | None) -> tuple[int, dict[str, str]]:
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Accept: text/event-stream\r\n{auth}Content-Length: {len(payload)}\r\n\r\n".encode()
                          + payload)
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                return status, headers
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()

    async def body_parts(self, headers: dict[str, str]):
        """The body as it arrives (chunked transfer encoding decoded)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        else:
            yield await self.reader.readexactly(int(headers.get("content-length", "0")))

    def close(self) -> None:
        self.writer.transport.abort()  # (a hang-up mid-stream, as a client that goes away)


async def request_raw(client, model: str, prompt: list[int], max_tokens: int, cancel_after: int | None) -> Result:
    """The same request over a bare asyncio connection with a minimal parser: the
    lightest client (one json.loads per server-sent event), so that the load
    generator is not what limits the run. Counts each chunk's tokens from the
    usage it carries (continuous_usage_stats)."""
    host, port, api_key = client
    result = Result(prompt_len=len(prompt))
    chunk_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    conn = None
    try:
        conn = _RawConnection(*await asyncio.open_connection(host, port))
        status, headers = await conn.post(f"{host}:{port}", "/v1/completions",
                                          json.dumps(_raw_body(model, prompt, max_tokens)).encode(), api_key)
        result.status = status
        if status != 200:
            body = b"".join([part async for part in conn.body_parts(headers)])
            result.error = f"HTTP {status}: {body[:200]!r}"
            return _finish(result, start, chunk_times, usage_tokens)
        buffer = b""
        seen_tokens = 0
        async for part in conn.body_parts(headers):
            now = time.perf_counter()
            buffer += part
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                data = event[6:]
                if data == b"[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    break
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    chunk_times.append(now)
                    result.chunk_tokens.append(usage_tokens - seen_tokens if usage_tokens is not None else 1)
                    seen_tokens = usage_tokens if usage_tokens is not None else seen_tokens + 1
                    reason = chunk["choices"][0].get("finish_reason")
                    if reason is not None:
                        result.finish_reason = reason
                    if cancel_after is not None and seen_tokens >= cancel_after:  # (tokens: see request_openai)
                        result.cancelled = True
                        break
            if result.ok or result.cancelled or result.error:
                break
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()
    return _finish(result, start, chunk_times, usage_tokens)


@dataclass
class Load:
    """What one client process sends: requests at times relative to `start_at`
    (wall clock, shared by the processes)."""

    base_url: str
    api_key: str | None
    model: str
    prompts: list[list[int]]
    arrivals: list[float]
    max_tokens: int
    cancel_after: list[int | None]
    client: str = "openai"
    start_at: float = 0.0


async def _run_load(load: Load) -> list[Result]:
    n = len(load.prompts)
    if load.client == "raw":
        from urllib.parse import urlsplit

        where = urlsplit(load.base_url)
        client, send = (where.hostname, where.port or 80, load.api_key), request_raw
    elif load.client == "openai":
        import openai

        http = openai.DefaultAsyncHttpxClient(limits=_limits(n), timeout=3600.0)
        client = openai.AsyncOpenAI(base_url=f"{load.base_url}/v1", api_key=load.api_key or "none",
                                    max_retries=0, http_client=http)
        send = request_openai
    else:
        headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
        client = httpx.AsyncClient(base_url=load.base_url, headers=headers, timeout=httpx.Timeout(3600.0),
                                   limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8))
        send = request_httpx
    # Wall clock -> this process's perf_counter: the processes share start_at.
    start = time.perf_counter() + max(0.0, load.start_at - time.time())

    async def scheduled(i: int) -> Result:
        await asyncio.sleep(max(0.0, start + load.arrivals[i] - time.perf_counter()))
        return await send(client, load.model, load.prompts[i], load.max_tokens, load.cancel_after[i])

    try:
        return list(await asyncio.gather(*[scheduled(i) for i in range(n)]))
    finally:
        if load.client == "openai":
            await client.close()
        elif load.client == "httpx":
            await client.aclose()


def _limits(n: int):
    import openai  # noqa: F401  (the Limits class of the httpx flavour the openai client uses)
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    return type(DEFAULT_CONNECTION_LIMITS)(max_connections=n + 8, max_keepalive_connections=n + 8)


def _run_client(coro):
    """Runs a client's event loop: uvloop's where it is installed (the load
    generator's own cost per token is then lower), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _client_work(load: Load) -> tuple[list[Result], float]:
    """One client's requests, on its own event loop: (results, CPU seconds)."""
    cpu = _cpu_seconds()
    results = _run_client(_run_load(load))
    return results, _cpu_seconds() - cpu


def _client_process(load: Load, conn) -> None:
    try:
        results, cpu = _client_work(load)
        conn.send(([asdict(r) for r in results], cpu))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


# CPU seconds the client processes used in the last run_load (the load generator's own cost).
LAST_CLIENT_CPU_S = [0.0]


def run_load(base_url: str, api_key: str | None, model: str, prompts: list[list[int]], arrivals: list[float],
             max_tokens: int, cancel_after: list[int | None] | None = None, client: str = "openai",
             processes: int = 1) -> tuple[list[Result], float]:
    """Sends every request at its arrival time; returns the results (in the
    prompts' order) and the seconds from the first arrival to the last answer.
    processes > 1: request i goes out from process i % processes. The clients'
    CPU seconds go to LAST_CLIENT_CPU_S[0]."""
    cancel_after = cancel_after or [None] * len(prompts)
    processes = max(1, processes)
    # (a spawned process takes ~0.5 s to start: the processes share a start 2 s ahead)
    start_at = time.time() + (2.0 if processes > 1 else 0.0)
    parts = [list(range(k, len(prompts), processes)) for k in range(processes)]
    loads = [Load(base_url, api_key, model, [prompts[i] for i in idx], [arrivals[i] for i in idx], max_tokens,
                  [cancel_after[i] for i in idx], client, start_at) for idx in parts]
    wall = None
    if processes == 1:
        t0 = time.perf_counter()
        done = [_client_work(loads[0])]
        wall = time.perf_counter() - t0  # (a client that falls behind its arrivals counts in full)
    else:
        ctx = multiprocessing.get_context("spawn")
        workers = []
        for load in loads:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_client_process, args=(load, child), daemon=True)
            proc.start()
            child.close()
            workers.append((parent, proc))
        done = []
        for parent, proc in workers:
            got = parent.recv()
            proc.join()
            if isinstance(got, str):
                raise RuntimeError(f"a client process failed: {got}")
            done.append(([Result(**r) for r in got[0]], got[1]))
    results: list[Result | None] = [None] * len(prompts)
    for idx, (got, _) in zip(parts, done):
        for i, r in zip(idx, got):
            results[i] = r
    LAST_CLIENT_CPU_S[0] = sum(cpu for _, cpu in done)
    if wall is not None:
        return results, wall
    # From the common start to the last answer (each request starts at its arrival).
    return results, max(r.e2e + a for r, a in zip(results, arrivals))


# ---- the server ----------------------------------------------------------------------------------


def server_metrics(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedcore_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_idle(base_url: str, timeout: float = 60.0) -> tuple[bool, dict[str, float]]:
    """Polls /metrics until every KV block is free and no request is left."""
    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics(base_url)
        if (m.get("pagedcore_kv_blocks_free") == m.get("pagedcore_kv_blocks_total")
                and m.get("pagedcore_num_requests") == 0):
            return True, m
        if time.monotonic() > deadline:
            return False, m
        time.sleep(0.1)


def read_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `pagedcore serve` that the offline run takes too."""
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--dtype", args.dtype, "--load-format", args.load_format, "--seed", str(args.seed)]
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.device != "auto":
        flags += ["--device", args.device]
    if args.model_path:
        flags += ["--model", args.model_path]
    return flags


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, log_path = tempfile.mkstemp(prefix="pagedcore-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "pagedcore", "serve", "--port", str(port), "--served-model-name", args.model,
           "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "INFO", *engine_flags(args),
           *args.server_arg]
    with os.fdopen(fd, "wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDCORE_LOOP_STALLS": "1"}
        if args.step_trace_path:
            env["PAGEDCORE_STEP_TRACE"] = args.step_trace_path
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{read_text(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server not healthy after 600 s:\n{read_text(log_path)}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen, timeout: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def shape_checkpoint(shape: str, root: str) -> tuple[str, int]:
    """A config.json of the shape (bench_e2e_gpu.py's shapes) and a word-level
    tokenizer; returns its directory and vocabulary size."""
    from pathlib import Path

    sys.path.insert(0, HERE)
    from bench_e2e_gpu import SHAPES, checkpoint_dir

    fields = SHAPES[shape][0]
    return str(checkpoint_dir(fields, Path(root))), fields["vocab_size"]


def vocab_size_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's HTTP processes
    ("http": the server process and the others of --api-server-count, named
    pagedcore-http) and of its engine process ("engine", of --engine-process),
    from /proc (Linux; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(p: str) -> tuple[int, float, str] | None:
        try:
            with open(f"/proc/{p}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
                fields = rest.split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    return None
        except OSError:
            return None
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, name  # ppid; utime + stime; comm

    own = stat(str(pid))
    if own is None:
        return {}
    cpu = {"http": own[1], "engine": 0.0}
    for p in os.listdir("/proc"):
        if p.isdigit() and p != str(pid):
            got = stat(p)
            if got is not None and got[0] == pid:
                cpu["http" if got[2] == "pagedcore-http" else "engine"] += got[1]
    return cpu


def histogram_quantiles(before: dict[str, float], after: dict[str, float], name: str, labels: str = "",
                        qs: tuple[float, ...] = (50, 99)) -> tuple[float, list[float]]:
    """The count and quantiles (linear inside a bucket, as Prometheus'
    histogram_quantile) of a /metrics histogram's observations between two scrapes."""
    prefix = f"pagedcore_{name}_bucket{{{labels + ',' if labels else ''}le=\""
    bounds = sorted((float(k[len(prefix):-2]), after[k] - before.get(k, 0.0)) for k in after if k.startswith(prefix))
    if not bounds or bounds[-1][1] <= 0:
        return 0.0, [float("nan")] * len(qs)
    total, out = bounds[-1][1], []
    for q in qs:
        rank, lower, below = total * q / 100, 0.0, 0.0
        for upper, cumulative in bounds:
            if cumulative >= rank:
                if math.isinf(upper):
                    out.append(lower)
                else:
                    inside = cumulative - below
                    out.append(lower + (upper - lower) * ((rank - below) / inside if inside else 1.0))
                break
            lower, below = upper, cumulative
    return total, out


def http_processes(server_args: list[str]) -> int:
    """The own server's HTTP processes (its --api-server-count)."""
    count = 1
    for i, arg in enumerate(server_args):
        if arg.startswith("--api-server-count="):
            count = int(arg.split("=", 1)[1])
        elif arg == "--api-server-count" and i + 1 < len(server_args):
            count = int(server_args[i + 1])
    return count


def server_diagnostics(before: dict[str, float], after: dict[str, float], http_processes: int = 1) -> dict:
    """Where long inter-token gaps come from: the engine's step times (steps
    in which prompt tokens ran apart) and the HTTP side's event-loop lag; the
    garbage collections (count and time per generation) of the engine's process
    and of the scraped HTTP process (the HTTP side's figures not with several
    HTTP processes: two scrapes may reach two of them, whose counts do not subtract)."""
    d = {}
    for key, name, labels in (("decode_step", "engine_step_seconds", 'kind="decode"'),
                              ("prefill_step", "engine_step_seconds", 'kind="prefill"'),
                              ("loop_lag", "event_loop_lag_seconds", "")):
        count, (p50, p99) = histogram_quantiles(before, after, name, labels)
        if key == "loop_lag" and http_processes > 1:
            count, p50, p99 = math.nan, math.nan, math.nan
        d[f"{key}_count"], d[f"{key}_p50_ms"], d[f"{key}_p99_ms"] = count, p50 * 1e3, p99 * 1e3
    for side in ("engine", "http"):
        for generation in range(3):
            for key, name in (("count", "collections"), ("ms", "seconds")):
                metric = f'pagedcore_{side}_gc_{name}_total{{generation="{generation}"}}'
                delta = after.get(metric, math.nan) - before.get(metric, 0.0)
                if side == "http" and http_processes > 1:
                    delta = math.nan
                d[f"{side}_gc{generation}_{key}"] = delta * 1e3 if key == "ms" else delta
    # What the HTTP side's loop ran while late (server/loop_stalls.py), most samples first.
    prefix = 'pagedcore_http_loop_stall_samples_total{where="'
    stalls = {k[len(prefix):-2]: after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix)}
    d["loop_stalls"] = [] if http_processes > 1 else sorted(((n, w) for w, n in stalls.items() if n > 0),
                                                            reverse=True)[:5]
    return d


def step_trace_summary(path: str, start: float, end: float) -> dict:
    """The engine loop's turns of one run (server/step_trace.py; the lines whose
    turn began in [start, end]): the time between turns' starts (what a stream's
    inter-token gap follows), what the long turns spent it on, and the forward
    passes by how they ran (ModelRunner.last_path)."""
    # (call once the server is idle: the loop writes its lines as it goes idle; a
    # moment for that, then more only while nothing of the run is there yet)
    deadline = time.monotonic() + 2.0
    turns: list[dict] = []
    while not turns and time.monotonic() < deadline:
        time.sleep(0.3)
        try:
            with open(path, encoding="utf-8") as f:
                turns = [t for t in map(json.loads, f) if start <= t["wall"] <= end]
        except FileNotFoundError:
            pass
    if len(turns) < 3:
        return {}
    gaps = [(b["wall"] - a["wall"]) * 1e3 for a, b in zip(turns, turns[1:])]
    median = percentile(gaps, 50)
    # A gap is long past twice the median (the bound on the p99), and
    # it is the turn that began it whose parts add up to it (with the wait in
    # between turns, if the loop idled).
    long_turns = [(a, prev, g) for prev, a, g in zip([None] + turns[:-2], turns[:-1], gaps) if g > 2 * median]
    parts = ("cmd", "step", "out", "flush")
    d = {"turns": len(turns), "span_s": turns[-1]["wall"] - turns[0]["wall"], "gap_p50_ms": median,
         "gap_p90_ms": percentile(gaps, 90), "gap_p99_ms": percentile(gaps, 99), "gap_max_ms": max(gaps),
         "long": len(long_turns)}
    if long_turns:
        d["long_parts_ms"] = {k: statistics.mean(t[k] for t, _, _ in long_turns) for k in parts}
        d["long_adds"] = statistics.mean(t["adds"] for t, _, _ in long_turns)
        # When in the run (s from its first turn): a one-off cost (a kernel's first
        # load, a first replay) comes early, a recurring one all along.
        d["long_at_s"] = [round(t["wall"] - turns[0]["wall"], 3) for t, _, _ in long_turns]
        # What a long turn's step waited for: the forward passes the turn before launched.
        waited = [sp for _, prev, _ in long_turns if prev for sp in prev["spans"]]
        d["long_waited_for"] = dict(collections.Counter(sp[0] for sp in waited).most_common())
        gpu = [sp[6] for sp in waited if sp[6] is not None]
        d["long_waited_gpu_ms"] = statistics.mean(gpu) if gpu else math.nan
        # What a long turn launched itself (its own host time is in its step part).
        own = [sp for t, _, _ in long_turns for sp in t["spans"]]
        d["long_launched"] = dict(collections.Counter(sp[0] for sp in own).most_common())
        d["long_launched_host_ms"] = statistics.mean(sp[5] for sp in own) if own else math.nan
        # (of it, waiting for the device before staging: traces since the thirty-fourth session)
        waits = [sp[7] for sp in own if len(sp) > 7]
        d["long_launched_wait_ms"] = statistics.mean(waits) if waits else math.nan
        # (of it, up to the first launch, in graph replays and on the thread's CPU: traces since
        # the thirty-fifth session)
        d["long_launched_staged_ms"] = _mean_field(own, 8)
        d["long_launched_cpu_ms"] = _mean_field(own, 9)
        d["long_launched_replay_ms"] = _mean_field(own, 10)
    d["all_parts_ms"] = {k: statistics.mean(t[k] for t in turns) for k in parts}
    by_path: dict[str, list[list]] = collections.defaultdict(list)
    for t in turns:
        for sp in t["spans"]:
            by_path[sp[0]].append(sp)
    paths = {}
    for name, spans in sorted(by_path.items(), key=lambda kv: -len(kv[1])):
        gpu = [sp[6] for sp in spans if sp[6] is not None]
        waits = [sp[7] for sp in spans if len(sp) > 7]
        # The slowest 1% of the passes by host time (at least one): where their time went.
        slow = sorted(spans, key=lambda sp: sp[5])[-max(1, len(spans) // 100):]
        paths[name] = {"count": len(spans), "host_p50_ms": percentile([sp[5] for sp in spans], 50),
                       "host_p99_ms": percentile([sp[5] for sp in spans], 99),
                       "wait_p99_ms": percentile(waits, 99) if waits else math.nan,
                       "slow": len(slow), "slow_host_ms": statistics.mean(sp[5] for sp in slow),
                       "slow_wait_ms": _mean_field(slow, 7), "slow_staged_ms": _mean_field(slow, 8),
                       "slow_cpu_ms": _mean_field(slow, 9), "slow_replay_ms": _mean_field(slow, 10),
                       "gpu_p50_ms": percentile(gpu, 50) if gpu else math.nan,
                       "gpu_p99_ms": percentile(gpu, 99) if gpu else math.nan,
                       "tokens_p50": percentile([sp[1] for sp in spans], 50), "tokens_max": max(sp[1] for sp in spans),
                       "prompt_p50": percentile([sp[3] for sp in spans], 50),
                       "longest_row_max": max(sp[4] for sp in spans)}
    d["paths"] = paths
    return d


def _mean_field(spans: list[list], i: int) -> float:
    """The mean of the spans' field i, over those whose trace has it (NaN: none)."""
    values = [sp[i] for sp in spans if len(sp) > i]
    return statistics.mean(values) if values else math.nan


def print_step_trace(d: dict) -> None:
    print(f"engine loop: {d['turns']} turns, between starts p50/p90/p99/max {d['gap_p50_ms']:.2f}/"
          f"{d['gap_p90_ms']:.2f}/{d['gap_p99_ms']:.2f}/{d['gap_max_ms']:.2f} ms; parts (mean ms) "
          + " ".join(f"{k} {v:.2f}" for k, v in d["all_parts_ms"].items()))
    if d.get("long"):
        print(f"  {d['long']} turns over 2x the median: parts (mean ms) "
              + " ".join(f"{k} {v:.2f}" for k, v in d["long_parts_ms"].items())
              + f", adds {d['long_adds']:.1f}; waited for " + ", ".join(f"{n} {k}" for k, n in d["long_waited_for"].items())
              + f" (device {d['long_waited_gpu_ms']:.2f} ms a pass); launched "
              + (", ".join(f"{n} {k}" for k, n in d.get("long_launched", {}).items()) or "nothing")
              + f" (host {d.get('long_launched_host_ms', math.nan):.2f} ms a pass, of it waiting for the device "
              f"{d.get('long_launched_wait_ms', math.nan):.2f}, up to its launch "
              f"{d.get('long_launched_staged_ms', math.nan):.2f}, in graph replays "
              f"{d.get('long_launched_replay_ms', math.nan):.2f}, on the thread's CPU "
              f"{d.get('long_launched_cpu_ms', math.nan):.2f})")
        print("    at s " + " ".join(f"{x:.2f}" for x in d["long_at_s"][:16]) + (" ..." if d["long"] > 16 else "")
              + f" of {d.get('span_s', math.nan):.2f}")
    for name, p in d["paths"].items():
        print(f"  {name:<7} x{p['count']:<6} device p50/p99 {p['gpu_p50_ms']:.2f}/{p['gpu_p99_ms']:.2f} ms, host "
              f"{p['host_p50_ms']:.2f}/{p['host_p99_ms']:.2f} ms (waiting p99 {p.get('wait_p99_ms', math.nan):.2f}); "
              f"tokens p50 {p['tokens_p50']:.0f} max "
              f"{p['tokens_max']}, prompt tokens p50 {p['prompt_p50']:.0f}, longest row {p['longest_row_max']}")
        if "slow" in p:
            print(f"          slowest {p['slow']} by host: host {p['slow_host_ms']:.2f} ms, of it waiting "
                  f"{p['slow_wait_ms']:.2f}, up to the launch {p['slow_staged_ms']:.2f}, in graph replays "
                  f"{p['slow_replay_ms']:.2f}, on the thread's CPU {p['slow_cpu_ms']:.2f}")


# ---- one run's figures --------------------------------------------------------------------------


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]
    chunks = [n for r in ok for n in r.chunk_tokens]
    s = {"completed": len(ok), "failed": sum(1 for r in results if not r.ok and not r.cancelled),
         "tokens_per_chunk": statistics.mean(chunks) if chunks else float("nan"),
         "cancelled": sum(1 for r in results if r.cancelled),
         "http_5xx": sum(1 for r in results if r.status >= 500),
         "error_events": sum(1 for r in results if r.status == 200 and r.error),
         "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration,
         "errors": sorted({r.error for r in results if r.error})[:5]}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        s[f"mean_{name}_ms"] = statistics.mean(values) if values else float("nan")
        s[f"median_{name}_ms"] = percentile(values, 50)
        s[f"p99_{name}_ms"] = percentile(values, 99)
    return s


def print_result(title: str, s: dict) -> None:
    """The block `vllm bench serve` prints, with its field names."""
    w = 50
    print("{s:{c}^{n}}".format(s=f" {title} ", n=w, c="="))
    rows = [("Successful requests:", s["completed"], "d"), ("Failed requests:", s["failed"], "d"),
            ("Benchmark duration (s):", s["duration_s"], ".2f"),
            ("Total input tokens:", s["total_input_tokens"], "d"),
            ("Total generated tokens:", s["total_output_tokens"], "d"),
            ("Request throughput (req/s):", s["request_throughput"], ".2f"),
            ("Output token throughput (tok/s):", s["output_throughput"], ".2f"),
            ("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f")]
    for label, value, fmt in rows:
        print(f"{label:<40}{value:<10{fmt}}")
    for name, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency")):
        print("{s:{c}^{n}}".format(s=head, n=w, c="-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
            print(f"{label:<40}{s[f'{stat}_{name}_ms']:<10.2f}")
    for e in s["errors"]:
        print(f"  error: {e}")
    print("=" * w)


def print_costs(s: dict, duration: float, args: argparse.Namespace) -> None:
    """Who was busy (CPU seconds over the run's wall time: 1.0 is one core all
    the time) and the server's diagnostics of long gaps."""
    cpu = s["server_cpu_s"]
    busy = ", ".join(f"{name} {seconds / duration:.2f}" for name, seconds in cpu.items())
    print(f"CPU busy (cores): client ({args.client} x {args.client_processes}) {s['client_cpu_s'] / duration:.2f}"
          f"{', server ' + busy if busy else ''}; tokens per chunk {s['tokens_per_chunk']:.2f}")
    d = s["diagnostics"]
    print(f"engine steps: {d['decode_step_count']:.0f} decode-only p50/p99 {d['decode_step_p50_ms']:.2f}/"
          f"{d['decode_step_p99_ms']:.2f} ms, {d['prefill_step_count']:.0f} with a prefill p50/p99 "
          f"{d['prefill_step_p50_ms']:.2f}/{d['prefill_step_p99_ms']:.2f} ms; HTTP event-loop lag p50/p99 "
          f"{d['loop_lag_p50_ms']:.2f}/{d['loop_lag_p99_ms']:.2f} ms")
    if d.get("loop_stalls"):
        print("HTTP loop while late (samples): " + "; ".join(f"{n:.0f} {w}" for n, w in d["loop_stalls"]))
    if s.get("step_trace"):
        print_step_trace(s["step_trace"])
    for side in ("engine", "http"):
        if not math.isnan(d.get(f"{side}_gc2_count", math.nan)):  # (a server that counts them)
            print(f"{side} process GC collections: " + ", ".join(
                f"gen {g} {d[f'{side}_gc{g}_count']:.0f} x "
                f"{d[f'{side}_gc{g}_ms'] / max(d[f'{side}_gc{g}_count'], 1):.2f} ms" for g in range(3)))


# ---- the offline run ------------------------------------------------------------------------------


def serve_default(dest: str):
    """The default of a `pagedcore serve` flag."""
    from pagedcore.cli import build_parser

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return serve.get_default(dest)


def offline_run(args: argparse.Namespace, prompt_sets: list[list[list[int]]], warmup: list[list[int]]) -> dict:
    """LLM.generate on each prompt set in turn (one engine), with the server's engine
    flags (in this process): the sets' figures summed, and each set's under "repeats"."""
    from pagedcore import LLM, SamplingParams

    kw = dict(model=args.model_path, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.device != "auto":
        kw["device"] = args.device
    # The flags of the server that change the engine, where LLM has them; the
    # mixed-prefill cap and its lift as serve sets them (its defaults unless given).
    for name in ("max_num_mixed_prefill_tokens", "mixed_prefill_lift_tokens", "mixed_prefill_lift_max_waiting"):
        kw[name] = serve_default(name)
    for flag in args.server_arg:
        if flag == "--enforce-eager":
            kw["enforce_eager"] = True
        elif flag == "--no-enable-prefix-caching":
            kw["enable_prefix_caching"] = False
        elif flag.startswith("--max-num-mixed-prefill-tokens="):
            kw["max_num_mixed_prefill_tokens"] = int(flag.split("=", 1)[1])
        elif flag.startswith("--mixed-prefill-waiting-per-cap="):
            kw["mixed_prefill_waiting_per_cap"] = int(flag.split("=", 1)[1])
        elif flag.startswith("--mixed-prefill-max-waiting="):
            kw["mixed_prefill_max_waiting"] = int(flag.split("=", 1)[1])
        elif flag.startswith("--mixed-prefill-lift-tokens="):
            kw["mixed_prefill_lift_tokens"] = int(flag.split("=", 1)[1])
        elif flag.startswith("--mixed-prefill-lift-max-waiting="):
            kw["mixed_prefill_lift_max_waiting"] = int(flag.split("=", 1)[1])
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if warmup:
        llm.generate([{"prompt_token_ids": p} for p in warmup], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    import torch

    repeats = []
    for prompts in prompt_sets:
        start, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu
        main_cpu = time.thread_time() - main_cpu
        repeats.append({"duration_s": duration, "cpu_s": cpu, "main_thread_cpu_s": main_cpu,
                        "requests": len(prompts), "total_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                        "total_input_tokens": sum(len(p) for p in prompts)})
    total = {k: sum(r[k] for r in repeats) for k in repeats[0]}
    duration = total["duration_s"]
    for r in repeats:
        r["output_throughput"] = r["total_output_tokens"] / r["duration_s"]
    # (the main thread's CPU apart: what the other threads burn, torch's intra-op pool among them)
    return {"duration_s": duration, "cpu_s": total["cpu_s"], "main_thread_cpu_s": total["main_thread_cpu_s"],
            "torch_threads": torch.get_num_threads(), "total_output_tokens": total["total_output_tokens"],
            "output_throughput": total["total_output_tokens"] / duration,
            "request_throughput": total["requests"] / duration,
            "total_token_throughput": (total["total_input_tokens"] + total["total_output_tokens"]) / duration,
            "repeats": repeats}


# ---- main ------------------------------------------------------------------------------------------------


def parse_rate(text: str) -> tuple[float, bool]:
    """'inf', '4' (requests/s) or '0.5x' (of the saturation rate) -> (value, relative)."""
    relative = text.endswith("x")
    value = float(text[:-1] if relative else text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0, got {text!r}")
    return value, relative


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="target this server instead of starting one")
    p.add_argument("--model", default="bench", help="the served model name")
    p.add_argument("--model-path", default=None, help="model directory of the own server (default: the default model)")
    p.add_argument("--shape", default=None, help="serve random weights in this shape of bench_e2e_gpu.py "
                                                 "(smollm2, llama3-8b, tiny), --load-format dummy")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids of prompts are < this "
                                                                "(default: the model's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", nargs="+", default=["inf"],
                   help="requests/s, 'Nx' (N times the saturation rate, measured by an inf run first) or inf")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len-median", type=float, default=64, help="median length of a prompt's own part")
    p.add_argument("--prompt-len-sigma", type=float, default=0.6)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of each shared system prompt")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                   help="fraction of requests that start with a shared system prompt")
    p.add_argument("--num-shared-prefixes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="short requests sent before measuring")
    p.add_argument("--client", choices=["raw", "openai", "httpx"], default="raw",
                   help="raw: bare asyncio connections with a minimal parser (the lightest); openai: AsyncOpenAI")
    p.add_argument("--client-processes", type=int, default=1)
    p.add_argument("--offline", action="store_true", help="LLM.generate on the inf run's requests, for the ratio")
    p.add_argument("--saturation-repeats", type=int, default=1,
                   help="the inf run this many times, each on prompts of its own, and --offline on the same "
                        "prompt sets in the same order: the ratio from their summed tokens and times")
    p.add_argument("--offline-from", default=None,
                   help="take the offline figures from this --json of an earlier run (same requests)")
    p.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="run S streams of which this fraction hang up mid-stream (S: --disconnect-streams)")
    p.add_argument("--disconnect-streams", type=int, default=512)
    p.add_argument("--sigterm-streams", type=int, default=0, help="SIGTERM the own server with this many streams "
                                                                  "in flight, at the end")
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    # Engine flags, for the own server and the offline run alike.
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for the own `pagedcore serve` (repeatable; --server-arg=--flag)")
    p.add_argument("--no-step-trace", dest="step_trace", action="store_false",
                   help="no trace of the own server's engine loop (PAGEDCORE_STEP_TRACE; summarized per run)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    return p


# What a repeat of the inf run keeps of its figures (the first run's summary holds them all).
REPEAT_FIELDS = ("duration_s", "completed", "total_output_tokens", "output_throughput", "request_throughput")


def saturation_prompt_sets(repeats: int) -> list[int]:
    """The prompt sets (prompts_for's run numbers) of the inf run's repeats: set 0,
    then sets of their own, apart from the other rates' 1, 2, ..."""
    return [0] + [100 + i for i in range(1, repeats)]


def _prompt_sets(args: argparse.Namespace, vocab: int):
    room = args.max_model_len - args.max_tokens

    def prompts_for(run: int) -> list[list[int]]:
        return make_prompts(args.num_requests, args.seed * 1000 + run, vocab, args.prompt_len_median,
                            args.prompt_len_sigma, room, args.shared_prefix_fraction, args.num_shared_prefixes,
                            args.shared_prefix_len)

    # Warm-up: each system prompt once and a few short prompts (CUDA graphs, allocator).
    warmup = make_prompts(args.warmup, args.seed * 1000 + 999, vocab, 16, 0.1, room, 1.0 if args.shared_prefix_len
                          else 0.0, args.num_shared_prefixes, args.shared_prefix_len)
    return prompts_for, warmup


def disconnect_check(args, url: str, vocab: int) -> dict:
    n = args.disconnect_streams
    rng = random.Random(args.seed + 7)
    prompts = make_prompts(n, args.seed * 1000 + 500, vocab, args.prompt_len_median, args.prompt_len_sigma,
                           args.max_model_len - args.max_tokens)
    every = round(1 / args.disconnect_fraction)
    # Each hang-up after a random number of tokens (at most half of them: mid-stream).
    cancel = [rng.randint(1, max(1, args.max_tokens // 2)) if i % every == 0 else None for i in range(n)]
    results, duration = run_load(url, args.api_key, args.model, prompts, [0.0] * n, args.max_tokens, cancel,
                                 args.client, args.client_processes)
    idle, m = wait_idle(url, 60)
    health = httpx.get(f"{url}/health", timeout=10).status_code
    s = summarize(results, duration)
    finished_ok = all(r.ok and r.finish_reason == "length" and r.output_tokens == args.max_tokens
                      for r, c in zip(results, cancel) if c is None)
    s.update(streams=n, hung_up=sum(c is not None for c in cancel), kv_blocks_free=m.get("pagedcore_kv_blocks_free"),
             kv_blocks_total=m.get("pagedcore_kv_blocks_total"), requests_left=m.get("pagedcore_num_requests"),
             health=health, all_blocks_free=idle, others_finished=finished_ok)
    s["pass"] = bool(idle and health == 200 and s["http_5xx"] == 0 and s["error_events"] == 0 and finished_ok
                     and s["cancelled"] == s["hung_up"])
    print(f"\ndisconnects: {n} streams at once, {s['cancelled']} of {s['hung_up']} hang up mid-stream: "
          f"{s['http_5xx']} 5xx, {s['error_events']} error events, the others finished: {finished_ok}; "
          f"KV blocks free {m.get('pagedcore_kv_blocks_free'):.0f} of {m.get('pagedcore_kv_blocks_total'):.0f}, "
          f"requests left {m.get('pagedcore_num_requests'):.0f}, /health {health}: "
          f"{'PASS' if s['pass'] else 'FAIL'}")
    return s


def sigterm_check(args, proc: subprocess.Popen, url: str, vocab: int) -> dict:
    """S streams; once each has its first chunk, SIGTERM; all must finish."""
    n = args.sigterm_streams
    prompts = make_prompts(n, args.seed * 1000 + 600, vocab, args.prompt_len_median, args.prompt_len_sigma,
                           args.max_model_len - args.max_tokens)
    box: dict = {}

    async def go() -> None:
        import openai

        http = openai.DefaultAsyncHttpxClient(limits=_limits(n), timeout=3600.0)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=args.api_key or "none", max_retries=0,
                                    http_client=http)
        tasks = [asyncio.create_task(request_openai(client, args.model, p, args.max_tokens, None)) for p in prompts]
        # Wait until every stream is running (its first token counted by the server).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = await asyncio.to_thread(server_metrics, url)
            if m.get("pagedcore_time_to_first_token_seconds_count", 0) >= box["ttft_before"] + n:
                break
            await asyncio.sleep(0.02)
        box["signal_at"] = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        box["results"] = await asyncio.gather(*tasks)
        box["streams_done_at"] = time.monotonic()
        await client.close()

    box["ttft_before"] = server_metrics(url).get("pagedcore_time_to_first_token_seconds_count", 0)
    asyncio.run(go())
    try:  # (no second signal: that one would cut what is left)
        code = proc.wait(args.shutdown_timeout + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    exited_after = time.monotonic() - box["signal_at"]
    results = box["results"]
    drained = all(r.ok and r.finish_reason == "length" and r.output_tokens == args.max_tokens for r in results)
    s = {"streams": n, "drained": drained, "exit_code": code, "exit_after_s": exited_after,
         "streams_done_after_s": box["streams_done_at"] - box["signal_at"],
         "errors": sorted({r.error for r in results if r.error})[:5]}
    s["pass"] = bool(drained and code == 0 and exited_after <= args.shutdown_timeout + 5)
    print(f"\nSIGTERM with {n} streams in flight: all finished ({drained}) within "
          f"{s['streams_done_after_s']:.2f} s, exit {code} {exited_after:.2f} s after the signal "
          f"(--shutdown-timeout {args.shutdown_timeout:g}): {'PASS' if s['pass'] else 'FAIL'}")
    return s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rates = [parse_rate(r) for r in args.request_rate]
    if not 0 <= args.disconnect_fraction <= 1:
        raise SystemExit(f"--disconnect-fraction must be in [0, 1], got {args.disconnect_fraction}")
    tmp = tempfile.TemporaryDirectory(prefix="pagedcore-bench-")
    if args.shape:
        args.model_path, vocab = shape_checkpoint(args.shape, tmp.name)
        args.load_format = "dummy"
    else:
        import pagedcore

        vocab = vocab_size_of(args.model_path or pagedcore.default_model_path())
    vocab = args.vocab_size or vocab
    prompts_for, warmup = _prompt_sets(args, vocab)

    if args.saturation_repeats < 1:
        raise SystemExit(f"--saturation-repeats must be at least 1, got {args.saturation_repeats}")
    saturation_sets = saturation_prompt_sets(args.saturation_repeats)
    if args.offline_worker:  # the child process of --offline: prints its figures as JSON
        with open(args.offline_worker, "w") as f:
            json.dump(offline_run(args, [prompts_for(r) for r in saturation_sets], warmup), f)
        return 0

    summary: dict = {"args": vars(args), "runs": {}}
    offline = None
    if args.offline_from:
        with open(args.offline_from) as f:
            offline = json.load(f)["offline"]
        summary["offline"] = offline
        held = len(offline.get("repeats", [offline]))
        if held != args.saturation_repeats and any(math.isinf(v) for v, _ in rates):
            # (refused before the server starts: the ratio would compare other runs)
            raise SystemExit(f"the offline figures hold {held} saturation runs, --saturation-repeats asks for "
                             f"{args.saturation_repeats} (it must match --offline-from's)")
    elif args.offline and args.base_url is None:
        out_path = os.path.join(tmp.name, "offline.json")
        argv_child = [a for a in (argv if argv is not None else sys.argv[1:])]
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv_child, "--offline-worker", out_path],
                       check=True)
        with open(out_path) as f:
            offline = json.load(f)
        summary["offline"] = offline

    proc = server_log = None
    args.step_trace_path = os.path.join(tmp.name, "steps.jsonl") if args.step_trace and args.base_url is None else None
    if args.base_url is None:
        proc, url, server_log = start_server(args)
    else:
        url = args.base_url.rstrip("/")
    ok = True
    try:
        if warmup:
            run_load(url, args.api_key, args.model, warmup, [0.0] * len(warmup), 4, client=args.client)
        order = sorted(range(len(rates)), key=lambda k: (not math.isinf(rates[k][0]), k))
        if any(rel for _, rel in rates) and not any(math.isinf(v) for v, _ in rates):
            raise SystemExit("a relative rate ('0.5x') needs an inf run in --request-rate")
        saturation = None
        for k in order:
            value, relative = rates[k]
            rate = value * saturation if relative else value
            # The inf run takes prompt set 0 (the offline run's; with --saturation-repeats,
            # then the offline run's next sets), the others their own.
            repeats = []
            for rep, run in enumerate(saturation_sets if math.isinf(rate) else [k + 1]):
                prompts = prompts_for(run)
                before = server_metrics(url)
                cpu_before = process_cpu(proc.pid) if proc is not None else {}
                window = time.time()
                results, duration = run_load(url, args.api_key, args.model, prompts,
                                             arrival_times(len(prompts), rate, args.seed + run), args.max_tokens,
                                             client=args.client, processes=args.client_processes)
                client_cpu = LAST_CLIENT_CPU_S[0]
                cpu_after = process_cpu(proc.pid) if proc is not None else {}
                after = server_metrics(url)
                s = summarize(results, duration)
                s["rate"] = rate
                s["server"] = {k2.removeprefix("pagedcore_"): after[k2] - before.get(k2, 0) for k2 in after
                               if k2.endswith("_total")}
                s["client_cpu_s"] = client_cpu
                s["server_cpu_s"] = {k2: cpu_after[k2] - cpu_before.get(k2, 0.0) for k2 in cpu_after}
                s["diagnostics"] = server_diagnostics(before, after, http_processes(args.server_arg))
                if args.step_trace_path:
                    window_end = time.time()
                    wait_idle(url)
                    s["step_trace"] = step_trace_summary(args.step_trace_path, window, window_end)
                repeats.append(s)
                if math.isinf(rate):  # (the repeats' median request rate)
                    saturation = statistics.median(r["request_throughput"] for r in repeats)
                name = "inf" if math.isinf(rate) else f"{rate:.2f} req/s" + (f" ({value:g}x)" if relative else "")
                if len(saturation_sets) > 1 and math.isinf(rate):
                    name += f", repeat {rep + 1} of {len(saturation_sets)}"
                    repeats[0]["repeats"] = [{key: r[key] for key in REPEAT_FIELDS} for r in repeats]
                summary["runs"][args.request_rate[k]] = repeats[0]
                print_result(f"request rate {name}", s)
                hits = s["server"].get("prefix_cache_hits_total", 0)
                queries = s["server"].get("prefix_cache_queries_total", 0)
                print(f"server: preemptions {s['server'].get('preemptions_total', 0):.0f}, prefix-cache hits "
                      f"{hits:.0f} of {queries:.0f} prompt tokens")
                print_costs(s, duration, args)
                ok &= s["failed"] == 0
        if args.disconnect_fraction > 0:
            summary["disconnect"] = disconnect_check(args, url, vocab)
            ok &= summary["disconnect"]["pass"]
        if args.sigterm_streams and proc is not None:
            summary["sigterm"] = sigterm_check(args, proc, url, vocab)
            ok &= summary["sigterm"]["pass"]
    finally:
        if proc is not None and proc.poll() is None:
            code = stop_server(proc, args.shutdown_timeout + 30)
            if code != 0:
                print(f"warning: the server exited with {code} (log: {server_log})", file=sys.stderr)

    # ---- the closing lines: what the targets read ----
    # (PAGEDCORE_COMMIT first, as the run scripts read it: a copy of the tree run
    # elsewhere may sit inside another checkout, whose HEAD is not the code's)
    commit = os.environ.get("PAGEDCORE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
        check=False).stdout.strip() or "?"
    summary["commit"] = commit
    print(f"\ncommit {commit}; {platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}; "
          f"{args.shape or args.model_path or 'default model'}; {args.num_requests} requests, own part "
          f"lognormal median {args.prompt_len_median:g}, {args.shared_prefix_fraction:g} behind "
          f"{args.num_shared_prefixes} system prompts of {args.shared_prefix_len}; {args.max_tokens} out; "
          f"client {args.client} x {args.client_processes}")
    runs = summary["runs"]
    inf_key = next((k for k in runs if math.isinf(parse_rate(k)[0])), None)
    if offline is not None and inf_key is not None:
        # (with --saturation-repeats: summed tokens over summed times, each side; each
        # repeat's pair beside; the counts match: an --offline-from file of others was refused)
        online_runs = runs[inf_key].get("repeats", [runs[inf_key]])
        offline_runs = offline.get("repeats", [offline])
        online_tps = sum(r["total_output_tokens"] for r in online_runs) / sum(r["duration_s"] for r in online_runs)
        ratio = online_tps / offline["output_throughput"]
        summary["online_offline_ratio"] = ratio
        each = ""
        if len(online_runs) > 1:
            pairs = [a["output_throughput"] / b["output_throughput"] for a, b in zip(online_runs, offline_runs)]
            summary["online_offline_ratio_each"] = pairs
            each = f"; {len(pairs)} runs each, their ratios " + ", ".join(f"{x:.3f}" for x in pairs)
        print(f"saturation: online {online_tps:.0f} output tok/s, offline LLM.generate "
              f"{offline['output_throughput']:.0f} ({offline['duration_s']:.2f} s): ratio {ratio:.3f} "
              f"(target >= 0.9){each}")
        engine_cpu = runs[inf_key].get("server_cpu_s", {}).get("engine")
        if engine_cpu and offline.get("cpu_s"):
            # (on a CPU device the engine's CPU time is its work; on a GPU, its host side)
            tokens = runs[inf_key]["total_output_tokens"]
            per_token = 1e6 / offline["total_output_tokens"]
            print(f"engine process CPU per output token at saturation: {engine_cpu / tokens * 1e6:.1f} us online, "
                  f"{offline['cpu_s'] * per_token:.1f} us offline", end="")
            if "main_thread_cpu_s" in offline:
                print(f" (its main thread {offline['main_thread_cpu_s'] * per_token:.1f} us, the other threads "
                      f"{(offline['cpu_s'] - offline['main_thread_cpu_s']) * per_token:.1f} us; torch threads "
                      f"{offline['torch_threads']})", end="")
            print()
    half = next((k for k in runs if k == "0.5x"), None)
    if half is not None:
        r = runs[half]
        itl_ratio = r["p99_itl_ms"] / r["median_itl_ms"]
        summary["itl_p99_over_median_at_half"] = itl_ratio
        print(f"at 0.5x saturation ({r['rate']:.2f} req/s): ITL p99 {r['p99_itl_ms']:.2f} ms, median "
              f"{r['median_itl_ms']:.2f} ms: ratio {itl_ratio:.2f} (target <= 2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
