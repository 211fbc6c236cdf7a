"""pagedcore.ops.linear (the CPU's float32 products of decode steps) against a float64
reference, over a grid of row counts, widths (non-multiples of every vector width
included), biases, strided inputs and outputs, instruction sets and thread counts.

The bound is the classical one for a dot product summed in any order in float32:
``|fl(x . w) - x . w| <= gamma_K * sum_k |x_k w_k|`` with ``gamma_K = K u / (1 - K u)``,
``u = 2^-24`` (plus one rounding of the bias add). Every output also equals, bit for bit,
the same row computed alone and with one thread: the documented fixed summation order
that makes a sequence's logits independent of the batch it decodes in.
"""

from __future__ import annotations

import pytest
import torch
from pagedcore import ops

U = 2.0**-24
NAN = float("nan")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(x, w, b):
    """float64 x @ w.T + b, and the float32 error bound of every output."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T
    k = w.shape[1]
    gamma = k * U / (1 - k * U)
    bound = gamma * (x64.abs() @ w64.abs().T)
    if b is not None:
        exact = exact + b.double()
        bound = bound * (1 + U) + U * exact.abs()
    return exact, bound


def check(out, x, w, b):
    exact, bound = reference(x, w, b)
    err = (out.double() - exact).abs()
    assert torch.isfinite(out).all()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (worst, err.flatten()[worst].item(), bound.flatten()[worst].item())


@pytest.fixture(autouse=True)
def _restore():
    threads, isa = ops.get_num_threads(), ops.cpu_isa()
    yield
    ops.set_num_threads(threads)
    ops.set_cpu_isa(isa)


def supported_isas():
    best = ops.cpu_isa()
    return [isa for isa in ("avx512", "avx2", "generic")
            if ["generic", "avx2", "avx512"].index(isa) <= ["generic", "avx2", "avx512"].index(best)]


# (rows, in_features, out_features): decode shapes of SmolLM2 (576 / 960 / 3072 / 1536),
# widths that are no multiple of 4, 8, 16 or 64 (the tails), a single output, and
# matrices above and below the size at which the rows are split over the threads.
SHAPES = [(1, 576, 960), (1, 1536, 576), (3, 576, 3072), (16, 64, 300), (5, 1000, 129), (2, 7, 1),
          (1, 1, 33), (4, 100, 2049), (1, 16, 16)]


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_linear_against_float64(isa, rows, k, n):
    ops.set_cpu_isa(isa)
    x, w, b = randn(rows, k, seed=k), randn(n, k, seed=n) / k**0.5, randn(n, seed=1)
    for bias in (None, b):
        out = torch.full((rows, n), NAN)
        assert ops.linear(x, w, bias, out=out) is out
        check(out, x, w, bias)
        check(ops.linear(x, w, bias), x, w, bias)


def test_strided_rows_and_untouched_gaps():
    # x and out as column slices of wider buffers (a fused projection's part, a slice of
    # a bigger output): the row strides are honoured, the gaps keep their poison.
    wide = randn(6, 700, seed=3)
    x = wide[:, 50:626]
    w, b = randn(200, 576, seed=4) / 24, randn(200, seed=5)
    buf = torch.full((6, 250), NAN)
    out = buf[:, 20:220]
    ops.linear(x, w, b, out=out)
    check(out, x, w, b)
    assert torch.isnan(buf[:, :20]).all() and torch.isnan(buf[:, 220:]).all()


@pytest.mark.parametrize("isa", supported_isas())
def test_a_row_gets_the_same_bits_alone_with_others_and_on_one_thread(isa):
    ops.set_cpu_isa(isa)
    x, w, b = randn(9, 576, seed=6), randn(4000, 576, seed=7) / 24, randn(4000, seed=8)
    ops.set_num_threads(2)
    together = ops.linear(x, w, b)
    ops.set_num_threads(1)
    for t in range(9):
        alone = ops.linear(x[t:t + 1], w, b)
        assert torch.equal(alone, together[t:t + 1]), t
    check(together, x, w, b)


def test_no_rows_writes_nothing():
    out = torch.empty(0, 8)
    assert ops.linear(torch.empty(0, 4), torch.ones(8, 4), out=out) is out


@pytest.mark.parametrize("call, error, words", [
    (lambda: ops.linear(torch.ones(1, 4, dtype=torch.float64), torch.ones(3, 4)), TypeError, "x must be float32"),
    (lambda: ops.linear(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.bfloat16)), TypeError,
     "weight must be float32"),
    (lambda: ops.linear(torch.ones(4), torch.ones(3, 4)), ValueError, "x must be [num_tokens, in_features]"),
    (lambda: ops.linear(torch.ones(1, 4), torch.ones(3, 5)), ValueError, "in_features = 4"),
    (lambda: ops.linear(torch.ones(1, 4), torch.ones(4, 3).T), ValueError, "weight must be contiguous"),
    (lambda: ops.linear(torch.ones(2, 8)[:, ::2], torch.ones(3, 4)), ValueError, "x rows must be dense"),
    (lambda: ops.linear(torch.ones(1, 4), torch.ones(3, 4), torch.ones(4)), ValueError, "bias must be"),
    (lambda: ops.linear(torch.ones(1, 4), torch.ones(3, 4), out=torch.ones(1, 4)), ValueError,
     "out must be [num_tokens, out_features] = [1, 3]"),
    (lambda: ops.linear(torch.ones(1, 0), torch.ones(3, 0)), ValueError, "in_features and out_features"),
    (lambda: ops.linear(torch.ones(1, 4), [[1.0] * 4]), TypeError, "weight must be a torch.Tensor"),
])
def test_bad_input_is_refused(call, error, words):
    with pytest.raises(error) as e:
        call()
    assert words in str(e.value)


def test_out_overlapping_an_input_is_refused():
    buf = torch.ones(1, 8)
    with pytest.raises(ValueError, match="out must not overlap"):
        ops.linear(buf[:, :4], torch.ones(4, 4), out=buf[:, 2:6])
    x = torch.ones(1, 4)
    with pytest.raises(ValueError, match="out must not overlap"):
        ops.linear(x, torch.ones(4, 4), out=x)
