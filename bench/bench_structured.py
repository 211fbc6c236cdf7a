#!/usr/bin/env python3
"""Structured outputs' cost: a batch of requests, each constrained by a JSON schema,
against the same batch unconstrained (issue 15's target: <= 10% slower), like with like.

Both runs make exactly ``--max-tokens`` tokens per request, so that both do the same
steps over the same batch sizes: unconstrained rows ignore EOS; constrained rows
follow a schema that cannot finish in time (an array of at least 10,000 strings,
``--schema bounded``: of at most 8 characters, or ``plain``), so each ends with
"length" too. The model is the default one (real weights: the grammar needs its
tokenizer); ``--load-format dummy`` draws random weights instead (``--model DIR``: a
directory with the default model's config.json and tokenizer files is enough then),
whose near-uniform choices visit other grammar states than a trained model's: mostly
the whitespace between items, where masks are cheap; the replay below times the
string states apart.

Each async-scheduling mode (``--async-scheduling both``: on, then off) runs the two
batches in one engine and prints output tokens/s, their ratio, and where the host's
time per step went (ms per engine step, medians over ``--repeats`` runs):

- ``execute``: scheduling the forward pass (the runner's ``execute``: inputs staged and
  the forward launched; on the CPU the forward itself)
- ``wait``: waiting for a step's sampled ids to reach the host
- ``process``: turning sampled ids into outputs, of which ``advance`` is feeding the
  tokens to the grammar matchers and ``start`` starting the next step's masks (rows,
  staging, the hand-over to the mask thread)
- ``masks``: the grammar bitmasks in the sampling metadata (``_add_token_bitmask``: their
  copy queued, behind the device's wait for them; without the pool or the device wait,
  waiting for them too)
- ``handover`` (async scheduling): right after the sampler is queued, up to 0.2 ms to let
  the mask thread, if done, take the GIL and write the device's flag
- ``join``: once the step's work is queued (with async scheduling, the next forward pass
  too), waiting for the masks' computation to end: the part of it the step did not hide
- ``sample``: the sampler's call (its kernels launched on CUDA, run on the CPU)

and the rest of ``step()`` as ``other``; ``compute`` is the masks' computation itself (on
the mask pool, beside the engine's thread: not in ``step``). On CUDA also ``gpu execute``
and ``gpu sample``, the device's time from the forward pass's and the sampler's first
launch to their last kernel's end (CUDA events around their calls: host gaps included),
and ``gpu wait``, the device's time in the wait for the masks. Then a replay of the
constrained run's own tokens through fresh matchers times llguidance alone on this host,
step by step over the same rows: how many rows per step are inside strings (where a mask
costs ~0.5 ms), each mask on one thread, the bound a pool meets when the matchers share
one compiled grammar (its lexer is locked through each mask) or are spread over lanes,
and the pool measured both ways; on CUDA, the bitmask's application alone, the kernel
against the torch unpacking it replaced. Last, the sampler alone on the bench's rows,
every row seeded (as the bench's requests) and none: its host time per call and its
torch calls (on CUDA, launches; a seeded row costs one exponential_ of its own).

With a mask pool, the engine computes a step's masks in the background or in line,
whichever its trials find cheaper for the engine's thread (printed after each mode's
runs); ``--mask-way background|inline`` forces one. ``--masks-alone STEPS`` times the
two ways without a model (see masks_alone).

Usage: python bench/bench_structured.py [--requests 64] [--max-tokens 256] [--device cuda]
       [--load-format dummy --model DIR] [--async-scheduling both|on|off]
       [--mask-way auto|background|inline] [--masks-alone STEPS [--busy-ms 1.5]]
       [--host-only (CPU: stand-ins for the forward pass and the sampler)] [--switch-interval S] [--gil-probe]
       (PAGEDCORE_MASK_THREADS=N: the mask pool's threads; PAGEDCORE_MASK_DEVICE_WAIT=0: no device wait;
        PAGEDCORE_GRAMMAR_WORKER=cpp|pyo3: the C++ grammar worker (the default where llguidance has its
        shared library), whose masks' "compute" reads 0 and which has no replay or mask-way trials, or
        llguidance's PyO3 matchers)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from pagedcore import LLM, SamplingParams, default_model_path
from pagedcore import llm_engine, structured_outputs
from pagedcore.structured_outputs import (DEVICE_WAIT_ENV, GRAMMAR_WORKER_ENV, MASK_THREADS_ENV,
                                         StructuredOutputsParams)

def schema(max_length: int | None) -> dict:
    """An array of at least 10,000 strings (of at most ``max_length`` characters)."""
    item = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 10000, "items": item}},
        "required": ["items"],
        "additionalProperties": False,
    }


# bounded: llguidance's mask inside a string of at most 8 characters costs ~0.4 ms on the
# 2-core CPU machine (each position a lexer state of its own), ~80x one inside a plain string.
SCHEMAS = {"bounded": schema(8), "plain": schema(None)}
SCHEMA = SCHEMAS["bounded"]
_WAIT = None  # _HostCopy.wait before it was timed
PARTS = ("execute", "wait", "process", "advance", "start", "masks", "handover", "join", "sample", "other")
_JOB_WAIT = None  # MaskJob.wait before it was timed
STRING_TOKENS = 1000  # a mask allowing more tokens than this: its row is inside a string


class Timers:
    """Wall time of the engine's step pieces, by wrapping them (ms totals)."""

    def __init__(self, engine) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._wrap(engine, "step", "step")
        self._wrap(engine, "_advance_matchers", "advance")
        self._wrap(engine, "_process", "process")
        self._wrap(engine, "_start_masks", "start")
        self._wrap(engine, "_add_token_bitmask", "masks")
        self._wrap(engine, "_join_masks", "join")
        self._wrap(engine.runner, "execute", "execute")
        self._engine = engine
        self._cuda = engine.device.type == "cuda"
        self._events: list = []  # (part, start, end) CUDA events, read after each run
        self.jobs: list = []  # the mask jobs of the run (their compute_seconds)
        sampler = engine.sampler
        engine.sampler = lambda *a, **kw: self._timed("sample", sampler, *a, **kw)
        global _WAIT
        if _WAIT is None:  # (the class is patched once; each engine's timers take their turn)
            _WAIT = llm_engine._HostCopy.wait
        llm_engine._HostCopy.wait = lambda copy: self._timed("wait", _WAIT, copy)
        global _JOB_WAIT
        if _JOB_WAIT is None:
            _JOB_WAIT = structured_outputs.MaskJob.wait
        # (a wait with a timeout: the hand-over right after the sampler; without: the join's own)
        structured_outputs.MaskJob.wait = lambda job, timeout=None: (
            _JOB_WAIT(job) if timeout is None else self._timed("handover", _JOB_WAIT, job, timeout))
        if self._cuda:  # the device's wait for the masks (device_wait), timed on the device
            from pagedcore.ops import bitmask as bitmask_ops

            self._device_wait = bitmask_ops.wait_host_flag
            bitmask_ops.wait_host_flag = lambda *a, **kw: self._timed("gpu wait", self._device_wait, *a, **kw)
        self._structured_wrapped = False

    def wrap_structured(self) -> None:
        """The grammar manager exists once a constrained request came (the warm-up)."""
        manager = self._engine._structured
        if manager is None or self._structured_wrapped:
            return
        start_masks = manager.start_masks

        def started(*args, **kwargs):
            job = start_masks(*args, **kwargs)
            self.jobs.append(job)
            return job

        manager.start_masks = started
        self._structured_wrapped = True

    def _wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, **kw: self._timed(part, fn, *a, **kw))

    def _timed(self, part: str, fn, *args, **kwargs):
        gpu = self._cuda and part in ("execute", "sample", "gpu wait")
        if gpu:  # the device's time of the forward pass and of the sampler, from events around them
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if part != "gpu wait":
                self.total[part] += 1e3 * (time.perf_counter() - t0)
            if part == "step":
                self.steps += 1
            if gpu:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((part if part == "gpu wait" else f"gpu {part}", start, end))

    def close(self) -> None:
        """Restores the module-level hooks, so that nothing keeps this engine alive (on
        CUDA the next mode's engine needs its memory)."""
        llm_engine._HostCopy.wait = _WAIT
        structured_outputs.MaskJob.wait = _JOB_WAIT
        if self._cuda:
            from pagedcore.ops import bitmask as bitmask_ops

            bitmask_ops.wait_host_flag = self._device_wait
        self._engine = None

    def reset(self) -> None:
        self.total.clear()
        self.steps = 0
        self._events.clear()
        self.jobs.clear()

    def per_step(self) -> dict[str, float]:
        if self._events:
            torch.cuda.synchronize()
            for part, start, end in self._events:
                self.total[part] += start.elapsed_time(end)
            self._events.clear()
        t, n = self.total, max(self.steps, 1)
        parts = {p: t.get(p, 0.0) / n for p in PARTS if p != "other"}
        # (advance and start are inside process or masks; join, when the masks were not
        # in yet, is the part of their computation the step did not hide)
        parts["other"] = t.get("step", 0.0) / n - sum(parts[p] for p in ("execute", "wait", "process", "masks",
                                                                        "handover", "join", "sample"))
        parts["step"] = t.get("step", 0.0) / n
        for job in self.jobs:
            _JOB_WAIT(job) if isinstance(job, structured_outputs.MaskJob) else job.wait()  # (WorkerMaskJob)
        parts["compute"] = 1e3 * sum(job.compute_seconds for job in self.jobs) / n
        if self._cuda:
            # (the device is idle for the rest of a step: waiting for the host to launch)
            for p in ("gpu execute", "gpu sample", "gpu wait"):
                parts[p] = t.get(p, 0.0) / n
        return parts


