"""pagedcore.ops on the CPU against plain torch references.

Attention: every row's keys and values are gathered from the paged cache through its
block table into contiguous tensors and attended in float64. The inputs are fresh random
tensors (fixed seeds); outputs are poisoned with NaN before the call; every cache slot
the kernel must not read (unused slots, the null block, slots before a sliding window)
holds NaN, and table entries past a row's blocks hold garbage, so any stray read shows.
The grid is stacked (dtype x head_dim x GQA x block size, then window / softcap / lengths
/ threads / instruction sets) rather than the full cartesian product.

Cache ops: exact equality against clone-and-index references; everything not named by
the call must stay bit-identical.
"""

from __future__ import annotations

import math
import os
import threading

import pagedcore
import pytest
import torch
from pagedcore import ops

NAN = float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) against a float64 reference: fp32 accumulates in fp32; 16-bit outputs are
# rounded once (inputs are exact in fp32).
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}


@pytest.fixture(autouse=True)
def _restore_threads_and_isa():
    threads, isa = ops.get_num_threads(), ops.cpu_isa()
    yield
    ops.set_num_threads(threads)
    ops.set_cpu_isa(isa)


def supported_isas() -> list[str]:
    best = ops.cpu_isa()
    order = ["generic", "avx2", "avx512"]
    return order[: order.index(best) + 1]


# ---- paged attention: inputs and reference -------------------------------------------------


def first_visible(pos: int, window: int) -> int:
    return max(0, pos - window + 1) if window > 0 else 0


