"""The engine's Python API: construction, validation, step round trips with
exact expected arrays, zero-copy views, n > 1 sharing, stop conditions,
finish / fork and stats are in test_engine_stops.py."""

from __future__ import annotations

import gc

import numpy as np
import pagedcore
import pytest
from engine_helpers import (
    LENGTH,
    NONE,
    batch_dict,
    params,
    result_dict,
    stats,
    step,
    tiny_engine,
    toks,
)

# --------------------------------------------------------------------------
# Construction


CONFIG_FIELDS = {
    "num_blocks": 40,
    "block_size": 32,
    "max_num_seqs": 7,
    "max_num_batched_tokens": 300,
    "max_model_len": 1000,
    "enable_prefix_caching": False,
    "preemption_mode": "swap",
    "scheduling_policy": "priority",
    "num_cpu_blocks": 9,
    "sliding_window": 64,
    "vocab_size": 32000,
    "prefix_hash_bits": 20,
}


def test_construction_from_kwargs_and_from_config_agree() -> None:
    from_kwargs = pagedcore.Engine(**CONFIG_FIELDS)
    from_config = pagedcore.Engine(pagedcore.EngineConfig(**CONFIG_FIELDS))
    for engine in (from_kwargs, from_config):
        assert isinstance(engine, pagedcore.Engine)
        assert isinstance(engine, pagedcore._C.Engine)
        cfg = engine.config
        for name, value in CONFIG_FIELDS.items():
            assert getattr(cfg, name) == value, name
        assert cfg.max_blocks_per_seq == 32  # ceil(1000 / 32)
        assert engine.num_physical_blocks == 41
        assert engine.num_physical_cpu_blocks == 10
        assert engine.has_pending_step is False
        assert engine.num_unfinished_requests == 0
        assert engine.has_unfinished_requests() is False
        s = stats(engine)
        assert s["num_blocks"] == 40 and s["num_free_blocks"] == 40
        assert s["num_cpu_blocks"] == 9 and s["num_free_cpu_blocks"] == 9
        engine.check_invariants()


def test_config_defaults() -> None:
    cfg = pagedcore.EngineConfig()
    assert (cfg.num_blocks, cfg.block_size, cfg.max_num_seqs) == (1024, 16, 256)
    assert (cfg.max_num_batched_tokens, cfg.max_model_len) == (2048, 2048)
    assert cfg.enable_prefix_caching is True
    assert cfg.preemption_mode == "recompute"
    assert cfg.scheduling_policy == "fcfs"
    assert (cfg.num_cpu_blocks, cfg.sliding_window, cfg.vocab_size) == (0, 0, 0)
    assert cfg.prefix_hash_bits == 64
    assert cfg.max_blocks_per_seq == 128
    engine = pagedcore.Engine()
    assert engine.config.num_blocks == 1024 and engine.num_physical_blocks == 1025
    # sliding_window=None means full attention.
    assert pagedcore.EngineConfig(sliding_window=None).sliding_window == 0


def test_config_and_kwargs_together_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="either an EngineConfig or keyword arguments"):
        pagedcore.Engine(pagedcore.EngineConfig(), num_blocks=8)


def test_config_is_keyword_only_and_read_only() -> None:
    with pytest.raises(TypeError):
        pagedcore.EngineConfig(8)  # type: ignore[misc]
    cfg = pagedcore.EngineConfig(num_blocks=8)
    with pytest.raises(AttributeError):
        cfg.num_blocks = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("num_blocks", 0, "0"),
        ("num_blocks", -3, "-3"),
        ("num_blocks", 2**27, str(2**27)),  # (num_blocks + 1) * 16 >= 2^31
        ("block_size", 12, "12"),
        ("block_size", 0, "0"),
        ("block_size", 256, "256"),
        ("max_num_seqs", 0, "0"),
        ("max_num_batched_tokens", 0, "0"),
        ("max_model_len", 0, "0"),
        ("max_model_len", -1, "-1"),
        ("preemption_mode", "foo", "'foo'"),
        ("preemption_mode", "SWAP", "'SWAP'"),
        ("scheduling_policy", "lifo", "'lifo'"),
        ("num_cpu_blocks", -1, "-1"),
        ("sliding_window", -1, "-1"),
        ("vocab_size", -5, "-5"),
        ("prefix_hash_bits", 65, "65"),
        ("prefix_hash_bits", -1, "-1"),
    ],
)
def test_config_field_validation(field: str, value, shown: str) -> None:
    kwargs = {field: value}
    for make in (pagedcore.EngineConfig, pagedcore.Engine):
        with pytest.raises(ValueError) as excinfo:
            make(**kwargs)
        assert isinstance(excinfo.value, pagedcore.InvalidArgumentError)
        message = str(excinfo.value)
        assert field in message, message
        assert shown in message, message


