"""How :func:`~pagedcore.ops.paged_attention` splits a step over CUDA thread
blocks: :class:`AttentionPlan`, made once per step on the host
(:func:`plan_attention`, :func:`plan_decode`) and shared by every layer."""

from __future__ import annotations

import os

import numpy as np
import torch

from .. import _C
from ._checks import _sm_count


class AttentionPlan:
    """How :func:`paged_attention` splits one step's rows over CUDA thread blocks.

    Rows with one query (decode) go to the decode kernel, one thread block per
    (row, kv head) streaming the row's keys, when the shape allows
    (``cuda_decode_supported``); with bfloat16/float16 queries so do rows of a few
    queries (query tokens x query heads per kv head <= 16: speculative decoding,
    beams). Other rows are cut into work items, tiles of
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
        # CTAs of a thread-block cluster that shares a short decode row (0: none):
        # set by plan_attention / plan_decode (_planned_cluster); the kernels take it
        # where the launch serves it (bf16/fp16 caches, head dim 64 or 128, Hopper,
        # the clusters fitting the GPU at once), else run the plain kernel.
        self.decode_cluster = 0
        # The most query tokens of a decode row in every step this plan serves, where
        # known (plan_attention: this step's; plan_decode: 1); 0: unknown (a
        # PaddedPlan, refilled each step under a graph captured once).
        self.decode_max_query_tokens = 0
        self.device = device
        # The three int32 lists in one copy. NOTE: from pinned memory (torch's caching
        # host allocator keeps the block until the copy has run): CUDA may make a copy
        # from pageable memory wait for the stream's queued work, and a plan is built
        # while the device runs the step's first layer piece (model_runner._replay_prefill).
        lists = np.concatenate([np.asarray(a, dtype=np.int32) for a in (work_seq, work_q_start, decode_seq)])
        host = torch.from_numpy(lists)
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        both = host.to(device, non_blocking=True)
        w = self.num_work
        self.work_seq, self.work_q_start, self.decode_seq = both[:w], both[w:2 * w], both[2 * w:]
        self._buffers: dict[str, torch.Tensor] = {}
        self._shared = False  # _buffers also another plan's (share_scratch)

    def share_scratch(self, other: AttentionPlan) -> None:
        """Uses ``other``'s split scratch (partial outputs, counters) for this plan's:
        for plans whose launches never overlap (the whole graphs of one size, with
        and without split tiles, replayed one at a time). A buffer one of them has
        made is never replaced (a captured graph holds its address): the plans'
        buffers of one name must have the same size, else :meth:`partial_ptrs`
        raises."""
        self._buffers = other._buffers
        self._shared = other._shared = True

    def _buffer(self, name: str, size: int, dtype: torch.dtype = torch.float32) -> int:
        buf = self._buffers.get(name)
        if buf is not None and buf.numel() < size and self._shared:
            raise RuntimeError(f"AttentionPlan: shared scratch {name!r} holds {buf.numel()} elements, "
                               f"{size} needed")
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


# Decode rows under twice _DECODE_SPLIT_KEYS keys run unsplit (the kernels'
# kAttentionDecodeSplitKeys); longer ones, planned one wave, take a split per
# _decode_split_chunk() keys at most (kAttentionDecodeSplitChunk, which the
# kernels apply per row; PAGEDCORE_DECODE_SPLIT_KEYS, read per call, overrides
# it in both, for benchmarks); other plans split by _DECODE_SPLIT_KEYS keys.
_DECODE_VECTORS = 16  # kAttentionDecodeVectors: query tokens x group of a bf16/fp16 decode row
_DECODE_SPLIT_KEYS = 256


def _decode_split_chunk() -> int:
    return int(os.environ.get("PAGEDCORE_DECODE_SPLIT_KEYS", "0") or 0) or 64


def _decode_cluster() -> int:
    """CTAs a cluster of PAGEDCORE_DECODE_CLUSTER, where set (read per call; 0: unset or off)."""
    return abs(int(os.environ.get("PAGEDCORE_DECODE_CLUSTER", "0") or 0))


# A decode launch whose longest row has at least this many keys takes clusters of
# _PLANNED_CLUSTER CTAs (the kernels' decode_cluster) where it fits the GPU at once.
# NOTE: measured on the H200 (bench/decode_variants.py at 61d22b2, 32/8 heads, d128,
# us, plain -> clusters of 4): B=1 L=16 3.1 -> 3.7, L=128 4.0 -> 3.8, L=256 5.3 ->
# 3.9, L=512 6.0 -> 4.7.
_CLUSTER_MIN_KEYS = 128
_PLANNED_CLUSTER = 4


def _planned_cluster(longest: int) -> int:
    """The decode_cluster of a plan whose longest decode row has ``longest`` keys: 0
    where PAGEDCORE_DECODE_CLUSTER is set (the kernels then read it themselves)."""
    if os.environ.get("PAGEDCORE_DECODE_CLUSTER", ""):
        return 0
    return _PLANNED_CLUSTER if longest >= _CLUSTER_MIN_KEYS else 0


def _splits(blocks: int, longest: int, sms: int, split_keys: int = 256) -> int:
    # Split keys when the blocks alone leave most multiprocessors idle.
    if blocks >= sms or longest < 2 * split_keys:
        return 1
    return int(max(1, min(-(-2 * sms // blocks), longest // split_keys, 64)))


def _decode_splits(blocks: int, longest: int, sms: int) -> int:
    """Key splits of a decode launch of ``blocks`` (rows x kv heads): where one CTA
    per multiprocessor fills at least 80% of them, that many (the launch then takes
    the decode kernel's deep pipeline, one CTA an SM, in one wave), else as
    :func:`_splits` (two CTAs an SM). PAGEDCORE_DECODE_ONE_WAVE=0 (read per call,
    for benchmarks) keeps the two-an-SM rule where one wave would be planned;
    PAGEDCORE_DECODE_BALANCE=1 splits launches of one to 1.5 CTAs an SM in two.

    NOTE: measured on the H200 (bench/decode_variants.py at b985186, us, two an SM
    -> one wave): B=1 L=32k 45.9 -> 43.7; under the decode graphs' plans 8B B=16
    with 160 / 256 / 384 / 4096 keys 8.8 -> 7.5, 10.3 -> 8.5, 13.1 -> 10.2,
    88.2 -> 72.2, B=1 L=32k 45.3 -> 43.5; B=64 and SmolLM2 cases unchanged. The 8B
    decode step (bench_e2e_gpu.py --overhead, device ms, batch 1 / 16): 4.348 /
    5.065 -> 4.334 / 4.891. Halves at one to 1.5 CTAs an SM (at 7fe0bfa, B=64 L=1k
    of SmolLM2's 3 kv heads: 192 CTAs, padded rows): 21.9 -> 20.4 us (graphs
    replayed in alternation), 21.1-21.2 -> 19.3-19.7 (one after the other); the
    8B cases named above have no launch in that range. Off by default since head
    dim 64 decodes in 128-key tiles (927106d, alternating): 18.3 with halves
    against 17.0 us without. One-wave plans count a split per 64 keys (since
    dddf13b; 256 before, as _splits): at dddf13b, us, 256 -> 64, B=1 L=512 7.8 ->
    6.0, L=1k 8.5 -> 7.2, under the decode graphs' plan 8B B=1 L=600 / 1k 8.6 ->
    7.0 / 8.3 -> 7.1, SmolLM2 B=1 L=1k 7.2 -> 6.0; every other case within 0.1."""
    if os.environ.get("PAGEDCORE_DECODE_ONE_WAVE", "1") != "0" and blocks < sms and longest >= 2 * _DECODE_SPLIT_KEYS:
        per_sm = sms // blocks
        if blocks * per_sm >= 0.8 * sms:
            splits = int(max(1, min(per_sm, longest // _decode_split_chunk(), 64)))
            # (the decode trial's launch rounds its splits up to whole clusters, which
            # must still fit one wave: a whole number of clusters here)
            cluster = _decode_cluster()
            return splits - splits % cluster if 1 < cluster < splits else splits
    if (os.environ.get("PAGEDCORE_DECODE_BALANCE", "0") == "1" and sms <= blocks <= 1.5 * sms
            and longest >= 2 * _DECODE_SPLIT_KEYS):
        # One to 1.5 CTAs an SM: some SMs would run two rows' CTAs where others run
        # one; halves of rows put at most three halves on any SM.
        return 2
    return _splits(blocks, longest, sms, _DECODE_SPLIT_KEYS)


def _plan_lists(query_start_loc, seq_lens, num_heads: int, num_kv_heads: int, head_dim: int | None,
                dtype: torch.dtype | None) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray, np.ndarray,
                                                    np.ndarray]:
    """The host half of :func:`plan_attention`: (work_seq, work_q_start, tile
    tokens, decode_seq, which rows are decode rows, the rows' lengths and query
    lengths, both int64)."""
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
    if not fast:
        is_decode = np.zeros(q_lens.shape[0], dtype=bool)
    elif element_size == 2:  # the tensor-core decode kernel: a row of a few queries too (<= 16 vectors)
        is_decode = (q_lens >= 1) & (q_lens * group <= _DECODE_VECTORS)
    else:
        is_decode = q_lens == 1
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
    return work_seq, work_q_start, tile, decode_seq, is_decode, seq_lens, q_lens


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
    work_seq, work_q_start, tile, decode_seq, is_decode, seq_lens, q_lens = _plan_lists(
        query_start_loc, seq_lens, num_heads, num_kv_heads, head_dim, dtype)
    total = work_seq.shape[0]
    sms = _sm_count(device)
    longest_tile = int(seq_lens[~is_decode].max()) if total else 0
    longest_decode = int(seq_lens[is_decode].max()) if decode_seq.size else 0
    plan = AttentionPlan(
        work_seq, work_q_start, tile, _splits(max(1, total * num_kv_heads), longest_tile, sms),
        decode_seq, _decode_splits(max(1, decode_seq.size * num_kv_heads), longest_decode, sms), device,
    )
    plan.decode_cluster = _planned_cluster(longest_decode)
    if decode_seq.size:
        plan.decode_max_query_tokens = int(q_lens[is_decode].max())
    return plan


def _switch(name: str, default: bool) -> bool:
    """An on/off environment switch: 1 on, 0 off, unset or empty its default; else an error."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return default if value == "" else value == "1"


_PADDED_SPLIT_ROWS = 32
# Prefill chunks whose rows hold at most this many keys take a whole mixed graph's
# unsplit tiles even where plan_attention would split them (few tiles: SmolLM2's
# 512-token prompt is 25 tiles x 3 kv heads, split in 2 eagerly). NOTE: measured on
# the H200 at 73b39de / f862100 (bench_e2e_gpu.py --mixed, SmolLM2, 40 rows
# decoding): such a step took 4.7-5.7 ms in pieces (3.9-5.4 ms of host time in
# execute) against 1.9-2.6 for the whole graphs of 256-token prompts; a split of
# <= 1024 keys saves a few us a layer. 4096 instead (2c2a9fb, serving SmolLM2 at half
# load) gained nothing: steps with prompt tokens p99 6.6 ms against 5.8 with 1024.
_PADDED_UNSPLIT_TILE_KEYS = 1024


def _tile_tokens(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Query tokens of a tile (as _plan_lists cuts them) for queries of ``dtype``."""
    return max(1, _C.cuda_attention_tile_vectors(dtype.itemsize) // (num_heads // num_kv_heads))


def split_tiles_useful(max_seq_len: int) -> bool:
    """Whether a PaddedPlan with split tiles can take a step that the unsplit one
    refuses (chunks of rows over _PADDED_UNSPLIT_TILE_KEYS keys: only with longer
    sequences)."""
    return max_seq_len > _PADDED_UNSPLIT_TILE_KEYS


def padded_tile_splits(max_tokens: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                       device: torch.device, max_seq_len: int) -> int:
    """Key splits for the tiles of a PaddedPlan of ``max_tokens`` tokens whose
    steps' chunks hold more keys than _PADDED_UNSPLIT_TILE_KEYS: what
    :func:`plan_attention` gives a chunk of ``max_tokens`` tokens over
    ``max_seq_len`` keys, at least 2."""
    tiles = -(-max_tokens // _tile_tokens(num_heads, num_kv_heads, dtype))
    return max(2, _splits(tiles * num_kv_heads, max_seq_len, _sm_count(device)))


class PaddedPlan:
    """A plan of fixed size for a CUDA graph of mixed steps (prefill chunks with
    decode rows) that runs attention inside the graph: ``plan.num_work`` tile
    items and ``plan.num_decode`` decode items whatever the step, so that one
    launch configuration serves every step that fits (:meth:`fill`).

    Sized for steps of up to ``max_tokens`` tokens in up to ``max_rows`` rows, of
    which at most ``max_tile_rows`` are cut into tiles (prefill chunks; every row
    when the decode kernel does not serve the shape). Items beyond the step's own
    repeat a padding row, the step's last row + 1, which the caller gives one
    query token (a padding token of the graph), one cached key and a block table
    pointing at the null block: CTAs that read one key each, whose output lands in
    the padding token's row (decode items: the first past the step's; the others
    are spare, -1, and their CTAs return at once; tile items likewise, unless
    PAGEDCORE_MIXED_TILE_SPARE=0, the padding row then computed by a tile only
    where no decode item is left for it). Tiles split their keys
    ``tile_splits`` ways whatever the step (1: never; any split count computes the
    same attention, a split of a short tile may be empty); decode rows may split as
    a step of 32 of them over ``max_seq_len`` keys would, each row running only the
    splits its length needs (as :func:`plan_decode`). :meth:`fill` refuses the
    steps whose eager plan would split much more (long contexts): tiles of rows
    over _PADDED_UNSPLIT_TILE_KEYS keys split more than the plan's tiles (more than
    twice, when they split), decode rows more than twice its decode splits.
    """

    def __init__(self, max_tokens: int, max_rows: int, max_tile_rows: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, max_seq_len: int,
                 tile_splits: int = 1) -> None:
        if tile_splits < 1:
            raise ValueError(f"PaddedPlan: tile_splits must be >= 1, got {tile_splits}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        group = num_heads // num_kv_heads
        tile = _tile_tokens(num_heads, num_kv_heads, dtype)
        if _C.cuda_decode_supported(group, head_dim, dtype.itemsize):
            num_decode, tile_rows = max_rows + 1, min(max_tile_rows, max_rows)
        else:  # every row is cut into tiles
            num_decode, tile_rows = 0, max_rows
        # A row of q tokens makes ceil(q / tile) tiles: at most tokens / tile + rows in all.
        num_work = -(-max_tokens // tile) + tile_rows + 1
        self.sms = _sm_count(device)
        # Decode splits sized for a step of up to 32 decode rows (the padding items are
        # no work to spread), each row running the splits its length needs; a step the
        # eager plan would split more than twice as much takes the pieces (fill).
        splits = _splits(max(1, min(num_decode, _PADDED_SPLIT_ROWS) * num_kv_heads), max_seq_len, self.sms,
                         _DECODE_SPLIT_KEYS)
        # Decode items past the step's own: the first computes the padding row (its
        # output written every step), the others are spare (-1: their CTAs return at
        # once, where each computing the padding row cost a CTA's whole latency for one
        # key). PAGEDCORE_MIXED_DECODE_SPARE=0 (read here, at capture; a measurement
        # switch): every one computes the padding row, as before. NOTE: measured on the
        # H200 (decode_variants.py at 057d3d5, the 512-token graph's 257 decode items,
        # us, spare -> not): SmolLM2 40 rows of 400 keys 12.1 -> 16.1, 150 rows 23.8 ->
        # 23.7, the 8B shape's 64 rows 47.3 -> 67.7.
        self.spare = _switch("PAGEDCORE_MIXED_DECODE_SPARE", True)
        # Tile items past the step's are spare too (-1 in work_seq: the prefill
        # kernels' CTAs return at once, the persistent wgmma walk passes them by).
        # PAGEDCORE_MIXED_TILE_SPARE=0 (read here, at capture; a measurement switch):
        # each computes the padding row over one key, as until 068f05e. NOTE:
        # measured on the H200 at 068f05e (decode_variants.py, the 512-token graph,
        # us a layer's attention, spare -> not): SmolLM2 40 rows of 400 keys 9.4 ->
        # 12.2, 150 rows 20.9 -> 23.5, the 8B shape's 64 rows 38.3 -> 48.3; clean
        # under compute-sanitizer memcheck; the mixed step end to end and serving
        # unchanged within their noise.
        self.tile_spare = _switch("PAGEDCORE_MIXED_TILE_SPARE", True)
        zeros = np.zeros(num_work, dtype=np.int32)
        self.plan = AttentionPlan(zeros, zeros, tile, tile_splits, np.zeros(num_decode, dtype=np.int32), splits,
                                  device)
        # The plan's three lists as views of one buffer: one copy a step.
        self.host = torch.zeros(num_work * 2 + num_decode, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.device_lists = torch.zeros(num_work * 2 + num_decode, dtype=torch.int32, device=device)
        self.plan.work_seq = self.device_lists[:num_work]
        self.plan.work_q_start = self.device_lists[num_work:2 * num_work]
        self.plan.decode_seq = self.device_lists[2 * num_work:]

    def lists(self, query_start_loc, seq_lens) -> tuple:
        """The step's plan lists (what :meth:`fill` takes: the same for every
        PaddedPlan of the model, so a step tried on several computes them once)."""
        return _plan_lists(query_start_loc, seq_lens, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)

    def fill(self, query_start_loc, seq_lens, pad_row: int, lists: tuple | None = None) -> bool:
        """Stages the step's lists, padded (the copy to the device is queued by
        :meth:`upload`); False, with nothing staged, when the step has more tile
        or decode items than the plan holds, or when :func:`plan_attention` would
        split its keys more than this plan does (long contexts: there the split
        launch is worth more than the graph; prefill chunks of rows up to
        _PADDED_UNSPLIT_TILE_KEYS keys are taken unsplit; a plan whose tiles split
        takes up to twice its splits, and decode rows up to twice its decode
        splits). ``lists``: :meth:`lists` of the step, if made."""
        plan = self.plan
        work_seq, work_q_start, tile, decode_seq, is_decode, lens, _ = (
            lists if lists is not None else self.lists(query_start_loc, seq_lens))
        if tile != plan.tile_tokens or work_seq.shape[0] > plan.num_work or decode_seq.shape[0] > plan.num_decode:
            return False
        total, decodes = work_seq.shape[0], decode_seq.shape[0]
        longest_tile = int(lens[~is_decode].max()) if total else 0
        taken = 1 if plan.num_splits == 1 else 2 * plan.num_splits
        if longest_tile > _PADDED_UNSPLIT_TILE_KEYS and _splits(total * self.num_kv_heads, longest_tile, self.sms) > taken:
            return False
        # (decode rows: splits sized for 32 rows; fewer rows over long contexts want
        # a few more, and up to twice the graph's serve them well enough: on the H200
        # at 4e54384, serving SmolLM2 at half load, ~29 decode rows beside a chunk
        # wanted 4 against the graph's 3, and 195 of 2,321 steps took the pieces so)
        if decodes and _splits(decodes * self.num_kv_heads, int(lens[is_decode].max()), self.sms,
                               _DECODE_SPLIT_KEYS) > 2 * plan.decode_splits:
            return False
        w = plan.num_work
        host = self.host.numpy()
        host[:w] = -1 if self.tile_spare else pad_row
        host[w:2 * w] = 0
        host[2 * w:] = -1 if self.spare else pad_row
        host[:total] = work_seq
        host[w:w + work_q_start.shape[0]] = work_q_start
        host[2 * w:2 * w + decodes] = decode_seq
        # The padding row: the first decode item past the step's, else the first
        # tile past its (the shapes the decode kernel does not serve), if any.
        if decodes < plan.num_decode:
            host[2 * w + decodes] = pad_row
        elif total < w:
            host[total] = pad_row
        return True

    def upload(self) -> None:
        """Queues the staged lists' copy to the device (the host buffer must stay
        untouched until the copy has run: the model runner's staging event)."""
        self.device_lists.copy_(self.host, non_blocking=True)


def plan_decode(num_rows: int, num_kv_heads: int, device: torch.device, max_seq_len: int) -> AttentionPlan:
    """A plan for ``num_rows`` decode rows (row ``i`` = query token ``i``) that does
    not depend on their lengths: key splits chosen for ``max_seq_len``, so one
    plan serves every step of that batch size (what a CUDA graph replays)."""
    empty = np.zeros(0, dtype=np.int32)
    rows = np.arange(num_rows, dtype=np.int32)
    splits = _decode_splits(num_rows * num_kv_heads, max_seq_len, _sm_count(device))
    plan = AttentionPlan(empty, empty, 1, 1, rows, splits, device)
    plan.decode_cluster = _planned_cluster(max_seq_len)
    plan.decode_max_query_tokens = 1
    return plan
