"""The sampler before and after its cheaper exact paths, logits to tokens on the host.

"old" is the sampler as it was before (kept below as the reference): every random
batch sorts every row of the vocabulary for top-k/top-p, every step computes the raw
``log_softmax`` of the whole batch, and the host reads the tokens and the sampled
logprobs with one ``.cpu()`` each (on CUDA each one waits for the device). "new" is
``pagedcore.sampler.Sampler`` with the metadata the engine builds (host copies of
top_k/top_p, sampled logprobs only when a request wants logprobs) and the engine's
one packed copy to the host (through a pinned buffer and an event on CUDA).

Both run on the same logits (random normal, fixed seed) and the same global RNG
state, and must return the same tokens (checked). Warm-up, then the median of
``--repeats`` runs, old and new alternating. The ratio old / new (> 1: new is
faster) is printed last on each line.

Usage: .venv/bin/python bench/bench_sampler.py [--device cpu|cuda] [--repeats 5]
       [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from pagedcore.llm_engine import _HostCopies
from pagedcore.sampler import Sampler, SamplingMetadata, _exponential_race, _gather_logprobs, apply_min_p
from pagedcore.sampling_params import _SAMPLING_EPS, SamplingParams

BATCHES = (1, 16, 256)
VOCABS = (49152, 128256)


def params_for(mode: str, batch: int) -> list[SamplingParams]:
    """One SamplingParams per row; 'mixed' cycles greedy, top-k, top-p, both."""
    kinds = {
        "greedy": [SamplingParams(temperature=0.0)],
        "top_k": [SamplingParams(temperature=0.8, top_k=50)],
        "top_p": [SamplingParams(temperature=0.8, top_p=0.9)],
        "top_k_top_p": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)],
        "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50),
                  SamplingParams(temperature=0.8, top_p=0.9),
                  SamplingParams(temperature=0.8, top_k=50, top_p=0.9)],
    }[mode]
    return [kinds[i % len(kinds)] for i in range(batch)]


# ---- the sampler as it was: the reference ---------------------------------------


def old_top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """apply_top_k_top_p before the topk paths: a full sort of every row."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = None
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        threshold = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        target = (top_p - 1e-6).to(cumulative.dtype).unsqueeze(1)
        below = torch.searchsorted(cumulative, target)
        num_kept = (below + 1).clamp_(max=vocab_size)
        p_threshold = sorted_logits.gather(1, num_kept - 1)
        p_threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), float("-inf"))
        threshold = p_threshold if threshold is None else torch.maximum(threshold, p_threshold)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def old_sample(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata):
    """The old Sampler.__call__ and the old host reads (one .cpu() per field)."""
    processed = sampler.process_logits(logits, md, for_random=False)
    top_logits, greedy_ids = processed.max(dim=-1)
    valid = top_logits > float("-inf")
    if md.all_greedy:
        sampled = greedy_ids
    else:
        temperature = md.temperature.to(processed.dtype)
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        random_logits = processed / temperature.unsqueeze(1)
        if not md.no_min_p:
            apply_min_p(random_logits, md.min_p)
        if not (md.no_top_k and md.no_top_p):
            old_top_k_top_p(random_logits, None if md.no_top_k else md.top_k,
                            None if md.no_top_p else md.top_p)
        random_ids = _exponential_race(random_logits.softmax(dim=-1), md.generators)
        sampled = random_ids if md.all_random else torch.where(
            md.temperature < _SAMPLING_EPS, greedy_ids, random_ids)
    sampled = torch.where(valid, sampled, -1)
    out = _gather_logprobs(logits, sampled, valid, md.num_logprobs)
    token_ids = out.sampled_token_ids.to(torch.int32).cpu().numpy()
    sampled_lp = out.sampled_logprobs.cpu().tolist()
    return token_ids, sampled_lp


def new_sample(sampler: Sampler, copies: _HostCopies, logits: torch.Tensor, md: SamplingMetadata):
    host = copies.launch(sampler(logits, md)).wait()
    return host.token_ids, host.sampled_logprobs


# ---- timing ---------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(device: torch.device, batch: int, vocab: int, mode: str, repeats: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1000 * batch + vocab % 1000)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device)
    params = params_for(mode, batch)
    md = SamplingMetadata.from_params(params, device)
    md.need_sampled_logprobs = False  # no request asks for logprobs (what the engine sets)
    sampler, copies = Sampler(), _HostCopies(device)

    def timed(fn) -> tuple[float, list[int]]:
        torch.manual_seed(7)  # the same draws for old and new
        sync(device)
        start = time.perf_counter()
        token_ids, _ = fn()
        elapsed = time.perf_counter() - start
        return elapsed, token_ids.tolist()

    run_old = lambda: old_sample(sampler, logits, md)
    run_new = lambda: new_sample(sampler, copies, logits, md)
    _, old_tokens = timed(run_old)  # warm-up
    _, new_tokens = timed(run_new)
    if old_tokens != new_tokens:
        raise AssertionError(f"{mode} batch {batch} vocab {vocab}: old and new tokens differ")
    old_times, new_times = [], []
    for _ in range(repeats):
        old_times.append(timed(run_old)[0])
        new_times.append(timed(run_new)[0])
    return statistics.median(old_times), statistics.median(new_times)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 16, vocab 49152 only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# sampler, old vs new | device {device} ({name}) | torch {torch.__version__} | "
          f"threads {torch.get_num_threads()} | commit {commit()} | median of {args.repeats}")
    print(f"{'mode':<12} {'batch':>5} {'vocab':>6} {'old ms':>9} {'new ms':>9} {'old/new':>8}")
    batches = BATCHES[:2] if args.quick else BATCHES
    vocabs = VOCABS[:1] if args.quick else VOCABS
    for vocab in vocabs:
        for batch in batches:
            for mode in ("greedy", "top_k", "top_p", "top_k_top_p", "mixed"):
                old, new = run_case(device, batch, vocab, mode, args.repeats)
                print(f"{mode:<12} {batch:>5} {vocab:>6} {old * 1e3:>9.2f} {new * 1e3:>9.2f} {old / new:>8.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