def test_swap_without_cpu_blocks_is_rejected() -> None:
    for make in (pagedcore.EngineConfig, pagedcore.Engine):
        with pytest.raises(pagedcore.InvalidArgumentError) as excinfo:
            make(preemption_mode="swap")
        message = str(excinfo.value)
        assert "num_cpu_blocks" in message and "swap" in message and "0" in message, message
    # With CPU blocks it is fine, and recompute needs none.
    assert pagedcore.Engine(preemption_mode="swap", num_cpu_blocks=1).config.num_cpu_blocks == 1
    assert pagedcore.Engine(preemption_mode="recompute").config.num_cpu_blocks == 0


def test_valid_boundaries_are_accepted() -> None:
    for bs in (8, 16, 32, 64, 128):
        assert pagedcore.EngineConfig(block_size=bs).block_size == bs
    cfg = pagedcore.EngineConfig(
        num_blocks=1, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1,
        prefix_hash_bits=0, sliding_window=0, vocab_size=0,
    )
    assert cfg.max_blocks_per_seq == 1
    assert pagedcore.EngineConfig(prefix_hash_bits=64).prefix_hash_bits == 64
    assert pagedcore.EngineConfig().reserve_max_model_len is False
    assert pagedcore.EngineConfig(reserve_max_model_len=True).reserve_max_model_len is True
    # Largest num_blocks with (num_blocks + 1) * block_size < 2^31.
    assert pagedcore.EngineConfig(num_blocks=2**27 - 2, block_size=16).num_blocks == 2**27 - 2


def test_request_params_fields() -> None:
    p = params(n=3, max_tokens=9, min_tokens=2, ignore_eos=True, eos_token_ids=[2],
               stop_token_ids=[5, 6], priority=4, cache_salt=77)
    assert (p.n, p.max_tokens, p.min_tokens, p.ignore_eos) == (3, 9, 2, True)
    assert (p.eos_token_ids, p.stop_token_ids, p.priority, p.cache_salt) == ([2], [5, 6], 4, 77)
    d = pagedcore.RequestParams()
    assert (d.n, d.max_tokens, d.min_tokens, d.ignore_eos, d.priority, d.cache_salt) == (
        1, 16, 0, False, 0, 0)
    assert d.eos_token_ids == [] and d.stop_token_ids == []


# --------------------------------------------------------------------------
# Round trips with exact arrays


