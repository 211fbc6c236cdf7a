"""The engine's Python API, continued: stop conditions, finish / fork, stats,
and boundary cases."""

from __future__ import annotations

import numpy as np
import pagedcore
import pytest
from engine_helpers import (
    LENGTH,
    NONE,
    STOP,
    params,
    stats,
    step,
    tiny_engine,
    toks,
)
from pagedcore import FinishReason

# --------------------------------------------------------------------------
# Stop conditions


def run_single(engine, prompt, p, sampled):
    """Feeds `sampled` one token per step to a single n=1 request; returns
    the finish reasons and stop reasons seen, and the finished-request lists."""
    engine.add_request("x", prompt, p)
    reasons, stops, finished = [], [], []
    for t in sampled:
        b = engine.schedule()
        assert b.num_samples == 1
        r = engine.update(toks(t))
        engine.check_invariants()
        reasons.append(int(r.finish_reasons[0]))
        stops.append(int(r.stop_reasons[0]))
        finished.append(list(r.finished_request_ids))
        if reasons[-1] != NONE:
            break
    return reasons, stops, finished


def test_eos_stops_with_stop_reason_minus_one() -> None:
    engine = tiny_engine()
    reasons, stops, finished = run_single(engine, [1, 2], params(max_tokens=10, eos_token_ids=[2, 3]),
                                          [5, 6, 3, 9])
    assert reasons == [NONE, NONE, STOP] and stops == [-1, -1, -1]
    assert finished == [[], [], ["x"]]
    assert stats(engine)["num_free_blocks"] == 8


def test_stop_token_reports_the_token() -> None:
    engine = tiny_engine()
    reasons, stops, _ = run_single(engine, [1, 2], params(max_tokens=10, stop_token_ids=[8, 7]),
                                   [5, 7])
    assert reasons == [NONE, STOP] and stops == [-1, 7]


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    engine = tiny_engine()
    p = params(max_tokens=10, min_tokens=3, eos_token_ids=[2], stop_token_ids=[7])
    reasons, stops, _ = run_single(engine, [1], p, [2, 7, 7, 9])
    # outputs 1 and 2 are below min_tokens; the 3rd (a stop token) stops.
    assert reasons == [NONE, NONE, STOP] and stops == [-1, -1, 7]
    engine = tiny_engine()
    reasons, stops, _ = run_single(engine, [1], p, [2, 7, 2])
    assert reasons == [NONE, NONE, STOP] and stops == [-1, -1, -1]
    engine = tiny_engine()
    reasons, _, _ = run_single(engine, [1], params(max_tokens=3, min_tokens=3,
                                                   eos_token_ids=[2]), [2, 2, 4])
    assert reasons == [NONE, NONE, LENGTH]


def test_max_tokens_gives_length() -> None:
    engine = tiny_engine()
    reasons, stops, finished = run_single(engine, [1, 2, 3], params(max_tokens=4), [9] * 10)
    assert reasons == [NONE, NONE, NONE, LENGTH] and stops == [-1] * 4
    assert finished[-1] == ["x"]
    # A stop on the last allowed token is a stop, not a length.
    engine = tiny_engine()
    reasons, stops, _ = run_single(engine, [1], params(max_tokens=2, stop_token_ids=[4]), [3, 4])
    assert reasons == [NONE, STOP] and stops == [-1, 4]


def test_ignore_eos_ignores_eos_but_not_stop_tokens() -> None:
    engine = tiny_engine()
    p = params(max_tokens=10, ignore_eos=True, eos_token_ids=[2], stop_token_ids=[7])
    reasons, stops, _ = run_single(engine, [1], p, [2, 2, 7, 5])
    assert reasons == [NONE, NONE, STOP] and stops == [-1, -1, 7]
    engine = tiny_engine()
    reasons, _, _ = run_single(engine, [1], params(max_tokens=3, ignore_eos=True,
                                                   eos_token_ids=[2]), [2, 2, 2, 2])
    assert reasons == [NONE, NONE, LENGTH]


