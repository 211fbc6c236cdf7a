"""The Hopper prefill kernels (wgmma, sm_90a) through pagedcore.ops.paged_attention with
PAGEDCORE_PREFILL_KERNEL=wgmma, =wgmma-tma and its variants (and =mma, the kernel they
replace), each against the float64 references of test_ops_cuda.py
(fresh random inputs, NaN in every cache slot the kernel must not read, NaN-poisoned
outputs): block sizes, head dims 64/128, GQA ratios (1, non-powers of two), bf16 and
fp16, mixed rows (decode rows stay on the decode kernel; cached prefixes, lengths that
are and are not block multiples), sliding window, softcap, key splits, rows of many key
tiles; fp8 (e4m3) caches, which wgmma-tma-fp8 (and auto at head dim 128) takes, against float64 attention
over the dequantized cache. Shapes a kernel does not serve (head dims 32/80/96/256, fp8
caches under the other names, fp8 with softcap or block sizes that are not powers of two)
must fall back to the mma.sync kernel under the same setting. Runs only where the kernel
runs (an sm_90 build on a compute capability 9.0 device)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from pagedcore import _C, ops

pytestmark = pytest.mark.cuda

from test_ops_cpu import NAN, make_batch, mixed_rows, reference  # noqa: E402
from test_ops_cuda import TOLERANCE  # noqa: E402

# wgmma: the plain kernel (every thread gathers K/V by cp.async); wgmma-tma (the default
# at head dim 128 above block size 32; -pairs up to 32): a copying warpgroup brings K and V by TMA, one copy per cache block,
# key tiles starting on a block boundary, persistent CTAs (softcap and block sizes that are
# not powers of two in 8..128 run the plain kernel); wgmma-tma-pairs: one copy per cache
# block for both 64-dim halves (head dim 128; K/V tiles in the paired shared-memory layout);
# wgmma-tma-fp8: the TMA kernel over an fp8 cache (bytes by TMA into a staging area, widened
# to fp16 in shared memory by the copying warpgroup; k/v scales as in mma.sync), auto over a
# 16-bit cache. mma: the mma.sync kernel, which the default (auto) no longer picks for head
# dim 128 here. PAGEDCORE_TEST_PREFILL_KERNELS (comma-separated) narrows the list, e.g. to
# leave out a variant that bench/check_wgmma.py found hanging.
KERNELS = ["mma", "wgmma", "wgmma-tma", "wgmma-tma-pairs", "wgmma-tma-fp8"]
if os.environ.get("PAGEDCORE_TEST_PREFILL_KERNELS"):
    KERNELS = [k for k in os.environ["PAGEDCORE_TEST_PREFILL_KERNELS"].split(",") if k]


@pytest.fixture(autouse=True)
def needs_sm90():
    if not _C.cuda_wgmma_prefill_available():
        pytest.skip("the wgmma prefill kernel runs on compute capability 9.0 (sm_90 builds) only")


def run_cuda(rows, *, block_size, head_dim, group, dtype, window=0, softcap=0.0, num_kv_heads=2, seed=0,
             fp8_scales=None, unsplit=False):
    """test_ops_cuda.run_cuda for every wgmma variant, one float64 reference for all;
    returns each variant's output (on the host)."""
    query, kc, vc, bt, seq_lens, qsl = make_batch(
        rows, block_size=block_size, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
        dtype=dtype, window=window, seed=seed,
    )
    bt = bt.clamp(0, kc.shape[0] - 1)  # garbage entries in range: a stray read shows as NaN
    scale = head_dim**-0.5
    kw = {}
    ref_k, ref_v = kc, vc
    if fp8_scales is not None:
        k_scale, v_scale = fp8_scales
        kc = (kc.float() / k_scale).to(torch.float8_e4m3fn)
        vc = (vc.float() / v_scale).to(torch.float8_e4m3fn)
        ref_k, ref_v = kc.double() * k_scale, vc.double() * v_scale
        kw = {"k_scale": k_scale, "v_scale": v_scale}
    expected = reference(query, ref_k, ref_v, bt, seq_lens, qsl, scale=scale, window=window, softcap=softcap)
    dev = [t.cuda() for t in (query, kc, vc, bt, seq_lens, qsl)]
    if unsplit:  # one CTA walks each row's whole key range (no key splits)
        plan = ops.plan_attention(qsl.numpy(), seq_lens.numpy(), query.shape[1], num_kv_heads, torch.device("cuda"),
                                  head_dim, dtype)
        plan.num_splits = plan.decode_splits = 1
        kw["plan"] = plan
    n = int(qsl[-1])
    atol, rtol = TOLERANCE[dtype]
    # NOTE: every variant runs even after one fails, and the failure names them all:
    # one device run tells which variants are wrong where.
    failures = []
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        for kernel in KERNELS:
            mp.setenv("PAGEDCORE_PREFILL_KERNEL", kernel)
            out = torch.full(query.shape, NAN, dtype=dtype, device="cuda")
            ops.paged_attention(*dev, scale=scale, sliding_window=window, softcap=softcap, out=out, **kw)
            torch.cuda.synchronize()
            got = out.cpu()
            outputs[kernel] = got
            try:
                assert torch.isnan(got[n:]).all(), "padding tokens after query_start_loc[-1] were written"
                assert not torch.isnan(got[:n]).any(), "a row was left unwritten or read a NaN slot"
                torch.testing.assert_close(got[:n].double(), expected[:n], atol=atol, rtol=rtol)
            except AssertionError as exc:
                detail = " ".join(str(exc).split())[:200]
                failures.append(f"[{kernel}] {detail}")
    if failures:
        pytest.fail(" | ".join(failures))
    return outputs


