"""pagedcore.ops.silu_and_mul_linear: the MLP's activation fused into the input of its down
product (issue 11). On CUDA at 2-16 rows the tensor-core kernel reads silu(gate) * up as it
loads its input: bit for bit the two ops it replaces (silu_and_mul, then linear on the same
kernel and plan), and close to float64 arithmetic of silu(g) * u rounded to the dtype then
the product; shapes of SmolLM2 (1536) and the 8B model (14336), odd multiples of 8, wider
input rows, bias, poisoned outputs. The model's opt-in routing (PAGEDCORE_FUSED_DOWN=1)
changes no greedy token. On the CPU (and wherever the kernel cannot take the input): the
argument checks and the fallback to the two ops, against torch arithmetic."""

from __future__ import annotations

import pytest
import torch

from pagedcore import ops

cuda = pytest.mark.cuda


def _case(rows, intermediate, out_features, dtype, bias, device, seed=0, row_stride=None):
    g = torch.Generator(device=device).manual_seed(seed)
    width = row_stride or 2 * intermediate
    # gate_up outputs of a few units: silu's curved part and both signs.
    base = (3 * torch.randn((rows, width), generator=g, device=device)).to(dtype)
    y = base[:, :2 * intermediate]
    w = (torch.randn((out_features, intermediate), generator=g, device=device) * intermediate**-0.5).to(dtype)
    b = torch.randn((out_features,), generator=g, device=device).to(dtype) if bias else None
    return y, w, b


