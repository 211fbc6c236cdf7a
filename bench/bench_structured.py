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
  tokens to the grammar matchers
- ``masks``: the grammar bitmasks of a step (``_add_token_bitmask``), of which
  ``compute`` is llguidance's and ``copy`` the rest (rows, staging, the copy queued)
- ``sample``: the sampler's call (its kernels launched on CUDA, run on the CPU)

and the rest of ``step()`` as ``other``; on CUDA also ``gpu execute`` and ``gpu sample``,
the device's time of the forward pass and of the sampler (CUDA events around them):
for the rest of a step the device waits for the host. Then a replay of the constrained run's
own tokens through fresh matchers times llguidance alone on this host, step by step
over the same 64 rows: one mask at a time on one thread, a step's masks on
llguidance's thread pool (1, 2, 4, 8 threads and its default), and, on CUDA, what
pinning a fresh mask buffer per step cost before the staging buffers.

Usage: python bench/bench_structured.py [--requests 64] [--max-tokens 256] [--device cuda]
       [--load-format dummy --model DIR] [--async-scheduling both|on|off]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from pagedcore import LLM, SamplingParams, default_model_path
from pagedcore import llm_engine
from pagedcore import structured_outputs
from pagedcore.structured_outputs import StructuredOutputsParams

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
PARTS = ("execute", "wait", "process", "advance", "masks", "compute", "copy", "sample", "other")


