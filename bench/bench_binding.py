#!/usr/bin/env python3
"""Engine step through the Python binding: schedule() + update() in steady-state decode.

The same workload as bench_core's step cases (block_size 16, 128-token random
prompts, prefix caching on, max_num_seqs equal to the running count so that the
waiting requests never get in, max_tokens long enough that nothing finishes),
timed through ``pagedcore.Engine`` at 64 / 256 / 1024 running sequences with 0
and 10,000 waiting requests, in three variants:

  (a) ``engine.schedule()`` + ``engine.update(sampled)`` only;
  (b) (a) plus creating the numpy views a model runner reads: input_ids,
      positions, slot_mapping, block_tables, seq_lens, query_start_loc,
      sample_indices;
  (c) (b) plus copying those views into preallocated staging arrays with
      ``np.copyto`` (what a runner does before the host-to-device copy).

The variants take turns on the same engine in blocks of BLOCK_STEPS steps, so
that they see the same context lengths (taking turns step by step would let the
copies of (c) evict the cache lines that the next (a) step reads). Each number
is the median over many steps after a warm-up, with the garbage collector off
while timing. Inputs come from fixed seeds; every step checks that the batch
really holds `running` decode rows and that nothing finished or got in. With ``--cpp-bench PATH/TO/bench_core`` the C++ median of the same case
over the same steps (``bench_core --step R W STEPS WARMUP``) is shown next to
them, so the binding's own cost is visible.

Usage: bench_binding.py [--quick] [--cpp-bench build/bench/bench/bench_core]
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import subprocess
import sys
import time

import numpy as np

import pagedcore

SEED = 20240601
VOCAB = 32000
BLOCK_SIZE = 16
PROMPT_LEN = 128
POOL_STEPS = 61  # distinct rows of sampled tokens, used in turn
BLOCK_STEPS = 25  # consecutive steps of one variant
MAX_BATCHED_TOKENS = 8192
RUNNING = (64, 256, 1024)
WAITING = (0, 10_000)
VARIANTS = ("a", "b", "c")


def fail(msg: str) -> None:
    print(f"bench_binding: check failed: {msg}", file=sys.stderr)
    sys.exit(2)


def make_engine(running: int, waiting: int, steps_needed: int):
    """An engine with `running` sequences in decode and `waiting` queued ones."""
    # The first sequences to finish their prompt decode while the others
    # prefill, taking one token of each step's budget each.
    prefill_steps = -(-running * PROMPT_LEN // max(1, MAX_BATCHED_TOKENS - running)) + 2
    max_model_len = PROMPT_LEN + steps_needed + prefill_steps + 64
    max_blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    engine = pagedcore.Engine(
        num_blocks=running * max_blocks_per_seq + 64,  # nothing is ever preempted
        block_size=BLOCK_SIZE,
        max_num_seqs=running,  # every seat taken: waiting requests stay waiting
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
    )
    rng = np.random.default_rng(SEED + 1000 * running + waiting)
    params = pagedcore.RequestParams(max_tokens=max_model_len - PROMPT_LEN, ignore_eos=True)
    prompts = rng.integers(1, VOCAB, size=(running, PROMPT_LEN), dtype=np.int32)
    for i in range(running):
        engine.add_request(f"run-{i}", prompts[i].tolist(), params)

    pool = rng.integers(1, VOCAB, size=(POOL_STEPS, running), dtype=np.int32)
    rows = [np.ascontiguousarray(pool[i]) for i in range(POOL_STEPS)]

    # Prefill until every sequence decodes.
    for guard in range(prefill_steps + 16):
        b = engine.schedule()
        all_decode = b.num_seqs == running and b.num_decode_seqs == running
        engine.update(rows[guard % POOL_STEPS][: b.num_samples])
        if all_decode:
            break
    else:
        fail("prefill did not finish")
    st = engine.stats()
    if st.num_running_seqs != running or st.num_waiting_seqs != 0 or st.num_preemptions != 0:
        fail(f"after prefill: {st.num_running_seqs} running, {st.num_waiting_seqs} waiting")

    wprompts = rng.integers(1, VOCAB, size=(waiting, PROMPT_LEN), dtype=np.int32)
    for i in range(waiting):
        engine.add_request(f"wait-{i}", wprompts[i].tolist(), params)
    if engine.stats().num_waiting_seqs != waiting:
        fail("waiting requests not queued")
    return engine, rows


def bench_case(running: int, waiting: int, warmup: int, per_variant: int) -> dict[str, float]:
    # Whole rounds of blocks, so that every variant gets per_variant timed steps.
    warmup = -(-warmup // (BLOCK_STEPS * len(VARIANTS))) * BLOCK_STEPS * len(VARIANTS)
    per_variant = -(-per_variant // BLOCK_STEPS) * BLOCK_STEPS
    total = warmup + per_variant * len(VARIANTS)
    engine, rows = make_engine(running, waiting, total + 16)
    max_blocks = engine.config.max_blocks_per_seq
    # Staging buffers of variant (c), sized for the whole batch.
    st_ids = np.empty(running, np.int32)
    st_pos = np.empty(running, np.int32)
    st_slots = np.empty(running, np.int32)
    st_tables = np.empty((running, max_blocks), np.int32)
    st_lens = np.empty(running, np.int32)
    st_qsl = np.empty(running + 1, np.int32)
    st_samples = np.empty(running, np.int32)

    def check(b, r) -> None:
        if not (b.num_seqs == running and b.num_decode_seqs == running and b.num_tokens == running
                and b.num_samples == running and b.num_block_copies == 0):
            fail(f"batch has {b.num_seqs} seqs ({b.num_decode_seqs} decode), {b.num_tokens} "
                 f"tokens, {b.num_samples} samples; expected {running} decode rows")
        if r.num_outputs != running or r.finished_request_ids:
            fail(f"update: {r.num_outputs} outputs, {len(r.finished_request_ids)} finished")

    times: dict[str, list[int]] = {v: [] for v in VARIANTS}
    perf = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for i in range(total):
            sampled = rows[i % POOL_STEPS]
            v = (i // BLOCK_STEPS) % len(VARIANTS)
            if v == 0:
                t0 = perf()
                b = engine.schedule()
                r = engine.update(sampled)
                t1 = perf()
            elif v == 1:
                t0 = perf()
                b = engine.schedule()
                ids = b.input_ids
                pos = b.positions
                slots = b.slot_mapping
                tables = b.block_tables
                lens = b.seq_lens
                qsl = b.query_start_loc
                samples = b.sample_indices
                r = engine.update(sampled)
                t1 = perf()
            else:
                t0 = perf()
                b = engine.schedule()
                ids = b.input_ids
                pos = b.positions
                slots = b.slot_mapping
                tables = b.block_tables
                lens = b.seq_lens
                qsl = b.query_start_loc
                samples = b.sample_indices
                np.copyto(st_ids, ids)
                np.copyto(st_pos, pos)
                np.copyto(st_slots, slots)
                np.copyto(st_tables, tables)
                np.copyto(st_lens, lens)
                np.copyto(st_qsl, qsl)
                np.copyto(st_samples, samples)
                r = engine.update(sampled)
                t1 = perf()
            # Checked outside the timed region (the batch stays readable until
            # the next schedule()).
            check(b, r)
            if v == 2 and not (st_lens[0] == b.seq_lens[0] and st_qsl[-1] == running):
                fail("staging copy does not match the batch")
            if i >= warmup:
                times[VARIANTS[v]].append(t1 - t0)
    finally:
        gc.enable()
    if any(len(t) != per_variant for t in times.values()):
        fail(f"timed {[len(t) for t in times.values()]} steps, expected {per_variant} each")
    st = engine.stats()
    if (st.num_running_seqs != running or st.num_waiting_seqs != waiting
            or st.num_preemptions != 0):
        fail(f"after measuring: {st.num_running_seqs} running, {st.num_waiting_seqs} waiting, "
             f"{st.num_preemptions} preemptions")
    out = {v: statistics.median(t) / 1e3 for v, t in times.items()}
    out["ctx"] = int(b.seq_lens[0])
    out["warmup"] = warmup
    out["steps"] = per_variant * len(VARIANTS)
    return out


def cpp_step_us(cpp_bench: str, running: int, waiting: int, steps: int,
                warmup: int) -> float | None:
    """Median step time of the same case in C++, over the same range of steps
    (hence of context lengths) as each Python variant."""
    try:
        proc = subprocess.run([cpp_bench, "--step", str(running), str(waiting), str(steps),
                               str(warmup)],
                              check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"bench_binding: could not run {cpp_bench}: {e}", file=sys.stderr)
        return None
    m = re.search(r"median ([0-9.]+) us", proc.stdout)
    return float(m.group(1)) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    ap.add_argument("--cpp-bench", metavar="PATH",
                    help="bench_core binary: show the C++ step time of each case too")
    args = ap.parse_args()
    # Rounded up to whole rounds of BLOCK_STEPS-step blocks in bench_case.
    warmup = 75 if args.quick else 150
    per_variant = 100 if args.quick else 400

    print(f"bench_binding: pagedcore {pagedcore.__version__} from {pagedcore.__file__}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}; {warmup} warm-up steps, "
          f"{per_variant} timed steps per variant (in turns of {BLOCK_STEPS} steps), "
          "gc off while timing")
    print("(a) schedule()+update()  (b) (a) + 7 numpy views  (c) (b) + np.copyto of the views\n")

    header = (f"{'running':>8} {'waiting':>8} {'C++ us':>8} {'(a) us':>8} {'(b) us':>8} "
              f"{'(c) us':>8} {'a-C++ us':>9} {'b-a us':>7} {'c-b us':>7} {'(a) ns/seq':>11} "
              f"{'context':>8}")
    print(header, flush=True)
    lines = []
    for running in RUNNING:
        for waiting in WAITING:
            r = bench_case(running, waiting, warmup, per_variant)
            cpp = (cpp_step_us(args.cpp_bench, running, waiting, r["steps"], r["warmup"])
                   if args.cpp_bench else None)
            cpp_s = f"{cpp:8.2f}" if cpp is not None else f"{'-':>8}"
            over_s = f"{r['a'] - cpp:9.2f}" if cpp is not None else f"{'-':>9}"
            line = (f"{running:8d} {waiting:8d} {cpp_s} {r['a']:8.2f} {r['b']:8.2f} {r['c']:8.2f} "
                    f"{over_s} {r['b'] - r['a']:7.2f} {r['c'] - r['b']:7.2f} "
                    f"{r['a'] * 1e3 / running:11.1f} {r['ctx']:8d}")
            lines.append(line)
            print(line, flush=True)
    print("\n" + header)
    print("-" * len(header))
    for line in lines:
        print(line)
    print(f"\nC++: bench_core --step R W {r['steps']} {r['warmup']}: the same steps "
          "(context lengths) in C++.\ncontext: tokens per sequence at the last timed step.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
