"""kv_cache_dtype: names vLLM users pass, clear errors where they cannot work, and
the fp8 (e4m3) cache on the CPU (ops/cpu_fp8.py) against torch references: the
write stores e4m3(x / scale) saturated at +-448, attention reads it back times
the scale, block copies and swaps move its bytes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedcore import InvalidArgumentError, ops
from pagedcore.llm_engine import EngineArgs

FP8 = torch.float8_e4m3fn


def test_unknown_kv_cache_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'int4'"):
        EngineArgs(model="unused", kv_cache_dtype="int4").validate()


def test_calculate_kv_scales_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="calculate_kv_scales must be True or False, got 'yes'"):
        EngineArgs(model="unused", calculate_kv_scales="yes").validate()
    from pagedcore.cli import build_parser

    parser = build_parser()  # pagedcore serve --calculate-kv-scales, as vLLM's flag
    assert parser.parse_args(["serve", "--calculate-kv-scales"]).calculate_kv_scales is True
    # The calibration pass runs on rank 0's shard alone: refused with tensor parallelism.
    with pytest.raises(ValueError, match="calculate_kv_scales does not combine with tensor_parallel_size > 1, "
                                         "got tensor_parallel_size=2"):
        EngineArgs(model="unused", kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=2).validate()
    assert parser.parse_args(["serve"]).calculate_kv_scales is False


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: x / scale (as x * float32(1 / scale)) saturated and rounded to e4m3."""
    inv = 1.0 / torch.tensor(scale, dtype=torch.float32)
    return (x.float() * inv).clamp(-448.0, 448.0).to(FP8)


def poisoned_cache(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan")).to(FP8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("through", ["reshape_and_cache", "rotary_embedding"])
def test_fp8_write_stores_e4m3_of_x_over_the_scale(dtype, through) -> None:
    g = torch.Generator().manual_seed(0)
    blocks, bs, heads, d = 5, 8, 2, 32
    k_scale, v_scale = 0.01, 0.003
    key = (torch.randn(6, heads, d, generator=g) * 3).to(dtype)  # some beyond 448 * k_scale
    value = torch.randn(6, heads, d, generator=g).to(dtype)
    slots = torch.tensor([9, -1, 33, 0, 17, 39])
    k_cache, v_cache = poisoned_cache((blocks, bs, heads, d)), poisoned_cache((blocks, bs, heads, d))
    if through == "rotary_embedding":
        # Position 0 leaves a head unrotated: cos 1, sin 0.
        query = torch.zeros(6, 4, d, dtype=dtype)
        table = ops.cos_sin_cache(torch.ones(d // 2), 4)
        ops.rotary_embedding(torch.zeros(6, dtype=torch.int64), query, key, table, value=value,
                             key_cache=k_cache, value_cache=v_cache, slot_mapping=slots, k_scale=k_scale,
                             v_scale=v_scale)
    else:
        ops.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert (key.float().abs() > 448 * k_scale).any()
    flat_k, flat_v = k_cache.view(-1, heads, d), v_cache.view(-1, heads, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s].view(torch.uint8), e4m3(key[t], k_scale).view(torch.uint8))
            assert torch.equal(flat_v[s].view(torch.uint8), e4m3(value[t], v_scale).view(torch.uint8))
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert flat_k[untouched].float().isnan().all() and flat_v[untouched].float().isnan().all()


def test_fp8_write_refuses_bad_slots_and_writes_nothing() -> None:
    k_cache = poisoned_cache((2, 4, 1, 32))
    v_cache = poisoned_cache((2, 4, 1, 32))
    x = torch.randn(2, 1, 32)
    for slots, match in ((torch.tensor([1, 8]), r"slot_mapping holds 8, outside \[0, 8\)"),
                         (torch.tensor([3, 3]), "slot_mapping holds a slot twice")):
        with pytest.raises(InvalidArgumentError, match=match):
            ops.reshape_and_cache(x, x, k_cache, v_cache, slots)
        assert k_cache.float().isnan().all() and v_cache.float().isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_attention_reads_the_cache_back_times_the_scales(dtype) -> None:
    # A decode row and the last 5 tokens of a chunked-prefill row (causal) over
    # scattered blocks of an fp8 cache (NaN everywhere else), GQA 3:1, against
    # softmax(q k^T) v in float64 on the dequantized keys and values. Row 1 fills its
    # one block exactly; the table entries after it are never read (not even range-checked).
    g = torch.Generator().manual_seed(1)
    bs, kv_heads, group, d = 8, 2, 3, 64
    k_scale, v_scale = 0.02, 0.005
    lens, q_lens = [19, 8], [1, 5]
    tables = torch.tensor([[6, 2, 9], [4, 77, -3]], dtype=torch.int32)
    k_cache, v_cache = poisoned_cache((10, bs, kv_heads, d)), poisoned_cache((10, bs, kv_heads, d))
    keys = [torch.randn(n, kv_heads, d, generator=g) * 2 for n in lens]
    values = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    for row, n in enumerate(lens):
        slots = torch.tensor([int(tables[row, j // bs]) * bs + j % bs for j in range(n)])
        ops.reshape_and_cache(keys[row].to(dtype), values[row].to(dtype), k_cache, v_cache, slots,
                              k_scale=k_scale, v_scale=v_scale)
    query = torch.randn(sum(q_lens), kv_heads * group, d, generator=g).to(dtype)
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32)
    out = ops.paged_attention(query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl,
                              scale=d ** -0.5, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    for row, (n, q_len) in enumerate(zip(lens, q_lens)):
        k = e4m3(keys[row].to(dtype), k_scale).double() * k_scale
        v = e4m3(values[row].to(dtype), v_scale).double() * v_scale
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = query[int(qsl[row]):int(qsl[row + 1])].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[int(qsl[row]):int(qsl[row + 1])].double(), ref, atol=tol, rtol=0)


def test_fp8_block_copies_and_swaps_move_bytes() -> None:
    g = torch.Generator().manual_seed(2)
    caches = [torch.randn(6, 4, 1, 8, generator=g).to(FP8) for _ in range(4)]
    before = [c.clone() for c in caches]
    ops.copy_blocks(caches[:2], caches[2:], torch.tensor([[1, 4], [3, 0]]))
    for c, b in zip(caches, before):
        expected = b.clone().view(torch.uint8)
        expected[4], expected[0] = b.view(torch.uint8)[1], b.view(torch.uint8)[3]
        assert torch.equal(c.view(torch.uint8), expected)
    with pytest.raises(InvalidArgumentError, match="both a source and a destination"):
        ops.copy_blocks(caches[:2], caches[2:], torch.tensor([[1, 4], [4, 5]]))
    pool = poisoned_cache((3, 4, 1, 8))
    ops.swap_blocks(caches[0], pool, torch.tensor([[5, 2], [0, 0]]))
    assert torch.equal(pool[2].view(torch.uint8), caches[0][5].view(torch.uint8))
    assert torch.equal(pool[0].view(torch.uint8), caches[0][0].view(torch.uint8))
    assert pool[1].float().isnan().all()
    with pytest.raises(InvalidArgumentError, match=r"dst id 3 outside \[0, 3\)"):
        ops.swap_blocks(caches[0], pool, torch.tensor([[5, 3]]))
