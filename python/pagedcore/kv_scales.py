"""Calculated fp8 KV-cache scales (vLLM's ``calculate_kv_scales``).

An fp8 (e4m3) cache stores ``key / k_scale`` and ``value / v_scale`` per layer,
saturated at +-448. With ``calculate_kv_scales=True`` the engine measures them at
start-up: one forward pass over a fixed calibration text (plain prose, then the
tokenizer's chat template around a short exchange, so that the template's special
tokens, which carry the largest keys of many models, are seen), reading each
layer's K and V back from a temporary cache of the model's dtype, and
``scale = amax / divisor`` with vLLM's divisors (200 for K, 100 for V: headroom
for prompts whose keys and values exceed the calibration text's; vLLM measures on
the first batch of real prompts instead). The scales are floats, fixed before
CUDA graphs are captured.

On the default model this buys nothing: its keys and values stay below 25, far
from 448, and e4m3's relative step is the same at any scale, so scales of 1 measure
as accurate (bench/bench_fp8_accuracy.py, bench/RESULTS.md); the option is off by
default, as in vLLM. It matters for a model whose keys or values pass 448.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import ops
from .models import AttentionMetadata, CausalLM

#: K and V divisors of the calculated scales: ``k_scale = amax(K) / K_DIVISOR``.
#: Headroom below e4m3's 448 for keys and values beyond the calibration text's.
K_DIVISOR = 200.0
V_DIVISOR = 100.0

CALIBRATION_TEXT = (
    "The river town woke slowly. By seven the bakery had its shutters up, the ferry had made two "
    "crossings, and the schoolteacher was writing the day's sums on the board: 17 x 23, 144 / 12, "
    "and a question about the speed of a boat going upstream against a current of 3 km/h. "
    "Nobody in the town would have called it remarkable, yet visitors kept coming back, saying the "
    "light on the water in the evening was unlike anything they had seen.\n\n"
    "def mean(values):\n    total = sum(values)\n    return total / len(values) if values else 0.0\n\n"
    "Q: What is the capital of Japan, and roughly how many people live in its metropolitan area?\n"
    "A: Tokyo; its metropolitan area is home to about 37 million people."
)
CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Give me three tips for keeping houseplants alive in winter."},
    {"role": "assistant", "content": "1. Water less often, since growth slows. 2. Move them closer to "
                                     "the light. 3. Keep them away from cold drafts and radiators."},
]


def calibration_token_ids(tokenizer: Any) -> list[int]:
    """The calibration text as token ids: the prose, then (when the tokenizer has a
    chat template) the short chat exchange in that template."""
    ids = list(tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"])
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(CALIBRATION_CHAT, tokenize=True, add_generation_prompt=False)
        if isinstance(chat, dict) or hasattr(chat, "keys"):  # transformers 5 returns a BatchEncoding
            chat = chat["input_ids"]
        ids += list(chat)
    return ids


@torch.inference_mode()
def measure_kv_amax(model: CausalLM, token_ids: list[int], block_size: int = 16) -> list[tuple[float, float]]:
    """``(max |K|, max |V|)`` of each layer over one forward pass of ``token_ids``
    (one sequence from position 0), as the layers write them into the cache: K after
    the q/k norm and rotary, in the model's dtype.

    Parameters
    ----------
    model : CausalLM
        Loaded, on its device, rotary table covering ``len(token_ids)`` positions.
    token_ids : list of int
        At least one token.
    """
    if not token_ids:
        raise ValueError("measure_kv_amax: token_ids is empty")
    spec, device = model.spec, model.embed_tokens.weight.device
    n = len(token_ids)
    if n > model.max_positions:
        raise ValueError(f"measure_kv_amax: {n} tokens exceed the rotary table's {model.max_positions} positions")
    blocks = -(-n // block_size)
    shape = (1 + blocks, block_size, spec.num_kv_heads, spec.head_dim)  # block 0: the null block
    caches = [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype,
                                                                                  device=device))
              for _ in range(spec.num_layers)]
    lens, qsl = np.array([n], dtype=np.int32), np.array([0, n], dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=torch.arange(block_size, block_size + n, dtype=torch.int32, device=device),
        block_tables=torch.arange(1, 1 + blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.from_numpy(lens).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
    )
    if device.type == "cuda":
        md.plan = ops.plan_attention(qsl, lens, spec.num_heads, spec.num_kv_heads, device, spec.head_dim,
                                     model.dtype)
    ids = torch.tensor(token_ids, dtype=torch.int32, device=device)
    model(ids, torch.arange(n, dtype=torch.int32, device=device), md, caches)
    amax = []
    for k, v in caches:
        written = slice(block_size, block_size + n)  # the slots of the n tokens
        k_rows = k.view(-1, spec.num_kv_heads, spec.head_dim)[written]
        v_rows = v.view(-1, spec.num_kv_heads, spec.head_dim)[written]
        amax.append((float(k_rows.abs().max().float()), float(v_rows.abs().max().float())))
    return amax


def calculate_kv_scales(model: CausalLM, token_ids: list[int], k_divisor: float = K_DIVISOR,
                        v_divisor: float = V_DIVISOR) -> list[tuple[float, float]]:
    """Sets every layer's ``k_scale`` / ``v_scale`` to ``amax / divisor`` of
    :func:`measure_kv_amax` (1.0 where the amax is 0 or not finite); returns the
    scales."""
    def scale(amax: float, divisor: float) -> float:
        return amax / divisor if math.isfinite(amax) and amax > 0 else 1.0

    scales = []
    for layer, (k_amax, v_amax) in zip(model.layers, measure_kv_amax(model, token_ids), strict=True):
        layer.k_scale, layer.v_scale = scale(k_amax, k_divisor), scale(v_amax, v_divisor)
        scales.append((layer.k_scale, layer.v_scale))
    return scales
