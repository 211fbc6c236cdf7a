#!/usr/bin/env python3
"""The engine process's host cost per step at N streams, without the model:
LLMEngine.step() with the forward pass replaced by zero logits (scheduling,
sampling, update and the output path are real), and the hand-off to the
sender (the message pickled as it crosses the pipe), for plain streamed
requests as RequestOutputs (``plain``: one CompletionOutput + RequestOutput per
stream and step, each encoded as a tuple) and as compact rows (``compact``:
``add_request(compact_key=...)``, four arrays a step; what ``pagedcore serve
--engine-process`` does for them since issue 14).

Usage: python bench/bench_engine_output.py [--streams 512] [--steps 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(model: str, mode: str, streams: int, steps: int) -> tuple[float, float, int]:
    """(step ms, hand-off ms, message bytes), medians over the steps."""
    from pagedcore import SamplingParams
    from pagedcore.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=model, load_format="dummy", device="cpu", dtype="float32",
                                  max_num_seqs=streams, max_model_len=1024, num_kv_blocks=streams * 64))
    vocab = engine.spec.vocab_size
    engine.runner.execute = lambda batch, *args: torch.zeros((batch.num_samples, vocab))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(streams):
        kw = {"compact_key": i} if mode == "compact" else {}
        engine.add_request(f"r{i}", None, [3 + i % 100] * 20, params, stream=True, detokenize=False, **kw)
    for _ in range(3):  # prompts, then the first decodes
        engine.step()
        engine.take_compact_outputs()
    step_ms, hand_ms, size = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if mode == "compact":
            parts = [engine.take_compact_outputs().to_bytes()]
        else:  # as _PipeEngine._encode sends a plain delta (after a request's first output)
            parts = [[(o.request_id, (c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason,
                                      c.stop_reason, o.finished)) for o in outs for c in o.outputs[:1]]]
        message = pickle.dumps(("out", parts, None, 0), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        hand_ms.append((t2 - t1) * 1e3)
        size = len(message)
    return statistics.median(step_ms), statistics.median(hand_ms), size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=512)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    from bench_e2e_gpu import SHAPES, checkpoint_dir

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(checkpoint_dir(SHAPES["tiny"][0], Path(tmp)))
        results = {mode: [measure(model, mode, args.streams, args.steps) for _ in range(args.repeat)]
                   for mode in ("plain", "compact")}
    for mode, runs in results.items():
        step = statistics.median(r[0] for r in runs)
        hand = statistics.median(r[1] for r in runs)
        print(f"{mode:<8} {args.streams} streams: step() {step:.2f} ms (forward stubbed), hand-off {hand:.3f} ms, "
              f"message {runs[0][2]} bytes (median of {args.repeat} x {args.steps} steps)")
    plain = statistics.median(r[0] + r[1] for r in results["plain"])
    compact = statistics.median(r[0] + r[1] for r in results["compact"])
    print(f"engine host time per step: plain {plain:.2f} ms, compact {compact:.2f} ms: {plain / compact:.1f}x")


if __name__ == "__main__":
    main()
