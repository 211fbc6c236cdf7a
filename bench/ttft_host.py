"""Where the host's time goes while one prompt gets its first token (issue 12).

    python bench/ttft_host.py --shape llama3-8b --device cuda [--tokens 4096]
    python bench/ttft_host.py --shape tiny --device cpu        (a dry run)

Random weights in the shape's config (as bench_e2e_gpu.py), prefix caching off. Wraps
the engine's and the runner's methods with perf_counter timers and runs generate() of
one prompt (max_tokens 1) five times after two warm-ups: each method's median time, the
last run's timeline (ms from the generate() call: when each method started and ended;
on CUDA the host waits in _resolve_launched until the GPU is done), then a cProfile of
one more run by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e_gpu  # noqa: E402

import pagedcore.model_runner as model_runner  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402

ENGINE_METHODS = ("add_request", "_schedule", "_sampling_metadata", "_resolve_launched", "_process",
                  "_compact_rows")
RUNNER_METHODS = ("execute", "_replay_prefill", "_staging_free", "_deferred_indices", "_move_blocks")
RUNS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(bench_e2e_gpu.SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    fields = dict(bench_e2e_gpu.SHAPES[args.shape][0])
    if args.shape == "tiny":
        fields["vocab_size"] = 128256  # (the 8B shape's vocabulary: its sampler's size)
    root = Path(tempfile.mkdtemp())
    bench_e2e_gpu.checkpoint_dir(fields, root)
    cuda = args.device == "cuda"
    llm = LLM(model=str(root), load_format="dummy", dtype="bfloat16" if cuda else "float32", device=args.device,
              max_model_len=args.tokens + 256, gpu_memory_utilization=0.85, enable_prefix_caching=False)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    times: dict[str, list[float]] = defaultdict(list)
    marks: list[tuple[str, float, float]] = []

    def wrap(obj, name: str, label: str | None = None) -> None:
        fn, label = getattr(obj, name), label or name

        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                end = time.perf_counter()
                times[label].append(end - start)
                marks.append((label, start, end))

        setattr(obj, name, timed)

    for name in ENGINE_METHODS:
        if hasattr(engine, name):
            wrap(engine, name)
    wrap(engine, "sampler")
    for name in RUNNER_METHODS:
        wrap(runner, name)
    wrap(model_runner.ops, "plan_attention")
    wrap(runner.model, "compute_logits")

    rng = np.random.default_rng(0)
    prompt = [{"prompt_token_ids": rng.integers(3, fields["vocab_size"], args.tokens).tolist()}]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run() -> tuple[float, float]:
        marks.clear()
        sync()
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        sync()
        return start, time.perf_counter()

    for _ in range(2):
        run()
    times.clear()
    walls, timeline = [], []
    for _ in range(RUNS):
        start, end = run()
        walls.append(end - start)
        timeline = [(label, (s - start) * 1e3, (e - start) * 1e3) for label, s, e in marks]
    print(f"{args.shape}, {args.tokens}-token prompt on {args.device}: wall median "
          f"{statistics.median(walls) * 1e3:.2f} ms ({', '.join(f'{w * 1e3:.2f}' for w in walls)})")
    for label, values in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {label:22s} median {statistics.median(values) * 1e3:8.3f} ms, {len(values) / RUNS:.1f} calls a run")
    print("the last run's timeline (ms from the generate() call):")
    for label, s, e in sorted(timeline, key=lambda row: row[1]):
        print(f"  {s:8.3f} - {e:8.3f}  {label}")
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    for key, count in (("cumtime", 40), ("tottime", 20)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(count)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
