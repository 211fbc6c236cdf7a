#!/usr/bin/env python3
"""The server's own cost per streamed token, without a model: the HTTP layer,
the engine thread's fan-out to the streams, SSE encoding and the writes.

A stub engine stands in for LLMEngine: each step sleeps --step-ms (a GPU step,
with the GIL released, as a CUDA synchronisation releases it) and gives every
running request one token (" tok"), until --max-tokens. The real AsyncEngine and
the real routes (build_app) serve it under uvicorn in a child process; N
streams at once come from bench_serving.py's raw client in this process.
Reported: the server process's
CPU time per streamed token (user + system, every thread: the figure that does
not depend on what else runs on the machine), the wall time against the steps'
floor (max_tokens x step), tokens/s, and how much longer a step took than its
sleeps (--gil-releases of them): the time the engine thread waited for the GIL
while the event loop held it.

Usage: bench/bench_server_fanout.py [--streams 256] [--max-tokens 64] [--step-ms 10] [--repeat 3] [--tokenizer default]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import time



_TEXT = ("The block table maps each sequence's logical blocks to physical ones, so memory follows the real "
         "length of a sequence and not its maximum. When a request finishes, its blocks go back to the free list; "
         "requests that share a prefix share its blocks, copy-on-write, and nothing is computed twice. "
         "Numbers such as 3.14159, 2026 and 0x7f, code like `for (int i = 0; i < n; ++i)`, and words in "
         "other scripts -- naïve café, 東京, Привет -- all pass through the same incremental detokenizer.")


class StubEngine:
    """What AsyncEngine and build_app use of LLMEngine, with no model.

    Without a tokenizer every stream's token is the text " tok" (a RequestOutput
    a step). With one (--tokenizer), the plain streams take the server's real
    path: compact rows from take_compact_outputs(), their text made on the HTTP
    side by its incremental detokenizers; the tokens are those of a fixed
    text (English, a little code, other scripts) in turn, each stream from its
    own place in it."""

    max_model_len = 4096

    def __init__(self, step_s: float, gil_releases: int = 1, step_time=None, tokenizer_path: str | None = None) -> None:
        self.step_s, self.gil_releases = step_s, gil_releases
        self.step_time = step_time  # shared [seconds in steps, steps]
        self.running: dict[str, list] = {}  # request id -> [tokens so far, max_tokens, prompt ids]
        self.compact: dict[str, list] = {}  # request id -> [tokens so far, max_tokens, compact key]
        self.tokenizer = None
        if tokenizer_path is not None:
            from pagedcore.model_loader import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer_path)
            self.text_ids = self.tokenizer.encode(_TEXT, add_special_tokens=False)
        self.compact_parts: list = []

    def stats(self) -> dict:
        return {"num_requests": len(self.running) + len(self.compact), "num_waiting_seqs": 0}

    def add_request(self, request_id, prompt, prompt_token_ids, params, stream=True, add_special_tokens=True,
                    detokenize=True, compact_key=None):
        if compact_key is not None:
            self.compact[request_id] = [len(self.compact) * 7, params.max_tokens, compact_key]
            return
        self.running[request_id] = [0, params.max_tokens, list(prompt_token_ids or [1])]

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self.compact.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.compact

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.compact)

    def take_compact_outputs(self):
        if not self.compact_parts:
            return None
        from pagedcore.compact_outputs import CompactOutputs

        parts, self.compact_parts = self.compact_parts, []
        return CompactOutputs.concat(parts)

    def step(self) -> list:
        from pagedcore.outputs import CompletionOutput, RequestOutput

        # NOTE: one step of a GPU engine releases the GIL at every launch and
        # synchronisation and must take it back each time; a thread that holds
        # it then (the event loop) delays the step by up to the switch interval.
        start = time.perf_counter()
        for _ in range(self.gil_releases):
            time.sleep(self.step_s / self.gil_releases)
        if self.step_time is not None:
            self.step_time[0] += time.perf_counter() - start
            self.step_time[1] += 1
        outs = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(RequestOutput(request_id, None, state[2], [CompletionOutput(
                0, " tok", [7], None, None, "length" if done else None)], done))
            if done:
                del self.running[request_id]
        if self.compact:
            import numpy as np

            from pagedcore.compact_outputs import CompactOutputs

            keys, ids, finish = [], [], []
            text_ids = self.text_ids
            for request_id, state in list(self.compact.items()):
                keys.append(state[2])
                ids.append(text_ids[state[0] % len(text_ids)])
                state[0] += 1
                state[1] -= 1
                finish.append(2 if state[1] == 0 else 0)  # ("length")
                if state[1] == 0:
                    del self.compact[request_id]
            self.compact_parts.append(CompactOutputs(np.array(keys, np.int64), np.array(ids, np.int32),
                                                     np.array(finish, np.uint8), np.full(len(keys), -1, np.int32)))
        return outs


class StubFactory:
    """Makes the stub in the engine's process (``serve --engine-process``'s layout)."""

    def __init__(self, step_s: float, gil_releases: int, step_time, tokenizer_path: str | None) -> None:
        self.args = (step_s, gil_releases, step_time, tokenizer_path)

    def __call__(self, engine_args) -> StubEngine:
        return StubEngine(*self.args)


def serve(sock: socket.socket, step_s: float, gil_releases: int, switch_interval: float | None, step_time,
          engine_process: bool, tokenizer_path: str | None) -> None:
    import sys

    import uvicorn

    from pagedcore.server.app import build_app
    from pagedcore.server.async_engine import AsyncEngine
    from pagedcore.server.lifecycle import freeze_startup_objects

    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    if engine_process:
        from pagedcore.server.engine_process import EngineProcess

        engine = EngineProcess(None, engine_factory=StubFactory(step_s, gil_releases, step_time, tokenizer_path),
                               tokenizer_path=tokenizer_path)
    else:
        engine = AsyncEngine(StubEngine(step_s, gil_releases, step_time, tokenizer_path))
    app = build_app(engine, "stub")
    freeze_startup_objects()  # (as `serve` does once it has started)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, every thread."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def load(url: str, streams: int, max_tokens: int) -> tuple[int, int]:
    """N streams at once from bench_serving.py's raw client (the lightest: the
    client must not be what limits the server); returns the tokens and chunks."""
    import sys
    from urllib.parse import urlsplit

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_serving import request_raw

    where = urlsplit(url)
    results = await asyncio.gather(*[request_raw((where.hostname, where.port, None), "stub", [1, 2, 3], max_tokens,
                                                 None) for _ in range(streams)])
    failed = [r.error for r in results if not r.ok]
    assert not failed, failed[:3]
    return sum(r.output_tokens for r in results), sum(len(r.itl) + 1 for r in results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--gil-releases", type=int, default=1,
                   help="a step releases and retakes the GIL this many times (launches, synchronisations)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval of the server")
    p.add_argument("--engine-process", action="store_true", help="the stub in a process of its own")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokenizer", default=None,
                   help="a model directory (or 'default': the default model's) whose tokenizer turns the stub's "
                        "tokens into text on the HTTP side, as the server does for plain streams")
    args = p.parse_args()
    if args.tokenizer == "default":
        from pagedcore.default_model import default_model_path

        args.tokenizer = default_model_path()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # (fork: the child starts with this process's imports and sys.path)
    ctx = multiprocessing.get_context("fork")
    step_time = multiprocessing.get_context("spawn").Array("d", 2)  # (shared with a spawned engine process too)
    child = ctx.Process(target=serve, args=(sock, args.step_ms / 1e3, args.gil_releases, args.switch_interval,
                                            step_time, args.engine_process, args.tokenizer))
    child.start()
    sock.close()
    asyncio.run(load(url, 8, 4))  # warm-up
    per_token, system, walls, stretch, per_chunk = [], [], [], [], []
    for _ in range(args.repeat):
        cpu0, t0 = cpu_seconds(child.pid), time.perf_counter()
        s0, n0 = step_time[0], step_time[1]
        tokens, chunks = asyncio.run(load(url, args.streams, args.max_tokens))
        per_chunk.append(tokens / chunks)
        wall, cpu1 = time.perf_counter() - t0, cpu_seconds(child.pid)
        cpu = sum(cpu1) - sum(cpu0)
        system.append((cpu1[1] - cpu0[1]) / cpu)
        assert tokens == args.streams * args.max_tokens, tokens
        per_token.append(cpu / tokens * 1e6)
        walls.append(wall)
        stretch.append((step_time[0] - s0) / (step_time[1] - n0) / (args.step_ms / 1e3))
    child.terminate()
    child.join(10)
    if child.is_alive():  # (uvicorn's graceful shutdown waiting on something: not this benchmark's subject)
        child.kill()
    floor = args.max_tokens * args.step_ms / 1e3
    wall = statistics.median(walls)
    print(f"engine {'in a process of its own' if args.engine_process else 'thread'}"
          f"{', text from the tokenizer' if args.tokenizer else ''}: {args.streams} streams x {args.max_tokens} tokens, stub steps of {args.step_ms:g} ms "
          f"(floor {floor:.2f} s): server CPU {statistics.median(per_token):.1f} us per token "
          f"(runs: {', '.join(f'{x:.1f}' for x in per_token)}; {statistics.median(system):.0%} of it in the kernel), "
          f"wall {wall:.2f} s "
          f"({wall / floor:.2f}x the floor), {args.streams * args.max_tokens / wall:.0f} tokens/s; "
          f"a step took {statistics.median(stretch):.2f}x its {args.step_ms:g} ms (GIL waits); "
          f"{statistics.median(per_chunk):.2f} tokens per chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