def host_only(engine, seed: int = 0) -> None:
    """Replaces the forward pass and the sampler with stand-ins that cost almost nothing,
    so that a step's time is the engine thread's own work (scheduling, outputs, the
    matchers, the masks' start and join, the sampling metadata): on a CPU whose model and
    sampler take ~100 ms a step, the host-bound step of a GPU seen apart. The forward
    pass returns zero logits; the sampler draws each row's token from a seeded numpy
    generator: any token for rows without a mask, else the lowest allowed token of the
    first word with one from a random word on (the grammar's states vary as in a run)."""
    from pagedcore.sampler import SamplerOutput

    vocab = engine.spec.vocab_size
    rng = np.random.default_rng(seed)
    logits = torch.zeros(0, vocab)

    def execute(batch, previous=None):
        nonlocal logits
        if logits.shape[0] < batch.num_samples:
            logits = torch.zeros(batch.num_samples, vocab)
        return logits[:batch.num_samples]

    def sample(x, md):
        ids = rng.integers(0, vocab, x.shape[0])
        if md.token_bitmask is not None and md.bitmask_rows is not None and md.bitmask_rows.numel():
            # (per row: the first word with an allowed token from a random word on,
            # cyclically, and its lowest allowed token; vectorized, to cost the host little)
            words = md.token_bitmask.numpy().view(np.uint32)
            n, w = words.shape
            allowed = words != 0
            after = allowed & (np.arange(w)[None, :] >= rng.integers(0, w, n)[:, None])
            word = np.where(after.any(axis=1), after.argmax(axis=1), allowed.argmax(axis=1))
            value = words[np.arange(n), word].astype(np.int64)
            ids[md.bitmask_rows.numpy()] = 32 * word + np.log2(value & -value).astype(np.int64)
        return SamplerOutput(sampled_token_ids=torch.from_numpy(ids), sampled_logprobs=None)

    engine.runner.execute = execute
    engine.sampler = sample


