"""Kernels the model code calls: paged attention and the KV-cache operations.

A layer's KV cache is two tensors ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot
``slot = block * block_size + offset`` of a sequence lives at
``cache[slot // block_size, slot % block_size]``. The kernels run in the C++ core
(``pagedcore._C``, no libtorch): these wrappers check dtype, device, shapes and
strides, raise ``TypeError`` / ``ValueError`` before any work is done, and pass
``tensor.data_ptr()`` with sizes and strides. Checks that need to look at every
index (slot ids, block ids, sequence lengths) run in C++ and raise
:class:`pagedcore.InvalidArgumentError` (a ``ValueError``) naming the field and
value; a call that raises has written nothing.

CPU tensors run the C++ kernels of the core, on a pool of threads it owns
(:func:`set_num_threads`); CUDA tensors run the CUDA kernels (``cuda/``) on the
current stream, asynchronously. Index ranges of CUDA inputs are checked (each
check costs a device synchronisation) except inside :func:`unchecked_indices`,
which the model runner uses: its indices come from the engine. The kernels
never dereference an index out of range either way.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import operator
from collections.abc import Sequence

import numpy as np
import torch

from . import _C

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "copy_blocks",
    "cpu_isa",
    "get_num_threads",
    "paged_attention",
    "plan_attention",
    "reshape_and_cache",
    "unchecked_indices",
    "swap_in",
    "swap_out",
    "set_cpu_isa",
    "set_num_threads",
    "swap_blocks",
]

#: Head sizes the attention kernel is compiled for.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)

_DTYPES = {
    torch.float32: _C.CpuDType.FLOAT32,
    torch.bfloat16: _C.CpuDType.BFLOAT16,
    torch.float16: _C.CpuDType.FLOAT16,
}
_INDEX_TYPES = {torch.int32: _C.CpuIndexType.INT32, torch.int64: _C.CpuIndexType.INT64}


# ---- checks -------------------------------------------------------------------------------


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
    # The cache holds t's dtype, or (CUDA only) fp8 e4m3 for bf16/fp16 t, with positive scales.
    for sname, sv in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(sv, bool) or not isinstance(sv, numbers.Real) or not (math.isfinite(sv) and sv > 0):
            raise ValueError(f"{op}: {sname} must be a finite float > 0, got {sv!r}")
    if key_cache.dtype != torch.float8_e4m3fn:
        _same_dtype(op, "key_cache", key_cache, name, t)
        return
    if t.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{op}: an fp8 (float8_e4m3fn) cache needs bfloat16 or float16 {name}, got {t.dtype}"
        )
    if key_cache.device.type != "cuda":
        raise NotImplementedError(f"{op}: an fp8 (float8_e4m3fn) KV cache needs CUDA tensors, got {key_cache.device}")


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


# ---- ops ------------------------------------------------------------------------------------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the step's keys and values into the paged cache.

    ``key_cache[s // block_size, s % block_size] = key[t]`` (and the same for values)
    for every token ``t`` with ``s = slot_mapping[t] >= 0``; negative slots are
    padding and skipped. Nothing else in the caches changes.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, float32 / bfloat16 / float16. Heads
        must be dense (``stride(2) == 1``, ``stride(1) == head_dim``); the token
        stride is free, so slices of a fused qkv projection are accepted.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same dtype
        as ``key``, or (CUDA, bfloat16/float16 keys) ``torch.float8_e4m3fn``: then
        ``key / k_scale`` and ``value / v_scale`` are stored, saturated to +-448.
        Written in place.
    slot_mapping : torch.Tensor
        ``[num_tokens]``, int32 or int64, contiguous. Slots ``>= 0`` must be distinct
        and ``< num_blocks * block_size`` (checked: ``InvalidArgumentError``).
    k_scale, v_scale : float, optional
        fp8 caches only: the per-tensor scales (positive).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> k_cache = torch.zeros(4, 16, 2, 64)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> qkv = torch.randn(3, 8 * 64)                      # fused projection output
    >>> k = qkv[:, 4 * 64:6 * 64].view(3, 2, 64)          # token stride 512
    >>> v = qkv[:, 6 * 64:].view(3, 2, 64)
    >>> ops.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([17, 18, -1]))
    >>> bool(torch.equal(k_cache[1, 2], k[1]))
    True
    """
    op = "reshape_and_cache"
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        _tensor(op, name, t)
    _cache_pair(op, key_cache, value_cache)
    _dim(op, "key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise ValueError(f"{op}: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"{op}: key is [num_tokens, {key.shape[1]}, {key.shape[2]}] but the cache holds "
            f"[num_kv_heads, head_dim] = [{num_kv_heads}, {head_dim}]"
        )
    dtype = _float_dtype(op, "key", key)
    _same_dtype(op, "value", value, "key", key)
    _fp8_cache(op, key_cache, "key", key, k_scale, v_scale)
    _index(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping must be [num_tokens] = [{key.shape[0]}], got shape "
            f"{tuple(slot_mapping.shape)}"
        )
    _contiguous(op, "slot_mapping", slot_mapping)
    key_stride = _token_stride(op, "key", key)
    value_stride = _token_stride(op, "value", value)
    device = _same_device(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                          slot_mapping=slot_mapping)
    if device.type == "cuda":
        _aligned(op, "key", key, key_stride)
        _aligned(op, "value", value, value_stride)
        _check_range(op, "slot_mapping", slot_mapping, 0, num_blocks * block_size, allow_negative=True)
        _C.cuda_reshape_and_cache(
            key=key.data_ptr(), value=value.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), slot_mapping=slot_mapping.data_ptr(),
            slot_mapping_int64=slot_mapping.dtype == torch.int64, dtype=_CUDA_DTYPES[key.dtype],
            num_tokens=key.shape[0], num_kv_heads=num_kv_heads, head_dim=head_dim,
            num_blocks=num_blocks, block_size=block_size, key_stride=key_stride,
            value_stride=value_stride, cache_dtype=_CUDA_DTYPES[key_cache.dtype],
            k_scale=float(k_scale), v_scale=float(v_scale), stream=_stream(device),
        )
        return
    _C.cpu_reshape_and_cache(
        key=key.data_ptr(),
        value=value.data_ptr(),
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        slot_mapping_type=_INDEX_TYPES[slot_mapping.dtype],
        dtype=dtype,
        num_tokens=key.shape[0],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        key_stride=key_stride,
        value_stride=value_stride,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a batch of rows over their paged KV cache.

    One call serves decode rows (one query), prefill rows (with or without a cached
    prefix) and chunked-prefill rows together. Row ``r`` owns the queries
    ``query_start_loc[r] .. query_start_loc[r+1] - 1``; they are the last ``q_len``
    positions of its sequence, so query ``i`` of the row sits at position
    ``p = seq_lens[r] - q_len + i`` and attends to keys ``j <= p`` (only
    ``p - sliding_window < j <= p`` when ``sliding_window > 0``), read from the cache
    through the row's block table. Query head ``h`` uses kv head
    ``h // (num_heads // num_kv_heads)`` (GQA). Write the step's keys and values with
    :func:`reshape_and_cache` first. Blocks and slots no query of a row sees are never
    read (they may hold the null block or NaN).

    ``score = (q . k) * scale``, then ``softcap * tanh(score / softcap)`` when
    ``softcap > 0``; softmax and accumulation in float32; the output is written in the
    query's dtype.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_dim]``; heads dense, token stride free.
        ``head_dim`` must be one of :data:`SUPPORTED_HEAD_DIMS`.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same dtype as
        ``query`` (or, on CUDA with bfloat16/float16 queries, ``torch.float8_e4m3fn``
        holding ``key / k_scale`` and ``value / v_scale``);
        ``num_heads % num_kv_heads == 0``.
    block_tables : torch.Tensor
        ``[num_seqs, max_blocks_per_seq]`` int32, ``stride(1) == 1`` (rows may be a
        slice of a wider table).
    seq_lens : torch.Tensor
        ``[num_seqs]`` int32: tokens in the cache for each row, this step's included.
    query_start_loc : torch.Tensor
        ``[num_seqs + 1]`` int32, non-decreasing, ``query_start_loc[-1] <= num_tokens``.
    scale : float
        Score scale, usually ``head_dim ** -0.5``.
    sliding_window : int, optional
        Keys visible to a query: the last ``sliding_window`` positions; 0 = all.
    softcap : float, optional
        Logit soft-capping (Gemma 2); 0 = off.
    out : torch.Tensor, optional
        ``[num_tokens, num_heads, head_dim]``, contiguous, query's dtype. Rows after
        ``query_start_loc[-1]`` are left untouched.
    plan : AttentionPlan, optional
        CUDA only: the work split of this step from :func:`plan_attention`, made once
        per step and shared by every layer. Without it the plan is made here (which
        reads ``query_start_loc`` and ``seq_lens`` back to the host).
    k_scale, v_scale : float, optional
        fp8 caches only: the scales the cache was written with.

    Returns
    -------
    torch.Tensor
        ``out`` (newly allocated when not given).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> k_cache = torch.randn(8, 16, 1, 64)
    >>> v_cache = torch.randn(8, 16, 1, 64)
    >>> q = torch.randn(1 + 5, 3, 64)   # row 0: one decode token, row 1: a 5-token prefill
    >>> out = ops.paged_attention(
    ...     q, k_cache, v_cache,
    ...     block_tables=torch.tensor([[3, 1], [5, 0]], dtype=torch.int32),
    ...     seq_lens=torch.tensor([20, 5], dtype=torch.int32),
    ...     query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
    ...     scale=64 ** -0.5)
    >>> out.shape
    torch.Size([6, 3, 64])
    """
    op = "paged_attention"
    for name, t in (
        ("query", query),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _tensor(op, name, t)
    _cache_pair(op, key_cache, value_cache)
    _dim(op, "query", query, 3, "[num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"{op}: query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: unsupported head_dim: {head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{op}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    dtype = _float_dtype(op, "query", query)
    _fp8_cache(op, key_cache, "query", query, k_scale, v_scale)
    query_stride = _token_stride(op, "query", query)

    _index(op, "block_tables", block_tables, (torch.int32,))
    _index(op, "seq_lens", seq_lens, (torch.int32,))
    _index(op, "query_start_loc", query_start_loc, (torch.int32,))
    _dim(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    num_seqs, max_blocks_per_seq = block_tables.shape
    if max_blocks_per_seq > 1 and block_tables.stride(1) != 1:
        raise ValueError(
            f"{op}: block_tables rows must be dense (stride(1) == 1), got strides "
            f"{block_tables.stride()}"
        )
    table_stride = block_tables.stride(0) if num_seqs > 1 else max_blocks_per_seq
    if table_stride < max_blocks_per_seq:
        raise ValueError(f"{op}: block_tables row stride {table_stride} < {max_blocks_per_seq}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"{op}: seq_lens must be [num_seqs] = [{num_seqs}], got shape {tuple(seq_lens.shape)}"
        )
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"{op}: query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    _contiguous(op, "seq_lens", seq_lens)
    _contiguous(op, "query_start_loc", query_start_loc)

    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"{op}: scale must be a finite float, got {scale!r}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"{op}: sliding_window must be an int, got {sliding_window!r}")
    sliding_window = operator.index(sliding_window)
    if not 0 <= sliding_window < 2**31:
        raise ValueError(f"{op}: sliding_window must be >= 0 (0 = off), got {sliding_window}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{op}: softcap must be a float, got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{op}: softcap must be finite and >= 0 (0 = off), got {softcap}")

    device = _same_device(op, query=query, key_cache=key_cache, value_cache=value_cache,
                          block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=device)
    else:
        _tensor(op, "out", out)
        if out.shape != query.shape:
            raise ValueError(
                f"{op}: out shape {tuple(out.shape)} != query shape {tuple(query.shape)}"
            )
        _same_dtype(op, "out", out, "query", query)
        _contiguous(op, "out", out)
        _same_device(op, query=query, out=out)

    if device.type == "cuda":
        if plan is None:
            _check_range(op, "block_tables", block_tables, 0, num_blocks)
            plan = plan_attention(query_start_loc.cpu().numpy(), seq_lens.cpu().numpy(),
                                  num_heads, num_kv_heads, device, head_dim, query.dtype)
        vectors = _C.cuda_attention_tile_vectors(query.element_size())
        if plan.tile_tokens * (num_heads // num_kv_heads) > vectors:
            raise ValueError(
                f"{op}: the plan's tiles hold {plan.tile_tokens} tokens x {num_heads // num_kv_heads} heads; "
                f"{query.dtype} queries allow {vectors} vectors (plan with dtype={query.dtype})"
            )
        _C.cuda_paged_attention(
            out=out.data_ptr(), query=query.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), block_tables=block_tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(), query_start_loc=query_start_loc.data_ptr(),
            work_seq=plan.work_seq.data_ptr(), work_q_start=plan.work_q_start.data_ptr(),
            decode_seq=plan.decode_seq.data_ptr(), num_decode=plan.num_decode,
            decode_splits=plan.decode_splits, **plan.partial_ptrs(num_kv_heads, head_dim),
            num_work=plan.num_work, num_splits=plan.num_splits, tile_tokens=plan.tile_tokens, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            num_blocks=num_blocks, query_stride=query_stride, block_tables_stride=table_stride,
            scale=float(scale), softcap=float(softcap), sliding_window=sliding_window,
            dtype=_CUDA_DTYPES[query.dtype], kv_dtype=_CUDA_DTYPES[key_cache.dtype],
            k_scale=float(k_scale), v_scale=float(v_scale), stream=_stream(device),
        )
        return out

    _C.cpu_paged_attention(
        out=out.data_ptr(),
        query=query.data_ptr(),
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        block_tables=block_tables.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        query_start_loc=query_start_loc.data_ptr(),
        dtype=dtype,
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        num_seqs=num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        query_stride=query_stride,
        block_tables_stride=table_stride,
        scale=float(scale),
        sliding_window=sliding_window,
        softcap=float(softcap),
    )
    return out


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks within every layer's cache (copy-on-write), in one call.

    For every layer ``l`` and pair ``(src, dst)`` of ``block_mapping``:
    ``key_caches[l][dst] = key_caches[l][src]`` and the same for ``value_caches``.

    Parameters
    ----------
    key_caches, value_caches : sequence of torch.Tensor
        One ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer, all
        of one shape and dtype, contiguous.
    block_mapping : torch.Tensor
        ``[num_pairs, 2]`` int32 or int64 (src, dst). Ids must be in
        ``[0, num_blocks)``, destinations distinct and never also a source (checked:
        ``InvalidArgumentError``).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> ks = [torch.randn(4, 16, 2, 64) for _ in range(3)]
    >>> vs = [torch.randn(4, 16, 2, 64) for _ in range(3)]
    >>> ops.copy_blocks(ks, vs, torch.tensor([[1, 3]]))
    >>> bool(torch.equal(ks[2][3], ks[2][1]))
    True
    """
    op = "copy_blocks"
    if isinstance(key_caches, torch.Tensor) or isinstance(value_caches, torch.Tensor):
        raise TypeError(
            f"{op}: key_caches and value_caches must be sequences of tensors, one per layer"
        )
    key_caches, value_caches = list(key_caches), list(value_caches)
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{op}: {len(key_caches)} key caches but {len(value_caches)} value caches")
    _block_mapping(op, block_mapping)
    if not key_caches:
        return
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        _cache_pair(f"{op} (layer {layer})", k, v)
        if k.shape != key_caches[0].shape or k.dtype != key_caches[0].dtype:
            raise ValueError(
                f"{op}: layer {layer} cache is {tuple(k.shape)} {k.dtype}, layer 0 is "
                f"{tuple(key_caches[0].shape)} {key_caches[0].dtype}"
            )
    ref = key_caches[0]
    device = _same_device(op, block_mapping=block_mapping,
                          **{f"cache{i}": t for i, t in enumerate(key_caches + value_caches)})
    if device.type == "cuda":  # bytes are copied: any dtype, fp8 included
        if block_mapping.shape[0] == 0:
            return
        _check_range(op, "block_mapping", block_mapping, 0, ref.shape[0])
        caches = _pointer_table(key_caches + value_caches, device)
        mapping = block_mapping.to(torch.int64)
        _C.cuda_copy_blocks(
            cache_ptrs=caches.data_ptr(), block_mapping=mapping.data_ptr(),
            num_caches=caches.shape[0], num_pairs=mapping.shape[0], num_blocks=ref.shape[0],
            block_bytes=ref[0].numel() * ref.element_size(), stream=_stream(device),
        )
        return
    dtype = _float_dtype(op, "key_caches[0]", ref)
    _C.cpu_copy_blocks(
        key_caches=[t.data_ptr() for t in key_caches],
        value_caches=[t.data_ptr() for t in value_caches],
        block_mapping=block_mapping.data_ptr(),
        block_mapping_type=_INDEX_TYPES[block_mapping.dtype],
        dtype=dtype,
        num_pairs=block_mapping.shape[0],
        num_blocks=ref.shape[0],
        block_numel=math.prod(ref.shape[1:]),
    )


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks from one cache pool to another (swap-out / swap-in).

    ``dst[d] = src[s]`` for every pair ``(s, d)`` of ``block_mapping``. Call once per
    layer and per K / V cache.

    Parameters
    ----------
    src : torch.Tensor
        ``[num_src_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
    dst : torch.Tensor
        ``[num_dst_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same
        block shape and dtype as ``src``. Written in place.
    block_mapping : torch.Tensor
        ``[num_pairs, 2]`` int32 or int64 (src block, dst block); ids in range and
        destinations distinct (checked: ``InvalidArgumentError``).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> gpu_like = torch.randn(8, 16, 2, 64)
    >>> cpu_pool = torch.zeros(4, 16, 2, 64)
    >>> ops.swap_blocks(gpu_like, cpu_pool, torch.tensor([[5, 0], [6, 1]]))
    >>> bool(torch.equal(cpu_pool[1], gpu_like[6]))
    True
    """
    op = "swap_blocks"
    _tensor(op, "src", src)
    _tensor(op, "dst", dst)
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _dim(op, "src", src, 4, layout)
    _dim(op, "dst", dst, 4, layout)
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"{op}: src blocks {tuple(src.shape[1:])} != dst blocks {tuple(dst.shape[1:])}"
        )
    dtype = _float_dtype(op, "src", src)
    _same_dtype(op, "dst", dst, "src", src)
    _contiguous(op, "src", src)
    _contiguous(op, "dst", dst)
    _block_mapping(op, block_mapping)
    if src.is_cuda or dst.is_cuda:
        # One gather and one copy per call (not one per block); the runner moves
        # every layer at once with swap_out / swap_in instead.
        if block_mapping.shape[0] == 0:
            return
        _check_range(op, "block_mapping[:, 0]", block_mapping[:, 0], 0, src.shape[0])
        _check_range(op, "block_mapping[:, 1]", block_mapping[:, 1], 0, dst.shape[0])
        index_src = block_mapping[:, 0].to(device=src.device, dtype=torch.int64)
        index_dst = block_mapping[:, 1].to(device=dst.device, dtype=torch.int64)
        dst.index_copy_(0, index_dst, src.index_select(0, index_src).to(dst.device))
        return
    _C.cpu_swap_blocks(
        src=src.data_ptr(),
        dst=dst.data_ptr(),
        block_mapping=block_mapping.data_ptr(),
        block_mapping_type=_INDEX_TYPES[block_mapping.dtype],
        dtype=dtype,
        num_pairs=block_mapping.shape[0],
        num_src_blocks=src.shape[0],
        num_dst_blocks=dst.shape[0],
        block_numel=math.prod(src.shape[1:]),
    )


# ---- threads and instruction set ------------------------------------------------------------


def set_num_threads(n: int) -> None:
    """Set the number of threads of the CPU kernels (the calling thread included).

    The default is ``std::thread::hardware_concurrency()``. Independent of
    ``torch.set_num_threads``: on a small machine give the two together no more threads
    than cores.

    Parameters
    ----------
    n : int
        ``>= 1``.

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.set_num_threads(2)
    >>> ops.get_num_threads()
    2
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    _C.cpu_set_num_threads(n)


def get_num_threads() -> int:
    """Number of threads the CPU kernels use (see :func:`set_num_threads`).

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.get_num_threads() >= 1
    True
    """
    return _C.cpu_get_num_threads()


def cpu_isa() -> str:
    """Instruction set the attention kernel runs with: ``"avx512"``, ``"avx2"`` or
    ``"generic"`` (the best the CPU supports, unless :func:`set_cpu_isa` chose another).

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.cpu_isa() in ("avx512", "avx2", "generic")
    True
    """
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> None:
    """Select the attention kernel's instruction set (for tests and benchmarks).

    Parameters
    ----------
    isa : str
        ``"avx512"``, ``"avx2"`` or ``"generic"``; raises ``ValueError`` when unknown or
        not supported by this CPU.

    Examples
    --------
    >>> from pagedcore import ops
    >>> best = ops.cpu_isa()
    >>> ops.set_cpu_isa("generic")
    >>> ops.set_cpu_isa(best)
    """
    _C.cpu_set_isa(isa)


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


class AttentionPlan:
    """How :func:`paged_attention` splits one step's rows over CUDA thread blocks.

    Rows with one query (decode) go to the decode kernel, one thread block per
    (row, kv head) streaming the row's keys, when the shape allows
    (``cuda_decode_supported``); other rows are cut into work items, tiles of
    consecutive query tokens (as many as fill ``cuda_attention_tile_vectors``
    query vectors with the heads of one kv head). With few blocks and long
    contexts, keys are also split (``num_splits`` / ``decode_splits``) and
    merged by a second kernel. Made once per step on the host
    (:func:`plan_attention`) and reused by every layer.
    """

    def __init__(self, work_seq, work_q_start, tile_tokens, num_splits, decode_seq, decode_splits, device) -> None:
        self.num_work = int(work_seq.shape[0])
        self.num_decode = int(decode_seq.shape[0])
        self.tile_tokens = tile_tokens
        self.num_splits = num_splits
        self.decode_splits = decode_splits
        self.device = device
        self.work_seq = torch.from_numpy(work_seq).to(device, non_blocking=True)
        self.work_q_start = torch.from_numpy(work_q_start).to(device, non_blocking=True)
        self.decode_seq = torch.from_numpy(decode_seq).to(device, non_blocking=True)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, size: int, dtype: torch.dtype = torch.float32) -> int:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:
            # NOTE: counters must start at zero; the kernels leave them at zero.
            buf = self._buffers[name] = torch.zeros(size, dtype=dtype, device=self.device)
        return buf.data_ptr()

    def partial_ptrs(self, num_kv_heads: int, head_dim: int) -> dict[str, int]:
        """Scratch for split keys: the tiles' and the decode rows' partial outputs,
        and the counters with which the last split of each merges them."""
        v = _C.cuda_attention_partial_vectors
        ptrs = {"partial_out": 0, "partial_lse": 0, "decode_partial_out": 0, "decode_partial_lse": 0,
                "split_counters": 0, "decode_split_counters": 0}
        if self.num_splits > 1 and self.num_work:
            n = self.num_work * num_kv_heads * self.num_splits * v
            ptrs["partial_out"] = self._buffer("partial_out", n * head_dim)
            ptrs["partial_lse"] = self._buffer("partial_lse", n * 2)
            ptrs["split_counters"] = self._buffer("split_counters", self.num_work * num_kv_heads, torch.int32)
        if self.decode_splits > 1 and self.num_decode:
            n = self.num_decode * num_kv_heads * self.decode_splits * v
            ptrs["decode_partial_out"] = self._buffer("decode_partial_out", n * head_dim)
            ptrs["decode_partial_lse"] = self._buffer("decode_partial_lse", n * 2)
            ptrs["decode_split_counters"] = self._buffer(
                "decode_split_counters", self.num_decode * num_kv_heads, torch.int32)
        return ptrs


def _splits(blocks: int, longest: int, sms: int) -> int:
    # Split keys when the blocks alone leave most multiprocessors idle.
    if blocks >= sms or longest < 512:
        return 1
    return int(max(1, min(-(-2 * sms // blocks), longest // 256, 64)))


def plan_attention(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionPlan:
    """Plans :func:`paged_attention` on CUDA for one step (host arrays in, no sync).

    Parameters
    ----------
    query_start_loc : np.ndarray
        ``[num_seqs + 1]`` the step's row starts (host copy).
    seq_lens : np.ndarray
        ``[num_seqs]`` tokens cached per row after the step (host copy).
    head_dim, dtype : optional
        The head size and the query's dtype; when given, tiles are sized for the
        kernel that serves that dtype and rows with a single query go to the
        decode kernel where it supports them.
    """
    group = num_heads // num_kv_heads
    element_size = dtype.itemsize if dtype is not None else 4
    vectors = _C.cuda_attention_tile_vectors(element_size)
    if group > vectors:
        raise ValueError(f"plan_attention: {group} query heads per kv head; at most {vectors} supported")
    tile = max(1, vectors // group)
    q_lens = np.diff(np.asarray(query_start_loc, dtype=np.int64))
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    rows = np.arange(q_lens.shape[0], dtype=np.int32)
    fast = (
        head_dim is not None and dtype is not None
        and _C.cuda_decode_supported(group, head_dim, element_size)
    )
    is_decode = (q_lens == 1) if fast else np.zeros(q_lens.shape[0], dtype=bool)
    decode_seq = rows[is_decode]
    tiles = np.where(is_decode, 0, (q_lens + tile - 1) // tile)
    total = int(tiles.sum())
    work_seq = np.repeat(rows, tiles)
    first_of_row = np.repeat(np.cumsum(tiles) - tiles, tiles)
    work_q_start = ((np.arange(total) - first_of_row) * tile).astype(np.int32)
    if total > 1:
        # Longest first (keys a tile reads: its last position + 1), so that the
        # short tiles fill the GPU's tail instead of the long ones.
        keys = seq_lens[work_seq] - q_lens[work_seq] + np.minimum(work_q_start + tile, q_lens[work_seq])
        order = np.argsort(-keys, kind="stable")
        work_seq, work_q_start = work_seq[order], work_q_start[order]
    sms = _sm_count(device)
    longest_tile = int(seq_lens[~is_decode].max()) if total else 0
    longest_decode = int(seq_lens[is_decode].max()) if decode_seq.size else 0
    return AttentionPlan(
        work_seq, work_q_start, tile, _splits(max(1, total * num_kv_heads), longest_tile, sms),
        decode_seq, _splits(max(1, decode_seq.size * num_kv_heads), longest_decode, sms), device,
    )


def plan_decode(num_rows: int, num_kv_heads: int, device: torch.device, max_seq_len: int) -> AttentionPlan:
    """A plan for ``num_rows`` decode rows (row ``i`` = query token ``i``) that does
    not depend on their lengths: key splits chosen for ``max_seq_len``, so one
    plan serves every step of that batch size (what a CUDA graph replays)."""
    empty = np.zeros(0, dtype=np.int32)
    rows = np.arange(num_rows, dtype=np.int32)
    splits = _splits(num_rows * num_kv_heads, max_seq_len, _sm_count(device))
    return AttentionPlan(empty, empty, 1, 1, rows, splits, device)


def _runs(ids: np.ndarray, max_gap: int) -> list[tuple[int, int]]:
    """Sorted distinct ids as (first, count) ranges; ranges at most ``max_gap``
    ids apart are joined (the ids in between come along)."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) > max_gap + 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]]) - 1
    return [(int(ids[s]), int(ids[e]) - int(ids[s]) + 1) for s, e in zip(starts, ends)]


# Host blocks a swap-in may read past those it needs, to join two runs into one copy.
_SWAP_IN_GAP = 8


def swap_out(gpu_caches: Sequence[torch.Tensor], cpu_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Moves blocks of every layer from the GPU caches to the CPU caches at once.

    ``cpu_caches[c][dst] = gpu_caches[c][src]`` for every cache ``c`` and pair
    ``(src, dst)``: one gather kernel into a device staging buffer (cache-major),
    then one device-to-host copy per cache and run of consecutive ``dst`` blocks,
    queued on the current stream (pinned CPU caches: asynchronous DMA).
    """
    caches = list(gpu_caches)
    if not caches or block_mapping.shape[0] == 0:
        return
    if caches[0].device.type == "cpu":  # a CPU engine: both pools are host memory
        for g, c in zip(caches, cpu_caches, strict=True):
            swap_blocks(g, c, block_mapping)
        return
    device = caches[0].device
    mapping = block_mapping.to("cpu", torch.int64).numpy()
    order = np.argsort(mapping[:, 1], kind="stable")
    src, dst = mapping[order, 0], mapping[order, 1]
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    staging = torch.empty((len(caches), src.size, block_bytes), dtype=torch.uint8, device=device)
    table = _pointer_table(caches, device)
    blocks = torch.from_numpy(src).to(device, non_blocking=True)
    _C.cuda_gather_blocks(
        cache_ptrs=table.data_ptr(), blocks=blocks.data_ptr(), staging=staging.data_ptr(),
        num_caches=len(caches), num_blocks_moved=src.size, num_blocks=caches[0].shape[0],
        block_bytes=block_bytes, to_staging=True, stream=_stream(device),
    )
    hosts = [cpu.view(cpu.shape[0], -1).view(torch.uint8) for cpu in cpu_caches]
    row = 0
    for first, count in _runs(dst, 0):  # exact runs: blocks in between belong to others
        for c, host in enumerate(hosts):
            host[first:first + count].copy_(staging[c, row:row + count], non_blocking=True)
        row += count


def swap_in(cpu_caches: Sequence[torch.Tensor], gpu_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Moves blocks of every layer from the CPU caches back to the GPU caches:
    one host-to-device copy per cache and run of consecutive source blocks (runs
    up to 8 blocks apart joined) into a device staging buffer, then one scatter
    kernel, queued on the current stream."""
    caches = list(gpu_caches)
    if not caches or block_mapping.shape[0] == 0:
        return
    if caches[0].device.type == "cpu":
        for g, c in zip(caches, cpu_caches, strict=True):
            swap_blocks(c, g, block_mapping)
        return
    device = caches[0].device
    mapping = block_mapping.to("cpu", torch.int64).numpy()
    order = np.argsort(mapping[:, 0], kind="stable")
    src, dst = mapping[order, 0], mapping[order, 1]
    runs = _runs(src, _SWAP_IN_GAP)
    rows = sum(count for _, count in runs)
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    staging = torch.empty((len(caches), rows, block_bytes), dtype=torch.uint8, device=device)
    targets = np.full(rows, -1, dtype=np.int64)  # staging row -> GPU block (-1: a gap row)
    hosts = [cpu.view(cpu.shape[0], -1).view(torch.uint8) for cpu in cpu_caches]
    row = 0
    for first, count in runs:
        for c, host in enumerate(hosts):
            staging[c, row:row + count].copy_(host[first:first + count], non_blocking=True)
        row += count
    starts = np.cumsum([0] + [count for _, count in runs[:-1]])
    firsts = np.array([first for first, _ in runs], dtype=np.int64)
    run_of = np.searchsorted(firsts, src, side="right") - 1
    targets[starts[run_of] + (src - firsts[run_of])] = dst
    blocks = torch.from_numpy(targets).to(device, non_blocking=True)
    table = _pointer_table(caches, device)
    _C.cuda_gather_blocks(
        cache_ptrs=table.data_ptr(), blocks=blocks.data_ptr(), staging=staging.data_ptr(),
        num_caches=len(caches), num_blocks_moved=rows, num_blocks=caches[0].shape[0],
        block_bytes=block_bytes, to_staging=False, stream=_stream(device),
    )