class Timers:
    """Wall time of the engine's step pieces, by wrapping them (ms totals)."""

    def __init__(self, engine) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._wrap(engine, "step", "step")
        self._wrap(engine, "_advance_matcher", "advance")
        self._wrap(engine, "_process", "process")
        self._wrap(engine, "_add_token_bitmask", "masks")
        self._wrap(engine.runner, "execute", "execute")
        self._engine = engine
        self._cuda = engine.device.type == "cuda"
        self._events: list = []  # (part, start, end) CUDA events, read after each run
        sampler = engine.sampler
        engine.sampler = lambda *a, **kw: self._timed("sample", sampler, *a, **kw)
        global _WAIT
        if _WAIT is None:  # (the class is patched once; each engine's timers take their turn)
            _WAIT = llm_engine._HostCopy.wait
        llm_engine._HostCopy.wait = lambda copy: self._timed("wait", _WAIT, copy)
        self._structured_wrapped = False

    def wrap_structured(self) -> None:
        """The grammar manager exists once a constrained request came (the warm-up)."""
        manager = self._engine._structured
        if manager is None or self._structured_wrapped:
            return
        # (fill_bitmask: computes into the staging buffer; bitmask: before that, a fresh tensor)
        name = "fill_bitmask" if hasattr(manager, "fill_bitmask") else "bitmask"
        self._wrap(manager, name, "compute")
        self._structured_wrapped = True

    def _wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, **kw: self._timed(part, fn, *a, **kw))

    def _timed(self, part: str, fn, *args, **kwargs):
        gpu = self._cuda and part in ("execute", "sample")
        if gpu:  # the device's time of the forward pass and of the sampler, from events around them
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.total[part] += 1e3 * (time.perf_counter() - t0)
            if part == "step":
                self.steps += 1
            if gpu:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((f"gpu {part}", start, end))

    def close(self) -> None:
        """Restores the class-level hook, so that nothing keeps this engine alive (on
        CUDA the next mode's engine needs its memory)."""
        llm_engine._HostCopy.wait = _WAIT
        self._engine = None

    def reset(self) -> None:
        self.total.clear()
        self.steps = 0
        self._events.clear()

    def per_step(self) -> dict[str, float]:
        if self._events:
            torch.cuda.synchronize()
            for part, start, end in self._events:
                self.total[part] += start.elapsed_time(end)
            self._events.clear()
        t, n = self.total, max(self.steps, 1)
        parts = {p: t.get(p, 0.0) / n for p in PARTS if p not in ("copy", "other")}
        parts["copy"] = parts["masks"] - parts["compute"]
        # (advance is inside process, compute and copy inside masks)
        parts["other"] = t.get("step", 0.0) / n - sum(parts[p] for p in ("execute", "wait", "process",
                                                                        "masks", "sample"))
        parts["step"] = t.get("step", 0.0) / n
        if self._cuda:
            # (the device is idle for the rest of a step: waiting for the host to launch)
            parts["gpu execute"] = t.get("gpu execute", 0.0) / n
            parts["gpu sample"] = t.get("gpu sample", 0.0) / n
        return parts


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
    rows = [list(c.token_ids) for o in outs for c in o.outputs]
    b, words = len(rows), manager.num_words
    nbytes = 4 * words
    steps = min(steps, min(len(r) for r in rows))
    threads = [1, 2, 4, 8, None]
    modes = ["one thread"] + [f"pool({t or 'default'})" for t in threads]
    executors = {f"pool({t or 'default'})": llguidance.LLExecutor(t) for t in threads}
    # One matcher set per mode, advanced in lockstep: a mask is computed once per state.
    sets = {m: [manager.new_matcher(spec) for _ in range(b)] for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    out = torch.empty((b, words), dtype=torch.int32)
    for t in range(steps):
        for m in (modes if t % 2 else modes[::-1]):  # (alternating order: neither is always first)
            ms = sets[m]
            t0 = time.perf_counter()
            if m == "one thread":
                for r, matcher in enumerate(ms):
                    matcher.unsafe_compute_mask_ptr(out.data_ptr() + r * nbytes, nbytes)
            else:
                executors[m].unsafe_compute_mask_ptr([(x, r) for r, x in enumerate(ms)], out.data_ptr(), nbytes, b)
            times[m].append(1e3 * (time.perf_counter() - t0))
        for m in modes:
            for matcher, row in zip(sets[m], rows):
                if not matcher.consume_token(row[t]):
                    raise SystemExit(f"replay: token {row[t]} refused at step {t}")
    threads = getattr(manager, "_mask_threads", None)  # (before PAGEDCORE_MASK_THREADS: the default pool)
    engine_uses = {None: "pool(default)", 0: "one thread"}.get(threads, f"pool({threads})")
    env = getattr(structured_outputs, "MASK_THREADS_ENV", "PAGEDCORE_MASK_THREADS")
    print(f"replay of the constrained run's tokens, llguidance alone ({b} rows x {steps} steps, "
          f"{os.cpu_count()} CPUs; the engine uses {engine_uses}, ${env} sets it):")
    # (the first steps visit new grammar states, whose lexer states llguidance builds then)
    early = min(8, steps // 2)
    for m in modes:
        xs = times[m]
        print(f"  {m:14s} {b} masks: median {statistics.median(xs):7.3f} ms, mean {statistics.mean(xs):7.3f} ms "
              f"(first {early} steps {statistics.mean(xs[:early]):7.3f}, later {statistics.mean(xs[early:]):7.3f}), "
              f"p90 {np.percentile(xs, 90):7.3f} ms; per mask {1e3 * statistics.median(xs) / b:7.1f} us (median)")
    # One mask in a few grammar states (median of 20, each on a fresh copy: no cache).
    for prefix in ('{"items": [', '{"items": ["', '{"items": ["ab'):
        matcher = manager.new_matcher(spec)
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
    if engine.device.type == "cuda":
        # What the masks' path did before the staging buffers: a fresh tensor pinned and copied each step.
        pinned = []
        for _ in range(50):
            t0 = time.perf_counter()
            torch.empty((b, words), dtype=torch.int32).pin_memory().to(engine.device, non_blocking=True)
            pinned.append(1e3 * (time.perf_counter() - t0))
        print(f"  a fresh [{b}, {words}] int32 buffer pinned and its copy queued: median "
              f"{statistics.median(pinned):.3f} ms")


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
    ap.add_argument("--replay-steps", type=int, default=64, help="steps of the replay (0: none)")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded",
                    help="the items' strings: of at most 8 characters (bounded) or any (plain)")
    args = ap.parse_args()

    prompts = [f"Request {i}: list some short words as JSON." for i in range(args.requests)]
    spec = StructuredOutputsParams(json=SCHEMAS[args.schema])
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, structured_outputs=spec)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.async_scheduling]
    ratios = {}
    for mode in modes:
        llm = LLM(model=args.model or default_model_path(), device=args.device, load_format=args.load_format,
                  async_scheduling=mode)
        engine = llm.llm_engine
        timers = Timers(engine)
        llm.generate(prompts[:4], [free] * 4, use_tqdm=False)  # warm-up (and grammar compile)
        llm.generate(prompts[:4], [constrained] * 4, use_tqdm=False)
        timers.wrap_structured()
        name = f"async scheduling {'on' if mode else 'off'}"
        print(f"== {name}: {args.requests} requests x {args.max_tokens} tokens on {engine.device}, "
              f"{args.schema} schema")
        results = {}
        for label, params in (("unconstrained", free), ("JSON schema", constrained)):
            wall, tokens, parts, outs = run(llm, timers, prompts, params, args.repeats)
            results[label] = (tokens / wall, outs)
            gpu = tuple(p for p in ("gpu execute", "gpu sample") if p in parts)
            print(f"{label:14s} {tokens / wall:10.1f} output tokens/s ({wall:.3f} s); per step (ms): "
                  + " ".join(f"{p} {parts[p]:.3f}" for p in ("step",) + PARTS + gpu))
        ratios[name] = results["JSON schema"][0] / results["unconstrained"][0]
        if mode == modes[-1] and args.replay_steps:
            replay(engine, spec, results["JSON schema"][1], args.replay_steps)
        timers.close()
        del llm, engine, timers, results
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name, ratio in ratios.items():
        print(f"constrained / unconstrained throughput, {name}: {ratio:.3f} (target >= 0.90)")


if __name__ == "__main__":
    main()