HALF = [torch.bfloat16, torch.float16]


def test_wgmma_building_blocks():
    # One tile, exactly representable inputs: S = Q K^T from the swizzled shared-memory
    # tiles and O = P V with P in registers, against float arithmetic, for bf16/fp16 and
    # head dims 64/128 (S: exact sums; O: float32 accumulation order only), then K and V in
    # wgmma-tma-pairs' paired layout at head dim 128 (its descriptors' strides).
    errs = _C.cuda_wgmma_selftest()
    assert len(errs) == 12, errs
    assert all(0 <= e < 1e-3 for e in errs[0::2]), errs
    assert all(0 <= e < 1e-2 for e in errs[1::2]), errs


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 6, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_wgmma_grid(dtype, head_dim, group, block_size):
    run_cuda(mixed_rows(block_size), block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)


@pytest.mark.parametrize("window,softcap", [(13, 0.0), (0, 2.0), (40, 3.5), (300, 0.0)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_wgmma_window_softcap(dtype, head_dim, window, softcap):
    rows = mixed_rows(16) + [(200, 700), (129, 129)]
    run_cuda(rows, block_size=16, head_dim=head_dim, group=4, dtype=dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("rows", [[(1000, 3000)], [(300, 5000), (129, 4000)], [(257, 2049)]])
@pytest.mark.parametrize("group", [1, 4, 5])
def test_wgmma_many_key_tiles(rows, group):
    # One CTA walks each row's whole key range (no key splits): dozens of key tiles
    # through the three K/V buffers, cached prefixes not a multiple of the tile.
    run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=torch.bfloat16, unsplit=True)
    run_cuda(rows, block_size=32, head_dim=64, group=group, dtype=torch.float16, unsplit=True)


# (rows of more than 16 query vectors: fewer go to the decode kernel)
@pytest.mark.parametrize("rows", [[(20, 4000), (18, 3000)], [(40, 5000)], [(1, 1), (17, 2049)]])
@pytest.mark.parametrize("group", [1, 4])
def test_wgmma_key_splits(rows, group):
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    plan = ops.plan_attention(qsl, [s for _, s in rows], 2 * group, 2, torch.device("cuda"), 128, torch.bfloat16)
    assert plan.num_splits > 1 and plan.num_work > 0
    run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=torch.bfloat16)


@pytest.mark.parametrize("walk", ["end", "start"])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (128, 3)])
def test_wgmma_many_items_per_cta(monkeypatch, head_dim, group, walk):
    # More work items x kv heads than multiprocessors: wgmma-tma's persistent CTAs walk
    # several items each (items of different lengths, the K/V buffer rings and their
    # barrier phases carried from one item to the next), from the plan's first item
    # (the default) or, with PAGEDCORE_PREFILL_WALK=end, from its last.
    monkeypatch.setenv("PAGEDCORE_PREFILL_WALK", walk)
    rows = [(17 + (37 * i) % 90, 17 + (37 * i) % 90 + (53 * i) % 300) for i in range(60)]
    plan = ops.plan_attention([0, *np.cumsum([q for q, _ in rows])], [s for _, s in rows], 4 * group, 4,
                              torch.device("cuda"), head_dim, torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.num_splits == 1 and plan.num_work * 4 > sms  # persistent CTAs: one per multiprocessor
    run_cuda(rows, block_size=16, head_dim=head_dim, group=group, dtype=torch.bfloat16, num_kv_heads=4)


@pytest.mark.parametrize("block_size", [8, 64, 128])
@pytest.mark.parametrize("window", [0, 45, 300])
def test_wgmma_key_tiles_on_block_boundaries(block_size, window):
    # The TMA kernel starts each key range's tiles at its first key rounded down to a
    # block: windows and key splits whose first key sits mid-block (the keys before it
    # masked, their V rows zero-filled: NaN in the tests), last blocks partly past the
    # row's end, blocks as large as a whole key tile; once with the plan's key splits,
    # once unsplit, and at head dim 64 (one 64-dim half per TMA copy).
    rows = [(200, 700), (129, 1000), (40, 5000), (1, 77), (300, 300), (70, 2500)]
    run_cuda(rows, block_size=block_size, head_dim=128, group=4, dtype=torch.bfloat16, window=window)
    run_cuda(rows, block_size=block_size, head_dim=128, group=3, dtype=torch.bfloat16, window=window, unsplit=True)
    run_cuda(rows, block_size=block_size, head_dim=64, group=2, dtype=torch.float16, window=window)


def test_wgmma_rows_longer_than_one_staged_block_table():
    run_cuda([(1, 9000), (40, 9000)], block_size=8, head_dim=128, group=4, dtype=torch.bfloat16, unsplit=True)


def test_wgmma_large_prefill_and_many_decodes():
    rows = [(1, 100 + 37 * i) for i in range(100)] + [(600, 600), (300, 1000)]
    run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, num_kv_heads=4)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_unserved_head_dims_fall_back(head_dim):
    run_cuda(mixed_rows(16), block_size=16, head_dim=head_dim, group=2, dtype=torch.bfloat16)