def make_batch(
    rows, *, block_size, head_dim, num_kv_heads, group, dtype, window=0, seed=0, extra_tokens=2
):
    """A paged batch for rows = [(q_len, seq_len), ...].

    Only the slots some query of a row sees get values; all others are NaN. Blocks are
    assigned in a shuffled order; table entries of blocks wholly before the first query's
    window are the null block 0; entries past a row's last block are garbage.
    """
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_row = [math.ceil(seq_len / block_size) for _, seq_len in rows]
    num_blocks = 1 + sum(blocks_per_row) + 3  # null block, rows, unused spares
    max_blocks = max(blocks_per_row + [1]) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, NAN, dtype=dtype)
    value_cache = torch.full(shape, NAN, dtype=dtype)
    # A wider table sliced to max_blocks: row stride != max_blocks_per_seq.
    wide = torch.randint(-5, 10**6, (len(rows), max_blocks + 3), generator=g, dtype=torch.int32)
    block_tables = wide[:, :max_blocks]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    next_block = 0
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    for r, (q_len, seq_len) in enumerate(rows):
        ids = perm[next_block : next_block + blocks_per_row[r]]
        next_block += blocks_per_row[r]
        block_tables[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if q_len == 0:
            continue
        lo = first_visible(seq_len - q_len, window)
        block_tables[r, : lo // block_size] = 0  # released: the null block
        pos = torch.arange(lo, seq_len)
        slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        flat_k[slots] = torch.randn(len(pos), num_kv_heads, head_dim, generator=g).to(dtype)
        flat_v[slots] = torch.randn(len(pos), num_kv_heads, head_dim, generator=g).to(dtype)
    q_lens = [q for q, _ in rows]
    num_tokens = sum(q_lens) + extra_tokens  # trailing padding tokens: out stays as it was
    # query: a slice of a fused qkv projection output (token stride > num_heads * head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, qsl


def reference(
    query, key_cache, value_cache, block_tables, seq_lens, qsl, *, scale, window=0, softcap=0.0
):
    """float64 attention over each row's gathered, contiguous keys and values."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    out = torch.full((num_tokens, num_heads, head_dim), NAN, dtype=torch.float64)
    for r in range(len(seq_lens)):
        a, b, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if a == b:
            continue
        first = seq_len - (b - a)
        pos = torch.arange(first_visible(first, window), seq_len)
        slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        k = flat_k[slots].double().repeat_interleave(group, dim=1)  # [keys, heads, dim]
        v = flat_v[slots].double().repeat_interleave(group, dim=1)
        assert torch.isfinite(k).all() and torch.isfinite(v).all(), "reference read a NaN slot"
        s = torch.einsum("qhd,khd->hqk", query[a:b].double(), k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(first, seq_len)[:, None]
        visible = pos[None, :] <= qpos
        if window > 0:
            visible &= pos[None, :] > qpos - window
        s = s.masked_fill(~visible[None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


def mixed_rows(block_size: int) -> list[tuple[int, int]]:
    """Decode rows, multi-query decode-like rows, pure prefills, prefills with a cached
    prefix, an empty row; lengths 1, block multiples and non-multiples."""
    bs = block_size
    return [
        (1, 1),
        (1, bs),
        (1, 3 * bs + 5),
        (2, 2 * bs + 1),
        (5, 5),
        (bs, bs),
        (7, 2 * bs + 7),
        (0, 9),
        (bs + 3, 3 * bs),
        (70, 101),
        (1, 130),
    ]


def run_and_check(
    rows, *, block_size, head_dim, group, dtype, window=0, softcap=0.0, num_kv_heads=2, seed=0
):
    query, kc, vc, bt, seq_lens, qsl = make_batch(
        rows,
        block_size=block_size,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        group=group,
        dtype=dtype,
        window=window,
        seed=seed,
    )
    scale = head_dim**-0.5
    out = torch.full(query.shape, NAN, dtype=dtype)
    result = ops.paged_attention(
        query,
        kc,
        vc,
        bt,
        seq_lens,
        qsl,
        scale=scale,
        sliding_window=window,
        softcap=softcap,
        out=out,
    )
    assert result is out
    expected = reference(
        query, kc, vc, bt, seq_lens, qsl, scale=scale, window=window, softcap=softcap
    )
    n = int(qsl[-1])
    assert torch.isnan(out[n:]).all(), "padding tokens after query_start_loc[-1] were written"
    assert not torch.isnan(out[:n]).any()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out[:n].double(), expected[:n], atol=atol, rtol=rtol)


# ---- paged attention: the grid ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_attention_grid(dtype, head_dim, group, block_size):
    seed = 1000 * DTYPES.index(dtype) + 10 * head_dim + 3 * group + block_size
    run_and_check(
        mixed_rows(block_size),
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        dtype=dtype,
        seed=seed,
    )


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("window,softcap", [(13, 0.0), (0, 2.0), (40, 3.5)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_attention_window_softcap(dtype, head_dim, block_size, window, softcap, seed):
    group = [1, 3, 4][(seed + head_dim // 32) % 3]
    run_and_check(
        mixed_rows(block_size),
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        dtype=dtype,
        window=window,
        softcap=softcap,
        seed=seed,
    )


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_attention_other_head_dims(head_dim):
    run_and_check(
        [(1, 40), (9, 9), (3, 50)],
        block_size=16,
        head_dim=head_dim,
        group=2,
        dtype=torch.float32,
        seed=head_dim,
    )


@pytest.mark.parametrize("group", [1, 4, 8, 16, 32])
def test_attention_wide_groups(group):
    # group > 8: one query is already more than the decode kernel takes; group 32 needs
    # two head groups per kv head with 16 lanes.
    run_and_check(
        [(1, 77), (2, 2), (20, 45)],
        block_size=16,
        head_dim=32,
        group=group,
        num_kv_heads=1,
        dtype=torch.float32,
        seed=group,
    )


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_attention_every_isa(isa, dtype):
    ops.set_cpu_isa(isa)
    assert ops.cpu_isa() == isa
    run_and_check(
        mixed_rows(16),
        block_size=16,
        head_dim=64,
        group=3,
        dtype=dtype,
        window=21,
        softcap=4.0,
        seed=7,
    )


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_attention_threads_and_split_kv(threads):
    # Few long decode rows: with several threads the rows are split along their keys.
    ops.set_num_threads(threads)
    rows = [(1, 1000), (2, 777), (1, 300)]
    run_and_check(
        rows, block_size=16, head_dim=64, group=3, num_kv_heads=1, dtype=torch.float32, seed=threads
    )
    run_and_check(
        rows,
        block_size=16,
        head_dim=64,
        group=4,
        num_kv_heads=1,
        dtype=torch.bfloat16,
        window=333,
        softcap=2.0,
        seed=threads,
    )


def test_attention_default_out_and_empty_batch():
    query, kc, vc, bt, seq_lens, qsl = make_batch(
        [(3, 20)],
        block_size=8,
        head_dim=32,
        num_kv_heads=1,
        group=2,
        dtype=torch.float32,
        extra_tokens=0,
    )
    out = ops.paged_attention(query, kc, vc, bt, seq_lens, qsl, scale=0.2)
    assert out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), reference(query, kc, vc, bt, seq_lens, qsl, scale=0.2))
    empty = ops.paged_attention(query[:0], kc, vc, bt[:0], seq_lens[:0], qsl[:1], scale=0.2)
    assert empty.shape == (0, 2, 32)


def test_attention_end_to_end_with_reshape_and_cache():
    """The model's order of calls: write this step's K/V, then attend; two steps."""
    torch.manual_seed(11)
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    num_heads = num_kv_heads * group
    key_cache = torch.full((12, block_size, num_kv_heads, head_dim), NAN)
    value_cache = torch.full_like(key_cache, NAN)
    block_tables = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0]], dtype=torch.int32)
    keys = {0: torch.empty(0, num_kv_heads, head_dim), 1: torch.empty(0, num_kv_heads, head_dim)}
    values = dict(keys)
    lens = [0, 0]
    for q_lens in ([20, 6], [1, 1]):  # prefill, then a decode step
        num_tokens = sum(q_lens)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        slots, start = [], 0
        for r, n in enumerate(q_lens):
            for p in range(lens[r], lens[r] + n):
                slots.append(int(block_tables[r, p // block_size]) * block_size + p % block_size)
            keys[r] = torch.cat([keys[r], k[start : start + n]])
            values[r] = torch.cat([values[r], v[start : start + n]])
            lens[r] += n
            start += n
        ops.reshape_and_cache(k, v, key_cache, value_cache, torch.tensor(slots))
        qsl = torch.tensor([0, q_lens[0], num_tokens], dtype=torch.int32)
        out = ops.paged_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            torch.tensor(lens, dtype=torch.int32),
            qsl,
            scale=0.125,
        )
        for r in range(2):
            a, b = int(qsl[r]), int(qsl[r + 1])
            kk = keys[r].repeat_interleave(group, dim=1)
            vv = values[r].repeat_interleave(group, dim=1)
            mask = torch.ones(b - a, lens[r], dtype=torch.bool).tril(lens[r] - (b - a))
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                kk.transpose(0, 1),
                vv.transpose(0, 1),
                attn_mask=mask,
                scale=0.125,
            ).transpose(0, 1)
            torch.testing.assert_close(out[a:b], expected, atol=2e-5, rtol=2e-5)


def test_attention_concurrent_callers():
    """Two Python threads (the GIL is released) share the pool; both get right answers."""
    ops.set_num_threads(2)
    batches = [
        make_batch(
            mixed_rows(16),
            block_size=16,
            head_dim=64,
            num_kv_heads=2,
            group=g,
            dtype=torch.float32,
            seed=g,
        )
        for g in (1, 3)
    ]
    expected = [reference(*b, scale=0.1) for b in batches]
    errors = []

    def worker(i):
        for _ in range(20):
            out = ops.paged_attention(*batches[i], scale=0.1)
            n = int(batches[i][5][-1])
            if not torch.allclose(out[:n].double(), expected[i][:n], atol=2e-5, rtol=2e-5):
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_attention_after_fork():
    """A forked child has none of the parent's pool threads; its launches must not hang."""
    ops.set_num_threads(2)
    batch = make_batch(
        [(1, 200), (30, 60)],
        block_size=16,
        head_dim=32,
        num_kv_heads=2,
        group=2,
        dtype=torch.float32,
    )
    ops.paged_attention(*batch, scale=0.1)  # the parent's pool is running
    expected = reference(*batch, scale=0.1)
    pid = os.fork()
    if pid == 0:  # child
        ok = False
        try:
            out = ops.paged_attention(*batch, scale=0.1)
            ok = torch.allclose(out[:31].double(), expected[:31], atol=2e-5, rtol=2e-5)
        finally:
            os._exit(0 if ok else 1)
    import time

    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("paged_attention hung in a forked child")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


# ---- reshape_and_cache ---------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 19, 600])
def test_reshape_and_cache(num_tokens, dtype, index_dtype):
    g = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size, num_kv_heads, head_dim = 70, 16, 2, 32
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    # key / value: slices of a fused projection output (token stride 4 * 2 * 32)
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=g).to(dtype)
    key = qkv[:, 2 * 64 : 3 * 64].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 3 * 64 :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens
    slot_mapping = slots.to(index_dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = key[keep]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = value[keep]
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


# ---- copy_blocks and swap_blocks ------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_pairs", [0, 1, 7, 60])
def test_copy_blocks(num_pairs, dtype, index_dtype):
    g = torch.Generator().manual_seed(num_pairs)
    num_layers, num_blocks = 3, 140
    shape = (num_blocks, 16, 2, 32)
    key_caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]
    value_caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]
    ids = torch.randperm(num_blocks, generator=g)[: 2 * num_pairs]
    mapping = torch.stack([ids[:num_pairs], ids[num_pairs:]], dim=1).to(index_dtype)
    expected = []
    for cache in key_caches + value_caches:
        e = cache.clone()
        e[mapping[:, 1].long()] = cache[mapping[:, 0].long()]
        expected.append(e)
    ops.copy_blocks(key_caches, value_caches, mapping)
    for cache, e in zip(key_caches + value_caches, expected, strict=True):
        assert torch.equal(cache, e)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_swap_blocks(dtype, index_dtype):
    g = torch.Generator().manual_seed(3)
    device_pool = torch.randn(50, 8, 3, 64, generator=g).to(dtype)
    host_pool = torch.randn(20, 8, 3, 64, generator=g).to(dtype)
    out_pairs = torch.tensor([[49, 0], [7, 19], [8, 3]], dtype=index_dtype)
    expected = host_pool.clone()
    expected[out_pairs[:, 1].long()] = device_pool[out_pairs[:, 0].long()]
    before = device_pool.clone()
    ops.swap_blocks(device_pool, host_pool, out_pairs)  # swap out
    assert torch.equal(host_pool, expected) and torch.equal(device_pool, before)
    in_pairs = torch.tensor([[19, 1], [0, 2]], dtype=index_dtype)
    expected = device_pool.clone()
    expected[[1, 2]] = host_pool[[19, 0]]
    ops.swap_blocks(host_pool, device_pool, in_pairs)  # swap in
    assert torch.equal(device_pool, expected)
    # many pairs (the parallel path)
    big_src = torch.randn(600, 16, 2, 64, generator=g).to(dtype)
    big_dst = torch.zeros(600, 16, 2, 64, dtype=dtype)
    pairs = torch.stack([torch.randperm(600, generator=g), torch.randperm(600, generator=g)], 1)
    ops.swap_blocks(big_src, big_dst, pairs.to(index_dtype))
    assert torch.equal(big_dst[pairs[:, 1]], big_src[pairs[:, 0]])


