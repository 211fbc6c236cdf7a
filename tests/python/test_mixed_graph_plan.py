"""The fixed-size attention plan of the whole-step CUDA graphs for small mixed
steps (PAGEDCORE_MIXED_GRAPHS; ops.planning.PaddedPlan), checked on the host:
its lists cover every query token of the step exactly once, the rest repeat the
padding row, and a step it cannot hold is refused with nothing staged. (The
graphs themselves run in test_gpu_path.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedcore import _C
from pagedcore.ops import planning

if not hasattr(_C, "cuda_attention_tile_vectors"):
    pytest.skip("pagedcore was built without CUDA (the plan's tile sizes come from it)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_gpu_needed(monkeypatch) -> None:
    monkeypatch.setattr(planning, "_sm_count", lambda device: 132)  # an H200's


def padded(max_tokens: int, max_rows: int, dtype=torch.bfloat16, heads=(9, 3), head_dim=64) -> planning.PaddedPlan:
    return planning.PaddedPlan(max_tokens, max_rows, 8, heads[0], heads[1], head_dim, dtype, torch.device("cpu"),
                               max_seq_len=4096)


def lists(p: planning.PaddedPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w, host = p.plan.num_work, p.host.numpy()
    return host[:w], host[w:2 * w], host[2 * w:]


def covered(p: planning.PaddedPlan, q_lens: list[int]) -> dict[tuple[int, int], int]:
    """How often each (row, query token) is computed by the plan's items."""
    work_seq, work_q_start, decode_seq = lists(p)
    tile = p.plan.tile_tokens
    count: dict[tuple[int, int], int] = {}
    for row, t0 in zip(work_seq.tolist(), work_q_start.tolist()):
        if row < 0:  # a spare item (unless PAGEDCORE_MIXED_TILE_SPARE=0)
            continue
        for i in range(t0, min(t0 + tile, q_lens[row])):
            count[row, i] = count.get((row, i), 0) + 1
    for row in decode_seq.tolist():
        if row < 0:  # a spare item: its CTAs return at once
            continue
        for i in range(q_lens[row]):
            count[row, i] = count.get((row, i), 0) + 1
    return count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mixed_step_is_covered_once_and_the_rest_is_padding(dtype) -> None:
    # 40 decode rows, a 2-token row (a decode item in bf16: 2 x 3 heads <= 16 vectors),
    # a 200-token prefill chunk and a 37-token one over 400 cached; the padding row is
    # 43, token 280 (computed by a decode item).
    q_lens = [1] * 40 + [2, 200, 37]
    seq_lens = [300 + i for i in range(40)] + [90, 200, 437]  # (short: the eager plan would not split)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = padded(512, 256, dtype)
    work_before = (p.plan.num_work, p.plan.num_decode)
    assert p.fill(qsl, np.array(seq_lens, dtype=np.int32), pad_row=43)
    assert (p.plan.num_work, p.plan.num_decode) == work_before  # fixed: one launch configuration
    q_lens_with_pad = q_lens + [1]
    count = covered(p, q_lens_with_pad)
    real = {(r, i) for r, n in enumerate(q_lens) for i in range(n)}
    assert {k: v for k, v in count.items() if k[0] != 43} == {k: 1 for k in real}
    work_seq, work_q_start, decode_seq = lists(p)
    tile = p.plan.tile_tokens
    real_tiles = sum(-(-n // tile) for n in q_lens if dtype == torch.float32 and n > 1 or n * 3 > 16)
    # Tile items past the step's are spare (-1; PAGEDCORE_MIXED_TILE_SPARE=0: each
    # computes the padding row): a decode item computes the padding row.
    assert (work_seq[:real_tiles] >= 0).all() and (work_seq[:real_tiles] != 43).all()
    assert (work_seq == -1).sum() == p.plan.num_work - real_tiles
    assert (work_q_start[work_seq == -1] == 0).all()
    # Decode items: the step's rows, then one for the padding row, then spare ones (-1).
    decodes = 41 if dtype == torch.bfloat16 else 40  # (float32: the decode kernel takes one-query rows only)
    assert sorted(decode_seq[:decodes].tolist()) == list(range(decodes))  # (bf16: the 1- and 2-token rows)
    assert p.plan.num_decode == 257 and decode_seq[decodes] == 43 and (decode_seq[decodes + 1:] == -1).all()
    assert p.plan.num_splits == 1


def test_a_step_with_more_tiles_than_the_plan_holds_is_refused_untouched() -> None:
    # Thirty 17-token chunks (510 tokens): one tile each (17 x 3 vectors > 16: not
    # decode rows), 30 tiles against the plan's ceil(512 / tile) + 8 + 1.
    p = padded(512, 256)
    assert p.plan.num_work == -(-512 // p.plan.tile_tokens) + 9 < 30
    before = p.host.clone()
    q_lens = [17] * 30
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert not p.fill(qsl, np.array(q_lens, dtype=np.int32), pad_row=30)
    assert torch.equal(p.host, before)
    # The first twenty-two fit.
    assert p.fill(qsl[:23], np.array(q_lens[:22], dtype=np.int32), pad_row=22)
    count = covered(p, [17] * 22 + [1])
    assert {k: v for k, v in count.items() if k[0] != 22} == {(r, i): 1 for r in range(22) for i in range(17)}


@pytest.mark.parametrize("value, expected", [(None, 8192), ("", 8192), ("0", 0), ("512", 512)])
def test_the_switch_reads_a_token_count(monkeypatch, value, expected) -> None:
    # unset or empty: the default (on, up to 8192 tokens: every size up to CUDA's budget); 0: off.
    from pagedcore.model_runner import mixed_graph_tokens

    if value is None:
        monkeypatch.delenv("PAGEDCORE_MIXED_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", value)
    assert mixed_graph_tokens() == expected


@pytest.mark.parametrize("value, message", [
    ("on", "PAGEDCORE_MIXED_GRAPHS must be a token count (0: off), got 'on'"),
    ("-1", "PAGEDCORE_MIXED_GRAPHS must be >= 0 (0: off), got -1"),
])
def test_a_bad_switch_is_refused_by_name(monkeypatch, value, message) -> None:
    from pagedcore.model_runner import mixed_graph_tokens

    monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", value)
    with pytest.raises(ValueError) as e:
        mixed_graph_tokens()
    assert str(e.value) == message


@pytest.mark.parametrize("case", ["decode rows", "a chunk"])
def test_a_step_the_eager_plan_would_split_takes_the_pieces(case) -> None:
    # Long contexts: plan_attention splits their keys over more CTAs than the graph's
    # plan (tiles unsplit; decode splits sized for its 257 rows), so the step is refused.
    p = padded(512, 256)
    if case == "decode rows":  # 8 rows of 3,000 keys: the eager plan splits each in 11
        q_lens, seq_lens = [1] * 8 + [20], [3000] * 8 + [20]
    else:  # 100 new tokens over 4,000 cached: 16 splits
        q_lens, seq_lens = [1, 100], [300, 4100]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(seq_lens, dtype=np.int32)
    eager = planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16)
    assert (eager.decode_splits if case == "decode rows" else eager.num_splits) > 1
    before = p.host.clone()
    assert not p.fill(qsl, lens, pad_row=len(q_lens))
    assert torch.equal(p.host, before)
    # The same step over short contexts fits.
    assert p.fill(qsl, np.minimum(lens, np.array(q_lens) + 300).astype(np.int32), pad_row=len(q_lens))


@pytest.mark.parametrize("keys", [512, 1024])
def test_a_short_chunk_the_eager_plan_would_split_takes_the_graph(keys) -> None:
    # SmolLM2's 512-token prompt beside 40 decode rows: 25 tiles x 3 kv heads leave most
    # of 132 SMs idle, so plan_attention splits the chunk's keys; rows of up to 1024 keys
    # take the graph's unsplit tiles all the same (decode rows' lengths do not count).
    assert planning._PADDED_UNSPLIT_TILE_KEYS == 1024
    p = padded(1024, 256)
    q_lens = [1] * 40 + [512]
    seq_lens = [1500] * 40 + [keys]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(seq_lens, dtype=np.int32)
    eager = planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16)
    assert eager.num_splits == keys // 256  # (2 or 4: 256 keys a split at least)
    assert p.fill(qsl, lens, pad_row=41)
    count = covered(p, q_lens + [1])
    assert {k: v for k, v in count.items() if k[0] != 41} == {(r, i): 1 for r, n in enumerate(q_lens) for i in range(n)}


@pytest.mark.parametrize("first", [600, 1025])
def test_a_chunk_over_more_than_1024_keys_takes_the_pieces(first) -> None:
    # Two prompt chunks, one of them (either) over 1,025 keys: the longest chunk decides,
    # and the split is worth more than the graph there.
    p = padded(1024, 256)
    q_lens = [1] * 8 + [200, 200]
    seq_lens = [300] * 8 + [first, 1625 - first]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(seq_lens, dtype=np.int32)
    assert planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16).num_splits > 1
    before = p.host.clone()
    assert not p.fill(qsl, lens, pad_row=10)
    assert torch.equal(p.host, before)
    # Both at 1024 keys or fewer: the graph.
    assert p.fill(qsl, np.minimum(lens, 1024).astype(np.int32), pad_row=10)


