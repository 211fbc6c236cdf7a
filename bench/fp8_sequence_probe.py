#!/usr/bin/env python3
"""Which of bench_kernels_gpu.py's decode cases, run before it in one process, slows the fp8
B=64 L=4k case (issue 13; the twenty-third session's puzzle: alone that case takes 140-141
us, after the bench's whole sequence 147)? Each group of earlier cases runs in a fresh
process, then the fp8 case four times, alternating the TMA boxes' L2 promotion (128 bytes,
the default, and 256), with the process's CUDA memory beside it.

Found in the twenty-fourth session (bench/RESULTS.md): only the first measurement after the
4-query rows (multi_query_case) is slow, 154.7-157.4 us, and the ones after it are not: a
transient of the GPU, so bench_kernels_gpu.time_graph now warms each graph ~50 ms first.

Usage (on the GPU machine, pagedcore built): python3 bench/fp8_sequence_probe.py [group ...]
"""

from __future__ import annotations

import os
import subprocess
import sys

GROUPS = ("none", "copy", "bs16", "bs128", "smollm2", "graph-plans", "multi-query", "all")


def run_group(group: str) -> None:
    import torch

    from pagedcore import ops

    import bench_kernels_gpu as bk

    cases = [(1, 256), (1, 4096), (1, 32768), (64, 1024), (64, 4096)]
    with ops.unchecked_indices():
        if group in ("copy", "all"):
            bk.copy_bandwidth()
        if group in ("bs16", "all"):
            for batch, ctx in cases:
                bk.decode_case(batch, ctx, 32, 8, 128, 16)
        if group in ("bs128", "all"):
            for batch, ctx in cases:
                bk.decode_case(batch, ctx, 32, 8, 128, 128)
        if group in ("smollm2", "all"):
            bk.decode_case(64, 1024, 9, 3, 64, 16, label="smollm2")
        if group in ("graph-plans", "all"):
            for shape in ((32, 8, 128), (9, 3, 64)):
                bk.decode_case(1, 160, *shape, 16, graph_plan_len=8192, label=f"plan {shape}")
        if group in ("multi-query", "all"):
            for batch, queries, ctx in ((1, 4, 4096), (64, 4, 1024), (64, 4, 4096)):
                bk.multi_query_case(batch, queries, ctx, 32, 8, 128)
        mib = 2**20
        mem = (f"allocated {torch.cuda.memory_allocated() / mib:.0f} MiB, "
               f"reserved {torch.cuda.memory_reserved() / mib:.0f} MiB")
        times = []
        for l2 in ("128", "256", "128", "256"):
            os.environ["PAGEDCORE_DECODE_TMA_L2"] = l2
            ours, *_ = bk.decode_case(64, 4096, 32, 8, 128, 16, fp8=True)
            times.append(f"{l2}: {ours:.1f}")
    print(f"{group:<12} fp8 B=64 L=4k us by L2 promotion  {'  '.join(times)}   ({mem})", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--group":
        run_group(sys.argv[2])
        return
    groups = sys.argv[1:] or GROUPS
    here = os.path.dirname(os.path.abspath(__file__))
    for group in groups:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--group", group], cwd=here, check=False)


if __name__ == "__main__":
    main()
