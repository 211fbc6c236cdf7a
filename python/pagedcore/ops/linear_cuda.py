"""The CUDA half of :func:`pagedcore.ops.linear` (:mod:`.matmul`): ``x @ weight.T (+ bias)`` for the
1..:data:`CUDA_LINEAR_MAX_ROWS` (16) token rows of a decode step, bfloat16/float16, in kernels that
stream each weight row once: a matrix-vector kernel at one row (``cuda/linear_kernels.cu``), a
tensor-core one (mma.sync, float32 sums) at 2-16 rows (``cuda/linear_mma.cu``).

At 1-16 rows cuBLAS's GEMM tiles leave most of the GPU idle and its calls are latency-bound
(~4 us for each of the SmolLM2 shape's products, whose weights take well under 1 us to read);
the kernels are bound by the weight's bytes. ``PAGEDCORE_CUDA_LINEAR=0`` sends every product
to cuBLAS (for comparisons).
"""

from __future__ import annotations

import os

import torch

from .. import _C
from ._checks import _CUDA_DTYPES, _overlap, _stream, _tensor

__all__ = ["CUDA_LINEAR_MAX_ROWS", "CUDA_LINEAR_MODEL_ROWS", "cuda_linear_eligible"]

#: Token rows the kernel takes at most.
CUDA_LINEAR_MAX_ROWS = int(getattr(_C, "CUDA_LINEAR_MAX_ROWS", 0))
# NOTE: measured on the H200 (bench_kernels_gpu.py's linear rows, weights read from
# DRAM, at c4ceb6f): the kernels beat cuBLAS wherever the product is latency-bound,
# i.e. its weight is small: SmolLM2's qkv/o/gate_up/down at 2-16 rows 2.6-4.0 us against
# cuBLAS's 3.6-5.1, the 8B shape's o (33.5 MB) 10.6-12.1 against 13.4-13.7. Over larger
# weights cuBLAS streams faster at 2-16 rows (8B qkv 18.8-23.9 us against 15.5-16.0,
# gate_up 63-69 against 57-62), and at one row over a large weight of short rows (SmolLM2's
# 576-wide LM head: 19.1 against 16.6 us). So: one row always, except large weights of
# short rows; 2-16 rows over weights up to _LARGE_WEIGHT_BYTES.
_DEFAULT_MODEL_ROWS = 16
# NOTE: also measured end to end on the H200 (8B TPOT batch 1 / 16, ms): every product
# above one row on cuBLAS 4.37 / 5.04 (9b2e4b9); qkv and o on the kernels at 4 parts of k
# (limit 64 MiB) 4.37 / 5.12; the down product (14336-long rows, where cuBLAS adds a
# split-K reduction) on the kernels 4.34 / 5.03 against 4.34 / 5.02 (ebdd2cc). No routing
# gained beyond noise; the switches were removed.
_LARGE_WEIGHT_BYTES = 40 << 20
#: Token rows up to which the model sends a CUDA product to the kernels (where its
#: weight is small enough, see :func:`cuda_linear_eligible`; else cuBLAS).
#: ``PAGEDCORE_CUDA_LINEAR_ROWS`` overrides the default of 16, for benchmarks and A/B runs.
CUDA_LINEAR_MODEL_ROWS = min(int(os.environ.get("PAGEDCORE_CUDA_LINEAR_ROWS", str(_DEFAULT_MODEL_ROWS))),
                             CUDA_LINEAR_MAX_ROWS)
_ENABLED = os.environ.get("PAGEDCORE_CUDA_LINEAR", "1") != "0"


def _aligned_rows(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) % 8 == 0) and x.data_ptr() % 16 == 0


def cuda_linear_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the model sends this product to :func:`linear` (else ``F.linear``): CUDA,
    1..:data:`CUDA_LINEAR_MODEL_ROWS` rows, bfloat16/float16 like the weight,
    ``in_features`` a multiple of 8, 16-byte aligned dense rows, a contiguous weight;
    and where the kernels measured faster than cuBLAS: at one row unless the weight is
    large (> 40 MiB) and its rows short (< 1024), at 2-16 rows over weights up to 40 MiB."""
    if not (
        _ENABLED and x.device.type == "cuda" and x.dim() == 2 and 1 <= x.shape[0] <= CUDA_LINEAR_MODEL_ROWS
        and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        and x.shape[1] % 8 == 0 and _aligned_rows(x) and weight.is_contiguous() and weight.data_ptr() % 16 == 0
    ):
        return False
    large = weight.numel() * weight.element_size() > _LARGE_WEIGHT_BYTES
    return not large if x.shape[0] > 1 else not (large and x.shape[1] < 1024)


def linear_cuda(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None, silu_and_mul: bool = False) -> torch.Tensor:
    """Checks and launches the kernel (x, weight on CUDA); see :func:`~pagedcore.ops.linear`
    (``silu_and_mul``: :func:`~pagedcore.ops.linear_silu_and_mul`'s kernels, ``out``
    then has half the weight's rows as columns)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: x on CUDA must be bfloat16 or float16 (float32 products run on the CPU), "
                        f"got {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("out", out)):
        if t is None:
            continue
        _tensor(op, name, t)
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must be {x.dtype} like x, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} must be on {x.device} like x, got {t.device}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    tokens, in_features = x.shape
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"{op}: weight must be [out_features, in_features = {in_features}], got shape "
                         f"{tuple(weight.shape)}")
    out_features = weight.shape[0]
    if silu_and_mul and out_features % 2:
        raise ValueError(f"{op}: the fused kernel takes an even number of weight rows [gate | up], got weight "
                         f"shape {tuple(weight.shape)}")
    if tokens > CUDA_LINEAR_MAX_ROWS:
        raise ValueError(f"{op}: x has {tokens} rows on CUDA; at most {CUDA_LINEAR_MAX_ROWS} (use F.linear)")
    if in_features % 8:
        raise ValueError(f"{op}: in_features must be a multiple of 8 on CUDA, got {in_features}")
    if not _aligned_rows(x):
        raise ValueError(f"{op}: x's rows must be dense, 16-byte aligned, with a row stride that is a multiple "
                         f"of 8, got strides {x.stride()}")
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError(f"{op}: weight must be contiguous and 16-byte aligned, got strides {weight.stride()}")
    if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"{op}: bias must be a contiguous [{out_features}], got shape {tuple(bias.shape)}")
    columns = out_features // 2 if silu_and_mul else out_features
    if out is None:
        out = torch.empty((tokens, columns), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, columns) or (columns > 1 and out.stride(1) != 1) or (
            tokens > 1 and out.stride(0) < columns):
        what = "intermediate_size" if silu_and_mul else "out_features"
        raise ValueError(f"{op}: out must be [num_tokens, {what}] = [{tokens}, {columns}] with dense "
                         f"rows, got shape {tuple(out.shape)} strides {out.stride()}")
    if tokens and out_features and any(_overlap(out, t) for t in (x, weight) + (() if bias is None else (bias,))):
        raise ValueError(f"{op}: out must not overlap x, weight or bias")
    if tokens and out_features:
        _C.cuda_linear(
            out=out.data_ptr(), input=x.data_ptr(), weight=weight.data_ptr(),
            bias=bias.data_ptr() if bias is not None else 0, dtype=_CUDA_DTYPES[x.dtype], num_tokens=tokens,
            in_features=in_features, out_features=out_features, input_stride=x.stride(0) if tokens > 1 else in_features,
            out_stride=out.stride(0) if tokens > 1 else columns, stream=_stream(x.device),
            silu_and_mul=silu_and_mul,
        )
    return out