def test_tile_splits_of_the_split_graphs() -> None:
    # What plan_attention gives a chunk of the graph's size over max_seq_len keys, at
    # least 2. bf16 tiles hold 128 query vectors: SmolLM2 (9/3 heads) 42 tokens, the
    # 8B shape (32/8) 32; float32 tiles 16 vectors: SmolLM2 5 tokens.
    cpu = torch.device("cpu")
    assert planning.padded_tile_splits(256, 9, 3, torch.bfloat16, cpu, 2048) == 8  # 7 x 3 blocks; 2048 / 256
    assert planning.padded_tile_splits(256, 9, 3, torch.bfloat16, cpu, 1024) == 4  # 1024 / 256
    assert planning.padded_tile_splits(256, 32, 8, torch.bfloat16, cpu, 8192) == 5  # 8 x 8 blocks: 264 / 64
    assert planning.padded_tile_splits(64, 9, 3, torch.float32, cpu, 2048) == 7  # 13 x 3 blocks: 264 / 39
    assert planning.padded_tile_splits(512, 9, 3, torch.float32, cpu, 2048) == 2  # 103 x 3 blocks fill the GPU


def test_a_split_graph_takes_the_long_chunk_that_the_unsplit_one_refuses() -> None:
    # serve's capped mixed step: 40 decode rows and a 216-token chunk of a prompt
    # behind 1,324 computed tokens (1,540 keys): plan_attention splits it 6 ways, the
    # unsplit graph refuses it, the graph whose tiles split 8 ways takes it; the same
    # lists given once serve both tries.
    q_lens = [1] * 40 + [216]
    seq_lens = [900] * 40 + [1540]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(seq_lens, dtype=np.int32)
    assert planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16).num_splits == 6
    unsplit = padded(256, 256)
    split = planning.PaddedPlan(256, 256, 8, 9, 3, 64, torch.bfloat16, torch.device("cpu"), max_seq_len=2048,
                                tile_splits=8)
    assert (unsplit.plan.num_splits, split.plan.num_splits) == (1, 8)
    assert split.plan.num_work == unsplit.plan.num_work and split.plan.num_decode == unsplit.plan.num_decode
    step_lists = unsplit.lists(qsl, lens)
    assert not unsplit.fill(qsl, lens, pad_row=41, lists=step_lists)
    assert split.fill(qsl, lens, pad_row=41, lists=step_lists)
    count = covered(split, q_lens + [1])
    assert {k: v for k, v in count.items() if k[0] != 41} == {(r, i): 1 for r, n in enumerate(q_lens) for i in range(n)}
    # Without the lists: the same staging.
    again = planning.PaddedPlan(256, 256, 8, 9, 3, 64, torch.bfloat16, torch.device("cpu"), max_seq_len=2048,
                                tile_splits=8)
    assert again.fill(qsl, lens, pad_row=41)
    assert torch.equal(again.host, split.host)


