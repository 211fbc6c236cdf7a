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

NOTE: the structures below follow llguidance's ``parser/llguidance.h`` (``LlgTokenizerInit``);
they must match the installed version's (1.9.1 here). ``LlgConstraintInit`` is filled by
``llg_constraint_init_set_defaults`` into a buffer larger than it.

Usage: python bench/llg_c_api.py [--model DIR] [--rows 64] [--steps 40]
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


def main() -> None:
    import sys

    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_structured import SCHEMAS

    from pagedcore import default_model_path
    from pagedcore.structured_outputs import StructuredOutputManager, StructuredOutputsParams, _grammar_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a directory with tokenizer.json and config.json")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    model = args.model or default_model_path()
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