class GilProbe:
    """A thread that sleeps ``period_s`` at a time and records how late it gets the GIL
    back each time (the OS's wake-up and the wait for the GIL): what any thread of the
    engine's process that leaves the GIL (the mask thread, for llguidance's call) waits
    to take it again while the engine's thread runs Python. CPython hands a waiting
    thread the GIL when the holder blocks, or else after the switch interval."""

    def __init__(self, period_s: float = 0.001) -> None:
        import threading

        self.period_s = period_s
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            self.late.append(time.perf_counter() - t0 - self.period_s)

    def take(self) -> list[float]:
        late, self.late = self.late, []
        return late

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run(llm: LLM, timers: Timers, prompts: list[str], params: SamplingParams, repeats: int):
    """Best-of-``repeats`` wall time; the median per-step breakdown; the last run's outputs."""
    walls, breakdowns = [], []
    for _ in range(repeats):
        timers.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        walls.append(time.perf_counter() - start)
        breakdowns.append(timers.per_step())
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    reasons = {c.finish_reason for o in outs for c in o.outputs}
    if reasons != {"length"}:
        raise SystemExit(f"every request must end by max_tokens, got {reasons}")
    median = {k: statistics.median(b[k] for b in breakdowns) for k in breakdowns[0]}
    return min(walls), tokens, median, outs