def test_max_model_len_gives_length() -> None:
    engine = tiny_engine(max_model_len=12)
    reasons, _, _ = run_single(engine, [1, 2, 3, 4, 5, 6, 7, 8, 9], params(max_tokens=100),
                               [9] * 10)
    # 9 prompt tokens + 3 outputs = max_model_len.
    assert reasons == [NONE, NONE, LENGTH]
    assert stats(engine)["num_generation_tokens"] == 3


def test_finish_for_a_stop_string() -> None:
    engine = tiny_engine()
    engine.add_request("x", [1, 2, 3], params(max_tokens=10))
    step(engine, 4)
    step(engine, 5)
    assert engine.seq_token_ids(0) == [1, 2, 3, 4, 5]
    assert engine.finish(0) is True
    engine.check_invariants()
    s = stats(engine)
    assert s["num_requests"] == 0 and s["num_running_seqs"] == 0 and s["num_free_blocks"] == 8
    with pytest.raises(KeyError):
        engine.seq_token_ids(0)
    with pytest.raises(KeyError):
        engine.finish(0)
    # The step after sees nothing.
    b = engine.schedule()
    assert b.num_seqs == 0 and b.num_tokens == 0
    engine.update(toks())

    # With n = 2: finishing one sample keeps the request.
    assert engine.add_request("y", [1, 2, 3], params(n=2, max_tokens=10)) == 1
    step(engine, 4, 5)
    assert engine.finish(1) is False
    engine.check_invariants()
    assert stats(engine)["num_requests"] == 1
    bd, _ = step(engine, 6)
    assert bd["seq_ids"] == [2]
    assert engine.finish(2, FinishReason.ABORT) is True
    assert stats(engine)["num_requests"] == 0 and stats(engine)["num_free_blocks"] == 8


def test_finish_waiting_and_unforked_sequences() -> None:
    engine = tiny_engine()
    engine.add_request("p", [1, 2, 3], params(n=3, max_tokens=4))
    # Waiting parent that stands for all n samples: finishing it ends the request.
    assert engine.finish(0) is True
    engine.check_invariants()
    assert stats(engine)["num_requests"] == 0 and stats(engine)["num_waiting_seqs"] == 0
    engine.add_request("q", [1, 2, 3], params(n=2, max_tokens=4))
    b = engine.schedule()
    assert b.sample_seq_ids.tolist() == [3, 4]
    engine.update(toks(7, 8))
    assert engine.finish(3) is False and engine.finish(4) is True
    assert stats(engine)["num_free_blocks"] == 8


def test_fork_shares_every_block() -> None:
    engine = tiny_engine(num_blocks=16, max_model_len=64)
    engine.add_request("r", list(range(1, 11)), params(max_tokens=3))
    step(engine, 50)
    child = engine.fork(0)
    assert child == 1
    engine.check_invariants()
    assert engine.seq_block_table(child) == engine.seq_block_table(0) == [1, 2]
    assert engine.seq_token_ids(child) == engine.seq_token_ids(0)
    s = stats(engine)
    assert s["num_running_seqs"] == 2 and s["num_used_blocks"] == 2
    assert engine.add_request("other", [3], params(max_tokens=1)) == 2
    b = engine.schedule()
    assert b.seq_ids.tolist() == [0, 1, 2]
    # Both decode at position 10 of the shared partial block 2: the first
    # copies it, the second (now its last owner) writes in place.
    assert b.positions.tolist() == [10, 10, 0]
    assert b.block_copies.tolist() == [[2, 3]]
    assert b.slot_mapping.tolist() == [3 * 8 + 2, 2 * 8 + 2, 4 * 8]
    assert b.sample_seq_ids.tolist() == [0, 1, 2]
    r = engine.update(toks(60, 61, 62))
    assert r.finished_request_ids == ["other"]
    assert engine.seq_token_ids(0)[-2:] == [50, 60]
    assert engine.seq_token_ids(1)[-2:] == [50, 61]
    # The fork counts its inherited outputs against max_tokens: 3rd output ends both.
    r = step(engine, 70, 71)[1]
    assert r["finish_reasons"] == [LENGTH, LENGTH] and r["finished_request_ids"] == ["r"]
    assert stats(engine)["num_free_blocks"] == 16