# ---- fp8 (e4m3) caches: wgmma-tma-fp8 (the other names leave them on mma.sync) ----
FP8_SCALES = (0.5, 2.0)


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_wgmma_fp8_grid(dtype, head_dim, group, block_size):
    # test_ops_cuda's fp8 grid (NaN e4m3 in every slot not to be read: a V row of a slot
    # outside the key range that is not zeroed shows) with non-power-of-two groups.
    run_cuda(mixed_rows(block_size), block_size=block_size, head_dim=head_dim, group=group, dtype=dtype,
             fp8_scales=FP8_SCALES)


@pytest.mark.parametrize("block_size", [8, 64, 128])
@pytest.mark.parametrize("window", [0, 45])
def test_wgmma_fp8_key_tiles_on_block_boundaries(block_size, window):
    # Key ranges starting mid-block (windows, the plan's key splits): the staged V rows
    # before s_lo and past s_hi become zeros; unsplit: dozens of tiles per item through
    # the two fp16 stages and two staging slots; other scales.
    rows = [(200, 700), (129, 1000), (40, 5000), (1, 77), (300, 300), (70, 2500)]
    run_cuda(rows, block_size=block_size, head_dim=128, group=4, dtype=torch.bfloat16, window=window,
             fp8_scales=(0.25, 0.75))
    run_cuda(rows, block_size=block_size, head_dim=128, group=3, dtype=torch.bfloat16, window=window, unsplit=True,
             fp8_scales=FP8_SCALES)
    run_cuda(rows, block_size=block_size, head_dim=64, group=2, dtype=torch.float16, window=window,
             fp8_scales=(1.0, 1.0))