def test_a_split_graph_refuses_a_chunk_that_wants_more_than_twice_its_splits() -> None:
    # One 16-token chunk over 5,000 keys: 1 tile x 3 kv heads; plan_attention splits it
    # 19 ways (5,000 / 256), more than twice the graph's 8: the pieces. At 4,000 keys
    # (15 splits) the graph takes it.
    q_lens = [1] * 8 + [16]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    split = planning.PaddedPlan(256, 256, 8, 9, 3, 64, torch.bfloat16, torch.device("cpu"), max_seq_len=8192,
                                tile_splits=8)
    for keys, splits, taken in ((5000, 19, False), (4000, 15, True)):
        lens = np.array([300] * 8 + [keys], dtype=np.int32)
        assert planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16).num_splits == splits
        before = split.host.clone()
        assert split.fill(qsl, lens, pad_row=9) == taken
        if not taken:
            assert torch.equal(split.host, before)


def test_tile_splits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tile_splits must be >= 1, got 0"):
        planning.PaddedPlan(256, 256, 8, 9, 3, 64, torch.bfloat16, torch.device("cpu"), max_seq_len=2048,
                            tile_splits=0)


@pytest.mark.parametrize("rows, taken", [(10, True), (28, True), (4, False)])
def test_fewer_decode_rows_over_long_contexts_take_up_to_twice_the_graphs_decode_splits(rows, taken) -> None:
    # The graph's decode splits are sized for 32 rows (3 here: 96 blocks over 132 SMs);
    # fewer rows over 1,500 keys want more: 10 rows 4 (one wave: 120 CTAs), 28 rows 4
    # (<= 6: the graph), 4 rows over 3,000 keys 11 (the pieces).
    p = padded(256, 256)
    assert p.plan.decode_splits == 3
    keys = 3000 if rows == 4 else 1500
    q_lens = [1] * rows + [100]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array([keys] * rows + [300], dtype=np.int32)
    eager = planning.plan_attention(qsl, lens, 9, 3, torch.device("cpu"), 64, torch.bfloat16)
    assert eager.decode_splits == {10: 4, 28: 4, 4: 11}[rows]
    assert p.fill(qsl, lens, pad_row=rows + 1) == taken