def test_round_trip_exact_arrays() -> None:
    engine = tiny_engine()
    assert engine.add_request("r0", list(range(1, 11)), params(max_tokens=3)) == 0
    assert engine.add_request("r1", [21, 22, 23], params(max_tokens=2)) == 1
    assert engine.num_unfinished_requests == 2
    s = stats(engine)
    assert (s["num_waiting_seqs"], s["num_running_seqs"], s["num_used_blocks"]) == (2, 0, 0)

    # Step 1: two prefills, r0 in blocks 1, 2 and r1 in block 3.
    b = engine.schedule()
    assert engine.has_pending_step is True
    assert (b.block_size, b.max_blocks_per_seq) == (8, 4)
    assert b.block_tables.shape == (2, 4)
    assert batch_dict(b) == {
        "num_tokens": 13,
        "num_seqs": 2,
        "num_decode_seqs": 0,
        "num_samples": 2,
        "input_ids": list(range(1, 11)) + [21, 22, 23],
        "positions": list(range(10)) + [0, 1, 2],
        "slot_mapping": list(range(8, 16)) + [16, 17] + [24, 25, 26],
        "seq_ids": [0, 1],
        "query_start_loc": [0, 10, 13],
        "num_computed_tokens": [0, 0],
        "seq_lens": [10, 3],
        "block_tables": [[1, 2], [3]],
        "sample_indices": [9, 12],
        "sample_seq_ids": [0, 1],
        "block_copies": [],
        "swap_out": [],
        "swap_in": [],
    }
    assert (b.num_block_copies, b.num_swap_out, b.num_swap_in) == (0, 0, 0)
    assert b.block_copies.shape == (0, 2) and b.swap_out.shape == (0, 2)
    assert b.swap_in.shape == (0, 2)
    r = engine.update(toks(100, 200))
    assert engine.has_pending_step is False
    assert r.num_outputs == 2
    assert result_dict(r) == {
        "seq_ids": [0, 1],
        "token_ids": [100, 200],
        "finish_reasons": [NONE, NONE],
        "stop_reasons": [-1, -1],
        "finished_request_ids": [],
    }
    assert engine.seq_token_ids(0) == list(range(1, 11)) + [100]
    assert engine.seq_token_ids(1) == [21, 22, 23, 200]
    assert engine.seq_block_table(0) == [1, 2]
    assert engine.seq_block_table(1) == [3]
    engine.check_invariants()

    # Step 2: two decodes; r1 reaches max_tokens=2.
    bd, rd = step(engine, 101, 201)
    assert bd == {
        "num_tokens": 2,
        "num_seqs": 2,
        "num_decode_seqs": 2,
        "num_samples": 2,
        "input_ids": [100, 200],
        "positions": [10, 3],
        "slot_mapping": [2 * 8 + 2, 3 * 8 + 3],
        "seq_ids": [0, 1],
        "query_start_loc": [0, 1, 2],
        "num_computed_tokens": [10, 3],
        "seq_lens": [11, 4],
        "block_tables": [[1, 2], [3]],
        "sample_indices": [0, 1],
        "sample_seq_ids": [0, 1],
        "block_copies": [],
        "swap_out": [],
        "swap_in": [],
    }
    assert rd == {
        "seq_ids": [0, 1],
        "token_ids": [101, 201],
        "finish_reasons": [NONE, LENGTH],
        "stop_reasons": [-1, -1],
        "finished_request_ids": ["r1"],
    }
    with pytest.raises(KeyError):
        engine.seq_token_ids(1)
    s = stats(engine)
    assert (s["num_requests"], s["num_used_blocks"], s["num_free_blocks"]) == (1, 2, 6)

    # Step 3: r2 arrives and gets block 3 back (freed blocks are reused first);
    # r0 decodes and reaches max_tokens=3.
    assert engine.add_request("r2", [31, 32, 33, 34, 35], params(max_tokens=4)) == 2
    bd, rd = step(engine, 102, 300)
    assert bd == {
        "num_tokens": 6,
        "num_seqs": 2,
        "num_decode_seqs": 1,
        "num_samples": 2,
        "input_ids": [101, 31, 32, 33, 34, 35],
        "positions": [11, 0, 1, 2, 3, 4],
        "slot_mapping": [2 * 8 + 3, 24, 25, 26, 27, 28],
        "seq_ids": [0, 2],
        "query_start_loc": [0, 1, 6],
        "num_computed_tokens": [11, 0],
        "seq_lens": [12, 5],
        "block_tables": [[1, 2], [3]],
        "sample_indices": [0, 5],
        "sample_seq_ids": [0, 2],
        "block_copies": [],
        "swap_out": [],
        "swap_in": [],
    }
    assert rd == {
        "seq_ids": [0, 2],
        "token_ids": [102, 300],
        "finish_reasons": [LENGTH, NONE],
        "stop_reasons": [-1, -1],
        "finished_request_ids": ["r0"],
    }
    # Step 4: r2 alone; position 5 stays in block 3.
    bd, rd = step(engine, 301)
    assert bd["input_ids"] == [300] and bd["positions"] == [5]
    assert bd["slot_mapping"] == [3 * 8 + 5] and bd["block_tables"] == [[3]]
    assert rd["finish_reasons"] == [NONE]
    engine.abort("r2")
    engine.check_invariants()
    s = stats(engine)
    assert s["num_requests"] == 0 and s["num_free_blocks"] == 8 and s["num_used_blocks"] == 0
    assert s["num_steps"] == 4
    assert s["num_prompt_tokens"] == 10 + 3 + 5
    assert s["num_generation_tokens"] == 7
    assert engine.has_unfinished_requests() is False


