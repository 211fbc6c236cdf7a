#!/usr/bin/env python3
"""Serving benchmark over HTTP: the OpenAI-compatible server under an open-loop load.

Workload (all seeded): N requests whose prompt lengths follow a lognormal
distribution (token-id prompts cut from a fixed text, so each length is exact),
sent at Poisson arrivals of --rate requests/s (inf: all at once); each is a
streaming /v1/completions request with a fixed max_tokens and ignore_eos, so
every request produces exactly that many tokens. Nothing limits concurrency but
the arrivals: a server slower than the rate builds a queue, which shows in the
time to first token.

Measured per request on the client: time to first token (TTFT: request sent ->
first streamed token), inter-token latency (ITL: the gap between streamed
chunks, per token), end-to-end latency (E2E: sent -> [DONE]). Reported:
mean/p50/p90/p99 of each, request throughput, output tokens/s, and the server's
preemption and prefix-cache counters from /metrics.

By default the script starts its own ``pagedcore serve`` (default model; engine
flags below) on a free port and stops it with SIGTERM at the end; --base-url
targets a running server instead.

Usage:
  bench/bench_serving.py [--num-requests 64] [--rate 2] [--max-tokens 32]
                         [--prompt-len-median 64 --prompt-len-sigma 0.6]
                         [--base-url http://127.0.0.1:8000 --model NAME --api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
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
from dataclasses import dataclass, field

try:
    import httpx
except ImportError:  # the openai client of some environments ships httpx as `httpx2`
    import httpx2 as httpx

from corpus import TEXT  # noqa: E402  (bench/ is on sys.path when run as a script)


@dataclass
class Result:
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # seconds per token, between chunks


def make_prompts(tokenizer, n: int, seed: int, median: float, sigma: float, max_len: int) -> list[list[int]]:
    """n token-id prompts with lognormal lengths (median `median`, shape `sigma`),
    clipped to [8, max_len], cut from a fixed text at seeded offsets.

    Each starts with its own request number: the text repeats, and two prompts
    cut at offsets a period apart would otherwise share prefix-cache blocks."""
    rng = random.Random(seed)
    corpus = tokenizer.encode(TEXT * (1 + (max_len * 6) // len(TEXT)))
    prompts = []
    for i in range(n):
        length = min(max(int(rng.lognormvariate(math.log(median), sigma)), 8), max_len)
        start = rng.randrange(0, len(corpus) - length)
        prompt = tokenizer.encode(f"Request {i}:") + corpus[start:start + length]
        prompts.append(prompt[:length])
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


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    result = Result(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    chunk_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    chunk_times.append(time.perf_counter())
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    end = time.perf_counter()
    if not chunk_times:
        result.ok, result.error = False, "no tokens streamed"
        return result
    result.ttft = chunk_times[0] - start
    result.e2e = end - start
    result.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    # NOTE: the server streams one chunk per engine step, so one token per chunk;
    # should chunks ever carry several tokens, spread each gap over them.
    gaps = [b - a for a, b in itertools.pairwise(chunk_times)]
    per_chunk = (result.output_tokens - 1) / len(gaps) if gaps else 1.0
    result.itl = [g / per_chunk for g in gaps] if per_chunk > 0 else []
    return result


async def run_load(base_url: str, api_key: str | None, model: str, prompts: list[list[int]],
                   arrivals: list[float], max_tokens: int) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:
        start = time.perf_counter()

        async def scheduled(prompt: list[int], at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(client, model, prompt, max_tokens)

        results = await asyncio.gather(*[scheduled(p, t) for p, t in zip(prompts, arrivals)])
        return list(results), time.perf_counter() - start


def server_counters(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedcore_") and not line.startswith(("pagedcore_time", "pagedcore_inter",
                                                                   "pagedcore_e2e")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---- the server process ---------------------------------------------------------------


def read_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, log_path = tempfile.mkstemp(prefix="pagedcore-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "pagedcore", "serve", "--port", str(port), "--served-model-name", args.model,
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), *args.server_arg]
    if args.model_path:
        cmd += ["--model", args.model_path]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
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
            raise SystemExit(f"server not healthy after 300 s:\n{read_text(log_path)}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---- report ------------------------------------------------------------------------------


def report(args, results: list[Result], duration: float, counters: dict[str, float], server_log: str | None,
           url: str) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=here, check=False).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=here, check=False).stdout.strip()
    print(f"commit {commit}{' (uncommitted changes)' if dirty else ''}; {platform.machine()}, "
          f"{os.cpu_count()} CPUs; python {platform.python_version()}; server {url}")
    if server_log:
        blocks = [line.split("# KV cache blocks:")[1].strip() for line in read_text(server_log).splitlines()
                  if "# KV cache blocks:" in line]
        print(f"server: own process ({' '.join(blocks)} KV cache blocks, max_model_len {args.max_model_len}, "
              f"max_num_seqs {args.max_num_seqs}{', ' + ' '.join(args.server_arg) if args.server_arg else ''})")
    lens = [r.prompt_len for r in results]
    arrivals = "all at once" if math.isinf(args.rate) else f"Poisson arrivals at {args.rate:g} req/s"
    print(f"{len(results)} requests, {arrivals} (seed {args.seed}), prompt tokens "
          f"lognormal median {args.prompt_len_median:g} sigma {args.prompt_len_sigma:g}: mean "
          f"{statistics.mean(lens):.0f}, min {min(lens)}, max {max(lens)}; {args.max_tokens} output tokens "
          f"each (ignore_eos, greedy, streamed)")
    for r in failed[:5]:
        print(f"  failed: {r.error}")
    if not ok:
        print("no request completed")
        return
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    print(f"server counters during the run: preemptions {counters.get('pagedcore_preemptions_total', 0):.0f}, "
          f"prefix-cache hits {counters.get('pagedcore_prefix_cache_hits_total', 0):.0f} of "
          f"{counters.get('pagedcore_prefix_cache_queries_total', 0):.0f} prompt tokens")
    print()
    print(f"{'metric':<30}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    rows = [
        ("TTFT (ms)", [r.ttft * 1e3 for r in ok]),
        ("ITL, per token (ms)", [x * 1e3 for r in ok for x in r.itl]),
        ("TPOT, per request (ms)", [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok
                                    if r.output_tokens > 1]),
        ("E2E latency (s)", [r.e2e for r in ok]),
    ]
    for name, values in rows:
        if values:
            print(f"{name:<30}{statistics.mean(values):>10.1f}{percentile(values, 50):>10.1f}"
                  f"{percentile(values, 90):>10.1f}{percentile(values, 99):>10.1f}")
    print(f"{'completed / failed':<30}{len(ok):>10}{len(failed):>10}")
    print(f"{'duration (s)':<30}{duration:>10.1f}")
    print(f"{'request throughput (req/s)':<30}{len(ok) / duration:>10.2f}")
    print(f"{'output tokens/s':<30}{out_tokens / duration:>10.1f}")
    print(f"{'total tokens/s (in + out)':<30}{(in_tokens + out_tokens) / duration:>10.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="target this server instead of starting one")
    parser.add_argument("--model", default="smol", help="served model name (asked from /v1/models with --base-url)")
    parser.add_argument("--model-path", default=None, help="model directory for the own server (default model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the default model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (inf: all at once)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len-median", type=float, default=64)
    parser.add_argument("--prompt-len-sigma", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="short requests sent before measuring")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for the own `pagedcore serve` (repeatable)")
    args = parser.parse_args()

    import transformers

    proc = server_log = None
    if args.base_url is None:
        proc, url, server_log = start_server(args)
    else:
        url = args.base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
        model = next((m for m in models if m["id"] == args.model), models[0])
        args.model = model["id"]
        args.max_model_len = model.get("max_model_len", args.max_model_len)
    try:
        if args.tokenizer is None:
            import pagedcore

            args.tokenizer = args.model_path or pagedcore.default_model_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        room = args.max_model_len - args.max_tokens
        # The warm-up prompts come after the measured ones: the measured ones then do
        # not depend on --warmup, and find nothing of theirs in the prefix cache.
        prompts = make_prompts(tokenizer, args.num_requests + args.warmup, args.seed, args.prompt_len_median,
                               args.prompt_len_sigma, room)
        prompts, warmup = prompts[:args.num_requests], prompts[args.num_requests:]
        arrivals = arrival_times(args.num_requests, args.rate, args.seed)
        if warmup:
            asyncio.run(run_load(url, args.api_key, args.model, warmup, [0.0] * len(warmup), 4))
        before = server_counters(url)
        results, duration = asyncio.run(run_load(url, args.api_key, args.model, prompts, arrivals,
                                                 args.max_tokens))
        after = server_counters(url)
    finally:
        if proc is not None:
            code = stop_server(proc)
            if code != 0:
                print(f"warning: the server exited with {code} (log: {server_log})", file=sys.stderr)
    counters = {k: after[k] - before.get(k, 0) for k in after}
    report(args, results, duration, counters, server_log, url)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
