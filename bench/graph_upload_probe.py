#!/usr/bin/env python3
"""What a decode CUDA graph's first replay costs against its later ones (issue 14's
host tail): the engine of a shape (random weights) is built as serve builds it, then a
fresh graph of the decode forward is captured for each batch size asked, over the
runner's padding inputs (no cache slot written), and replayed REPEATS times, each
timed alone (host time of the replay call, and to the end of its work on the device).
Since the thirty-fourth session every decode graph is replayed once at capture
(model_runner._capture_decode_graphs), for this first replay's cost.

Usage: python bench/graph_upload_probe.py [--shape smollm2] [--sizes 8 64 112] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2", help="bench_serving.py's shapes")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 112])
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    import torch

    import bench_serving
    from pagedcore import LLM, ops

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = bench_serving.shape_checkpoint(args.shape, tmp)
        llm = LLM(model=path, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=512)
    runner = llm.llm_engine.runner
    print(f"{args.shape}: decode graphs of sizes {list(runner.graphs)}; a fresh graph of each size below, "
          f"its replays timed alone (ms: host call / to the end on the device)")
    for b in args.sizes:
        size = next(s for s in runner.graphs if s >= b)
        md = runner.graphs[size].md
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with ops.unchecked_indices(), torch.cuda.graph(graph):  # (as the runner captures)
            runner._decode_forward(size, md)
        torch.cuda.synchronize()
        rows = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            graph.replay()
            called = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            rows.append(((called - start) * 1e3, (done - start) * 1e3))
        later = rows[1:]
        print(f"  batch {size:>3}: first {rows[0][0]:.3f} / {rows[0][1]:.3f}; later (median) "
              f"{statistics.median(r[0] for r in later):.3f} / {statistics.median(r[1] for r in later):.3f}")
        del graph


if __name__ == "__main__":
    main()