def test_prefill_crossing_blocks_and_chunking() -> None:
    # A 20-token prompt with a 16-token budget is chunked: 16 then 4.
    engine = tiny_engine(max_num_batched_tokens=16, max_model_len=64, num_blocks=8)
    assert engine.add_request("a", list(range(100, 120)), params(max_tokens=2)) == 0
    bd, rd = step(engine)
    assert bd["num_tokens"] == 16 and bd["num_samples"] == 0 and bd["num_decode_seqs"] == 0
    assert bd["positions"] == list(range(16))
    assert bd["slot_mapping"] == list(range(8, 24))  # blocks 1, 2
    assert bd["seq_lens"] == [16] and bd["num_computed_tokens"] == [0]
    assert bd["block_tables"] == [[1, 2]]
    assert rd == {"seq_ids": [], "token_ids": [], "finish_reasons": [], "stop_reasons": [],
                  "finished_request_ids": []}
    bd, rd = step(engine, 7)
    assert bd["input_ids"] == list(range(116, 120)) and bd["positions"] == [16, 17, 18, 19]
    assert bd["slot_mapping"] == [24, 25, 26, 27]  # block 3
    assert bd["num_computed_tokens"] == [16] and bd["seq_lens"] == [20]
    assert bd["block_tables"] == [[1, 2, 3]]
    assert bd["sample_indices"] == [3] and bd["sample_seq_ids"] == [0]
    assert stats(engine)["num_prompt_tokens"] == 20
    bd, rd = step(engine, 8)
    assert rd["finish_reasons"] == [LENGTH] and rd["finished_request_ids"] == ["a"]


def test_decode_rows_come_first() -> None:
    # Under the priority policy a newly admitted high-priority prompt is
    # scheduled before an older low-priority decode, yet the decode row leads
    # the batch.
    engine = tiny_engine(scheduling_policy="priority", num_blocks=16, max_num_batched_tokens=16,
                         max_model_len=64)
    assert engine.add_request("low", [1, 2, 3, 4], params(priority=5, max_tokens=10)) == 0
    step(engine, 9)
    assert engine.add_request("high", list(range(50, 70)), params(priority=0, max_tokens=10)) == 1
    bd, _ = step(engine, 10)  # low decodes, high gets a 15-token chunk
    assert bd["seq_ids"] == [0, 1] and bd["num_decode_seqs"] == 1
    assert bd["query_start_loc"] == [0, 1, 16]
    assert bd["sample_seq_ids"] == [0]
    bd, _ = step(engine, 11, 60)  # high (runs first) finishes its prompt; low decodes
    assert bd["seq_ids"] == [0, 1]
    assert bd["num_decode_seqs"] == 1
    assert bd["input_ids"] == [10] + list(range(65, 70))
    assert bd["positions"] == [5, 15, 16, 17, 18, 19]
    assert bd["query_start_loc"] == [0, 1, 6]
    assert bd["num_computed_tokens"] == [5, 15] and bd["seq_lens"] == [6, 20]
    assert bd["sample_indices"] == [0, 5] and bd["sample_seq_ids"] == [0, 1]