def test_the_mixed_decode_spare_switch(monkeypatch) -> None:
    # PAGEDCORE_MIXED_DECODE_SPARE=0 (a measurement switch, read when the plan is made):
    # every decode item past the step's computes the padding row (no spare items);
    # unset, empty or 1: spare ones (-1) after the padding row's; else an error.
    q_lens = [1] * 5 + [30]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array([200] * 5 + [30], dtype=np.int32)
    for value, tail in (("0", 6), ("", -1), ("1", -1)):
        monkeypatch.setenv("PAGEDCORE_MIXED_DECODE_SPARE", value)
        p = padded(256, 256)
        assert p.fill(qsl, lens, pad_row=6)
        decode_seq = lists(p)[2]
        assert decode_seq[:5].tolist() == list(range(5)) and decode_seq[5] == 6 and (decode_seq[6:] == tail).all()
    for bad in ("2", "yes"):
        monkeypatch.setenv("PAGEDCORE_MIXED_DECODE_SPARE", bad)
        with pytest.raises(ValueError, match=f"PAGEDCORE_MIXED_DECODE_SPARE must be 0 or 1, got '{bad}'"):
            padded(256, 256)


@pytest.mark.parametrize("tile_splits", [1, 4])
@pytest.mark.parametrize("heads, decode_kernel", [((9, 3), True), ((20, 1), False)])
def test_spare_tiles_leave_the_padding_row_to_one_item(monkeypatch, heads, decode_kernel, tile_splits) -> None:
    # Unset or PAGEDCORE_MIXED_TILE_SPARE=1: tile items past the step's are spare (-1,
    # their query start 0); the padding row is computed once, by the first decode item
    # past the step's, or (20 query heads a kv head: no decode kernel, every row in
    # tiles) by the first tile past the step's. 0: every padding tile computes the
    # padding row, as until 068f05e.
    assert _C.cuda_decode_supported(heads[0] // heads[1], 64, 2) == decode_kernel
    q_lens = [1] * 6 + [70, 9]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array([300] * 6 + [170, 409], dtype=np.int32)
    real = {(r, i): 1 for r, n in enumerate(q_lens) for i in range(n)}
    for value in ("1", "0", ""):
        monkeypatch.setenv("PAGEDCORE_MIXED_TILE_SPARE", value)
        p = planning.PaddedPlan(512, 256, 8, heads[0], heads[1], 64, torch.bfloat16, torch.device("cpu"),
                                max_seq_len=4096, tile_splits=tile_splits)
        assert p.fill(qsl, lens, pad_row=8)
        count = covered(p, q_lens + [1])
        assert {k: v for k, v in count.items() if k[0] != 8} == real
        work_seq, work_q_start, decode_seq = lists(p)
        spare = value != "0"
        tiles = int((work_seq >= 0).sum()) if spare else int((work_seq[:p.plan.num_work] != 8).sum())
        assert (work_q_start[tiles:] == 0).all()
        if spare:
            assert count[8, 0] == 1  # the padding row: once
            if decode_kernel:
                assert (work_seq[:tiles] != 8).all() and (work_seq[tiles:] == -1).all()
                assert decode_seq[6] == 8 and (decode_seq[7:] == -1).all()
            else:
                assert p.plan.num_decode == 0
                assert work_seq[tiles - 1] == 8 and (work_seq[tiles:] == -1).all()
        else:
            assert (work_seq[tiles:] == 8).all() and tiles < p.plan.num_work - 1
    for bad in ("2", "on"):
        monkeypatch.setenv("PAGEDCORE_MIXED_TILE_SPARE", bad)
        with pytest.raises(ValueError, match=f"PAGEDCORE_MIXED_TILE_SPARE must be 0 or 1, got '{bad}'"):
            padded(256, 256)


def test_the_split_graph_shares_the_unsplit_graphs_decode_scratch() -> None:
    # The two graphs of one size run one at a time: one set of decode partials and
    # counters serves both, and the split plan adds only its tiles'. A shared buffer
    # is never replaced (a captured graph holds its address): too small is an error.
    cpu = torch.device("cpu")
    unsplit = padded(256, 256)
    split = planning.PaddedPlan(256, 256, 8, 9, 3, 64, torch.bfloat16, cpu, max_seq_len=4096, tile_splits=8)
    split.plan.share_scratch(unsplit.plan)
    a, b = unsplit.plan.partial_ptrs(3, 64), split.plan.partial_ptrs(3, 64)
    for name in ("decode_partial_out", "decode_partial_lse", "decode_split_counters"):
        assert a[name] == b[name] != 0
    assert a["partial_out"] == 0 and b["partial_out"] != 0  # (tiles split only in the split plan)
    assert unsplit.plan.partial_ptrs(3, 64) == a  # (nothing replaced)
    with pytest.raises(RuntimeError, match="shared scratch 'decode_partial_out' holds"):
        unsplit.plan.partial_ptrs(3, 128)  # a larger head: would need a larger buffer


def test_a_lifted_step_over_a_long_prompt_takes_the_split_graph_of_its_size() -> None:
    # serve's lifted cap (1,024 tokens): 150 decode rows and the next 874 tokens of a
    # prompt whose row reaches 1,590 keys. The unsplit graph of 1,024 tokens refuses it
    # (its row holds more than _PADDED_UNSPLIT_TILE_KEYS keys); the split graph of that
    # size, which split_mixed_graph_top now captures with the lift, holds it.
    from pagedcore.model_runner import mixed_graph_tile_rows

    cpu = torch.device("cpu")
    splits = planning.padded_tile_splits(1024, 9, 3, torch.bfloat16, cpu, 2048)
    q_lens = [1] * 150 + [874]
    lens = np.array([300 + 9 * i for i in range(150)] + [1590], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    unsplit, split = (planning.PaddedPlan(1024, 512, mixed_graph_tile_rows(1024), 9, 3, 64, torch.bfloat16, cpu,
                                          max_seq_len=2048, tile_splits=t) for t in (1, splits))
    assert splits > 1 and not unsplit.fill(qsl, lens, pad_row=151)
    assert split.fill(qsl, lens, pad_row=151)
    count = covered(split, q_lens + [1])
    assert {k: v for k, v in count.items() if k[0] != 151} == {(r, i): 1 for r, n in enumerate(q_lens)
                                                              for i in range(n)}


@pytest.mark.parametrize("blocks, longest, expect", [
    (8, 32768, 16),    # one row of the 8B shape: 16 x 8 = 128 CTAs, one an SM
    (128, 8192, 1),    # 16 rows: 128 CTAs unsplit
    (8, 4096, 16),     # 16 an SM (the keys allow 64 of 64 keys)
    (8, 1000, 15),     # 15 splits of >= 64 keys
    (8, 512, 8),       # 512 keys split (8 of 64)
    (8, 511, 1),       # under 512 keys: unsplit
    (8, 300, 1),
    (96, 8192, 3),     # 96 x 1 fills 73%: two an SM, ceil(264 / 96)
    (48, 8192, 6),     # 48 x 2 fills 73%: two an SM
    (26, 32768, 5),    # 26 x 5 = 130
    (2, 32768, 64),    # at most 64
    (200, 8192, 1),    # blocks alone fill the SMs
])
def test_decode_splits_plan_one_wave_where_it_fills_the_gpu(monkeypatch, blocks, longest, expect) -> None:
    monkeypatch.delenv("PAGEDCORE_DECODE_ONE_WAVE", raising=False)
    assert planning._decode_splits(blocks, longest, 132) == expect
    monkeypatch.setenv("PAGEDCORE_DECODE_ONE_WAVE", "0")
    assert planning._decode_splits(blocks, longest, 132) == planning._splits(blocks, longest, 132, 256)


@pytest.mark.parametrize("cluster, blocks, longest, expect", [
    ("8", 3, 8192, 40),    # SmolLM2's one row: 44 an SM, 40 in whole clusters of 8 (48 would not fit)
    ("4", 3, 8192, 44),
    ("-8", 3, 8192, 40),   # (the tests' -C: the same plan)
    ("8", 8, 8192, 16),    # the 8B shape's one row: whole clusters already
    ("8", 8, 600, 8),      # 9 splits of >= 64 keys
    ("8", 8, 511, 1),      # under 512 keys: unsplit (the kernel's cluster shares the row)
    ("8", 26, 32768, 5),   # fewer than a cluster: as planned (the launch does not fit one wave)
    ("0", 3, 8192, 44),
])
def test_decode_splits_of_the_cluster_trial_are_whole_clusters(monkeypatch, cluster, blocks, longest,
                                                               expect) -> None:
    # PAGEDCORE_DECODE_CLUSTER=C rounds a launch's splits up to whole clusters; one-wave
    # plans are rounded down to them instead, so that such a launch still fits one wave.
    monkeypatch.delenv("PAGEDCORE_DECODE_ONE_WAVE", raising=False)
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", cluster)
    assert planning._decode_splits(blocks, longest, 132) == expect


def test_plans_ask_for_decode_clusters_from_128_keys(monkeypatch) -> None:
    # Unset, PAGEDCORE_DECODE_CLUSTER leaves the clusters to the plan: 4 CTAs where the
    # longest decode row has 128 keys or more (the kernels take them where the launch
    # fits); set (to anything), the kernels read it and the plan asks for none.
    monkeypatch.delenv("PAGEDCORE_DECODE_CLUSTER", raising=False)
    assert [planning._planned_cluster(n) for n in (0, 1, 127, 128, 256, 32768)] == [0, 0, 0, 4, 4, 4]
    for value in ("0", "4", "-8"):
        monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", value)
        assert planning._planned_cluster(256) == 0
    monkeypatch.setenv("PAGEDCORE_DECODE_CLUSTER", "")  # (empty: unset, as the kernels read it)
    assert planning._planned_cluster(256) == 4


@pytest.mark.parametrize("blocks, longest, expect", [
    (192, 1024, 2),    # SmolLM2's B=64 (3 kv heads): 60 SMs would run two rows, 72 one
    (132, 8192, 2),    # one CTA an SM exactly: halves, two an SM
    (198, 8192, 2),    # 1.5 an SM: at most three halves on any SM
    (199, 8192, 1),    # over 1.5: halves would put four on some SMs, no better than two rows
    (192, 500, 1),     # under 512 keys: unsplit
])
def test_decode_splits_halve_launches_of_one_to_one_and_a_half_ctas_an_sm(monkeypatch, blocks, longest,
                                                                          expect) -> None:
    # Only with PAGEDCORE_DECODE_BALANCE=1; by default such launches stay unsplit.
    monkeypatch.setenv("PAGEDCORE_DECODE_BALANCE", "1")
    assert planning._decode_splits(blocks, longest, 132) == expect
    monkeypatch.delenv("PAGEDCORE_DECODE_BALANCE", raising=False)
    assert planning._decode_splits(blocks, longest, 132) == 1
    monkeypatch.setenv("PAGEDCORE_DECODE_BALANCE", "0")
    assert planning._decode_splits(blocks, longest, 132) == 1


def test_a_plan_says_how_many_query_tokens_its_decode_rows_hold_at_most() -> None:
    # (fp8 decode's TMA tiles take their narrow kernel where that times
    # the group is at most 8 vectors; 0: unknown, never narrow)
    cpu = torch.device("cpu")
    # rows of 1, 2 and 1 query tokens (decode: at most 16 vectors at group 4) and a 100-token chunk
    plan = planning.plan_attention(np.array([0, 1, 3, 4, 104]), np.array([50, 60, 70, 300]), 32, 8, cpu, 128,
                                   torch.bfloat16)
    assert (plan.num_decode, plan.num_work, plan.decode_max_query_tokens) == (3, 4, 2)
    chunk = planning.plan_attention(np.array([0, 100]), np.array([100]), 32, 8, cpu, 128, torch.bfloat16)
    assert (chunk.num_decode, chunk.decode_max_query_tokens) == (0, 0)
    assert planning.plan_decode(16, 8, cpu, 4096).decode_max_query_tokens == 1
    # a whole mixed graph's plan, refilled every step under one capture: unknown
    p = padded(512, 64)
    assert p.fill(np.array([0, 1, 3], dtype=np.int32), np.array([40, 50], dtype=np.int32), pad_row=2)
    assert p.plan.num_decode > 0 and p.plan.decode_max_query_tokens == 0