# ---- input checks ------------------------------------------------------------------------------


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports a CUDA device (no GPU needed to test the refusal)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


# A CUDA tensor among CPU ones: refused before any launch (built without CUDA: refused
# as such).
MIXED_DEVICES = (
    (ValueError, "all tensors must be on one device")
    if pagedcore.cuda_info()["compiled"]
    else (NotImplementedError, "built without CUDA kernels")
)


def attention_args(**overrides):
    query, kc, vc, bt, seq_lens, qsl = make_batch(
        [(1, 20), (4, 9)],
        block_size=8,
        head_dim=32,
        num_kv_heads=2,
        group=2,
        dtype=torch.float32,
        extra_tokens=0,
    )
    args = dict(
        query=query,
        key_cache=kc,
        value_cache=vc,
        block_tables=bt,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        scale=0.1,
    )
    args.update(overrides)
    return args


def t32(values):
    return torch.tensor(values, dtype=torch.int32)


ATTENTION_ERRORS = [
    # (overrides, exception, message fragment)
    (dict(query=[[1.0]]), TypeError, "query must be a torch.Tensor"),
    (
        dict(query=torch.zeros(5, 4, 32, dtype=torch.int32)),
        TypeError,
        "float32, bfloat16 or float16",
    ),
    (
        dict(query=torch.zeros(5, 128)),
        ValueError,
        "query must be [num_tokens, num_heads, head_dim]",
    ),
    (dict(query=torch.zeros(5, 4, 16)), ValueError, "query head_dim 16 != cache head_dim 32"),
    (dict(query=torch.zeros(5, 3, 32)), ValueError, "multiple of num_kv_heads"),
    (dict(query=torch.zeros(5, 4, 64)[:, :, ::2]), ValueError, "dense heads"),
    (dict(query=torch.zeros(5, 4, 32, dtype=torch.float16)), TypeError, "key_cache has dtype"),
    (
        dict(
            key_cache=torch.zeros(4, 8, 2, 48),
            value_cache=torch.zeros(4, 8, 2, 48),
            query=torch.zeros(5, 4, 48),
        ),
        ValueError,
        "unsupported head_dim: 48",
    ),
    (dict(value_cache=torch.zeros(3, 8, 2, 32)), ValueError, "value_cache shape"),
    (
        dict(key_cache=torch.zeros(9, 2, 8, 32).transpose(1, 2)),
        ValueError,
        "key_cache must be contiguous",
    ),
    (
        dict(block_tables=torch.zeros(2, 5, dtype=torch.int64)),
        TypeError,
        "block_tables must be int32",
    ),
    (
        dict(block_tables=torch.zeros(2, 10, dtype=torch.int32)[:, ::2]),
        ValueError,
        "block_tables rows must be dense",
    ),
    (dict(seq_lens=t32([20])), ValueError, "seq_lens must be [num_seqs] = [2]"),
    (dict(seq_lens=torch.tensor([20, 9])), TypeError, "seq_lens must be int32"),
    (dict(query_start_loc=t32([0, 1])), ValueError, "query_start_loc must be [num_seqs + 1] = [3]"),
    (
        dict(seq_lens=t32([20, 3])),
        pagedcore.InvalidArgumentError,
        "seq_lens[1] = 3 < the row's query count 4",
    ),
    (
        dict(query_start_loc=t32([0, 4, 1])),
        pagedcore.InvalidArgumentError,
        "query_start_loc must be non-decreasing",
    ),
    (
        dict(query_start_loc=t32([0, 1, 9])),
        pagedcore.InvalidArgumentError,
        "query_start_loc[2] = 9 > num_tokens (5)",
    ),
    (
        dict(query_start_loc=t32([-1, 1, 5])),
        pagedcore.InvalidArgumentError,
        "query_start_loc[0] = -1",
    ),
    (
        dict(seq_lens=t32([20, 99])),
        pagedcore.InvalidArgumentError,
        "seq_lens[1] = 99 > max_blocks_per_seq * block_size",
    ),
    (dict(scale=float("nan")), TypeError, "scale must be a finite float"),
    (dict(scale="0.1"), TypeError, "scale must be a finite float"),
    (dict(sliding_window=-1), ValueError, "sliding_window must be >= 0"),
    (dict(sliding_window=2.5), TypeError, "sliding_window must be an int"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite and >= 0"),
    (dict(out=torch.zeros(5, 4, 31)), ValueError, "out shape"),
    (dict(out=torch.zeros(5, 4, 32, dtype=torch.bfloat16)), TypeError, "out has dtype"),
    (dict(out=torch.zeros(4, 5, 32).transpose(0, 1)), ValueError, "out must be contiguous"),
    (dict(query=torch.zeros(5, 4, 32, device="meta")), ValueError, "must be a CPU or CUDA tensor"),
    (dict(query=torch.zeros(5, 4, 32).as_subclass(FakeCudaTensor)), *MIXED_DEVICES),
]


@pytest.mark.parametrize(
    "overrides,error,message", ATTENTION_ERRORS, ids=[m for _, _, m in ATTENTION_ERRORS]
)
def test_attention_bad_input(overrides, error, message):
    args = attention_args()
    args.update(overrides)
    with pytest.raises(error, match=_literal(message)):
        ops.paged_attention(**args)


def test_attention_bad_block_table_entry_writes_nothing():
    args = attention_args()
    args["block_tables"][1, 1] = 99  # row 1 (9 tokens, block size 8) reads blocks 0 and 1
    out = torch.full(args["query"].shape, NAN)
    with pytest.raises(
        pagedcore.InvalidArgumentError,
        match=_literal("block_tables[1][1] = 99 out of range [0, 9)"),
    ):
        ops.paged_attention(**args, out=out)
    assert torch.isnan(out).all()
    # Entries no query reads are not checked: garbage past the row's blocks is fine.
    args["block_tables"][1, 1] = args["block_tables"][0, 1]
    args["block_tables"][1, 2:] = -12345
    ops.paged_attention(**args, out=out)


def _literal(message: str) -> str:
    import re

    return re.escape(message)


CACHE_SHAPE = (6, 4, 2, 8)


def rc_args(**overrides):
    args = dict(
        key=torch.randn(3, 2, 8),
        value=torch.randn(3, 2, 8),
        key_cache=torch.zeros(CACHE_SHAPE),
        value_cache=torch.zeros(CACHE_SHAPE),
        slot_mapping=torch.tensor([0, 5, -1]),
    )
    args.update(overrides)
    return args


RESHAPE_ERRORS = [
    (dict(key=torch.randn(3, 2, 8).tolist()), TypeError, "key must be a torch.Tensor"),
    (dict(key=torch.randn(3, 16)), ValueError, "key must be [num_tokens, num_kv_heads, head_dim]"),
    (dict(value=torch.randn(4, 2, 8)), ValueError, "value shape"),
    (dict(key=torch.randn(3, 4, 8), value=torch.randn(3, 4, 8)), ValueError, "the cache holds"),
    (
        dict(
            key=torch.randn(3, 2, 8).double(),
            value=torch.randn(3, 2, 8).double(),
            key_cache=torch.zeros(CACHE_SHAPE).double(),
            value_cache=torch.zeros(CACHE_SHAPE).double(),
        ),
        TypeError,
        "float32, bfloat16 or float16",
    ),
    (dict(value=torch.randn(3, 2, 8).half()), TypeError, "value has dtype"),
    (
        dict(
            key_cache=torch.zeros(CACHE_SHAPE).half(), value_cache=torch.zeros(CACHE_SHAPE).half()
        ),
        TypeError,
        "key_cache has dtype",
    ),
    (dict(key=torch.randn(3, 8, 2).transpose(1, 2)), ValueError, "dense heads"),
    (
        dict(value_cache=torch.zeros(6, 4, 8, 2).transpose(2, 3)),
        ValueError,
        "value_cache must be contiguous",
    ),
    (
        dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])),
        TypeError,
        "slot_mapping must be int32 or int64",
    ),
    (
        dict(slot_mapping=torch.tensor([0, 1])),
        ValueError,
        "slot_mapping must be [num_tokens] = [3]",
    ),
    (
        dict(slot_mapping=torch.tensor([0, 2, 4, 6, 8, 10])[::2]),
        ValueError,
        "slot_mapping must be contiguous",
    ),
    (
        dict(slot_mapping=torch.tensor([0, 24, 1])),
        pagedcore.InvalidArgumentError,
        "slot_mapping[1] = 24 out of range [0, 24)",
    ),
    (dict(key=torch.randn(3, 2, 8).as_subclass(FakeCudaTensor)), *MIXED_DEVICES),
]