# --------------------------------------------------------------------------
# numpy views

BATCH_DTYPES = {
    "input_ids": np.int32,
    "positions": np.int32,
    "slot_mapping": np.int32,
    "seq_ids": np.int64,
    "query_start_loc": np.int32,
    "num_computed_tokens": np.int32,
    "seq_lens": np.int32,
    "block_tables": np.int32,
    "sample_indices": np.int32,
    "sample_seq_ids": np.int64,
    "block_copies": np.int32,
    "swap_out": np.int32,
    "swap_in": np.int32,
}
RESULT_DTYPES = {
    "seq_ids": np.int64,
    "token_ids": np.int32,
    "finish_reasons": np.uint8,
    "stop_reasons": np.int32,
}


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_views_are_read_only_zero_copy_with_exact_dtypes() -> None:
    engine = tiny_engine(preemption_mode="swap", num_cpu_blocks=4)
    engine.add_request("a", [1, 2, 3], params(max_tokens=5))
    engine.add_request("b", [4, 5, 6, 7, 8, 9, 10, 11, 12], params(max_tokens=5))
    b = engine.schedule()
    for name, dtype in BATCH_DTYPES.items():
        a1 = getattr(b, name)
        a2 = getattr(b, name)
        assert isinstance(a1, np.ndarray)
        assert a1.dtype == np.dtype(dtype), name
        assert not a1.flags.writeable, name
        assert a1.flags.c_contiguous, name
        assert not a1.flags.owndata, name
        # Two views of the same field are views of the same memory.
        assert addr(a1) == addr(a2), name
        if a1.size:
            assert np.shares_memory(a1, a2), name
        with pytest.raises(ValueError):
            a1.setflags(write=True)
        if a1.size:
            with pytest.raises(ValueError, match="read-only"):
                a1.flat[0] = 0
    assert b.input_ids.shape == (12,) and b.query_start_loc.shape == (3,)
    first_ids = b.input_ids
    first_addr = {name: addr(getattr(b, name)) for name in BATCH_DTYPES}
    r = engine.update(toks(70, 80))
    for name, dtype in RESULT_DTYPES.items():
        a1 = getattr(r, name)
        a2 = getattr(r, name)
        assert a1.dtype == np.dtype(dtype), name
        assert a1.shape == (2,)
        assert not a1.flags.writeable, name
        assert addr(a1) == addr(a2) and np.shares_memory(a1, a2), name
    result_addr = {name: addr(getattr(r, name)) for name in RESULT_DTYPES}
    old_tokens = r.token_ids
    # The next step reuses the same buffers: the old view sees the new step.
    b2 = engine.schedule()
    for name in BATCH_DTYPES:
        assert addr(getattr(b2, name)) == first_addr[name], name
    assert np.shares_memory(first_ids, b2.input_ids)
    assert first_ids.tolist()[:2] == [70, 80]
    r2 = engine.update(toks(71, 81))
    for name in RESULT_DTYPES:
        assert addr(getattr(r2, name)) == result_addr[name], name
    assert old_tokens.tolist() == [71, 81]


def test_views_keep_the_engine_alive() -> None:
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3], params(max_tokens=5))
    ids = engine.schedule().input_ids
    del engine
    gc.collect()
    assert ids.tolist() == [1, 2, 3]
    owner = ids.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    assert owner is not None


# --------------------------------------------------------------------------
# n > 1


