"""CPU paged attention against torch's scaled_dot_product_attention.

The same queries, keys and values are given to both: to pagedcore.ops.paged_attention
through a paged cache (block size 16, shuffled block tables), and to
torch.nn.functional.scaled_dot_product_attention laid out contiguously per row
([rows, heads, tokens, head_dim], GQA through enable_gqa), prepared outside the timing.
Both use the same number of threads. Fixed seeds, warm-up, median of repeated runs (the
two alternate run by run); the ratio (SDPA time / pagedcore time, > 1 means pagedcore
is faster) is printed last.

Usage: .venv/bin/python bench/bench_ops_cpu.py [--threads 2] [--repeats 30] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pagedcore import ops

BLOCK_SIZE = 16


@dataclass
class Case:
    name: str
    rows: int
    q_len: int  # queries per row (1: decode)
    context: int  # tokens in the cache per row after the step
    num_heads: int
    num_kv_heads: int
    head_dim: int


CASES = [
    Case("decode SmolLM2 32 x 512", 32, 1, 512, 9, 3, 64),
    Case("prefill SmolLM2 8 x 384", 8, 384, 384, 9, 3, 64),
    Case("decode Llama 8 x 2048", 8, 1, 2048, 32, 8, 128),
]


def make_inputs(case: Case, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = (case.context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = case.rows * blocks_per_row + 1  # block 0: the null block
    shape = (num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=g)
    value_cache = torch.randn(shape, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    block_tables = perm.view(case.rows, blocks_per_row).to(torch.int32).contiguous()
    query = torch.randn(case.rows * case.q_len, case.num_heads, case.head_dim, generator=g)
    seq_lens = torch.full((case.rows,), case.context, dtype=torch.int32)
    query_start_loc = torch.arange(0, case.rows + 1, dtype=torch.int32) * case.q_len

    # The same data, contiguous per row, for SDPA.
    slots = (block_tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(
        case.rows, -1
    )[:, : case.context]
    flat_k = key_cache.view(-1, case.num_kv_heads, case.head_dim)
    flat_v = value_cache.view(-1, case.num_kv_heads, case.head_dim)
    k = flat_k[slots].permute(0, 2, 1, 3).contiguous()  # [rows, kv_heads, context, head_dim]
    v = flat_v[slots].permute(0, 2, 1, 3).contiguous()
    q = query.view(case.rows, case.q_len, case.num_heads, case.head_dim)
    q = q.permute(0, 2, 1, 3).contiguous()  # [rows, heads, q_len, head_dim]
    return dict(
        paged=(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc),
        out=torch.empty_like(query),
        sdpa=(q, k, v),
        scale=case.head_dim**-0.5,
        causal=case.q_len > 1,
    )


def median_ms(fns, repeats: int, warmup: int) -> list[float]:
    """Median milliseconds of each function; the functions alternate run by run, so a
    shared machine's drifting load hits all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) * 1e3 for ts in times]


def run_case(case: Case, repeats: int, warmup: int) -> tuple[float, float, float]:
    x = make_inputs(case, seed=1234)
    query, key_cache, value_cache, block_tables, seq_lens, qsl = x["paged"]
    q, k, v = x["sdpa"]

    def paged():
        ops.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            qsl,
            scale=x["scale"],
            out=x["out"],
        )

    def sdpa():
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=x["causal"], scale=x["scale"], enable_gqa=True
        )

    # Same answer (the comparison is meaningless otherwise).
    paged()
    expected = sdpa().permute(0, 2, 1, 3).reshape_as(x["out"])
    err = (x["out"] - expected).abs().max().item()
    if err > 1e-4:
        raise SystemExit(f"{case.name}: pagedcore and SDPA disagree (max abs diff {err:.3g})")
    with torch.inference_mode():
        t_paged, t_sdpa = median_ms([paged, sdpa], repeats, warmup)
    return t_paged, t_sdpa, err


def machine() -> str:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--", "cpp", "python"], capture_output=True
            ).returncode
            != 0
        )
        commit += " (modified)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return f"cpu: {cpu}; torch {torch.__version__}; commit {commit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="5 repeats, 2 warm-up runs")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup = 5, 2
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)

    print(machine())
    print(
        f"threads: {args.threads} (pagedcore and torch); pagedcore isa: {ops.cpu_isa()}; "
        f"fp32; block size {BLOCK_SIZE}; median of {args.repeats} after {args.warmup} warm-up"
    )
    print()
    columns = [
        f"{'case':<26}",
        f"{'heads q/kv, dim':<15}",
        f"{'pagedcore ms':>12}",
        f"{'SDPA ms':>9}",
        f"{'SDPA / pagedcore':>16}",
    ]
    header = "| " + " | ".join(columns) + " |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for case in CASES:
        t_paged, t_sdpa, _ = run_case(case, args.repeats, args.warmup)
        heads = f"{case.num_heads}/{case.num_kv_heads}, {case.head_dim}"
        print(
            f"| {case.name:<26} | {heads:<15} | {t_paged:>12.3f} | {t_sdpa:>9.3f} | "
            f"{t_sdpa / t_paged:>15.2f}x |"
        )


if __name__ == "__main__":
    main()
