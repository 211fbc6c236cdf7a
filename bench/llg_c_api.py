#!/usr/bin/env python3
"""llguidance's C API, as the installed wheel exports it, driven without PyO3: the probe
for a mask worker in C++ that needs no GIL (issue 15; see bench_structured --gil-probe).

The wheel's ``_lib.abi3.so`` exports llguidance's C functions (``llg_new_tokenizer``,
``llg_new_matcher``, ``llg_clone_matcher``, ``llg_matcher_consume_token``,
``llg_matcher_compute_mask_into``, ``llg_matcher_is_stopped``, ...). This loads it with
ctypes (which leaves the GIL during each call), builds the tokenizer from the model's
``tokenizer.json``, a matcher from the grammar text StructuredOutputManager compiles
(constraint type "llguidance"), and checks that its masks equal those of the PyO3
``LLMatcher`` over a few prefixes; then times, on one thread, ``--rows`` clones walking
``--steps`` steps of seeded random allowed tokens: the masks, and the tokens fed one by
one (ctypes' call overhead included, ~1 us a call).

NOTE: this probe builds the tokenizer without a tokenize function (greedy): llguidance
then does not call it canonical, and where a grammar forces bytes its masks allow more
than the engine's PyO3 matchers (a choice "maybe not": " no" after "maybe"); the three
prefixes checked here do not show it. pagedcore._C.LlgWorker (cpp/grammar) passes the
engine's tokenizer and matches the PyO3 masks (tests/python/test_llg_worker.py).

NOTE: the structures below follow llguidance's ``parser/llguidance.h`` (``LlgTokenizerInit``);
they must match the installed version's (1.9.1 here). ``LlgConstraintInit`` is filled by
``llg_constraint_init_set_defaults`` into a buffer larger than it.

With ``--worker``: instead, pagedcore's C++ grammar worker (``pagedcore._C.LlgWorker``,
which drives this C API from C++) against the engine's current way, with the GIL
contended as in the engine: per step the engine's thread hands the step's work to a
thread and runs ``--busy-ms`` of pure Python meanwhile, watching the pinned "masks
ready" word as the device would (no GIL needed to read it). Current way: the tokens fed
to the PyO3 matchers on the engine's thread, the masks on StructuredOutputManager's
background pool (``--threads``), the word written by the job's release (Python). Worker:
``LlgWorker.start_step`` (the step on the worker's own C++ thread: consume, masks over
``--threads`` C++ threads, the word stored from C++; no GIL), later ``wait_step``; with
``--python-thread``, ``LlgWorker.step`` on a Python thread instead. Both replay the same seeded
walk of allowed tokens (the masks are checked equal). Reported, ms per step (median,
p90): when the word was seen set after the hand-over, and the engine thread's time
besides the Python.

Usage: python bench/llg_c_api.py [--model DIR] [--rows 64] [--steps 40]
       python bench/llg_c_api.py --worker [--rows 64] [--steps 40] [--threads 2] [--busy-ms 1.5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np


class TokenizerInit(ctypes.Structure):
    _fields_ = [("vocab_size", ctypes.c_uint32), ("tok_eos", ctypes.c_uint32),
                ("token_lens", ctypes.c_void_p), ("token_bytes", ctypes.c_void_p),
                ("tokenizer_json", ctypes.c_char_p), ("tokenize_assumes_string", ctypes.c_bool),
                ("tokenize_fn", ctypes.c_void_p), ("use_approximate_greedy_tokenize_fn", ctypes.c_bool),
                ("tokenize_user_data", ctypes.c_void_p), ("slices", ctypes.c_void_p)]


def load() -> ctypes.CDLL:
    import llguidance

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llguidance.__file__), "_lib.abi3.so"))
    p, i32, size = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
    for name, restype, argtypes in (
            ("llg_new_tokenizer", p, [ctypes.POINTER(TokenizerInit), ctypes.c_char_p, size]),
            ("llg_constraint_init_set_defaults", None, [p, p]),
            ("llg_new_matcher", p, [p, ctypes.c_char_p, ctypes.c_char_p]),
            ("llg_matcher_get_error", ctypes.c_char_p, [p]),
            ("llg_clone_matcher", p, [p]),
            ("llg_matcher_compute_mask_into", i32, [p, p, size]),
            ("llg_matcher_consume_token", i32, [p, ctypes.c_uint32]),
            ("llg_matcher_is_stopped", ctypes.c_bool, [p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def worker_vs_pyo3(model: str, rows: int, steps: int, threads: int, busy_ms: float, thread_way: bool) -> None:
    """See the module's docstring (--worker)."""
    import queue
    import sys
    import threading

    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_structured import SCHEMAS

    import llguidance

    from pagedcore import _C
    from pagedcore.structured_outputs import MASK_THREADS_ENV, StructuredOutputManager, StructuredOutputsParams, \
        _grammar_text, _llg_library_path

    os.environ[MASK_THREADS_ENV] = str(threads)
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    eos = [tokenizer.eos_token_id]
    manager = StructuredOutputManager(tokenizer, vocab, eos)
    spec = StructuredOutputsParams(json=SCHEMAS["bounded"])
    lib = _C.LlgLibrary.open(_llg_library_path(llguidance))
    worker = _C.LlgWorker(lib, tokenizer.backend_tokenizer.to_str(), vocab, eos, threads,
                          manager._tokenizer.tokenize_bytes)
    grammar = _grammar_text(spec.key)
    lanes = [worker.new_matcher("llguidance", grammar, lane) for lane in range(threads)]
    handles = np.array([worker.clone_matcher(lanes[r % threads]) for r in range(rows)], dtype=np.int64)
    matchers = [manager.new_matcher(spec) for _ in range(rows)]
    words = manager.num_words
    py_masks = torch.zeros((rows, words), dtype=torch.int32)
    c_masks = np.zeros((rows, words), dtype=np.int32)
    status, stopped = np.zeros(rows, np.uint8), np.zeros(rows, np.uint8)
    flag = np.zeros(1, dtype=np.uint32)
    tokens = np.full(rows, -1, dtype=np.int32)
    rng = np.random.default_rng(0)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    started, finished = threading.Event(), threading.Event()

    def worker_thread() -> None:
        while (job := jobs.get()) is not None:
            started.set()
            worker.step(handles, tokens, c_masks, status, stopped, flag, job)
            finished.set()

    if thread_way:
        threading.Thread(target=worker_thread, daemon=True).start()

    def python_while_waiting(ticket: int, t0: float) -> float | None:
        seen, end = None, time.perf_counter() + busy_ms / 1e3
        while (now := time.perf_counter()) < end:
            if seen is None and flag[0] == ticket:
                seen = now - t0
        return seen

    ready: dict[str, list[float]] = {"current": [], "worker": []}
    engine: dict[str, list[float]] = {"current": [], "worker": []}
    for t in range(1, steps + 1):
        for way in (("current", "worker") if t % 2 else ("worker", "current")):
            ticket = 2 * t + (way == "worker")
            t0 = time.perf_counter()
            if way == "current":
                if t > 1 and not all(m.ll.consume_token(int(k)) for m, k in zip(matchers, tokens)):
                    raise SystemExit(f"step {t}: a token refused by the PyO3 matchers")
                job = manager.start_masks(matchers, py_masks, release=lambda k=ticket: flag.__setitem__(0, k))
                manager._choose_mask_way = lambda n: True  # (always the background)
            elif thread_way:
                started.clear()
                finished.clear()
                jobs.put(ticket)
                started.wait()  # (as start_masks: the thread needs the GIL to start)
            else:
                worker.start_step(handles, tokens, c_masks, status, stopped, flag, ticket)
            t1 = time.perf_counter()
            seen = python_while_waiting(ticket, t0)
            t2 = time.perf_counter()
            if way == "current":
                job.wait()
            elif thread_way:
                finished.wait()
            else:
                worker.wait_step()
            while flag[0] != ticket:
                pass
            if seen is None:
                seen = time.perf_counter() - t0
            ready[way].append(1e3 * seen)
            engine[way].append(1e3 * ((t1 - t0) + (time.perf_counter() - t2)))
        if not (np.array_equal(py_masks.numpy(), c_masks) and not status.any()):
            raise SystemExit(f"step {t}: the worker's masks differ from the PyO3 matchers'")
        bits = np.unpackbits(c_masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens[:] = [int(rng.choice(np.flatnonzero(row))) for row in bits]
    print(f"{rows} rows x {steps} steps, bounded schema, {threads} threads, {os.cpu_count()} CPUs, "
          f"{busy_ms} ms of Python on the engine's thread meanwhile (masks equal each step), worker "
          f"{'step on a Python thread' if thread_way else 'start_step/wait_step'}; ms per step:")
    for way in ready:
        print(f"  {way:8s}: masks ready seen after median {statistics.median(ready[way]):7.3f} "
              f"(p90 {np.percentile(ready[way], 90):7.3f}); engine thread besides the Python "
              f"median {statistics.median(engine[way]):7.3f} (p90 {np.percentile(engine[way], 90):7.3f})")
    print(f"  worker tokenize callbacks (cache misses): {worker.tokenize_calls()}")
    print(f"  ratio current/worker, ready: {statistics.median(ready['current']) / statistics.median(ready['worker']):.2f}")
    jobs.put(None)
    worker.wait_step()


def main() -> None:
    import sys

    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_structured import SCHEMAS

    from pagedcore import default_model_path
    from pagedcore.structured_outputs import (GRAMMAR_WORKER_ENV, StructuredOutputManager, StructuredOutputsParams,
                                              _grammar_text)

    # The probe compares against the PyO3 way's manager (its LLMatchers, its mask pool),
    # whatever the engine's default.
    os.environ[GRAMMAR_WORKER_ENV] = "pyo3"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a directory with tokenizer.json and config.json")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worker", action="store_true", help="the C++ worker against the current way (see above)")
    ap.add_argument("--threads", type=int, default=2, help="--worker: threads of each way")
    ap.add_argument("--busy-ms", type=float, default=1.5, help="--worker: the Python run meanwhile")
    ap.add_argument("--python-thread", action="store_true",
                    help="--worker: LlgWorker.step on a Python thread instead of start_step/wait_step")
    args = ap.parse_args()
    model = args.model or default_model_path()
    if args.worker:
        worker_vs_pyo3(model, args.rows, args.steps, args.threads, args.busy_ms, args.python_thread)
        return
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    words = (vocab + 31) // 32
    lib = load()
    with open(os.path.join(model, "tokenizer.json"), "rb") as f:
        init = TokenizerInit(vocab_size=vocab, tok_eos=tokenizer.eos_token_id, tokenizer_json=f.read(),
                             # (no tokenize_fn: llguidance tokenizes forced strings greedily then;
                             # a C++ worker would pass the model tokenizer's)
                             use_approximate_greedy_tokenize_fn=True)
    error = ctypes.create_string_buffer(1024)
    llg_tokenizer = lib.llg_new_tokenizer(ctypes.byref(init), error, len(error))
    if not llg_tokenizer:
        raise SystemExit(f"llg_new_tokenizer: {error.value.decode()}")
    constraint_init = ctypes.create_string_buffer(1024)
    lib.llg_constraint_init_set_defaults(constraint_init, llg_tokenizer)
    spec = StructuredOutputsParams(json=SCHEMAS["bounded"])
    template = lib.llg_new_matcher(constraint_init, b"llguidance", _grammar_text(spec.key).encode())
    if lib.llg_matcher_get_error(template):
        raise SystemExit(f"llg_new_matcher: {lib.llg_matcher_get_error(template).decode()}")

    manager = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])
    for prefix in ('{"items": [', '{"items": ["', '{"items": ["ab'):
        c_matcher, py_matcher = lib.llg_clone_matcher(template), manager.new_matcher(spec).ll
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            if lib.llg_matcher_consume_token(c_matcher, token) != 0 or not py_matcher.consume_token(token):
                raise SystemExit(f"{prefix!r} refused")
        c_mask, py_mask = np.zeros(words, dtype=np.uint32), np.zeros(words, dtype=np.uint32)
        lib.llg_matcher_compute_mask_into(c_matcher, c_mask.ctypes.data, 4 * words)
        py_matcher.unsafe_compute_mask_ptr(py_mask.ctypes.data, 4 * words)
        print(f"after {prefix!r:16s}: C API and PyO3 masks {'equal' if (c_mask == py_mask).all() else 'DIFFER'} "
              f"({int(np.bitwise_count(c_mask).sum())} tokens allowed)")

    matchers = [lib.llg_clone_matcher(template) for _ in range(args.rows)]
    masks = np.zeros((args.rows, words), dtype=np.uint32)
    rng = np.random.default_rng(0)
    mask_ms, consume_ms = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for row, matcher in enumerate(matchers):
            if lib.llg_matcher_compute_mask_into(matcher, masks[row].ctypes.data, 4 * words) != 0:
                raise SystemExit(f"mask: {lib.llg_matcher_get_error(matcher).decode()}")
        mask_ms.append(1e3 * (time.perf_counter() - t0))
        tokens = []
        for row in masks:
            word = int(rng.choice(np.flatnonzero(row)))
            bits = np.flatnonzero((int(row[word]) >> np.arange(32)) & 1)
            tokens.append(32 * word + int(rng.choice(bits)))
        t0 = time.perf_counter()
        for matcher, token in zip(matchers, tokens):
            if lib.llg_matcher_consume_token(matcher, token) != 0:
                raise SystemExit(f"consume: {lib.llg_matcher_get_error(matcher).decode()}")
        consume_ms.append(1e3 * (time.perf_counter() - t0))
    print(f"{args.rows} rows x {args.steps} steps on one thread through the C API: masks median "
          f"{statistics.median(mask_ms):.3f} ms a step, tokens fed median {statistics.median(consume_ms):.3f} ms")


if __name__ == "__main__":
    main()