# --------------------------------------------------------------------------
# Stats

STATS_FIELDS = {
    "num_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks", "num_cpu_blocks",
    "num_free_cpu_blocks", "num_requests", "num_running_seqs", "num_waiting_seqs",
    "num_swapped_seqs", "num_steps", "num_preemptions", "num_recompute_preemptions",
    "num_swap_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    "prefix_cache_hit_rate", "num_prompt_tokens", "num_generation_tokens", "num_kv_tokens",
    "num_reserved_blocks",
}


def test_stats_fields_and_stats_dict() -> None:
    engine = pagedcore.Engine(num_blocks=10, block_size=8, max_model_len=64,
                              preemption_mode="swap", num_cpu_blocks=3)
    st = engine.stats()
    assert isinstance(st, pagedcore.EngineStats)
    d = pagedcore.stats_dict(st)
    assert set(d) == STATS_FIELDS
    for name in STATS_FIELDS:
        assert d[name] == getattr(st, name)
    assert d == {
        "num_blocks": 10, "num_free_blocks": 10, "num_cached_blocks": 0, "num_used_blocks": 0,
        "num_cpu_blocks": 3, "num_free_cpu_blocks": 3, "num_requests": 0,
        "num_running_seqs": 0, "num_waiting_seqs": 0, "num_swapped_seqs": 0, "num_steps": 0,
        "num_preemptions": 0, "num_recompute_preemptions": 0, "num_swap_preemptions": 0,
        "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0,
        "num_prompt_tokens": 0, "num_generation_tokens": 0, "num_kv_tokens": 0,
        "num_reserved_blocks": 0,
    }
    assert isinstance(d["prefix_cache_hit_rate"], float)


def test_stats_prefix_cache_counters() -> None:
    engine = tiny_engine(num_blocks=8, max_model_len=64, enable_prefix_caching=True)
    prompt = list(range(1, 18))  # 17 tokens: two full blocks and one token
    engine.add_request("a", prompt, params(max_tokens=1))
    s = stats(engine)
    assert s["num_waiting_seqs"] == 1 and s["prefix_cache_queries"] == 0
    bd, rd = step(engine, 99)
    assert rd["finished_request_ids"] == ["a"]
    s = stats(engine)
    assert s["prefix_cache_queries"] == 17 and s["prefix_cache_hits"] == 0
    assert s["prefix_cache_hit_rate"] == 0.0
    assert s["num_cached_blocks"] == 2 and s["num_free_blocks"] == 8 and s["num_used_blocks"] == 0
    assert s["num_prompt_tokens"] == 17 and s["num_generation_tokens"] == 1
    # Same 17 tokens: the two full blocks hit, the last token is recomputed.
    engine.add_request("b", prompt, params(max_tokens=2))
    b = engine.schedule()
    assert b.num_computed_tokens.tolist() == [16] and b.input_ids.tolist() == [17]
    assert b.block_tables[0, :2].tolist() == bd["block_tables"][0][:2]
    engine.update(toks(5))
    s = stats(engine)
    assert s["prefix_cache_queries"] == 34 and s["prefix_cache_hits"] == 16
    assert s["prefix_cache_hit_rate"] == pytest.approx(16 / 34)
    assert s["num_cached_blocks"] == 0 and s["num_used_blocks"] == 3
    # A different salt never shares.
    engine.add_request("c", prompt, params(max_tokens=1, cache_salt=1))
    b = engine.schedule()
    assert b.num_computed_tokens.tolist() == [17, 0]
    engine.update(toks(6, 7))
    s = stats(engine)
    assert s["prefix_cache_queries"] == 51 and s["prefix_cache_hits"] == 16
    assert s["num_requests"] == 0
    assert s["num_steps"] == 3
    assert s["num_prompt_tokens"] == 51 and s["num_generation_tokens"] == 4