def replay(engine, spec: StructuredOutputsParams, outs, steps: int) -> None:
    """Times llguidance alone over the constrained run's own token sequences."""
    import llguidance

    manager = engine._structured
    compiled = manager._compiled[spec.key]
    rows = [list(c.token_ids) for o in outs for c in o.outputs]
    b, words = len(rows), manager.num_words
    nbytes = 4 * words
    steps = min(steps, min(len(r) for r in rows))
    threads = manager.mask_threads or 2
    lanes = list(compiled.templates)
    while len(lanes) < threads:  # (an engine without a pool has one)
        lanes.append(llguidance.LLMatcher(manager._tokenizer, compiled.grammar, log_level=0))
    # Each set advances its own matchers in lockstep (a matcher caches the mask of its
    # current state: a set computes each mask once). "one thread" times every row alone.
    sets = {
        "one thread": [lanes[0].deep_copy() for _ in range(b)],
        f"pool({threads}), 1 lane": [lanes[0].deep_copy() for _ in range(b)],
        f"pool({threads}), {len(lanes)} lanes": [lanes[r % len(lanes)].deep_copy() for r in range(b)],
    }
    lane_of = {f"pool({threads}), 1 lane": [0] * b,
               f"pool({threads}), {len(lanes)} lanes": [r % len(lanes) for r in range(b)]}
    executor = llguidance.LLExecutor(threads)
    modes = list(sets)
    times: dict[str, list[float]] = {m: [] for m in modes}
    consumed: dict[str, list[float]] = {m: [] for m in modes}
    row_us = np.zeros((steps, b))
    allowed = np.zeros((steps, b), dtype=np.int64)
    out = torch.empty((b, words), dtype=torch.int32)
    for t in range(steps):
        for m in (modes if t % 2 else modes[::-1]):  # (alternating order: neither is always first)
            ms = sets[m]
            t0 = time.perf_counter()
            if m == "one thread":
                for r, matcher in enumerate(ms):
                    a = time.perf_counter()
                    matcher.unsafe_compute_mask_ptr(out.data_ptr() + r * nbytes, nbytes)
                    row_us[t, r] = 1e6 * (time.perf_counter() - a)
                allowed[t] = np.bitwise_count(out.numpy().view(np.uint32)).sum(axis=1)
            else:
                pairs = sorted(((x, r) for r, x in enumerate(ms)), key=lambda p: lane_of[m][p[1]])
                executor.unsafe_compute_mask_ptr(pairs, out.data_ptr(), nbytes, b)
            times[m].append(1e3 * (time.perf_counter() - t0))
        for m in modes:  # (the one-thread set's tokens one by one, the lanes' set's on the pool)
            tokens = [row[t] for row in rows]
            t0 = time.perf_counter()
            if m == modes[2]:
                order = sorted(range(b), key=lambda r: lane_of[m][r])
                accepted = executor.consume_token_par([(sets[m][r], tokens[r]) for r in order])
            else:
                accepted = [matcher.consume_token(token) for matcher, token in zip(sets[m], tokens)]
            consumed[m].append(1e3 * (time.perf_counter() - t0))
            if not all(accepted):
                raise SystemExit(f"replay: a token refused at step {t}")
    inside = allowed > STRING_TOKENS
    per_step = inside.sum(axis=1)
    print(f"replay of the constrained run's tokens, llguidance alone ({b} rows x {steps} steps, "
          f"{os.cpu_count()} CPUs; the engine: {manager.mask_threads} pool threads (${MASK_THREADS_ENV}), "
          f"{manager.num_lanes} lanes):")
    print(f"  rows inside strings (> {STRING_TOKENS} tokens allowed) per step: mean {per_step.mean():.2f}, median "
          f"{np.median(per_step):.0f}, p90 {np.percentile(per_step, 90):.0f}, max {per_step.max()}; steps with none "
          f"{100 * (per_step == 0).mean():.0f}%. One thread, a mask inside a string: median "
          f"{np.median(row_us[inside]) if inside.any() else 0:.0f} us, p90 "
          f"{np.percentile(row_us[inside], 90) if inside.any() else 0:.0f}; outside: median "
          f"{np.median(row_us[~inside]):.1f} us, p99 {np.percentile(row_us[~inside], 99):.0f}")
    # The least a pool can take per step: its slowest lane (masks of one lane run one at a
    # time), or its share of the whole.
    for name, num_lanes in (("1 lane", 1), (f"{len(lanes)} lanes", len(lanes))):
        lane_sum = np.zeros((steps, num_lanes))
        for r in range(b):
            lane_sum[:, r % num_lanes] += row_us[:, r]
        bound = np.maximum(lane_sum.max(axis=1), row_us.sum(axis=1) / threads) / 1e3
        print(f"  bound for pool({threads}), {name:9s}: mean {bound.mean():7.3f} ms, median {np.median(bound):7.3f}, "
              f"p90 {np.percentile(bound, 90):7.3f}")
    for m in modes:
        xs = times[m]
        print(f"  {m:22s} {b} masks: mean {statistics.mean(xs):7.3f} ms, median {statistics.median(xs):7.3f}, "
              f"p90 {np.percentile(xs, 90):7.3f}, max {max(xs):7.3f}")
    for m, how in ((modes[0], "one by one"), (modes[2], f"on the pool({threads}), by lane")):
        xs = consumed[m]
        print(f"  a step's {b} tokens fed to the matchers {how:22s}: mean {statistics.mean(xs):7.3f} ms, "
              f"median {statistics.median(xs):7.3f}")
    # One mask in a few grammar states (median of 20, each on a fresh copy: no cache).
    for prefix in ('{"items": [', '{"items": ["', '{"items": ["ab'):
        matcher = manager.new_matcher(spec).ll
        for token in engine.tokenizer.encode(prefix, add_special_tokens=False):
            if not matcher.consume_token(token):
                raise SystemExit(f"replay: {prefix!r} refused by the schema")
        single = []
        for _ in range(20):
            copy = matcher.deep_copy()
            t0 = time.perf_counter()
            copy.unsafe_compute_mask_ptr(out.data_ptr(), nbytes)
            single.append(1e6 * (time.perf_counter() - t0))
        print(f"  one mask after {prefix!r:16s}: median {statistics.median(single):8.1f} us")