@pytest.mark.parametrize("walk", ["end", "start"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_fp8_many_items_per_cta(monkeypatch, head_dim, walk):
    # Persistent CTAs walking several items each: the staging slots' and fp16 stages'
    # barrier phases carried from one item to the next (the widening runs a tile late);
    # either walk (PAGEDCORE_PREFILL_WALK).
    monkeypatch.setenv("PAGEDCORE_PREFILL_WALK", walk)
    rows = [(17 + (37 * i) % 90, 17 + (37 * i) % 90 + (53 * i) % 300) for i in range(60)]
    run_cuda(rows, block_size=16, head_dim=head_dim, group=3, dtype=torch.bfloat16, num_kv_heads=4,
             fp8_scales=FP8_SCALES)


def test_wgmma_fp8_is_not_the_mma_kernel():
    # NOTE: a wgmma-tma-fp8 that silently fell back to mma.sync (wgmma_prefill_serves
    # saying no) would pass every reference above; the two kernels sum in different
    # orders (128-key wgmma tiles against 64-key mma.sync ones), so their fp16 outputs
    # differ in some element where both ran.
    if "wgmma-tma-fp8" not in KERNELS or "mma" not in KERNELS:
        pytest.skip("needs mma and wgmma-tma-fp8 in PAGEDCORE_TEST_PREFILL_KERNELS")
    rows = [(300, 1000), (129, 129)]
    out = run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.float16, fp8_scales=FP8_SCALES)
    n = sum(q for q, _ in rows)  # (the padding rows after them stay NaN, and NaN != NaN: equal never holds there)
    assert not torch.equal(out["wgmma-tma-fp8"][:n], out["mma"][:n])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_default_over_an_fp8_cache(monkeypatch, head_dim):
    # auto (PAGEDCORE_PREFILL_KERNEL unset or "auto"): wgmma-tma-fp8 at head dim 128, where
    # it measured 1.8x mma.sync at 8k causal; mma.sync at 64 (not timed apart). The two
    # kernels sum in different orders, so the bits tell which one ran.
    if "wgmma-tma-fp8" not in KERNELS:
        pytest.skip("wgmma-tma-fp8 left out by PAGEDCORE_TEST_PREFILL_KERNELS")
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", ["mma", "wgmma-tma-fp8", "auto"])
    rows = [(300, 1000), (129, 129)]
    out = run_cuda(rows, block_size=16, head_dim=head_dim, group=4, dtype=torch.float16, fp8_scales=FP8_SCALES)
    n = sum(q for q, _ in rows)  # (the padding rows after them stay NaN, and NaN != NaN)
    assert not torch.equal(out["wgmma-tma-fp8"][:n], out["mma"][:n])
    assert torch.equal(out["auto"][:n], out["wgmma-tma-fp8" if head_dim == 128 else "mma"][:n])


def test_fp8_cache_falls_back():
    # Softcap (the TMA kernel has none) and a block size the tensor maps cannot take.
    run_cuda(mixed_rows(16), block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, softcap=3.5,
             fp8_scales=FP8_SCALES)
    run_cuda(mixed_rows(48), block_size=48, head_dim=128, group=4, dtype=torch.bfloat16, fp8_scales=FP8_SCALES)