def test_stats_count_preemptions_and_swaps() -> None:
    # Two sequences that cannot both grow in 3 blocks.
    for mode in ("recompute", "swap"):
        engine = tiny_engine(num_blocks=3, max_model_len=32, preemption_mode=mode,
                             num_cpu_blocks=4 if mode == "swap" else 0)
        engine.add_request("a", list(range(1, 8)), params(max_tokens=9))
        engine.add_request("b", list(range(11, 18)), params(max_tokens=9))
        swapped_seen = False
        finished = []
        for _ in range(100):
            b = engine.schedule()
            if b.num_swap_out:
                s = stats(engine)
                assert s["num_swapped_seqs"] == 1 and s["num_free_cpu_blocks"] == 4 - b.num_swap_out
                swapped_seen = True
            r = engine.update(np.full(b.num_samples, 1, dtype=np.int32))
            finished += list(r.finished_request_ids)
            engine.check_invariants()
            s = stats(engine)
            assert s["num_free_blocks"] + s["num_used_blocks"] == 3
            if not engine.has_unfinished_requests():
                break
        assert sorted(finished) == ["a", "b"]
        s = stats(engine)
        assert s["num_preemptions"] >= 1
        assert s["num_preemptions"] == s["num_recompute_preemptions"] + s["num_swap_preemptions"]
        if mode == "swap":
            assert swapped_seen and s["num_swap_preemptions"] >= 1
            assert s["num_free_cpu_blocks"] == 4
        else:
            assert s["num_swap_preemptions"] == 0
        assert s["num_free_blocks"] == 3 and s["num_generation_tokens"] == 18


# --------------------------------------------------------------------------
# Admission boundary: "a request that could not fit in the whole cache even
# alone" is rejected, and one that fits is accepted and completes.


def test_never_fits_boundary_is_exact() -> None:
    # One 8-token block. An 8-token prompt with max_tokens=1 computes the KV of
    # its 8 prompt tokens only (the sampled token is never run through the
    # model), so it fits in one block and completes.
    engine = pagedcore.Engine(num_blocks=1, block_size=8, max_model_len=64)
    engine.add_request("fits", list(range(8)), params(max_tokens=1))
    b = engine.schedule()
    assert b.num_tokens == 8
    r = engine.update(toks(3))
    assert r.finished_request_ids == ["fits"]
    # 7 prompt tokens + 2 outputs: the KV of 8 tokens (7 + the first output).
    engine.add_request("fits2", list(range(7)), params(max_tokens=2))
    engine.schedule()
    engine.update(toks(3))
    engine.schedule()
    r = engine.update(toks(4))
    assert r.finished_request_ids == ["fits2"]
    # 8 + 2 needs a second block: rejected.
    with pytest.raises(ValueError, match="num_blocks is 1"):
        engine.add_request("too-big", list(range(8)), params(max_tokens=2))


# --------------------------------------------------------------------------
# Liveness: every request add_request accepts runs to completion, even on an
# otherwise idle engine.


def run_until_done(engine: pagedcore.Engine, max_steps: int = 200) -> list[str]:
    finished: list[str] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        b = engine.schedule()
        r = engine.update(np.full(b.num_samples, 1, dtype=np.int32))
        engine.check_invariants()
        finished += list(r.finished_request_ids)
    assert not engine.has_unfinished_requests(), (
        f"requests never finish; stats: {stats(engine)}")
    return finished