@pytest.mark.parametrize("prompt_len", [10, 16])
def test_n_samples_share_prompt_blocks(prompt_len: int) -> None:
    engine = tiny_engine(num_blocks=16, max_model_len=64)
    prompt = list(range(1, prompt_len + 1))
    assert engine.add_request("r", prompt, params(n=3, max_tokens=4)) == 0
    b = engine.schedule()
    s = stats(engine)
    assert s["num_running_seqs"] == 1  # the parent counts once until it forks
    assert b.num_seqs == 1 and b.num_samples == 3
    assert b.sample_indices.tolist() == [prompt_len - 1] * 3
    assert b.sample_seq_ids.tolist() == [0, 1, 2]
    with pytest.raises(KeyError):
        engine.seq_token_ids(1)  # children do not exist before the fork
    r = engine.update(toks(5, 6, 7))
    assert r.seq_ids.tolist() == [0, 1, 2] and r.token_ids.tolist() == [5, 6, 7]
    engine.check_invariants()
    tables = [engine.seq_block_table(i) for i in range(3)]
    assert tables == [[1, 2]] * 3
    assert [engine.seq_token_ids(i) for i in range(3)] == [prompt + [t] for t in (5, 6, 7)]
    s = stats(engine)
    assert s["num_running_seqs"] == 3 and s["num_used_blocks"] == 2
    # The next request gets ids after all n of them.
    assert engine.add_request("next", [9], params(max_tokens=1)) == 3

    b = engine.schedule()
    # Seqs 0, 1 and 2 decode; 'next' is a one-token prompt, also a one-token row.
    assert b.seq_ids.tolist() == [0, 1, 2, 3] and b.num_decode_seqs == 4
    if prompt_len % 8:
        # The shared partial block 2 is copied for seq 0 and 1; seq 2, its
        # last owner, writes in place.
        assert b.num_block_copies == 2
        assert b.block_copies.tolist() == [[2, 3], [2, 4]]
        assert b.slot_mapping.tolist()[:3] == [3 * 8 + 2, 4 * 8 + 2, 2 * 8 + 2]
        rows = [b.block_tables[i, :2].tolist() for i in range(3)]
        assert rows == [[1, 3], [1, 4], [1, 2]]
        assert b.slot_mapping.tolist()[3] == 5 * 8
    else:
        # Full shared blocks are never copied: each sample opens its own block.
        assert b.num_block_copies == 0 and b.block_copies.shape == (0, 2)
        assert b.slot_mapping.tolist()[:3] == [3 * 8, 4 * 8, 5 * 8]
        rows = [b.block_tables[i, :3].tolist() for i in range(3)]
        assert rows == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
        assert b.slot_mapping.tolist()[3] == 6 * 8
    assert b.positions.tolist() == [prompt_len] * 3 + [0]
    assert b.input_ids.tolist() == [5, 6, 7, 9]
    r = engine.update(toks(15, 16, 17, 19))
    assert r.finished_request_ids == ["next"]
    engine.check_invariants()
    assert [engine.seq_token_ids(i)[-2:] for i in range(3)] == [[5, 15], [6, 16], [7, 17]]
    # Third step: no more copies, every block is private now.
    b = engine.schedule()
    assert b.num_block_copies == 0
    engine.update(toks(25, 26, 27))
    b = engine.schedule()
    r = engine.update(toks(35, 36, 37))
    assert r.finish_reasons.tolist() == [LENGTH] * 3
    assert r.finished_request_ids == ["r"]
    s = stats(engine)
    assert s["num_free_blocks"] == 16 and s["num_requests"] == 0


def test_n_samples_with_prefix_caching_fork_ids_after_other_requests() -> None:
    engine = tiny_engine(num_blocks=16, max_model_len=64, enable_prefix_caching=True,
                         max_num_seqs=6)
    assert engine.add_request("a", [1, 2, 3], params(n=2, max_tokens=2)) == 0
    assert engine.add_request("b", [4, 5], params(n=3, max_tokens=2)) == 2
    assert engine.add_request("c", [6], params()) == 5
    b = engine.schedule()
    assert b.sample_seq_ids.tolist() == [5, 0, 1, 2, 3, 4]  # c is a one-token row
    assert b.sample_indices.tolist() == [0, 3, 3, 5, 5, 5]
    r = engine.update(toks(10, 11, 12, 13, 14, 15))
    assert r.seq_ids.tolist() == [5, 0, 1, 2, 3, 4]
    assert engine.seq_token_ids(1) == [1, 2, 3, 12]
    assert engine.seq_token_ids(4) == [4, 5, 15]
    engine.check_invariants()
