"""The decoder layer's fused elementwise ops: RMSNorm (plain, per head, fused with the
residual add), rotary embedding from a cos/sin table, SiLU-and-multiply.

Each is one kernel launch (C++ on the CPU, CUDA on the GPU) in place of the
handful of torch ops of the Hugging Face modules, with the same arithmetic:
float32 reductions and products, and every intermediate rounded to the
activation dtype where those modules round it. bfloat16 / float16 results
therefore equal the unfused torch arithmetic; float32 results equal it up to
the order of the variance sum (about an ulp).
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import _C
from . import cpu_fp8
from ._checks import (
    _CUDA_DTYPES,
    _INDEX_TYPES,
    _cache_pair,
    _check_range,
    _contiguous,
    _dim,
    _float_dtype,
    _fp8_cache,
    _index,
    _overlap,
    _same_device,
    _same_dtype,
    _stream,
    _tensor,
    _token_stride,
)

__all__ = ["cos_sin_cache", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]


def _eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a float, got {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return float(eps)


def _rows(op: str, name: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_tokens, num_heads, hidden_size, token stride) of a [T, H] or [T, heads, D] tensor."""
    if t.dim() == 2:
        tokens, hidden = t.shape
        if hidden > 1 and t.stride(1) != 1:
            raise ValueError(f"{op}: {name} rows must be dense (stride(1) == 1), got strides {t.stride()}")
        stride = t.stride(0) if tokens > 1 else hidden
        if stride < hidden:
            raise ValueError(f"{op}: {name} token stride {stride} < hidden size {hidden}")
        return tokens, 1, hidden, stride
    if t.dim() == 3:
        return t.shape[0], t.shape[1], t.shape[2], _token_stride(op, name, t)
    raise ValueError(f"{op}: {name} must be [num_tokens, hidden_size] or [num_tokens, num_heads, head_dim], "
                     f"got shape {tuple(t.shape)}")


def _weight(op: str, weight: object, size: int, ref: torch.Tensor, ref_name: str) -> torch.Tensor:
    _tensor(op, "weight", weight)
    if weight.shape != (size,):
        raise ValueError(f"{op}: weight must be [{size}], got shape {tuple(weight.shape)}")
    _same_dtype(op, "weight", weight, ref_name, ref)
    _contiguous(op, "weight", weight)
    return weight


