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

CPU only for now: a CUDA tensor raises ``NotImplementedError`` (the CUDA kernels
land in step 3). The CPU kernels use a pool of threads owned by the core, sized
by :func:`set_num_threads`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

from . import _C

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "copy_blocks",
    "cpu_isa",
    "get_num_threads",
    "paged_attention",
    "reshape_and_cache",
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


def _tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        if t.device.type == "cuda":
            raise NotImplementedError(
                f"{op}: {name} is on {t.device}; the CUDA kernels land in step 3, "
                "only CPU tensors are supported for now"
            )
        raise ValueError(f"{op}: {name} must be a CPU tensor, got device {t.device}")
    return t


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
        as ``key``. Written in place.
    slot_mapping : torch.Tensor
        ``[num_tokens]``, int32 or int64, contiguous. Slots ``>= 0`` must be distinct
        and ``< num_blocks * block_size`` (checked: ``InvalidArgumentError``).

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
    _same_dtype(op, "key_cache", key_cache, "key", key)
    _index(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping must be [num_tokens] = [{key.shape[0]}], got shape "
            f"{tuple(slot_mapping.shape)}"
        )
    _contiguous(op, "slot_mapping", slot_mapping)
    key_stride = _token_stride(op, "key", key)
    value_stride = _token_stride(op, "value", value)
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
        ``query``; ``num_heads % num_kv_heads == 0``.
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
    _same_dtype(op, "key_cache", key_cache, "query", query)
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

    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    else:
        _tensor(op, "out", out)
        if out.shape != query.shape:
            raise ValueError(
                f"{op}: out shape {tuple(out.shape)} != query shape {tuple(query.shape)}"
            )
        _same_dtype(op, "out", out, "query", query)
        _contiguous(op, "out", out)

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
