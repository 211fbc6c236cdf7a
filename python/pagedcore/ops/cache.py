"""KV-cache operations: the cache write (:func:`reshape_and_cache`), copy-on-write
block copies (:func:`copy_blocks`) and swapping between the GPU and CPU pools
(:func:`swap_blocks`, :func:`swap_out`, :func:`swap_in`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .. import _C
from . import cpu_fp8
from ._checks import (
    _CUDA_DTYPES,
    _INDEX_TYPES,
    _aligned,
    _block_mapping,
    _cache_pair,
    _check_range,
    _contiguous,
    _dim,
    _float_dtype,
    _fp8_cache,
    _index,
    _pointer_table,
    _same_device,
    _same_dtype,
    _stream,
    _tensor,
    _token_stride,
)


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
        as ``key``, or ``torch.float8_e4m3fn`` (on CUDA for bfloat16/float16 keys):
        then ``key / k_scale`` and ``value / v_scale`` are stored, saturated to
        +-448 (the CPU writes them in torch, :mod:`.cpu_fp8`). Written in place.
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
    if key_cache.dtype == cpu_fp8.FP8_DTYPE:
        cpu_fp8.write(op, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
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
    if ref.dtype == cpu_fp8.FP8_DTYPE:
        pairs = cpu_fp8.block_pairs(op, block_mapping, ref.shape[0], ref.shape[0], within=True)
        for t in key_caches + value_caches:
            cpu_fp8.copy_bytes(t, t, pairs)
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
    fp8 = src.dtype == cpu_fp8.FP8_DTYPE
    dtype = None if fp8 else _float_dtype(op, "src", src)
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
    if fp8:
        cpu_fp8.copy_bytes(src, dst, cpu_fp8.block_pairs(op, block_mapping, src.shape[0], dst.shape[0]))
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
