"""The fused layer ops of pagedcore.ops on CUDA, against the float64 references of
layer_ops_reference.py (the unfused arithmetic rounded where Hugging Face rounds)
over the large grid: hidden sizes 64..8192 (incl. non-multiples of the vector
width), head dims 64/128/256, token counts 1..4096, bf16/fp16/fp32, in place and
not, strided rows (scalar path), rope scaling variants. Outputs are poisoned with
NaN; the parts of a fused qkv buffer an op must not touch are compared bit for
bit. Also: the CPU and CUDA kernels agree, and the ops run inside a CUDA graph."""

from __future__ import annotations

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
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
)
from pagedcore import ops

pytestmark = pytest.mark.cuda

EPS = 1e-6
DEV = "cuda"
TOKENS = [1, 3, 17, 255, 4096]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000, 2048, 4096, 8192, 8190])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(dtype, hidden, tokens):
    if tokens * hidden > 4096 * 4096:
        tokens = 4096 * 4096 // hidden
    x = randn(tokens, hidden, dtype=dtype, seed=hidden + tokens, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=1) + 1
    out = torch.full_like(x, NAN)
    ops.rms_norm(x, w, EPS, out=out)
    ref, _ = rms_norm_ref(x.cpu(), w.cpu(), EPS)
    check(out, ref)
    ops.rms_norm(x, w, EPS, out=x)  # in place
    check(x, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000, 4096, 8192])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm(dtype, hidden, tokens):
    x = randn(tokens, hidden, dtype=dtype, seed=hidden, scale=2.0)
    residual = randn(tokens, hidden, dtype=dtype, seed=tokens, scale=4.0)
    w = randn(hidden, dtype=dtype, seed=2) + 1
    ref, ref_residual = rms_norm_ref(x.cpu(), w.cpu(), EPS, residual=residual.cpu())
    ops.fused_add_rms_norm(x, residual, w, EPS)
    assert_same_bits(residual, ref_residual.to(dtype))
    check(x, ref)