@pytest.mark.parametrize(
    "overrides,error,message", RESHAPE_ERRORS, ids=[m for _, _, m in RESHAPE_ERRORS]
)
def test_reshape_and_cache_bad_input(overrides, error, message):
    args = rc_args(**overrides)
    before = args["key_cache"].clone() if isinstance(args["key_cache"], torch.Tensor) else None
    with pytest.raises(error, match=_literal(message)):
        ops.reshape_and_cache(**args)
    if before is not None:
        assert torch.equal(args["key_cache"], before), "a failed call wrote into the cache"


def cb_args(**overrides):
    args = dict(
        key_caches=[torch.zeros(CACHE_SHAPE) for _ in range(2)],
        value_caches=[torch.zeros(CACHE_SHAPE) for _ in range(2)],
        block_mapping=torch.tensor([[1, 2], [3, 4]]),
    )
    args.update(overrides)
    return args


COPY_ERRORS = [
    (dict(key_caches=torch.zeros(CACHE_SHAPE)), TypeError, "sequences of tensors"),
    (dict(value_caches=[torch.zeros(CACHE_SHAPE)]), ValueError, "2 key caches but 1 value caches"),
    (
        dict(
            key_caches=[torch.zeros(CACHE_SHAPE), torch.zeros(7, 4, 2, 8)],
            value_caches=[torch.zeros(CACHE_SHAPE), torch.zeros(7, 4, 2, 8)],
        ),
        ValueError,
        "layer 1 cache is",
    ),
    (dict(block_mapping=torch.tensor([1, 2])), ValueError, "block_mapping must be [num_pairs, 2]"),
    (
        dict(block_mapping=torch.tensor([[1.0, 2.0]])),
        TypeError,
        "block_mapping must be int32 or int64",
    ),
    (
        dict(block_mapping=torch.tensor([[1, 6]])),
        pagedcore.InvalidArgumentError,
        "block_mapping[0][1] = 6 out of range [0, 6)",
    ),
    (
        dict(block_mapping=torch.tensor([[-1, 2]])),
        pagedcore.InvalidArgumentError,
        "block_mapping[0][0] = -1 out of range",
    ),
    (
        dict(block_mapping=torch.tensor([[1, 2], [3, 2]])),
        pagedcore.InvalidArgumentError,
        "destination block 2 twice",
    ),
    (
        dict(block_mapping=torch.tensor([[1, 2], [2, 3]])),
        pagedcore.InvalidArgumentError,
        "block 2 is both a source and a destination",
    ),
    (dict(key_caches=[torch.zeros(CACHE_SHAPE).as_subclass(FakeCudaTensor)] * 2), *MIXED_DEVICES),
]


