"""Checks shared by the ``pagedcore.ops`` wrappers: each raises ``TypeError`` /
``ValueError`` naming the op, the argument and the offending value, before any
kernel runs. Also the dtype codes of the C++ and CUDA kernels, the CUDA stream
and device helpers, and :func:`unchecked_indices`."""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from collections.abc import Sequence

import torch

from .. import _C

_DTYPES = {
    torch.float32: _C.CpuDType.FLOAT32,
    torch.bfloat16: _C.CpuDType.BFLOAT16,
    torch.float16: _C.CpuDType.FLOAT16,
}
_INDEX_TYPES = {torch.int32: _C.CpuIndexType.INT32, torch.int64: _C.CpuIndexType.INT64}

_CUDA_DTYPES = (
    {
        torch.float32: _C.CudaDType.FLOAT32,
        torch.bfloat16: _C.CudaDType.BFLOAT16,
        torch.float16: _C.CudaDType.FLOAT16,
        torch.float8_e4m3fn: _C.CudaDType.FLOAT8_E4M3,
    }
    if hasattr(_C, "CudaDType")
    else {}
)
_local = threading.local()


@contextlib.contextmanager
def unchecked_indices():
    """Within this block (on this thread), CUDA calls skip their index-range checks,
    which synchronise with the device: for callers whose indices are valid by
    construction (the model runner) and for CUDA-graph capture."""
    previous = getattr(_local, "unchecked", False)
    _local.unchecked = True
    try:
        yield
    finally:
        _local.unchecked = previous


def _tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda":
        if not _CUDA_DTYPES:
            raise NotImplementedError(
                f"{op}: {name} is on {t.device} but pagedcore was built without CUDA kernels"
            )
    elif t.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a CPU or CUDA tensor, got device {t.device}")
    return t


def _same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{op}: all tensors must be on one device; {name} is on {device}, "
                             f"{next(iter(devices))} on {first}")
    return first


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _check_range(op: str, name: str, t: torch.Tensor, low: int, high: int, allow_negative: bool = False) -> None:
    # CUDA inputs only (the C++ CPU kernels check their own): one synchronisation.
    if getattr(_local, "unchecked", False) or t.numel() == 0:
        return
    values = t[t >= 0] if allow_negative else t
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise ValueError(f"{op}: {name} holds {bad}, outside [{low}, {high})")


def _aligned(op: str, name: str, t: torch.Tensor, stride_elements: int) -> None:
    if t.data_ptr() % 16 or (stride_elements * t.element_size()) % 16:
        raise ValueError(f"{op}: {name} must start on 16 bytes with a token stride of a multiple "
                         f"of 16 bytes for the CUDA kernels")


def _dim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {layout}, got shape {tuple(t.shape)}")


def _float_dtype(op: str, name: str, t: torch.Tensor) -> _C.CpuDType:
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    return code


def _same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def _index(op: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must be {allowed}, got {t.dtype}")


def _contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {t.stride()}")


def _token_stride(op: str, name: str, t: torch.Tensor) -> int:
    """Stride between tokens of a [tokens, heads, head_dim] tensor whose (heads, head_dim)
    part is dense; the token stride itself is free (a slice of a fused projection)."""
    tokens, heads, head_dim = t.shape
    if (head_dim > 1 and t.stride(2) != 1) or (heads > 1 and t.stride(1) != head_dim):
        raise ValueError(
            f"{op}: {name} must have dense heads (stride(2) == 1, stride(1) == head_dim "
            f"== {head_dim}), got strides {t.stride()}"
        )
    if tokens <= 1:
        return heads * head_dim
    if t.stride(0) < heads * head_dim:
        raise ValueError(
            f"{op}: {name} token stride {t.stride(0)} overlaps its heads "
            f"(must be >= num_heads * head_dim = {heads * head_dim})"
        )
    return t.stride(0)


def _cache_pair(op: str, key_cache: object, value_cache: object) -> None:
    _tensor(op, "key_cache", key_cache)
    _tensor(op, "value_cache", value_cache)
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _dim(op, "key_cache", key_cache, 4, layout)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{op}: value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    _same_dtype(op, "value_cache", value_cache, "key_cache", key_cache)
    _contiguous(op, "key_cache", key_cache)
    _contiguous(op, "value_cache", value_cache)


def _fp8_cache(op: str, key_cache: torch.Tensor, name: str, t: torch.Tensor, k_scale: object, v_scale: object) -> None:
    # The cache holds t's dtype, or fp8 e4m3 (CUDA: for bf16/fp16 t; CPU: any float t,
    # see cpu_fp8), with positive scales.
    for sname, sv in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(sv, bool) or not isinstance(sv, numbers.Real) or not (math.isfinite(sv) and sv > 0):
            raise ValueError(f"{op}: {sname} must be a finite float > 0, got {sv!r}")
    if key_cache.dtype != torch.float8_e4m3fn:
        _same_dtype(op, "key_cache", key_cache, name, t)
        return
    if key_cache.device.type == "cuda" and t.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{op}: an fp8 (float8_e4m3fn) cache on CUDA needs bfloat16 or float16 {name}, got {t.dtype}"
        )


def _block_mapping(op: str, block_mapping: object) -> torch.Tensor:
    _tensor(op, "block_mapping", block_mapping)
    _index(op, "block_mapping", block_mapping, (torch.int32, torch.int64))
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"{op}: block_mapping must be [num_pairs, 2] (src, dst), got shape "
            f"{tuple(block_mapping.shape)}"
        )
    _contiguous(op, "block_mapping", block_mapping)
    return block_mapping


# ---- CUDA helpers --------------------------------------------------------------------------

_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNTS.get(index)
    if sms is None:
        sms = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms


def _pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device, non_blocking=True)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans (first to last element) of two non-empty tensors meet."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
