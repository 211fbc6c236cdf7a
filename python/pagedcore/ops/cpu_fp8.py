"""The fp8 (e4m3) KV cache on the CPU, in torch: the cache write and the
dequantized blocks that attention reads.

The CPU attention kernel reads float caches only. With an fp8 cache the wrappers
in :mod:`.cache`, :mod:`.layer` and :mod:`.attention` come here: the write stores
``key * (1 / k_scale)`` saturated to +-448 and rounded to e4m3 (nearest even), as
the CUDA write does (the reciprocal in float32, then the product); attention
gathers the blocks the step's rows can see, multiplies them back by the scale in
float32 and runs the float32 kernel over that small dense copy. This costs a
copy of the visible context per layer and step; what it saves is memory (a
quarter of a float32 cache), which is what an fp8 cache is for on the CPU.
"""

from __future__ import annotations

import torch

from .. import _C

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def _reciprocal(scale: float) -> torch.Tensor:
    # As the CUDA kernels: the scale rounded to float32, then 1 / scale in float32.
    return torch.tensor(float(scale), dtype=torch.float32).reciprocal()


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as e4m3 (saturated at +-448, NaN kept), computed as
    ``x * (1 / scale)`` in float32."""
    return (x.float() * _reciprocal(scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_slots(op: str, slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The slots ``>= 0`` of ``slot_mapping`` (int64), after checking them as the
    C++ write does: below ``num_slots`` and distinct."""
    slots = slot_mapping.to(torch.int64)
    slots = slots[slots >= 0]
    if slots.numel():
        hi = int(slots.max())
        if hi >= num_slots:
            raise _C.InvalidArgumentError(f"{op}: slot_mapping holds {hi}, outside [0, {num_slots})")
        if torch.unique(slots).numel() != slots.numel():
            raise _C.InvalidArgumentError(f"{op}: slot_mapping holds a slot twice")
    return slots


def write(op: str, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """``reshape_and_cache`` into fp8 caches (arguments checked by the caller,
    slots checked here: in range and distinct, else nothing is written)."""
    num_blocks, block_size, heads, head_dim = key_cache.shape
    slots = check_slots(op, slot_mapping, num_blocks * block_size)
    keep = slot_mapping >= 0
    key_cache.view(-1, heads, head_dim)[slots] = quantize(key[keep], k_scale)
    value_cache.view(-1, heads, head_dim)[slots] = quantize(value[keep], v_scale)


def dequantized_blocks(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, k_scale: float, v_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the rows see (``ceil(seq_lens[r] / block_size)`` entries of row
    ``r``'s table), as float32 caches ``[1 + used, block_size, heads, head_dim]``
    holding ``e4m3 * scale`` (block 0 zeros), and the block tables renumbered into
    them (int32, contiguous; entries past a row's length point at block 0)."""
    num_blocks, block_size = key_cache.shape[:2]
    lens = seq_lens.to(torch.int64)
    width = block_tables.shape[1]
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > width * block_size):
        raise _C.InvalidArgumentError(
            f"{op}: seq_lens must be in [0, {width * block_size}] (max_blocks_per_seq * block_size), got "
            f"[{int(lens.min())}, {int(lens.max())}]")
    visible = torch.arange(width, dtype=torch.int64)[None, :] * block_size < lens[:, None]
    ids = block_tables[visible].to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise _C.InvalidArgumentError(f"{op}: block_tables holds {bad}, outside [0, {num_blocks})")
    used, renumbered = torch.unique(ids, return_inverse=True)
    # The used blocks' bytes through a 256-entry table of e4m3 value x scale. NOTE: the
    # table holds float32(e4m3) * float32(scale) rounded to float32, the product the
    # CUDA kernels compute (they fold the scale into the score / output scale); torch's
    # fp8 -> float32 cast is element by element and several times slower.
    k = _dequantize(key_cache, used, k_scale)
    v = _dequantize(value_cache, used, v_scale)
    tables = torch.zeros(block_tables.shape, dtype=torch.int32)
    tables[visible] = (renumbered + 1).to(torch.int32)
    return k, v, tables


# e4m3fn value of every byte (0x7f / 0xff: NaN).
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()


def _dequantize(cache: torch.Tensor, blocks: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 ``[1 + len(blocks), block_size, heads, head_dim]``: zeros (where table
    entries past a row's length point; never read), then the cache's ``blocks`` times
    ``scale``."""
    table = _E4M3_VALUES * torch.tensor(float(scale), dtype=torch.float32)
    out = torch.empty((1 + blocks.numel(),) + tuple(cache.shape[1:]), dtype=torch.float32)
    out[0] = 0.0
    codes = cache.view(torch.uint8).index_select(0, blocks).to(torch.int32)  # (int32: the fast index path)
    torch.index_select(table, 0, codes.view(-1), out=out[1:].view(-1))
    return out


def block_pairs(op: str, block_mapping: torch.Tensor, num_src_blocks: int, num_dst_blocks: int,
                within: bool = False) -> torch.Tensor:
    """``block_mapping`` as int64 after the checks the C++ copies make: ids in range,
    destinations distinct and (``within`` one pool) never also a source."""
    pairs = block_mapping.to(torch.int64)
    for column, name, limit in ((0, "src", num_src_blocks), (1, "dst", num_dst_blocks)):
        ids = pairs[:, column]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise _C.InvalidArgumentError(f"{op}: block_mapping {name} id {bad} outside [0, {limit})")
    dst = pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise _C.InvalidArgumentError(f"{op}: block_mapping names a destination block twice")
    if within and bool(torch.isin(dst, pairs[:, 0]).any()):
        raise _C.InvalidArgumentError(f"{op}: block_mapping has a block that is both a source and a destination")
    return pairs


def copy_bytes(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """``dst[d] = src[s]`` for the (s, d) rows of ``pairs``, as bytes."""
    dst.view(torch.uint8)[pairs[:, 1]] = src.view(torch.uint8).index_select(0, pairs[:, 0])