def test_sliding_window_prefix_hits_do_not_block_admission() -> None:
    # Request A (40 tokens = 5 blocks) leaves its 5 blocks cached. B repeats
    # A's prompt and adds 7 tokens: its prefix lookup finds 5 cached blocks,
    # and 5 revived + 1 fresh block > 5 blocks. With a sliding window B needs
    # only 3 blocks (add_request accepts it), so it must still run.
    engine = pagedcore.Engine(num_blocks=5, block_size=8, max_model_len=128,
                              max_num_batched_tokens=8, sliding_window=8)
    prompt = list(range(1, 41))
    engine.add_request("A", prompt, params(max_tokens=1))
    assert run_until_done(engine) == ["A"]
    assert stats(engine)["num_cached_blocks"] == 5
    engine.add_request("B", prompt + [50] * 7, params(max_tokens=1))
    assert run_until_done(engine) == ["B"]
    assert stats(engine)["num_free_blocks"] == 5


def test_sliding_window_swapped_sequence_comes_back() -> None:
    # B is preempted holding 3 blocks right after a 15-token chunk; the window
    # no longer needs the first two of them, so only the last is swapped out
    # (and charged at swap-in). Charging all three + 2 new blocks > num_blocks
    # made B wait forever on an idle engine.
    engine = pagedcore.Engine(num_blocks=4, block_size=8, max_model_len=256,
                              max_num_batched_tokens=16, sliding_window=8,
                              enable_prefix_caching=False, preemption_mode="swap",
                              num_cpu_blocks=4)
    engine.add_request("A", list(range(1, 8)), params(max_tokens=5))
    engine.add_request("B", list(range(100, 148)), params(max_tokens=1))
    b = engine.schedule()
    assert b.seq_ids.tolist() == [0, 1] and b.num_tokens == 16
    engine.update(toks(1))
    b = engine.schedule()
    assert b.seq_ids.tolist() == [0, 1] and b.num_tokens == 16
    engine.update(toks(1))
    b = engine.schedule()  # A needs a block: B (last) is swapped out
    assert b.num_swap_out == 1 and b.seq_ids.tolist() == [0]
    engine.update(toks(1))
    assert stats(engine)["num_swapped_seqs"] == 1
    assert sorted(run_until_done(engine)) == ["A", "B"]
    s = stats(engine)
    assert s["num_free_blocks"] == 4 and s["num_free_cpu_blocks"] == 4


def test_prompt_as_numpy_array_and_max_model_len_boundary() -> None:
    engine = tiny_engine(max_model_len=16)
    prompt = np.arange(1, 16, dtype=np.int64)  # 15 = max_model_len - 1 tokens
    assert engine.add_request("np", prompt, params(max_tokens=50)) == 0
    assert engine.seq_token_ids(0) == list(range(1, 16))
    b = engine.schedule()
    assert b.input_ids.tolist() == list(range(1, 16))
    r = engine.update(toks(3))
    # The first output brings the sequence to max_model_len.
    assert r.finish_reasons.tolist() == [LENGTH] and r.finished_request_ids == ["np"]


def test_reserve_max_model_len_through_the_binding() -> None:
    # 32 blocks of 8 tokens, max_model_len 64 (8 blocks): reserving admits 4 of 6.
    for reserve, admitted in ((False, 6), (True, 4)):
        engine = pagedcore.Engine(num_blocks=32, block_size=8, max_model_len=64, max_num_batched_tokens=256,
                                  enable_prefix_caching=False, reserve_max_model_len=reserve)
        for i in range(6):
            engine.add_request(f"r{i}", list(range(1 + 20 * i, 11 + 20 * i)), pagedcore.RequestParams(max_tokens=4))
        assert engine.schedule().num_seqs == admitted
        s = stats(engine)
        assert (s["num_kv_tokens"], s["num_used_blocks"]) == (10 * admitted, 2 * admitted)
        assert s["num_reserved_blocks"] == (8 * admitted if reserve else 2 * admitted)
