"""pagedcore.ops.linear on CUDA (the decode steps' kernels, bf16/fp16, 1-16 rows: a
matrix-vector kernel at one row, tensor cores at 2-16) against a float64 product of the
same rounded inputs: shapes of the model families (in_features 64..14336, out_features
1..~50k incl. non-multiples of the 16 features of an mma tile and in_features that are
not multiples of its 32-element chunks), every split of k over the warps of a CTA and
the CTAs of a cluster, bias, strided input rows, outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from pagedcore import ops

pytestmark = pytest.mark.cuda


def _case(rows, in_features, out_features, dtype, bias, seed=0, row_stride=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = row_stride or in_features
    base = torch.randn((rows, width), generator=g, device="cuda").to(dtype)
    x = base[:, :in_features]
    w = (torch.randn((out_features, in_features), generator=g, device="cuda") * in_features**-0.5).to(dtype)
    b = torch.randn((out_features,), generator=g, device="cuda").to(dtype) if bias else None
    return x, w, b


def _check(x, w, b, out):
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    # float32 accumulation in another order, then one rounding to the dtype.
    eps = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    err = (out.double() - expected).abs()
    bound = eps * expected.abs() + 1e-4 * (x.double().abs() @ w.double().abs().T).clamp(min=1.0) + 1e-6
    assert not torch.isnan(out).any()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} (bound {bound[err > bound].min().item():.3g})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16])
@pytest.mark.parametrize("in_features,out_features", [
    (64, 1), (576, 960), (576, 3072), (1536, 576), (4096, 6144), (14336, 4096), (2048, 4099), (8, 13),
    (8192, 1000), (8200, 7),  # one row: 8 warps per feature, parts of uneven length
    (72, 40), (1000, 24),
])
def test_linear_against_float64(dtype, rows, in_features, out_features):
    x, w, b = _case(rows, in_features, out_features, dtype, bias=False)
    if w.numel() * w.element_size() <= 40 << 20:  # (larger weights: test_model_sends_products_where_faster)
        assert ops.cuda_linear_eligible(x, w) == (rows <= ops.CUDA_LINEAR_MODEL_ROWS)
    out = ops.linear(x, w)
    _check(x, w, b, out)


@pytest.mark.parametrize("rows", [1, 6, 13])
@pytest.mark.parametrize("in_features,out_features,row_stride", [(896, 1152, 1024), (4096, 1000, 4104)])
def test_linear_bias_strided_rows_and_out(rows, in_features, out_features, row_stride):
    # Qwen's qkv bias; input rows inside a wider buffer; out a view into a poisoned buffer.
    # (4096 -> 1000 at one row: 8 warps per feature, the bias added once after the parts.)
    x, w, b = _case(rows, in_features, out_features, torch.bfloat16, bias=True, row_stride=row_stride)
    full = torch.full((rows, out_features + 48), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = full[:, :out_features]
    assert ops.linear(x, w, b, out=out) is out
    _check(x, w, b, out)
    assert torch.isnan(full[:, out_features:]).all(), "wrote past out_features"


@pytest.mark.parametrize("parts", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("rows", [2, 9, 16])
@pytest.mark.parametrize("in_features,out_features", [(2056, 20), (72, 40), (1536, 576)])
def test_linear_every_split_of_k(monkeypatch, parts, rows, in_features, out_features):
    # PAGEDCORE_LINEAR_PARTS (read at each launch) forces the split of a group's k over
    # warps (<= 8) and cluster CTAs (16, 64: Hopper; fewer where the shape has fewer
    # 32-element chunks: 72 has 3, the last one with one lane's worth of k). The
    # partial sums meet in a fixed order; bias and strided rows ride along.
    monkeypatch.setenv("PAGEDCORE_LINEAR_PARTS", str(parts))
    x, w, b = _case(rows, in_features, out_features, torch.bfloat16, bias=True, seed=parts, row_stride=in_features + 8)
    full = torch.full((rows, out_features + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = full[:, :out_features]
    ops.linear(x, w, b, out=out)
    _check(x, w, b, out)
    assert torch.isnan(full[:, out_features:]).all(), "wrote past out_features"
    again = torch.full_like(out, float("nan"))
    ops.linear(x, w, b, out=again)
    assert torch.equal(again, out), "the same product twice gave different bits"


@pytest.mark.parametrize("parts", [0, 1, 2, 8, 16, 64])
@pytest.mark.parametrize("rows", [2, 8, 9, 16])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (2056, 20), (72, 40)])
def test_linear_reductions_give_the_same_bits(monkeypatch, parts, rows, in_features, out_features):
    # PAGEDCORE_LINEAR_MMA=old (read at each launch) takes the 2-16-row kernel's other way
    # (a warp's place from divisions, one warp of a group summing the partials); the
    # default spreads the sums over the group's warps. They add in the same order, so
    # the outputs, plain and gated, are the same bits at every split of k (parts 0: the
    # planner's; 16 and 64: clusters of CTAs).
    if parts:
        monkeypatch.setenv("PAGEDCORE_LINEAR_PARTS", str(parts))
    x, w, b = _case(rows, in_features, out_features, torch.bfloat16, bias=True, seed=parts + rows)
    results = {}
    for mode in ("old", "default"):
        if mode == "old":
            monkeypatch.setenv("PAGEDCORE_LINEAR_MMA", "old")
        else:
            monkeypatch.delenv("PAGEDCORE_LINEAR_MMA", raising=False)
        full = torch.full((rows, out_features + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
        gated = torch.full((rows, out_features // 2 + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
        ops.linear(x, w, b, out=full[:, :out_features])
        ops.linear_silu_and_mul(x, w, b, out=gated[:, :out_features // 2])
        assert torch.isnan(full[:, out_features:]).all() and torch.isnan(gated[:, out_features // 2:]).all(), mode
        results[mode] = (full[:, :out_features], gated[:, :out_features // 2])
    _check(x, w, b, results["default"][0])
    # (the real columns only: NaN != NaN)
    assert torch.equal(results["default"][0], results["old"][0]), "plain product differs"
    assert torch.equal(results["default"][1], results["old"][1]), "gated product differs"


@pytest.mark.parametrize("in_features,out_features", [(576, 960), (1536, 576), (4096, 6144)])
def test_linear_row_sums_independent_of_the_other_rows(in_features, out_features):
    # ops.linear's contract: on CUDA a row's result is the same bits whichever other rows
    # (2-16 in all) share the call, so decode batches of 2..16 sequences agree.
    x, w, b = _case(16, in_features, out_features, torch.bfloat16, bias=True, seed=7)
    full = ops.linear(x, w, b)
    _check(x, w, b, full)
    for rows in (2, 3, 8, 9, 15):
        assert torch.equal(ops.linear(x[:rows], w, b), full[:rows]), f"rows 0..{rows - 1} alone differ"
        assert torch.equal(ops.linear(x[16 - rows:], w, b), full[16 - rows:]), f"last {rows} rows alone differ"


@pytest.mark.parametrize("rows,in_features,out_features,expected", [
    (1, 576, 960, True), (16, 576, 960, True), (16, 4096, 4096, True),  # latency-bound: the kernels
    (2, 4096, 6144, False), (16, 4096, 28672, False),                  # large weights, 2-16 rows: cuBLAS
    (1, 4096, 6144, True), (1, 4096, 128256, True),                    # one row: the kernel
    (1, 576, 49152, False),                                            # except a large head of short rows
])
def test_model_sends_products_where_faster(rows, in_features, out_features, expected):
    # Where the H200 measured the kernels faster than cuBLAS (ops/linear_cuda.py's NOTE).
    x = torch.zeros((rows, in_features), dtype=torch.bfloat16, device="cuda")
    w = torch.empty((out_features, in_features), dtype=torch.bfloat16, device="cuda")
    assert ops.cuda_linear_eligible(x, w) == (expected and rows <= ops.CUDA_LINEAR_MODEL_ROWS)


def test_linear_large_vocabulary_head():
    x, w, _ = _case(2, 576, 49152, torch.bfloat16, bias=False, seed=3)
    _check(x, w, None, ops.linear(x, w))


def test_linear_refuses_what_the_kernel_cannot_take():
    x, w, _ = _case(17, 64, 32, torch.bfloat16, bias=False)
    assert not ops.cuda_linear_eligible(x, w)  # more rows than the kernel's maximum: cuBLAS
    with pytest.raises(ValueError, match=r"linear: x has 17 rows on CUDA; at most 16"):
        ops.linear(x, w)
    x, w, _ = _case(1, 60, 32, torch.bfloat16, bias=False)
    assert not ops.cuda_linear_eligible(x, w)
    with pytest.raises(ValueError, match=r"in_features must be a multiple of 8 on CUDA, got 60"):
        ops.linear(x, w)
    x, w, _ = _case(1, 64, 32, torch.bfloat16, bias=False)
    with pytest.raises(TypeError, match=r"linear: weight must be torch.bfloat16 like x, got torch.float16"):
        ops.linear(x, w.half())
    with pytest.raises(TypeError, match=r"float32 products run on the CPU"):
        ops.linear(x.float(), w.float())


@pytest.mark.parametrize("rows", [1, 2, 7, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("in_features,intermediate", [(576, 1536), (4096, 14336), (2048, 1000), (1536, 13)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_linear_silu_and_mul(rows, dtype, in_features, intermediate, bias):
    """The decode MLP kernels (gate_up product and SiLU-mul in one: the one-row kernel,
    the tensor-core one at 2-16 rows) against the two ops they replace, bit for bit
    (gate_up shapes of the models, feature counts that are no multiple of a CTA's pairs
    or of a warp's 8, 2-4 warps a feature at one row), and against float64 arithmetic."""
    if rows > 1 and intermediate == 14336 and dtype == torch.float16:
        pytest.skip("(one dtype is enough for the large shape at several rows)")
    x, w, b = _case(rows, in_features, 2 * intermediate, dtype, bias=bias, seed=5)
    full = torch.full((rows, intermediate + 40), float("nan"), dtype=dtype, device="cuda")
    out = full[:, :intermediate]
    assert ops.linear_silu_and_mul(x, w, b, out=out) is out
    assert torch.isnan(full[:, intermediate:]).all(), "wrote past intermediate_size"
    two_ops = ops.silu_and_mul(ops.linear(x, w, b))
    assert torch.equal(out, two_ops)
    y = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    expected = torch.nn.functional.silu(y[:, :intermediate]) * y[:, intermediate:]
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    # Roundings: gate and up (product, dtype), silu, the result; plus the float32 sums'
    # order (1e-4 of the absolute dot products, as _check allows); silu' <= 1.1.
    g, u = y[:, :intermediate], y[:, intermediate:]
    scale = x.double().abs() @ w.double().abs().T
    dg, du = eps * g.abs() + 1e-4 * scale[:, :intermediate], eps * u.abs() + 1e-4 * scale[:, intermediate:]
    bound = 3 * eps * expected.abs() + 1.1 * dg * u.abs() + (g.abs() + 0.3) * du + 1e-6
    assert ((out.double() - expected).abs() <= bound).all()


def test_linear_silu_and_mul_refuses_what_the_kernels_cannot_take():
    x, w, _ = _case(17, 64, 2 * 32, torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match=r"linear: x has 17 rows on CUDA; at most 16"):
        ops.linear_cuda.linear_cuda("linear", x, w, None, None, silu_and_mul=True)
    with pytest.raises(ValueError, match=r"an even number of weight rows"):
        ops.linear_cuda.linear_cuda("linear", x[:2], w[:63], None, None, silu_and_mul=True)
