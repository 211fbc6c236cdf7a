"""Paged attention over the KV cache (:func:`paged_attention`): decode, prefill
and chunked-prefill rows in one call."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from .. import _C
from . import cpu_fp8
from ._checks import (
    _CUDA_DTYPES,
    _cache_pair,
    _check_range,
    _contiguous,
    _dim,
    _float_dtype,
    _fp8_cache,
    _index,
    _same_device,
    _same_dtype,
    _stream,
    _tensor,
    _token_stride,
)
from .planning import AttentionPlan, plan_attention

#: Head sizes the attention kernel is compiled for.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)

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
        ``query`` (or ``torch.float8_e4m3fn`` holding ``key / k_scale`` and
        ``value / v_scale``; on CUDA for bfloat16/float16 queries; on the CPU the
        visible blocks are dequantized and read in float32, :mod:`.cpu_fp8`);
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
        reads ``query_start_loc`` and ``seq_lens`` back to the host). A plan serves
        only steps whose decode rows hold at most its ``decode_max_query_tokens``
        query tokens (where it is not 0): fp8 decode at head dim 128 launches a kernel
        built for no more where that is at most 8 query vectors a row, which traps on a
        longer row.
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
            k_scale=float(k_scale), v_scale=float(v_scale), decode_cluster=plan.decode_cluster,
            decode_max_query_tokens=plan.decode_max_query_tokens, stream=_stream(device),
        )
        return out

    if key_cache.dtype == cpu_fp8.FP8_DTYPE:
        # The visible blocks dequantized, then the float32 kernel (see cpu_fp8).
        keys, values, tables = cpu_fp8.dequantized_blocks(op, key_cache, value_cache, block_tables, seq_lens,
                                                          k_scale, v_scale)
        result = paged_attention(query.float(), keys, values, tables, seq_lens, query_start_loc, scale=scale,
                                 sliding_window=sliding_window, softcap=softcap)
        rows = int(query_start_loc[-1])
        out[:rows].copy_(result[:rows])
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