@pytest.mark.parametrize("vecs", ["1", "2", "4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_vectors_per_thread(monkeypatch, dtype, vecs):
    # PAGEDCORE_RMSNORM_VECS forces K (vectors a thread holds between the passes; by
    # default chosen by the row count). Rows of 4100 in a stride of 4104: 16-byte rows
    # whose last 4 elements take the scalar tail after the K held vectors and any others.
    monkeypatch.setenv("PAGEDCORE_RMSNORM_VECS", vecs)
    base_x = randn(300, 4104, dtype=dtype, seed=11, scale=2.0)
    base_r = randn(300, 4104, dtype=dtype, seed=12, scale=4.0)
    x, residual = base_x[:, :4100], base_r[:, :4100]
    w = randn(4100, dtype=dtype, seed=13) + 1
    ref, ref_residual = rms_norm_ref(x.cpu(), w.cpu(), EPS, residual=residual.cpu())
    ops.fused_add_rms_norm(x, residual, w, EPS)
    assert_same_bits(residual, ref_residual.to(dtype))
    check(x, ref)
    y = randn(300, 8192, dtype=dtype, seed=14, scale=3.0)
    w2 = randn(8192, dtype=dtype, seed=15) + 1
    out = torch.full_like(y, NAN)
    ops.rms_norm(y, w2, EPS, out=out)
    check(out, rms_norm_ref(y.cpu(), w2.cpu(), EPS)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_rms_norm_strided_unaligned_rows(dtype, offset):
    # Rows that start off 16 bytes take the scalar path; the rest must stay as it was.
    base = randn(40, 1100, dtype=dtype, seed=offset)
    x = base[:, offset:offset + 1024]
    before = base.clone()
    ref, _ = rms_norm_ref(x.cpu(), torch.ones(1024, dtype=dtype), EPS)
    ops.rms_norm(x, torch.ones(1024, dtype=dtype, device=DEV), EPS, out=x)
    check(x, ref)
    assert_same_bits(base[:, :offset], before[:, :offset])
    assert_same_bits(base[:, offset + 1024:], before[:, offset + 1024:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 7, 1000])
def test_qk_norm_per_head_inside_qkv(dtype, head_dim, tokens):
    heads, kv_heads = 8, 2
    qkv, q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEV, pad=8, seed=head_dim)
    before = qkv.clone()
    qw = randn(head_dim, dtype=dtype, seed=3) + 1
    kw = randn(head_dim, dtype=dtype, seed=4) + 1
    q_ref, _ = rms_norm_ref(q.cpu(), qw.cpu(), EPS)
    k_ref, _ = rms_norm_ref(k.cpu(), kw.cpu(), EPS)
    ops.rms_norm(q, qw, EPS, out=q)
    ops.rms_norm(k, kw, EPS, out=k)
    check(q, q_ref)
    check(k, k_ref)
    start = (heads + kv_heads) * head_dim
    assert_same_bits(qkv[:, start:], before[:, start:])


ROPES = {"plain": dict(), "llama3": dict(rope_scaling=LLAMA3_SCALING, theta=500000.0),
         "qwen_theta": dict(theta=1000000.0)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pad", [1, 8], ids=["rows-unaligned", "rows-on-16-bytes"])
def test_rotary(dtype, head_dim, rope, tokens, positions_dtype, pad):
    # (pad 8: every row starts on 16 bytes, the kernel's vector path; pad 1: its scalar path)
    spec, _ = llama_spec(**ROPES[rope], head_dim=head_dim)
    table = ops.cos_sin_cache(spec.inv_freq().to(DEV), 8192)
    heads, kv_heads = 8, 2
    qkv, q, k, _ = qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEV, pad=pad, seed=tokens)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(tokens),
                              dtype=positions_dtype)
    before = qkv.clone()
    q_ref = rotary_ref(q.cpu(), positions, table.cpu())
    k_ref = rotary_ref(k.cpu(), positions, table.cpu())
    ops.rotary_embedding(positions.to(DEV), q, k, table)
    check(q, q_ref, max_off=0.0)
    check(k, k_ref, max_off=0.0)
    start = (heads + kv_heads) * head_dim
    assert_same_bits(qkv[:, start:], before[:, start:])


@pytest.mark.parametrize("dtype,cache", [(torch.float32, "same"), (torch.bfloat16, "same"), (torch.float16, "same"),
                                         (torch.bfloat16, "fp8"), (torch.float16, "fp8")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 17, 1000])
@pytest.mark.parametrize("pad", [3, 8], ids=["rows-unaligned", "rows-on-16-bytes"])
@pytest.mark.parametrize("slots_dtype", [torch.int64, torch.int32], ids=["slots-int64", "slots-int32"])
def test_rotary_with_the_cache_write(dtype, cache, head_dim, tokens, pad, slots_dtype):
    # (positions int64: int32 slots beside them are read as int32, not as the positions' type)
    spec, _ = llama_spec(LLAMA3_SCALING, theta=500000.0, head_dim=head_dim)
    table = ops.cos_sin_cache(spec.inv_freq().to(DEV), 4096)
    heads, kv_heads, block_size = 8, 2, 16
    num_blocks = (2 * tokens) // block_size + 2
    qkv, q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEV, pad=pad, seed=tokens)
    g = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEV)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::5] = -1  # padding rows
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
    k_scale, v_scale = (2.0, 0.5) if cache == "fp8" else (1.0, 1.0)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), NAN, device=DEV).to(cache_dtype)
    v_cache = k_cache.clone()
    q_ref = rotary_ref(q.cpu(), positions.cpu(), table.cpu())
    k_ref = rotary_ref(k.cpu(), positions.cpu(), table.cpu())
    v_before = v.clone()
    ops.rotary_embedding(positions, q, k, table, value=v, key_cache=k_cache, value_cache=v_cache,
                         slot_mapping=slots.to(slots_dtype).to(DEV), k_scale=k_scale, v_scale=v_scale)
    check(q, q_ref, max_off=0.0)
    check(k, k_ref, max_off=0.0)
    assert_same_bits(v, v_before)
    k_rows = k_cache.view(-1, kv_heads, head_dim).cpu()
    v_rows = v_cache.view(-1, kv_heads, head_dim).cpu()
    rows = slots >= 0
    # The stored values: the rotated keys and the values in the cache's type (fp8: / scale,
    # exact powers of two, so the scaling itself rounds nothing).
    want_k = (k_ref[rows] / k_scale).to(cache_dtype)
    want_v = (v_before.cpu()[rows].double() / v_scale).to(cache_dtype)
    assert_same_bits(k_rows[slots[rows]], want_k)
    assert_same_bits(v_rows[slots[rows]], want_v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[rows]] = False
    assert torch.isnan(k_rows[untouched].float()).all() and torch.isnan(v_rows[untouched].float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 1000, 1536, 8192, 14336, 3])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(dtype, size, tokens):
    if tokens * size > 4096 * 4096:
        tokens = 4096 * 4096 // size
    x = randn(tokens, 2 * size, dtype=dtype, seed=size + tokens, scale=3.0)
    out = torch.full((tokens, size), NAN, dtype=dtype, device=DEV)
    ops.silu_and_mul(x, out=out)
    check(out, silu_and_mul_ref(x.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_and_cuda_kernels_agree(dtype):
    x = randn(33, 1000, dtype=dtype, seed=5)
    w = randn(1000, dtype=dtype, seed=6)
    check(ops.rms_norm(x, w, EPS), ops.rms_norm(x.cpu(), w.cpu(), EPS).double())
    g = randn(9, 2 * 768, dtype=dtype, seed=7)
    check(ops.silu_and_mul(g), ops.silu_and_mul(g.cpu()).double())


def test_layer_ops_inside_a_cuda_graph():
    spec, _ = llama_spec(head_dim=128)
    table = ops.cos_sin_cache(spec.inv_freq().to(DEV), 1024)
    x = randn(4, 1024, dtype=torch.bfloat16, seed=8)
    residual = randn(4, 1024, dtype=torch.bfloat16, seed=9)
    w = randn(1024, dtype=torch.bfloat16, seed=10)
    gate_up = randn(4, 2 * 512, dtype=torch.bfloat16, seed=11)
    _, q, k, _ = qkv_views(4, 4, 2, 128, torch.bfloat16, DEV, seed=12)
    positions = torch.tensor([0, 3, 9, 1023], dtype=torch.int32, device=DEV)
    inputs = [t.clone() for t in (x, residual, q, k)]
    out = torch.empty(4, 512, dtype=torch.bfloat16, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with ops.unchecked_indices(), torch.cuda.graph(graph):
        ops.fused_add_rms_norm(x, residual, w, EPS)
        ops.rotary_embedding(positions, q, k, table)
        ops.silu_and_mul(gate_up, out=out)
    for t, v in zip((x, residual, q, k), inputs):  # capture ran nothing
        t.copy_(v)
    graph.replay()
    ref, ref_residual = rms_norm_ref(inputs[0].cpu(), w.cpu(), EPS, residual=inputs[1].cpu())
    check(x, ref)
    assert_same_bits(residual, ref_residual.to(torch.bfloat16))
    check(q, rotary_ref(inputs[2].cpu(), positions.cpu(), table.cpu()), max_off=0.0)
    check(out, silu_and_mul_ref(gate_up.cpu()))


def test_positions_out_of_the_table_raise():
    spec, _ = llama_spec(head_dim=64)
    table = ops.cos_sin_cache(spec.inv_freq().to(DEV), 16)
    qkv, q, k, _ = qkv_views(2, 2, 1, 64, torch.float32, DEV)
    before = qkv.clone()
    with pytest.raises(ValueError, match=r"rotary_embedding: positions holds 16, outside \[0, 16\)"):
        ops.rotary_embedding(torch.tensor([3, 16], device=DEV), q, k, table)
    assert_same_bits(qkv, before)
    with pytest.raises(ValueError, match="rotary_embedding: all tensors must be on one device"):
        ops.rotary_embedding(torch.tensor([3, 1]), q, k, table)