def _norm(op: str, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
          weight: torch.Tensor, eps: float, tokens: int, heads: int, size: int,
          x_stride: int, out_stride: int, residual_stride: int) -> None:
    device = _same_device(op, x=x, weight=weight, out=out, **({} if residual is None else {"residual": residual}))
    residual_ptr = 0 if residual is None else residual.data_ptr()
    if device.type == "cuda":
        _C.cuda_rms_norm(
            out=out.data_ptr(), input=x.data_ptr(), residual=residual_ptr, weight=weight.data_ptr(),
            dtype=_CUDA_DTYPES[x.dtype], num_tokens=tokens, num_heads=heads, hidden_size=size,
            input_stride=x_stride, out_stride=out_stride, residual_stride=residual_stride, eps=eps,
            stream=_stream(device),
        )
        return
    _C.cpu_rms_norm(
        out=out.data_ptr(), input=x.data_ptr(), residual=residual_ptr, weight=weight.data_ptr(),
        dtype=_float_dtype(op, "x", x), num_tokens=tokens, num_heads=heads, hidden_size=size,
        input_stride=x_stride, out_stride=out_stride, residual_stride=residual_stride, eps=eps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of ``x``, as Hugging Face's ``LlamaRMSNorm`` computes it:
    ``weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)``.

    A 3-D ``x`` is normalised per head: this is Qwen3's q/k norm, applied in place
    to the q or k part of a fused qkv output (``out=q``).

    Parameters
    ----------
    x : torch.Tensor
        ``[num_tokens, hidden_size]`` with dense rows (the token stride is free), or
        ``[num_tokens, num_heads, head_dim]`` with dense heads (``stride(2) == 1``,
        ``stride(1) == head_dim``, token stride free). float32 / bfloat16 / float16.
    weight : torch.Tensor
        ``[hidden_size]`` (or ``[head_dim]``), contiguous, ``x``'s dtype.
    eps : float
        Added to the mean square (finite, ``>= 0``).
    out : torch.Tensor, optional
        ``x``'s shape and dtype, same layout rules; may be ``x`` itself (in place).
        Allocated (contiguous) when not given.

    Returns
    -------
    torch.Tensor
        ``out``.

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> x = torch.randn(3, 64)
    >>> y = ops.rms_norm(x, torch.ones(64), 1e-6)
    >>> bool(torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    True
    """
    op = "rms_norm"
    _tensor(op, "x", x)
    _float_dtype(op, "x", x)
    tokens, heads, size, x_stride = _rows(op, "x", x)
    _weight(op, weight, size, x, "x")
    eps = _eps(op, eps)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _tensor(op, "out", out)
        if out.shape != x.shape:
            raise ValueError(f"{op}: out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
        _same_dtype(op, "out", out, "x", x)
    _, _, _, out_stride = _rows(op, "out", out)
    if out.data_ptr() == x.data_ptr() and out_stride != x_stride and tokens > 1:
        raise ValueError(f"{op}: out overlaps x with another layout (strides {out.stride()} vs {x.stride()})")
    _norm(op, out, x, None, weight, eps, tokens, heads, size, x_stride, out_stride, 0)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The residual add and the next RMSNorm in one pass, in place (vLLM's semantics):
    ``residual <- residual + x`` (in the activation dtype, as Hugging Face adds),
    then ``x <- rms_norm(residual, weight, eps)``.

    Parameters
    ----------
    x : torch.Tensor
        ``[num_tokens, hidden_size]``, dense rows (token stride free); overwritten
        with the normalised sum.
    residual : torch.Tensor
        ``[num_tokens, hidden_size]``, dense rows, ``x``'s dtype; overwritten with the
        sum. Must not overlap ``x``.
    weight : torch.Tensor
        ``[hidden_size]``, contiguous, ``x``'s dtype.
    eps : float
        Added to the mean square (finite, ``>= 0``).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> x, residual = torch.randn(2, 64), torch.randn(2, 64)
    >>> total = x + residual
    >>> ops.fused_add_rms_norm(x, residual, torch.ones(64), 1e-6)
    >>> bool(torch.equal(residual, total))
    True
    """
    op = "fused_add_rms_norm"
    _tensor(op, "x", x)
    _tensor(op, "residual", residual)
    _float_dtype(op, "x", x)
    _dim(op, "x", x, 2, "[num_tokens, hidden_size]")
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    _same_dtype(op, "residual", residual, "x", x)
    tokens, _, size, x_stride = _rows(op, "x", x)
    _, _, _, residual_stride = _rows(op, "residual", residual)
    _weight(op, weight, size, x, "x")
    eps = _eps(op, eps)
    if tokens and _overlap(x, residual):
        raise ValueError(f"{op}: residual must not overlap x")
    _norm(op, x, x, residual, weight, eps, tokens, 1, size, x_stride, x_stride, residual_stride)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """The table :func:`rotary_embedding` reads: float32 ``[max_positions, head_dim]``,
    row ``p`` = ``cos(p * inv_freq) | sin(p * inv_freq)``, computed on ``inv_freq``'s
    device with the arithmetic of Hugging Face's rotary embedding (float32 positions
    times float32 frequencies).

    Parameters
    ----------
    inv_freq : torch.Tensor
        ``[head_dim // 2]`` float32 inverse frequencies (scaling applied), e.g.
        ``ModelSpec.inv_freq()``.
    max_positions : int
        Rows of the table (``max_model_len``).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> table = ops.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), 128)
    >>> table.shape
    torch.Size([128, 64])
    """
    op = "cos_sin_cache"
    _tensor(op, "inv_freq", inv_freq)
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1:
        raise TypeError(f"{op}: inv_freq must be a 1-D float32 tensor, got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if isinstance(max_positions, bool) or not isinstance(max_positions, numbers.Integral) or max_positions < 1:
        raise ValueError(f"{op}: max_positions must be an int >= 1, got {max_positions!r}")
    positions = torch.arange(int(max_positions), dtype=torch.int64, device=inv_freq.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    value: torch.Tensor | None = None,
    key_cache: torch.Tensor | None = None,
    value_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotary embedding (rotate-half layout), in place on ``query`` and ``key``, and
    optionally the paged cache write of the rotated keys and the values in the same
    kernel.

    With ``c, s = cos_sin_cache[positions[t]].chunk(2)`` rounded to the dtype, every
    head ``x`` of token ``t`` becomes ``x * cat(c, c) + rotate_half(x) * cat(s, s)``
    with each product and the sum rounded to the dtype, as Hugging Face computes it.
    With ``key_cache`` given, the rotated keys and the values are then written as
    :func:`~pagedcore.ops.reshape_and_cache` writes them (same arguments, same
    semantics: slots ``< 0`` skipped, fp8 caches with their scales).

    Parameters
    ----------
    positions : torch.Tensor
        ``[num_tokens]`` int32 or int64, contiguous, each in
        ``[0, cos_sin_cache.shape[0])`` (checked; on CUDA outside
        :func:`~pagedcore.ops.unchecked_indices`; a CUDA token outside is left as it is).
    query, key : torch.Tensor
        ``[num_tokens, num_heads, head_dim]`` and ``[num_tokens, num_kv_heads,
        head_dim]``, one dtype (float32 / bfloat16 / float16), heads dense, token
        strides free: the q and k parts of a fused qkv output are rotated where they
        lie. They must not share an element.
    cos_sin_cache : torch.Tensor
        ``[max_positions, head_dim]`` float32, contiguous (:func:`cos_sin_cache`).
    value, key_cache, value_cache, slot_mapping : torch.Tensor, optional
        All four or none: the cache write, as for ``reshape_and_cache(key, value,
        key_cache, value_cache, slot_mapping)``.
    k_scale, v_scale : float, optional
        fp8 caches only: the per-tensor scales (positive).

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> qkv = torch.randn(2, (4 + 2 + 2) * 64)
    >>> q, k = qkv[:, :256].view(2, 4, 64), qkv[:, 256:384].view(2, 2, 64)
    >>> v = qkv[:, 384:].view(2, 2, 64)
    >>> table = ops.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), 16)
    >>> k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    >>> ops.rotary_embedding(torch.tensor([0, 7]), q, k, table, value=v, key_cache=k_cache,
    ...                      value_cache=v_cache, slot_mapping=torch.tensor([16, -1]))
    >>> bool(torch.equal(k_cache[1, 0], k[0]))
    True
    """
    op = "rotary_embedding"
    for name, t in (("positions", positions), ("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        _tensor(op, name, t)
    _dim(op, "query", query, 3, "[num_tokens, num_heads, head_dim]")
    _dim(op, "key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    dtype = _float_dtype(op, "query", query)
    _same_dtype(op, "key", key, "query", query)
    tokens, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != tokens or key.shape[2] != head_dim:
        raise ValueError(f"{op}: key shape {tuple(key.shape)} does not match query shape {tuple(query.shape)} "
                         f"(num_tokens and head_dim)")
    if head_dim % 2:
        raise ValueError(f"{op}: head_dim must be even, got {head_dim}")
    query_stride = _token_stride(op, "query", query)
    key_stride = _token_stride(op, "key", key)
    _index(op, "positions", positions, (torch.int32, torch.int64))
    if positions.shape != (tokens,):
        raise ValueError(f"{op}: positions must be [num_tokens] = [{tokens}], got shape {tuple(positions.shape)}")
    _contiguous(op, "positions", positions)
    if cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"{op}: cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"{op}: cos_sin_cache must be [max_positions, head_dim = {head_dim}], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    _contiguous(op, "cos_sin_cache", cos_sin_cache)
    cache_args = (value, key_cache, value_cache, slot_mapping)
    write = {"value": 0, "key_cache": 0, "value_cache": 0, "slot_mapping": 0, "num_blocks": 0, "block_size": 1,
             "value_stride": 0}
    tensors = {"positions": positions, "query": query, "key": key, "cos_sin_cache": cos_sin_cache}
    if any(t is not None for t in cache_args):
        if any(t is None for t in cache_args):
            raise ValueError(f"{op}: the cache write needs value, key_cache, value_cache and slot_mapping together")
        _tensor(op, "value", value)
        _tensor(op, "slot_mapping", slot_mapping)
        _cache_pair(op, key_cache, value_cache)
        if value.shape != key.shape:
            raise ValueError(f"{op}: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
        _same_dtype(op, "value", value, "key", key)
        num_blocks, block_size, cache_heads, cache_head_dim = key_cache.shape
        if (cache_heads, cache_head_dim) != (kv_heads, head_dim):
            raise ValueError(f"{op}: key is [num_tokens, {kv_heads}, {head_dim}] but the cache holds "
                             f"[num_kv_heads, head_dim] = [{cache_heads}, {cache_head_dim}]")
        _fp8_cache(op, key_cache, "key", key, k_scale, v_scale)
        _index(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
        if slot_mapping.shape != (tokens,):
            raise ValueError(f"{op}: slot_mapping must be [num_tokens] = [{tokens}], got shape "
                             f"{tuple(slot_mapping.shape)}")
        _contiguous(op, "slot_mapping", slot_mapping)
        write = {"value": value.data_ptr(), "key_cache": key_cache.data_ptr(), "value_cache": value_cache.data_ptr(),
                 "slot_mapping": slot_mapping.data_ptr(), "num_blocks": num_blocks, "block_size": block_size,
                 "value_stride": _token_stride(op, "value", value)}
        tensors.update(value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    device = _same_device(op, **tensors)
    max_position = cos_sin_cache.shape[0]
    if device.type == "cuda":
        _check_range(op, "positions", positions, 0, max_position)
        cache_dtype = _CUDA_DTYPES[query.dtype]
        if key_cache is not None:
            _check_range(op, "slot_mapping", slot_mapping, 0, write["num_blocks"] * write["block_size"],
                         allow_negative=True)
            cache_dtype = _CUDA_DTYPES[key_cache.dtype]
        _C.cuda_rotary_embedding(
            positions=positions.data_ptr(), positions_int64=positions.dtype == torch.int64,
            query=query.data_ptr(), key=key.data_ptr(), cos_sin_cache=cos_sin_cache.data_ptr(),
            dtype=_CUDA_DTYPES[query.dtype], num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, query_stride=query_stride, key_stride=key_stride, max_position=max_position,
            slot_mapping_int64=slot_mapping is not None and slot_mapping.dtype == torch.int64,
            cache_dtype=cache_dtype, k_scale=float(k_scale), v_scale=float(v_scale), stream=_stream(device),
            **write,
        )
        return
    fp8 = key_cache is not None and key_cache.dtype == cpu_fp8.FP8_DTYPE
    if fp8:  # rotary in C++, then the fp8 write in torch (cpu_fp8); slots checked before either
        cpu_fp8.check_slots(op, slot_mapping, write["num_blocks"] * write["block_size"])
        write = {"value": 0, "key_cache": 0, "value_cache": 0, "slot_mapping": 0, "num_blocks": 0,
                 "block_size": 1, "value_stride": 0}
    _C.cpu_rotary_embedding(
        positions=positions.data_ptr(), positions_type=_INDEX_TYPES[positions.dtype], query=query.data_ptr(),
        key=key.data_ptr(), cos_sin_cache=cos_sin_cache.data_ptr(), dtype=dtype, num_tokens=tokens,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, query_stride=query_stride,
        key_stride=key_stride, max_position=max_position,
        slot_mapping_type=_INDEX_TYPES[slot_mapping.dtype if slot_mapping is not None else torch.int64], **write,
    )
    if fp8:
        cpu_fp8.write(op, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate_up projection output ``x = [gate | up]``,
    as Hugging Face's MLP computes it (``F.silu`` rounded to the dtype, then the
    product).

    Parameters
    ----------
    x : torch.Tensor
        ``[num_tokens, 2 * intermediate_size]``, dense rows (token stride free),
        float32 / bfloat16 / float16.
    out : torch.Tensor, optional
        ``[num_tokens, intermediate_size]``, ``x``'s dtype, dense rows; must not
        overlap ``x``. Allocated (contiguous) when not given.

    Returns
    -------
    torch.Tensor
        ``out``.

    Examples
    --------
    >>> import torch
    >>> from pagedcore import ops
    >>> x = torch.randn(3, 2 * 128)
    >>> y = ops.silu_and_mul(x)
    >>> bool(torch.allclose(y, torch.nn.functional.silu(x[:, :128]) * x[:, 128:]))
    True
    """
    op = "silu_and_mul"
    _tensor(op, "x", x)
    dtype = _float_dtype(op, "x", x)
    _dim(op, "x", x, 2, "[num_tokens, 2 * intermediate_size]")
    tokens, _, width, x_stride = _rows(op, "x", x)
    if width % 2:
        raise ValueError(f"{op}: x's last dimension must be even (gate | up), got {width}")
    size = width // 2
    if out is None:
        out = torch.empty((tokens, size), dtype=x.dtype, device=x.device)
    else:
        _tensor(op, "out", out)
        if out.shape != (tokens, size):
            raise ValueError(f"{op}: out must be [num_tokens, intermediate_size] = [{tokens}, {size}], got shape "
                             f"{tuple(out.shape)}")
        _same_dtype(op, "out", out, "x", x)
        if tokens and _overlap(out, x):
            raise ValueError(f"{op}: out must not overlap x")
    _, _, _, out_stride = _rows(op, "out", out)
    device = _same_device(op, x=x, out=out)
    if size == 0 or tokens == 0:
        return out
    if device.type == "cuda":
        _C.cuda_silu_and_mul(
            out=out.data_ptr(), input=x.data_ptr(), dtype=_CUDA_DTYPES[x.dtype], num_tokens=tokens,
            intermediate_size=size, input_stride=x_stride, out_stride=out_stride, stream=_stream(device),
        )
        return out
    _C.cpu_silu_and_mul(
        out=out.data_ptr(), input=x.data_ptr(), dtype=dtype, num_tokens=tokens, intermediate_size=size,
        input_stride=x_stride, out_stride=out_stride,
    )
    return out
