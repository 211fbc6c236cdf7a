"""Helpers shared by the engine API tests: plain-list snapshots of step
batches and results, and one-step drivers."""

from __future__ import annotations

import numpy as np
import pagedcore
from pagedcore import FinishReason

NONE = int(FinishReason.NONE.value)
STOP = int(FinishReason.STOP.value)
LENGTH = int(FinishReason.LENGTH.value)
ABORT = int(FinishReason.ABORT.value)


def toks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def params(**kw) -> pagedcore.RequestParams:
    return pagedcore.RequestParams(**kw)


def batch_dict(b: pagedcore.StepBatch) -> dict:
    """The valid part of a batch as plain Python lists (block-table rows are
    cut to ceil(seq_len / block_size) entries, the rest is unspecified)."""
    tables = [
        b.block_tables[r, : -(-int(b.seq_lens[r]) // b.block_size)].tolist()
        for r in range(b.num_seqs)
    ]
    return {
        "num_tokens": b.num_tokens,
        "num_seqs": b.num_seqs,
        "num_decode_seqs": b.num_decode_seqs,
        "num_samples": b.num_samples,
        "input_ids": b.input_ids.tolist(),
        "positions": b.positions.tolist(),
        "slot_mapping": b.slot_mapping.tolist(),
        "seq_ids": b.seq_ids.tolist(),
        "query_start_loc": b.query_start_loc.tolist(),
        "num_computed_tokens": b.num_computed_tokens.tolist(),
        "seq_lens": b.seq_lens.tolist(),
        "block_tables": tables,
        "sample_indices": b.sample_indices.tolist(),
        "sample_seq_ids": b.sample_seq_ids.tolist(),
        "block_copies": b.block_copies.tolist(),
        "swap_out": b.swap_out.tolist(),
        "swap_in": b.swap_in.tolist(),
    }


def result_dict(r: pagedcore.StepResult) -> dict:
    return {
        "seq_ids": r.seq_ids.tolist(),
        "token_ids": r.token_ids.tolist(),
        "finish_reasons": r.finish_reasons.tolist(),
        "stop_reasons": r.stop_reasons.tolist(),
        "finished_request_ids": list(r.finished_request_ids),
    }


def step(engine: pagedcore.Engine, *sampled: int) -> tuple[dict, dict]:
    b = engine.schedule()
    bd = batch_dict(b)
    assert bd["num_samples"] == len(sampled), bd
    r = engine.update(toks(*sampled))
    engine.check_invariants()
    return bd, result_dict(r)


def stats(engine: pagedcore.Engine) -> dict:
    return pagedcore.stats_dict(engine.stats())


def tiny_engine(**kw) -> pagedcore.Engine:
    cfg = dict(num_blocks=8, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=32, enable_prefix_caching=False)
    cfg.update(kw)
    return pagedcore.Engine(**cfg)