def _act64(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64, silu rounded to the dtype, the product rounded to it."""
    size = y.shape[1] // 2
    g, u = y[:, :size].double(), y[:, size:].double()
    silu = (g * torch.sigmoid(g)).to(y.dtype).double()
    return (silu * u).to(y.dtype).double()


def _check_float64(y, w, b, out):
    act = _act64(y)
    # (the kernels' silu is float32: where it rounds to the other neighbour of a tie-near
    # float64 value, silu is one ulp of the dtype off (<= 2 eps relative), and the
    # activation after its own rounding <= 4 eps; the product's bound below allows it)
    eps = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-11
    two_ops_act = ops.silu_and_mul(y).double()
    ulp = (two_ops_act - act).abs()
    assert (ulp <= 4 * eps * act.abs() + 1e-30).all(), "silu_and_mul more than one silu ulp from float64"
    expected = act @ w.double().T + (b.double() if b is not None else 0.0)
    scale = act.abs() @ w.double().abs().T
    bound = eps * expected.abs() + 1e-4 * scale.clamp(min=1.0) + ulp @ w.double().abs().T + 1e-6
    err = (out.double() - expected).abs()
    assert not torch.isnan(out).any()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


# ---- CUDA: the kernel ------------------------------------------------------------------------

SHAPES = [  # (intermediate_size, out_features)
    (1536, 576),    # SmolLM2's down
    (14336, 4096),  # the 8B model's down
    (296, 40),      # 37 * 8: the last 32-element chunk has one lane's worth of k
    (1000, 13),     # 125 * 8; out_features no multiple of an mma tile's 16
    (8, 24),        # one lane's worth of k in all
]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", list(range(1, 17)))
@pytest.mark.parametrize("intermediate,out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_fused_down_equals_the_two_ops_and_float64(dtype, rows, intermediate, out_features, bias):
    # (the default plans: the 8B shape's 8 parts and the small shapes' <= 8 in the shared
    # kernel, SmolLM2's 16 in the per-warp one)
    if intermediate == 14336 and (rows not in (1, 2, 8, 9, 16) or dtype == torch.float16 and bias):
        pytest.skip("(the large shape at a few row counts is enough)")
    # rows of [gate | up] inside wider rows (stride 2I + 24) for every other row count
    stride = 2 * intermediate + 24 if rows % 2 else None
    y, w, b = _case(rows, intermediate, out_features, dtype, bias, "cuda", seed=rows, row_stride=stride)
    assert ops.cuda_silu_and_mul_linear_eligible(y, w) == (2 <= rows <= ops.CUDA_LINEAR_MODEL_ROWS)
    full = torch.full((rows, out_features + 40), float("nan"), dtype=dtype, device="cuda")
    out = full[:, :out_features]
    assert ops.silu_and_mul_linear(y, w, b, out=out) is out
    assert torch.isnan(full[:, out_features:]).all(), "wrote past out_features"
    two_ops = ops.linear(ops.silu_and_mul(y), w, b)
    assert torch.equal(out, two_ops)
    _check_float64(y, w, b, out)


@cuda
@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared", "per-warp"])
@pytest.mark.parametrize("parts", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("rows", [2, 9, 16])
def test_fused_down_every_split_of_k(monkeypatch, shared, parts, rows):
    # PAGEDCORE_LINEAR_PARTS (read at each launch) forces the split of k over warps and
    # cluster CTAs: each part reads its own k range of gate and up. Up to 8 parts the
    # fused kernel runs them as a cluster of CTAs that each compute silu(gate) * up once
    # for their 8 warps (kSiluShared, summing in the plain plan's order), unless
    # PAGEDCORE_LINEAR_SILU_SHARED=0 (read at each launch) keeps the per-warp kernel.
    monkeypatch.setenv("PAGEDCORE_LINEAR_PARTS", str(parts))
    monkeypatch.setenv("PAGEDCORE_LINEAR_SILU_SHARED", shared)
    y, w, b = _case(rows, 2056, 40, torch.bfloat16, True, "cuda", seed=parts, row_stride=2 * 2056 + 8)
    out = ops.silu_and_mul_linear(y, w, b)
    assert torch.equal(out, ops.linear(ops.silu_and_mul(y), w, b))
    _check_float64(y, w, b, out)


@cuda
def test_fused_down_falls_back_where_the_kernel_cannot_take_the_input():
    # one row; I not a multiple of 8; rows not 16-byte aligned: the two ops
    cases = [_case(1, 64, 16, torch.bfloat16, False, "cuda")[:2], _case(4, 12, 16, torch.bfloat16, False, "cuda")[:2]]
    odd = torch.randn(4, 2 * 64 + 1, device="cuda").to(torch.bfloat16)[:, 1:]
    cases.append((odd, cases[0][1]))
    for y, w in cases:
        assert not ops.cuda_silu_and_mul_linear_eligible(y, w)
        assert torch.equal(ops.silu_and_mul_linear(y, w), ops.linear(ops.silu_and_mul(y), w))


@cuda
def test_model_routes_the_down_product_through_the_fused_kernel(monkeypatch, tmp_path):
    """PAGEDCORE_FUSED_DOWN=1 on a bfloat16 model whose gate_up product goes to cuBLAS
    (forced here: the tiny model's gate_up is small enough for the fused gate_up kernel,
    which the real 8B shape's is not at 2-16 rows): the down product then reads SiLU-mul
    itself, in the same kernel and plan as the unfused path's down product, so that
    greedy tokens equal the unfused path's token for token."""
    pytest.importorskip("transformers")
    from pagedcore import LLM, SamplingParams
    from pagedcore.models import decoder
    from test_gpu_path import add_toy_tokenizer
    from test_models_hf import COMMON, make_checkpoint

    path = make_checkpoint("llama", tmp_path)
    add_toy_tokenizer(path, COMMON["vocab_size"])
    eligible = ops.cuda_linear_eligible
    gate_up_rows = 2 * COMMON["intermediate_size"]  # (no other weight of the tiny model has as many)

    def gate_up_on_cublas(x, weight):
        return False if weight.shape[0] == gate_up_rows else eligible(x, weight)

    monkeypatch.setattr(decoder.ops, "cuda_linear_eligible", gate_up_on_cublas)
    fused_calls = []
    fused = ops.silu_and_mul_linear

    def spy(*args, **kwargs):
        fused_calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(decoder.ops, "silu_and_mul_linear", spy)
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 384, (int(n),), generator=gen).tolist() for n in (5, 17, 9, 30, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PAGEDCORE_FUSED_DOWN", flag)
        llm = LLM(model=str(path), device="cuda", dtype="bfloat16", num_kv_blocks=128, max_model_len=256,
                  enforce_eager=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        runs[flag] = [o.outputs[0].token_ids for o in outs]
        del llm
        if flag == "0":
            assert fused_calls == []
    assert fused_calls and all(2 <= r <= 16 for r in fused_calls)
    assert runs["1"] == runs["0"]


# ---- CPU: the wrapper's checks and its fallback to the two ops ----------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 20])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_silu_and_mul_linear_on_cpu_equals_torch(rows, bias):
    y, w, b = _case(rows, 44, 12, torch.float32, bias, "cpu", seed=rows, row_stride=2 * 44 + 5)
    expected = (torch.nn.functional.silu(y[:, :44]) * y[:, 44:]) @ w.T + (b if bias else 0.0)
    full = torch.full((rows, 12 + 3), float("nan"))
    out = full[:, :12]
    assert ops.silu_and_mul_linear(y, w, b, out=out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.isnan(full[:, 12:]).all()
    assert not ops.cuda_silu_and_mul_linear_eligible(y, w)


def test_silu_and_mul_linear_refuses_bad_arguments():
    y, w, b = _case(2, 16, 8, torch.float32, True, "cpu")
    f = ops.silu_and_mul_linear
    with pytest.raises(TypeError, match=r"silu_and_mul_linear: gate_up_out must be a torch.Tensor"):
        f(y.tolist(), w)
    with pytest.raises(ValueError, match=r"gate_up_out must be \[num_tokens, 2 \* intermediate_size\], got "
                                         r"shape \(2, 31\)"):
        f(y[:, :31], w)
    with pytest.raises(ValueError, match=r"gate_up_out must be .*got shape \(32,\)"):
        f(y[0], w)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, intermediate_size = 16\], got shape "
                                         r"\(8, 15\)"):
        f(y, w[:, :15])
    with pytest.raises(TypeError, match=r"weight must be torch.float32 like gate_up_out, got torch.bfloat16"):
        f(y, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must not overlap gate_up_out"):
        f(y, w, out=y[:, :8])
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[8\], got shape \(7,\)"):
        f(y, w, b[:7])
    with pytest.raises(TypeError, match=r"x must be float32, got torch.bfloat16"):
        f(y.to(torch.bfloat16), w.to(torch.bfloat16))  # (bfloat16 products run on CUDA only)


def test_fused_down_kernel_checks_run_before_any_launch():
    # linear_cuda's own refusals for silu_in, on tensors it never launches for.
    y = torch.zeros(3, 128, dtype=torch.bfloat16)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"got 1 rows of stride 128"):
        ops.linear_cuda.linear_cuda("op", y[:1, :64], w, None, None, silu_in=True)
    with pytest.raises(ValueError, match=r"\(row stride >= 128\), got 6 rows of stride 64"):
        ops.linear_cuda.linear_cuda("op", y.reshape(6, 64), w, None, None, silu_in=True)
    with pytest.raises(ValueError, match=r"got 3 rows"):
        ops.linear_cuda.linear_cuda("op", y[:, :64], w, None, None, silu_and_mul=True, silu_in=True)
