#!/usr/bin/env python3
"""Host time on the critical path between decode steps, with and without async
output processing (any machine; the CPU stands in for the device).

On a GPU the device waits from the moment a step's sampled tokens reach the host
until the next step's forward pass is launched. This benchmark measures that
host span directly: from the engine's ``update`` call (the tokens have just
arrived) to the next ``forward`` call of the model, per decode step. The model
is a 1-layer, 64-wide stand-in with random weights and the default model's
tokenizer and vocabulary, so that the span is the engine's own work: the C++
update and schedule, staging, and (without async processing) detokenizing, stop
strings and output objects. ``--stream`` gives every request a detokenizer and
a stop string that never matches, as the server does.

Usage: bench/bench_host_gap.py [--requests 256] [--output-tokens 64] [--stream]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch


def stand_in_model(root: str) -> str:
    """config.json of the default model, shrunk; its tokenizer files as they are."""
    from pagedcore import default_model_path

    src = default_model_path()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")):
            shutil.copy(os.path.join(src, name), root)
    return root


def measure(path: str, args, async_output: bool) -> float:
    """Median host gap (ms) over the decode steps of one run."""
    from pagedcore import LLM, SamplingParams

    llm = LLM(model=path, load_format="dummy", device="cpu", max_num_seqs=args.requests, max_model_len=1024,
              async_output_proc=async_output)
    engine = llm.llm_engine
    marks: list[tuple[str, float]] = []
    update, forward = engine.engine.update, engine.runner.model.forward

    class Engine:  # the C++ engine's methods cannot be replaced; wrap the object
        def __getattr__(self, name):
            return getattr(inner, name)

        def update(self, *a):
            marks.append(("update", time.perf_counter()))
            return update(*a)

    def timed_forward(*a, **kw):
        marks.append(("forward", time.perf_counter()))
        return forward(*a, **kw)

    inner = engine.engine
    engine.engine = Engine()
    engine.runner.model.forward = timed_forward
    rng = np.random.default_rng(args.seed)
    vocab = engine.spec.vocab_size
    stop = ["\x00never\x00"] if args.stream else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, stop=stop)
    for i in range(args.requests):
        ids = rng.integers(100, vocab, args.prompt_tokens).tolist()
        engine.add_request(str(i), None, ids, params, stream=args.stream)
    while engine.has_unfinished_requests():
        engine.step()
    # Each forward after an update: the gap the device would sit through.
    gaps = [t1 - t0 for (k0, t0), (k1, t1) in itertools.pairwise(marks) if k0 == "update" and k1 == "forward"]
    decode = gaps[len(gaps) // 4:]  # past the prefill steps
    engine.engine = inner
    return statistics.median(decode) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="detokenize every request, as the server does")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        path = stand_in_model(root)
        runs = {False: [], True: []}
        for _ in range(args.repeats):  # alternate: a shared VM's speed drifts
            for mode, gaps in runs.items():
                gaps.append(measure(path, args, mode))
    print(f"{args.requests} requests x {args.output_tokens} outputs, prompts {args.prompt_tokens}, "
          f"stream={args.stream}; median over decode steps, median of {args.repeats} runs")
    sync, overlapped = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"host gap per decode step, outputs processed before the next step: {sync:.3f} ms")
    print(f"host gap per decode step, async output processing:               {overlapped:.3f} ms")
    print(f"ratio: {sync / overlapped:.2f}x shorter")


if __name__ == "__main__":
    main()
