"""The Hopper prefill kernel (wgmma, sm_90a) through pagedcore.ops.paged_attention with
PAGEDCORE_PREFILL_KERNEL=wgmma and =wgmma-ws (warp-specialized), against the float64 references of test_ops_cuda.py
(fresh random inputs, NaN in every cache slot the kernel must not read, NaN-poisoned
outputs): block sizes, head dims 64/128, GQA ratios (1, non-powers of two), bf16 and
fp16, mixed rows (decode rows stay on the decode kernel; cached prefixes, lengths that
are and are not block multiples), sliding window, softcap, key splits, rows of many key
tiles. Shapes the kernel does not serve (head dims 32/80/96/256, fp8 caches) must fall
back to the mma.sync kernel under the same setting. Runs only where the kernel runs
(an sm_90 build on a compute capability 9.0 device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedcore import _C, ops

pytestmark = pytest.mark.cuda

from test_ops_cpu import mixed_rows  # noqa: E402
from test_ops_cuda import run_cuda  # noqa: E402


@pytest.fixture(autouse=True, params=["wgmma", "wgmma-ws"])
def wgmma_kernel(request, monkeypatch):
    # wgmma-ws: the warp-specialized variant (softcap cases run the plain one).
    if not _C.cuda_wgmma_prefill_available():
        pytest.skip("the wgmma prefill kernel runs on compute capability 9.0 (sm_90 builds) only")
    monkeypatch.setenv("PAGEDCORE_PREFILL_KERNEL", request.param)


HALF = [torch.bfloat16, torch.float16]


def test_wgmma_building_blocks():
    # One tile, exactly representable inputs: S = Q K^T from the swizzled shared-memory
    # tiles and O = P V with P in registers, against float arithmetic, for bf16/fp16 and
    # head dims 64/128 (S: exact sums; O: float32 accumulation order only).
    errs = _C.cuda_wgmma_selftest()
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
    # through the two K/V buffers, cached prefixes not a multiple of the tile.
    run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=torch.bfloat16, unsplit=True)
    run_cuda(rows, block_size=32, head_dim=64, group=group, dtype=torch.float16, unsplit=True)


@pytest.mark.parametrize("rows", [[(3, 4000), (2, 3000)], [(40, 5000)], [(1, 1), (17, 2049)]])
@pytest.mark.parametrize("group", [1, 4])
def test_wgmma_key_splits(rows, group):
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    plan = ops.plan_attention(qsl, [s for _, s in rows], 2 * group, 2, torch.device("cuda"), 128, torch.bfloat16)
    assert plan.num_splits > 1 and plan.num_work > 0
    run_cuda(rows, block_size=16, head_dim=128, group=group, dtype=torch.bfloat16)


@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (128, 3)])
def test_wgmma_many_items_per_cta(head_dim, group):
    # More work items x kv heads than multiprocessors: wgmma-ws's persistent CTAs walk
    # several items each (items of different lengths, the K/V buffer rings and their
    # barrier phases carried from one item to the next).
    rows = [(17 + (37 * i) % 90, 17 + (37 * i) % 90 + (53 * i) % 300) for i in range(60)]
    plan = ops.plan_attention([0, *np.cumsum([q for q, _ in rows])], [s for _, s in rows], 4 * group, 4,
                              torch.device("cuda"), head_dim, torch.bfloat16)
    assert plan.num_splits == 1 and plan.num_work * 4 > 2 * 132
    run_cuda(rows, block_size=16, head_dim=head_dim, group=group, dtype=torch.bfloat16, num_kv_heads=4)


def test_wgmma_rows_longer_than_one_staged_block_table():
    run_cuda([(1, 9000), (40, 9000)], block_size=8, head_dim=128, group=4, dtype=torch.bfloat16, unsplit=True)


def test_wgmma_large_prefill_and_many_decodes():
    rows = [(1, 100 + 37 * i) for i in range(100)] + [(600, 600), (300, 1000)]
    run_cuda(rows, block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, num_kv_heads=4)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_unserved_head_dims_fall_back(head_dim):
    run_cuda(mixed_rows(16), block_size=16, head_dim=head_dim, group=2, dtype=torch.bfloat16)


def test_fp8_cache_falls_back():
    run_cuda(mixed_rows(16), block_size=16, head_dim=128, group=4, dtype=torch.bfloat16, fp8_scales=(0.5, 2.0))
