"""Linear layers of decode steps: ``x @ weight.T + bias`` for a few token rows, in a
kernel that streams each weight row once: on the CPU in float32 (C++), on CUDA in
bfloat16/float16 for up to 16 rows (:mod:`.linear_cuda`).

A batch-1 decode step is bound by reading the weights; torch's float32 GEMM reads
them at a fraction of the memory bandwidth on the AMD EPYC CPUs this was measured on
(see ``cpp/src/cpu_ops/linear.cpp``). Prefill-sized inputs stay with torch
(:data:`LINEAR_MAX_ROWS`).
"""

from __future__ import annotations

import torch

from .. import _C
from ._checks import _overlap, _tensor
from .layer import silu_and_mul
from .linear_cuda import CUDA_LINEAR_MAX_ROWS, linear_cuda

__all__ = ["LINEAR_MAX_ROWS", "linear", "linear_silu_and_mul"]

#: Token rows up to which the model sends a CPU float32 product to :func:`linear`.
#: NOTE: a row's result changes when a product crosses this size (torch's GEMM sums in
#: another order), so decode batches that grow or shrink across it give a sequence
#: other logits: sync and async output processing, whose batches differ by a row,
#: then diverge (test_async_output, 16 sequences). 16 keeps every decode batch of up to
#: 16 sequences on one path. Cost, measured one thread each over SmolLM2's 121 matrices
#: on a loaded machine (ms, ours vs torch): 71/95 at 1 row, 97/145 at 4, 160/169 at 8,
#: 305/210 at 16; with two threads under load torch's GEMM was the slower at every size.
LINEAR_MAX_ROWS = 16


def _cpu_float32(op: str, name: str, t: object) -> torch.Tensor:
    _tensor(op, name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a CPU tensor, got device {t.device}")
    return t


def _row_stride(op: str, name: str, t: torch.Tensor) -> int:
    rows, width = t.shape
    if width > 1 and t.stride(1) != 1:
        raise ValueError(f"{op}: {name} rows must be dense (stride(1) == 1), got strides {t.stride()}")
    if rows <= 1:
        return width
    if t.stride(0) < width:
        raise ValueError(f"{op}: {name} row stride {t.stride(0)} < row width {width}")
    return t.stride(0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x @ weight.T (+ bias)``, as ``torch.nn.functional.linear`` computes it, on
    the CPU in float32, or on CUDA in bfloat16/float16 for 1 to
    :data:`~pagedcore.ops.CUDA_LINEAR_MAX_ROWS` rows (float32 sums, ``in_features`` a
    multiple of 8, 16-byte aligned rows; the dtype of ``x`` everywhere).

    On the CPU every output is summed in one fixed order, whatever the number of rows and
    threads, so a row's result does not depend on the rows it shares the call with. On
    CUDA that holds within one row and within 2-16 rows, which take different kernels
    (a matrix-vector kernel whose sums are split over 1-8 warps by the shape; tensor
    cores) whose sums round differently. The order
    is not torch's: results agree with ``F.linear`` to float32 rounding (a few ulps of
    the largest terms), not bit for bit.

    Parameters
    ----------
    x : torch.Tensor
        ``[num_tokens, in_features]`` float32 CPU (or bfloat16/float16 CUDA), dense rows (row
        stride free).
    weight : torch.Tensor
        ``[out_features, in_features]`` like ``x``, contiguous.
    bias : torch.Tensor, optional
        ``[out_features]`` float32 CPU, contiguous.
    out : torch.Tensor, optional
        ``[num_tokens, out_features]`` float32 CPU, dense rows, overlapping no input.
        Allocated (contiguous) when not given.

    Returns
    -------
    torch.Tensor
        ``out``.

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> x, w = torch.randn(2, 64), torch.randn(96, 64)
    >>> bool(torch.allclose(ops.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5))
    True
    """
    op = "linear"
    _tensor(op, "x", x)
    if x.device.type == "cuda":
        _tensor(op, "weight", weight)
        return linear_cuda(op, x, weight, bias, out)
    _cpu_float32(op, "x", x)
    _cpu_float32(op, "weight", weight)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: weight must be [out_features, in_features = {x.shape[1]}], got shape "
                         f"{tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous, got strides {weight.stride()}")
    tokens, in_features = x.shape
    out_features = weight.shape[0]
    if in_features == 0 or out_features == 0:
        raise ValueError(f"{op}: in_features and out_features must be >= 1, got weight shape "
                         f"{tuple(weight.shape)}")
    x_stride = _row_stride(op, "x", x)
    bias_ptr = 0
    if bias is not None:
        _cpu_float32(op, "bias", bias)
        if bias.shape != (out_features,) or not bias.is_contiguous():
            raise ValueError(f"{op}: bias must be a contiguous [{out_features}], got shape {tuple(bias.shape)} "
                             f"strides {bias.stride()}")
        bias_ptr = bias.data_ptr()
    if out is None:
        out = torch.empty((tokens, out_features), dtype=torch.float32)
    else:
        _cpu_float32(op, "out", out)
        if out.shape != (tokens, out_features):
            raise ValueError(f"{op}: out must be [num_tokens, out_features] = [{tokens}, {out_features}], got "
                             f"shape {tuple(out.shape)}")
        if tokens and any(_overlap(out, t) for t in (x, weight) + (() if bias is None else (bias,))):
            raise ValueError(f"{op}: out must not overlap x, weight or bias")
    out_stride = _row_stride(op, "out", out)
    if tokens:
        _C.cpu_linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(), bias_ptr, tokens, in_features,
                      out_features, x_stride, out_stride)
    return out


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))``: the MLP's fused gate_up projection and
    its activation. On CUDA, for 1-16 rows (a decode step), in one kernel: the warp
    that sums gate feature ``j`` also sums up feature ``I + j`` and writes
    ``silu(gate) * up`` with :func:`~pagedcore.ops.silu_and_mul`'s arithmetic over the
    product rounded to the dtype, so the result equals the two ops' (the product's
    sum order is :func:`linear`'s: at one row up to its split over at most 4 warps a
    feature; at 2-16 rows the same plan of the tensor-core kernel).
    Elsewhere the two ops, under :func:`linear`'s conditions.

    Parameters
    ----------
    x : torch.Tensor
        ``[num_tokens, in_features]``, as :func:`linear` takes it.
    weight : torch.Tensor
        ``[2 * intermediate_size, in_features]``: the gate rows, then the up rows.
    bias : torch.Tensor, optional
        ``[2 * intermediate_size]``.
    out : torch.Tensor, optional
        ``[num_tokens, intermediate_size]``, dense rows, overlapping no input.

    Returns
    -------
    torch.Tensor
        ``out``.

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> x, w = torch.randn(1, 64), torch.randn(2 * 32, 64)
    >>> y = x @ w.T
    >>> ref = torch.nn.functional.silu(y[:, :32]) * y[:, 32:]
    >>> bool(torch.allclose(ops.linear_silu_and_mul(x, w), ref, rtol=1e-4, atol=1e-4))
    True
    """
    op = "linear_silu_and_mul"
    _tensor(op, "x", x)
    if x.device.type == "cuda" and x.dim() == 2 and 1 <= x.shape[0] <= CUDA_LINEAR_MAX_ROWS:
        _tensor(op, "weight", weight)
        return linear_cuda(op, x, weight, bias, out, silu_and_mul=True)
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"{op}: weight must be [2 * intermediate_size, in_features], got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    return silu_and_mul(linear(x, weight, bias), out=out)