@pytest.mark.parametrize("overrides,error,message", COPY_ERRORS, ids=[m for _, _, m in COPY_ERRORS])
def test_copy_blocks_bad_input(overrides, error, message):
    with pytest.raises(error, match=_literal(message)):
        ops.copy_blocks(**cb_args(**overrides))


SWAP_ERRORS = [
    (dict(src=torch.zeros(3, 4, 2, 8)[:, :, :, :4]), ValueError, "src blocks"),
    (dict(dst=torch.zeros(3, 4, 2, 8).half()), TypeError, "dst has dtype"),
    (dict(dst=torch.zeros(8, 2, 4, 3).permute(3, 2, 1, 0)), ValueError, "dst must be contiguous"),
    (
        dict(block_mapping=torch.tensor([[0, 3]])),
        pagedcore.InvalidArgumentError,
        "block_mapping[0][1] = 3 out of range [0, 3)",
    ),
    (
        dict(block_mapping=torch.tensor([[0, 1], [2, 1]])),
        pagedcore.InvalidArgumentError,
        "destination block 1 twice",
    ),
]


@pytest.mark.parametrize("overrides,error,message", SWAP_ERRORS, ids=[m for _, _, m in SWAP_ERRORS])
def test_swap_blocks_bad_input(overrides, error, message):
    args = dict(
        src=torch.zeros(CACHE_SHAPE),
        dst=torch.zeros(3, 4, 2, 8),
        block_mapping=torch.tensor([[5, 0]]),
    )
    args.update(overrides)
    with pytest.raises(error, match=_literal(message)):
        ops.swap_blocks(**args)


def test_swap_blocks_same_pool_overlap_refused():
    pool = torch.zeros(CACHE_SHAPE)
    with pytest.raises(pagedcore.InvalidArgumentError, match="both a source and a destination"):
        ops.swap_blocks(pool, pool, torch.tensor([[1, 2], [2, 3]]))
    ops.swap_blocks(pool, pool, torch.tensor([[1, 2], [4, 3]]))


def test_threads_and_isa_settings():
    ops.set_num_threads(3)
    assert ops.get_num_threads() == 3
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        ops.set_num_threads(0)
    with pytest.raises(TypeError, match="n must be an int"):
        ops.set_num_threads(2.0)
    with pytest.raises(ValueError, match="unknown cpu isa 'sse9'"):
        ops.set_cpu_isa("sse9")
    assert ops.cpu_isa() in ("avx512", "avx2", "generic")
