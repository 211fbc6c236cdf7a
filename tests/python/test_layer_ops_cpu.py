"""The fused layer ops of pagedcore.ops (RMSNorm, fused add + RMSNorm, per-head q/k
norm, rotary embedding, SiLU-and-multiply) on the CPU.

Against float64 references of the unfused arithmetic rounded where Hugging Face rounds
(layer_ops_reference.py), and, where the float32 result is fixed by the unfused torch
ops themselves, against those ops bit for bit; rotary also against transformers'
own rotary embedding (Llama 3 scaling, Qwen's theta). Outputs are poisoned with NaN
before each call; the parts of a fused qkv buffer an op must not touch are compared
bit for bit afterwards. The grid is stacked (sizes x dtypes, token counts incl.
non-multiples of the vector width) and kept small: the CUDA tests run the large one.
"""

from __future__ import annotations

import pagedcore
import pytest
import torch
from layer_ops_reference import (
    DTYPES,
    LLAMA3_SCALING,
    NAN,
    assert_same_bits,
    check,
    llama_spec,
    qkv_views,
    rel_close_fp32,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
)
from pagedcore import ops

EPS = 1e-5


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = ops.get_num_threads()
    yield
    ops.set_num_threads(threads)


# ---- RMSNorm ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 576), (17, 1000), (2, 8192), (130, 2048)])
def test_rms_norm(dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, seed=hidden, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=1) + 1
    out = torch.full_like(x, NAN)
    assert ops.rms_norm(x, w, EPS, out=out) is out
    ref, _ = rms_norm_ref(x, w, EPS)
    check(out, ref)


def test_rms_norm_float32_equals_the_torch_ops():
    # The decoder's RMSNorm before the fused kernels: what float32 results must keep, up
    # to the rounding of the variance and rsqrt (each side a few ulps from exact).
    x = randn(9, 576, seed=3)
    w = randn(576, seed=4)
    torch_out = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    rel_close_fp32(ops.rms_norm(x, w, EPS), torch_out.double(), ulps=4)


def test_rms_norm_matches_transformers_module_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(1024, eps=EPS).to(torch.bfloat16)
    hf.weight.data = randn(1024, dtype=torch.bfloat16, seed=5) + 1
    x = randn(33, 1024, dtype=torch.bfloat16, seed=6, scale=2.0)
    with torch.no_grad():
        want = hf(x)
    got = ops.rms_norm(x, hf.weight.data, EPS)
    check(got, want.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_and_strided_rows(dtype):
    base = randn(5, 700, dtype=dtype, seed=7)
    x = base[:, 30:670]  # rows 700 apart, starting off the vector alignment
    before = base.clone()
    ref, _ = rms_norm_ref(x.clone(), torch.ones(640, dtype=dtype), EPS)
    assert ops.rms_norm(x, torch.ones(640, dtype=dtype), EPS, out=x) is x
    check(x, ref)
    assert_same_bits(base[:, :30], before[:, :30])
    assert_same_bits(base[:, 670:], before[:, 670:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 576), (33, 1000), (3, 8192)])
def test_fused_add_rms_norm(dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, seed=8, scale=2.0)
    residual = randn(tokens, hidden, dtype=dtype, seed=9, scale=4.0)
    w = randn(hidden, dtype=dtype, seed=10) + 1
    ref, ref_residual = rms_norm_ref(x, w, EPS, residual=residual)
    assert ops.fused_add_rms_norm(x, residual, w, EPS) is None
    # The sum is rounded once to the dtype, as torch adds: exact.
    assert_same_bits(residual, ref_residual.to(dtype))
    check(x, ref)


def test_fused_add_rms_norm_float32_equals_the_torch_ops():
    x, residual, w = randn(4, 576, seed=11), randn(4, 576, seed=12), randn(576, seed=13)
    h = residual + x
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))
    ops.fused_add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, h)
    rel_close_fp32(x, want.double(), ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_qk_norm_per_head_inside_qkv(dtype, head_dim):
    tokens, heads, kv_heads = 5, 4, 2
    qkv, q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, "cpu", pad=8, seed=head_dim)
    before = qkv.clone()
    qw = randn(head_dim, dtype=dtype, seed=14) + 1
    kw = randn(head_dim, dtype=dtype, seed=15) + 1
    q_ref, _ = rms_norm_ref(q, qw, EPS)
    k_ref, _ = rms_norm_ref(k, kw, EPS)
    ops.rms_norm(q, qw, EPS, out=q)
    ops.rms_norm(k, kw, EPS, out=k)
    check(q, q_ref)
    check(k, k_ref)
    assert_same_bits(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])