def apply_alone(device: torch.device, rows: int, vocab: int) -> None:
    """The bitmask's application on the device alone: the kernel, and the torch
    unpacking it replaced (shifts, and, compare, masked_fill), by CUDA events over 200
    calls queued while the device sleeps; host time per call beside (what launching
    costs the engine's thread)."""
    from pagedcore.sampler import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask, logits = bitmask.to(device), torch.randn(rows, vocab, generator=gen).to(device)
    index = torch.arange(rows, device=device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)

    def torch_unpacking(x):
        blocked = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab] == 0
        return x.masked_fill_(blocked, float("-inf"))

    kernel = lambda x: apply_token_bitmask(x, index, bitmask)  # noqa: E731
    for name, fn in (("kernel", kernel), ("torch unpacking", torch_unpacking)):
        x = logits.clone()
        for _ in range(10):
            fn(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # NOTE: the device first sleeps (~50 ms) while the host queues every call, so
        # that the events time the kernels back to back, not the host's launches.
        torch.cuda._sleep(100_000_000)
        start.record()
        t0 = time.perf_counter()
        for _ in range(200):
            fn(x)
        host = 1e6 * (time.perf_counter() - t0) / 200
        end.record()
        end.synchronize()
        device_us = 1e3 * start.elapsed_time(end) / 200
        print(f"  bitmask applied to [{rows}, {vocab}] float32, {name:15s}: {device_us:6.1f} us "
              f"on the device, {host:6.1f} us of host time per call")


def sampler_alone(device: torch.device, rows: int, vocab: int, calls: int = 50) -> None:
    """The sampler's host time per call for the bench's rows (temperature 0.8, every row
    seeded as the bench's requests are, and none seeded), and its torch calls (each a
    launch on CUDA): what its 'sample' part is made of."""
    from torch.profiler import ProfilerActivity, profile

    from pagedcore.sampler import Sampler, SamplingMetadata

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    sampler = Sampler()
    for seeded in (True, False):
        params = [SamplingParams(temperature=0.8, seed=i if seeded else None) for i in range(rows)]
        md = SamplingMetadata.from_params(params, device)
        md.need_sampled_logprobs = False  # (as the engine's, without logprobs)
        for _ in range(3):
            sampler(logits, md)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sampler(logits, md)
        ops = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
        times = []
        for _ in range(calls):
            if device.type == "cuda":
                # (the device busy for ~2.5 ms behind an empty queue: the host's time alone is timed)
                torch.cuda.synchronize()
                torch.cuda._sleep(5_000_000)
            t0 = time.perf_counter()
            sampler(logits, md)
            times.append(1e3 * (time.perf_counter() - t0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"  sampler alone, [{rows}, {vocab}], temperature 0.8, {'every row seeded' if seeded else 'unseeded':16s}: "
              f"{statistics.median(times):.3f} ms of host time per call (median of {calls}), {len(ops)} torch calls, "
              f"{ops.count('aten::exponential_')} of them exponential_")


def masks_alone(model: str, rows: int, steps: int, threads: int, busy_ms: float, schema_name: str) -> None:
    """The engine thread's cost of a step's masks each way, without a model: ``rows``
    matchers of the schema walk ``steps`` steps (each takes a seeded random token that
    its mask allows); per step, with the masks started the engine thread runs
    ``busy_ms`` of Python (as it queues the sampler) and then waits for them. Each way
    in turn, step by step: in the background (start, the Python, the wait) and in line
    (the computation in start_masks, then the Python). Reported: the engine thread's
    time besides the Python, ms per step (median, p90), and the tokens fed one by one."""
    import transformers

    from pagedcore.structured_outputs import MaskJob, StructuredOutputManager

    os.environ[MASK_THREADS_ENV] = str(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    vocab = json_config(model)["vocab_size"]
    manager = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = StructuredOutputsParams(json=SCHEMAS[schema_name])
    ways = {"background": True, "in line": False}
    sets = {way: [manager.new_matcher(spec) for _ in range(rows)] for way in ways}
    out = torch.empty((rows, manager.num_words), dtype=torch.int32)
    rng = np.random.default_rng(0)
    cost: dict[str, list[float]] = {way: [] for way in ways}
    computed: dict[str, list[float]] = {way: [] for way in ways}
    fed: list[float] = []

    def python_work() -> None:
        end = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:
            pass

    for t in range(steps):
        for way in (ways if t % 2 else list(ways)[::-1]):
            manager._choose_mask_way = lambda rows, b=ways[way]: b
            t0 = time.perf_counter()
            job: MaskJob = manager.start_masks(sets[way], out)
            t1 = time.perf_counter()
            python_work()
            t2 = time.perf_counter()
            job.wait()
            cost[way].append(1e3 * ((t1 - t0) + (time.perf_counter() - t2)))
            computed[way].append(1e3 * job.compute_seconds)
        bits = np.unpackbits(out.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = [int(rng.choice(np.nonzero(row)[0])) for row in bits]
        for way in ways:
            t0 = time.perf_counter()
            accepted = [m.ll.consume_token(token) for m, token in zip(sets[way], tokens)]
            fed.append(1e3 * (time.perf_counter() - t0))
            if not all(accepted):
                raise SystemExit(f"masks alone: a token refused at step {t}")
    print(f"masks alone: {rows} rows x {steps} steps, {schema_name} schema, pool of {threads} threads "
          f"({os.cpu_count()} CPUs), {busy_ms} ms of Python while they are computed; the engine thread's "
          f"time besides it, ms per step:")
    for way, xs in cost.items():
        print(f"  {way:10s}: median {statistics.median(xs):7.3f}, p90 {np.percentile(xs, 90):7.3f}, "
              f"mean {statistics.mean(xs):7.3f}")
    # NOTE: the job's compute time runs until llguidance's call has returned, which needs
    # the GIL: in the background, while the engine's thread runs Python, that waits for
    # the switch interval (the busy Python here never blocks); in line nothing competes.
    print("  llguidance's call until its thread had the GIL back, ms per step: "
          + ", ".join(f"{way} median {statistics.median(xs):.3f}" for way, xs in computed.items()))
    print(f"  tokens fed one by one: median {statistics.median(fed):7.3f}")


def json_config(model: str) -> dict:
    import json

    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--model", default=None, help="a model directory (default: the default model); with "
                    "--load-format dummy its config and tokenizer are enough")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async-scheduling", choices=("both", "on", "off"), default="both")
    ap.add_argument("--replay-steps", type=int, default=-1, help="steps of the replay (0: none; -1: every "
                    "step of the run)")
    ap.add_argument("--mask-way", choices=("auto", "background", "inline"), default="auto",
                    help="with a mask pool: the engine's choice by its trials (auto), or always one way")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded",
                    help="the items' strings: of at most 8 characters (bounded) or any (plain)")
    ap.add_argument("--masks-alone", type=int, default=0, metavar="STEPS",
                    help="instead of the engine: the masks' cost each way over STEPS steps, without a model "
                         "(see masks_alone; --requests rows, $PAGEDCORE_MASK_THREADS threads, default 2)")
    ap.add_argument("--busy-ms", type=float, default=1.5, help="--masks-alone: the Python run meanwhile")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval(S) first (CPython's default 0.005): how long a thread that "
                         "wants the GIL waits before the thread running Python must hand it over (the mask "
                         "thread needs it to take a job and to finish one)")
    ap.add_argument("--host-only", action="store_true",
                    help="the forward pass and the sampler replaced by stand-ins that cost almost nothing "
                         "(see host_only): each step times the engine thread's own work")
    ap.add_argument("--gil-probe", action="store_true",
                    help="a thread that sleeps 1 ms at a time during the runs; prints how late it gets the "
                         "GIL back (see GilProbe)")
    args = ap.parse_args()
    if args.host_only and args.device not in ("cpu", "auto"):
        raise SystemExit("--host-only runs on the CPU (--device cpu)")
    if args.switch_interval is not None:
        if not args.switch_interval > 0:
            raise SystemExit(f"--switch-interval must be > 0, got {args.switch_interval}")
        sys.setswitchinterval(args.switch_interval)
    print(f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms")
    if args.masks_alone:
        masks_alone(args.model or default_model_path(), args.requests, args.masks_alone,
                    int(os.environ.get(MASK_THREADS_ENV, "2")), args.busy_ms, args.schema)
        return

    prompts = [f"Request {i}: list some short words as JSON." for i in range(args.requests)]
    spec = StructuredOutputsParams(json=SCHEMAS[args.schema])
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, structured_outputs=spec)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.async_scheduling]
    replay_steps = args.max_tokens if args.replay_steps < 0 else args.replay_steps
    ratios = {}
    for mode in modes:
        llm = LLM(model=args.model or default_model_path(), device=args.device, load_format=args.load_format,
                  async_scheduling=mode)
        engine = llm.llm_engine
        if args.host_only:
            host_only(engine)
        timers = Timers(engine)
        llm.generate(prompts[:4], [free] * 4, use_tqdm=False)  # warm-up (and grammar compile)
        llm.generate(prompts[:4], [constrained] * 4, use_tqdm=False)
        timers.wrap_structured()
        name = f"async scheduling {'on' if mode else 'off'}"
        manager = engine._structured
        if args.mask_way != "auto":
            manager._choose_mask_way = lambda rows: args.mask_way == "background"
        print(f"== {name}: {args.requests} requests x {args.max_tokens} tokens on {engine.device}, "
              f"{args.schema} schema; masks: {manager.mask_threads} pool threads, {manager.num_lanes} lanes, "
              f"device wait {'on' if engine._bitmask_staging and engine._bitmask_staging.device_wait else 'off'}, "
              f"grammar worker {'cpp' if manager.worker is not None else 'pyo3'} "
              f"(${MASK_THREADS_ENV}, ${DEVICE_WAIT_ENV}, ${GRAMMAR_WORKER_ENV})")
        results = {}
        probe = GilProbe() if args.gil_probe else None
        for label, params in (("unconstrained", free), ("JSON schema", constrained)):
            if probe is not None:
                probe.take()
            wall, tokens, parts, outs = run(llm, timers, prompts, params, args.repeats)
            results[label] = (tokens / wall, outs)
            gpu = tuple(p for p in ("gpu execute", "gpu sample", "gpu wait") if p in parts)
            print(f"{label:14s} {tokens / wall:10.1f} output tokens/s ({wall:.3f} s); per step (ms): "
                  + " ".join(f"{p} {parts[p]:.3f}" for p in ("step",) + PARTS + ("compute",) + gpu))
            if probe is not None:
                late = np.array(probe.take()) * 1e3
                print(f"{'':14s} GIL probe ({len(late)} wake-ups of a thread sleeping {probe.period_s * 1e3:g} ms): "
                      f"late by median {np.median(late):.3f} ms, p90 {np.percentile(late, 90):.3f}, "
                      f"max {late.max():.3f}")
        if manager.background and manager.worker is None:
            rows = args.requests.bit_length()
            way = manager.mask_ways.get(rows)
            print(f"masks with the pool ({args.mask_way}; the engine's trials for {2 ** (rows - 1)}-"
                  f"{2 ** rows - 1} rows): " + ("none" if way is None or way.medians is None else
                  f"{'in the background' if way.background else 'in line'} chosen, engine-thread time per row: "
                  f"background {1e6 * way.medians[0]:.1f} us, in line {1e6 * way.medians[1]:.1f} us")
                  + ("" if way is None or way.trials is None else
                     f" (trials under way: {sum(map(len, way.trials.values()))} jobs done)"))
        ratios[name] = results["JSON schema"][0] / results["unconstrained"][0]
        if mode == modes[-1] and replay_steps and not args.host_only and manager.worker is None:  # (PyO3 only)
            replay(engine, spec, results["JSON schema"][1], replay_steps)
        if mode == modes[-1] and engine.device.type == "cuda":
            apply_alone(engine.device, args.requests, engine.spec.vocab_size)
        if mode == modes[-1] and not args.host_only:
            sampler_alone(engine.device, args.requests, engine.spec.vocab_size,
                          calls=50 if engine.device.type == "cuda" else 5)
        timers.close()
        if probe is not None:
            probe.close()
        del llm, engine, timers, results
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name, ratio in ratios.items():
        print(f"constrained / unconstrained throughput, {name}: {ratio:.3f} (target >= 0.90)")


if __name__ == "__main__":
    main()