def test_rms_norm_3d_out_of_place():
    _, q, _, _ = qkv_views(3, 4, 1, 128, torch.bfloat16, "cpu", seed=16)
    w = randn(128, dtype=torch.bfloat16, seed=17)
    out = torch.full((3, 4, 128), NAN, dtype=torch.bfloat16)
    ops.rms_norm(q, w, EPS, out=out)
    check(out, rms_norm_ref(q, w, EPS)[0])


def test_rms_norm_threads_agree():
    x = randn(300, 2048, seed=18)  # large enough for the thread pool
    w = randn(2048, seed=19)
    ops.set_num_threads(1)
    one = ops.rms_norm(x, w, EPS)
    ops.set_num_threads(2)
    two = ops.rms_norm(x, w, EPS)
    assert torch.equal(one, two)
    check(two, rms_norm_ref(x, w, EPS)[0])


# ---- rotary -------------------------------------------------------------------------------

SPECS = {
    "plain": dict(),
    "llama3": dict(rope_scaling=LLAMA3_SCALING, theta=500000.0),
    "qwen_theta": dict(theta=1000000.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rope", list(SPECS))
def test_rotary(dtype, head_dim, rope):
    spec, _ = llama_spec(**SPECS[rope], head_dim=head_dim)
    table = ops.cos_sin_cache(spec.inv_freq(), 4096)
    tokens, heads, kv_heads = 11, 3, 1
    qkv, q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, "cpu", pad=2, seed=head_dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 1023, 1024, 2047, 3000, 4094, 4095], dtype=torch.int64)
    before = qkv.clone()
    q_ref, k_ref = rotary_ref(q, positions, table), rotary_ref(k, positions, table)
    ops.rotary_embedding(positions, q, k, table)
    # Every intermediate is a product or sum of dtype values rounded once: exact.
    check(q, q_ref, max_off=0.0)
    check(k, k_ref, max_off=0.0)
    v_start = (heads + kv_heads) * head_dim
    assert_same_bits(qkv[:, v_start:], before[:, v_start:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", ["plain", "llama3"])
def test_rotary_matches_transformers(dtype, rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    spec, config = llama_spec(**SPECS[rope], head_dim=128)
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 5, 511, 1500, 8000, 8191])
    qkv, q, k, _ = qkv_views(6, 4, 2, 128, dtype, "cpu", seed=20)
    x = q.new_empty(1)  # dtype carrier for HF
    cos, sin = hf_rope(x.expand(1, 6, 1).to(dtype), positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ops.rotary_embedding(positions, q, k, ops.cos_sin_cache(spec.inv_freq(), 8192))
    assert torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(k, want_k[0].transpose(0, 1))


def test_cos_sin_cache_is_the_decoders_rotary_arithmetic():
    spec, _ = llama_spec(LLAMA3_SCALING, theta=500000.0, head_dim=128)
    positions = torch.arange(2048)
    freqs = positions.to(torch.float32)[:, None] * spec.inv_freq()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    table = ops.cos_sin_cache(spec.inv_freq(), 2048)
    assert table.dtype == torch.float32 and table.shape == (2048, 128)
    assert torch.equal(table[:, :64], emb.cos()[:, :64]) and torch.equal(table[:, 64:], emb.sin()[:, :64])


@pytest.mark.parametrize("tokens", [1, 4, 37])
def test_rotary_float32_equals_the_torch_ops_int32_positions(tokens):
    spec, _ = llama_spec(head_dim=64)
    table = ops.cos_sin_cache(spec.inv_freq(), 512)
    _, q, k, _ = qkv_views(tokens, 9, 3, 64, torch.float32, "cpu", seed=tokens)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(tokens), dtype=torch.int32)
    rows = table[positions.long()]
    cos = torch.cat((rows[:, :32], rows[:, :32]), -1)[:, None]
    sin = torch.cat((rows[:, 32:], rows[:, 32:]), -1)[:, None]

    def rotate(x):  # the decoder's rotary before the fused kernels
        return x * cos + torch.cat((-x[..., 32:], x[..., :32]), -1) * sin

    want_q, want_k = rotate(q.clone()), rotate(k.clone())
    ops.rotary_embedding(positions, q, k, table)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_rotary_with_the_cache_write(dtype, slot_dtype):
    spec, _ = llama_spec(LLAMA3_SCALING, theta=500000.0, head_dim=128)
    table = ops.cos_sin_cache(spec.inv_freq(), 2048)
    tokens, heads, kv_heads, num_blocks, block_size = 6, 4, 2, 4, 16
    qkv, q, k, v = qkv_views(tokens, heads, kv_heads, 128, dtype, "cpu", pad=8, seed=30)
    positions = torch.tensor([0, 9, 100, 1500, 2047, 3])
    slots = torch.tensor([5, 17, -1, 40, 3, 63], dtype=slot_dtype)
    k_cache = torch.full((num_blocks, block_size, kv_heads, 128), NAN, dtype=dtype)
    v_cache = torch.full_like(k_cache, NAN)
    q_ref, k_ref, v_before = rotary_ref(q, positions, table), rotary_ref(k, positions, table), v.clone()
    ops.rotary_embedding(positions, q, k, table, value=v, key_cache=k_cache, value_cache=v_cache,
                         slot_mapping=slots)
    check(q, q_ref, max_off=0.0)
    check(k, k_ref, max_off=0.0)
    assert_same_bits(v, v_before)
    k_rows, v_rows = k_cache.view(-1, kv_heads, 128), v_cache.view(-1, kv_heads, 128)
    written = [int(s) for s in slots if s >= 0]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_same_bits(k_rows[slot], k_ref[t].to(dtype))
            assert_same_bits(v_rows[slot], v_before[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(k_rows[untouched]).all() and torch.isnan(v_rows[untouched]).all()


def test_rotary_cache_write_bad_input_writes_nothing():
    spec, _ = llama_spec(head_dim=64)
    table = ops.cos_sin_cache(spec.inv_freq(), 16)
    qkv, q, k, v = qkv_views(2, 2, 1, 64, torch.float32, "cpu")
    k_cache, v_cache = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    before = qkv.clone()
    positions = torch.tensor([1, 2])
    with pytest.raises(pagedcore.InvalidArgumentError, match=r"rotary_embedding: slot_mapping\[1\] = 8 out of range \[0, 8\)"):
        ops.rotary_embedding(positions, q, k, table, value=v, key_cache=k_cache, value_cache=v_cache,
                             slot_mapping=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="rotary_embedding: the cache write needs value, key_cache, value_cache and slot_mapping together"):
        ops.rotary_embedding(positions, q, k, table, key_cache=k_cache, value_cache=v_cache,
                             slot_mapping=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"rotary_embedding: key is \[num_tokens, 1, 64\] but the cache holds \[num_kv_heads, head_dim\] = \[2, 32\]"):
        ops.rotary_embedding(positions, q, k, table, value=v, key_cache=torch.zeros(2, 4, 2, 32),
                             value_cache=torch.zeros(2, 4, 2, 32), slot_mapping=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="rotary_embedding: key_cache has dtype torch.bfloat16 but key has torch.float32"):
        ops.rotary_embedding(positions, q, k, table, value=v, key_cache=k_cache.bfloat16(),
                             value_cache=v_cache.bfloat16(), slot_mapping=torch.tensor([0, 1]))
    assert_same_bits(qkv, before)
    assert not k_cache.any() and not v_cache.any()


# ---- SiLU and multiply --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,size", [(1, 64), (5, 1536), (9, 1000), (2, 8192), (67, 3)])
def test_silu_and_mul(dtype, tokens, size):
    x = randn(tokens, 2 * size, dtype=dtype, seed=size, scale=3.0)
    out = torch.full((tokens, size), NAN, dtype=dtype)
    assert ops.silu_and_mul(x, out=out) is out
    check(out, silu_and_mul_ref(x))


def test_silu_and_mul_float32_equals_the_torch_ops_and_strided_rows():
    base = randn(6, 2 * 768 + 16, seed=21, scale=4.0)
    x = base[:, : 2 * 768]
    want = torch.nn.functional.silu(x[:, :768]) * x[:, 768:]
    out_base = torch.full((6, 800), NAN)
    out = out_base[:, :768]
    ops.silu_and_mul(x, out=out)
    rel_close_fp32(out, want.double(), ulps=4)
    assert torch.isnan(out_base[:, 768:]).all()  # beyond the rows: untouched


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input_raises_before_any_write():
    x = randn(2, 64)
    w = torch.ones(64)
    with pytest.raises(TypeError, match="rms_norm: x must be float32, bfloat16 or float16, got torch.int32"):
        ops.rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match=r"rms_norm: weight must be \[64\], got shape \(32,\)"):
        ops.rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(TypeError, match="rms_norm: weight has dtype torch.bfloat16 but x has torch.float32"):
        ops.rms_norm(x, w.bfloat16(), EPS)
    with pytest.raises(ValueError, match="rms_norm: eps must be finite and >= 0, got -1"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(TypeError, match="rms_norm: eps must be a float, got None"):
        ops.rms_norm(x, w, None)
    with pytest.raises(ValueError, match="rms_norm: x rows must be dense"):
        ops.rms_norm(randn(64, 2).t(), w, EPS)
    with pytest.raises(ValueError, match=r"rms_norm: out shape \(2, 32\) != x shape \(2, 64\)"):
        ops.rms_norm(x, w, EPS, out=torch.empty(2, 32))
    with pytest.raises(TypeError, match="rms_norm: x must be a torch.Tensor, got list"):
        ops.rms_norm([1.0], w, EPS)

    residual = randn(2, 64, seed=1)
    snapshot = (x.clone(), residual.clone())
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual shape \(3, 64\) != x shape \(2, 64\)"):
        ops.fused_add_rms_norm(x, randn(3, 64), w, EPS)
    with pytest.raises(ValueError, match="fused_add_rms_norm: residual must not overlap x"):
        ops.fused_add_rms_norm(x, x, w, EPS)
    with pytest.raises(TypeError, match="fused_add_rms_norm: residual has dtype torch.float16"):
        ops.fused_add_rms_norm(x, residual.half(), w, EPS)
    assert torch.equal(x, snapshot[0]) and torch.equal(residual, snapshot[1])

    spec, _ = llama_spec(head_dim=64)
    table = ops.cos_sin_cache(spec.inv_freq(), 16)
    qkv, q, k, _ = qkv_views(2, 2, 1, 64, torch.float32, "cpu")
    before = qkv.clone()
    with pytest.raises(pagedcore.InvalidArgumentError, match=r"rotary_embedding: positions\[1\] = 16 outside the cos/sin table \[0, 16\)"):
        ops.rotary_embedding(torch.tensor([3, 16]), q, k, table)
    with pytest.raises(TypeError, match="rotary_embedding: positions must be int32 or int64, got torch.float32"):
        ops.rotary_embedding(torch.tensor([3.0, 1.0]), q, k, table)
    with pytest.raises(ValueError, match=r"rotary_embedding: positions must be \[num_tokens\] = \[2\], got shape \(3,\)"):
        ops.rotary_embedding(torch.tensor([0, 1, 2]), q, k, table)
    with pytest.raises(TypeError, match="rotary_embedding: cos_sin_cache must be float32, got torch.float16"):
        ops.rotary_embedding(torch.tensor([0, 1]), q, k, table.half())
    with pytest.raises(ValueError, match=r"rotary_embedding: cos_sin_cache must be \[max_positions, head_dim = 64\]"):
        ops.rotary_embedding(torch.tensor([0, 1]), q, k, table[:, :32].contiguous())
    with pytest.raises(TypeError, match="rotary_embedding: key has dtype torch.bfloat16 but query has torch.float32"):
        ops.rotary_embedding(torch.tensor([0, 1]), q, k.bfloat16(), table)
    with pytest.raises(ValueError, match="rotary_embedding: head_dim must be even, got 63"):
        ops.rotary_embedding(torch.tensor([0, 1]), q[..., :63], k[..., :63], table)
    assert_same_bits(qkv, before)

    with pytest.raises(ValueError, match="silu_and_mul: x's last dimension must be even"):
        ops.silu_and_mul(randn(2, 63))
    with pytest.raises(ValueError, match=r"silu_and_mul: out must be \[num_tokens, intermediate_size\] = \[2, 32\]"):
        ops.silu_and_mul(x, out=torch.empty(2, 64))
    with pytest.raises(ValueError, match="silu_and_mul: out must not overlap x"):
        ops.silu_and_mul(x, out=x[:, :32])
    with pytest.raises(ValueError, match=r"silu_and_mul: x must be \[num_tokens, 2 \* intermediate_size\]"):
        ops.silu_and_mul(randn(2, 2, 64))


def test_empty_batches_are_no_ops():
    w = torch.ones(64)
    assert ops.rms_norm(torch.empty(0, 64), w, EPS).shape == (0, 64)
    ops.fused_add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), w, EPS)
    assert ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    spec, _ = llama_spec(head_dim=64)
    ops.rotary_embedding(torch.empty(0, dtype=torch.int64), torch.empty(0, 2, 64), torch.empty(0, 1, 64),
                         ops.cos_sin_cache(spec.inv_freq(), 4))
