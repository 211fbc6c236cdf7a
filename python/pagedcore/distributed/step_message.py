"""One engine step's batch as one int32 message, driver -> workers.

A worker's :class:`pagedcore.model_runner.ModelRunner` reads the same fields of
a step as the driver's (token ids, positions, slots, lengths, block tables,
sample rows, prompt-logprob rows, deferred inputs, block copies and swaps).
:func:`pack_step` writes them into one int32 buffer behind a fixed header;
:func:`unpack_step` gives numpy views of them (a :class:`StepArrays`, which
``execute`` takes in place of a :class:`pagedcore.StepBatch`).

The message travels in one broadcast of ``INLINE`` ints when it fits (every
decode step of up to a few hundred sequences with short tables), else in two
(the first ``INLINE`` ints, whose header gives the length, then the rest).
"""

from __future__ import annotations

import numpy as np

# Message kinds (header[0]).
STEP, LOGITS, SHUTDOWN = 1, 2, 3
# Header: kind, total length, previous-samples length, table width, the step's
# counts (_COUNTS), then the size of each array (_ARRAYS), in order.
_COUNTS = ("num_tokens", "num_seqs", "num_samples", "num_prompt_logprob_tokens", "num_deferred_inputs",
           "num_swap_out", "num_swap_in", "num_block_copies")
_ARRAYS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables",
           "sample_indices", "prompt_logprob_indices", "deferred_input_indices", "deferred_input_samples",
           "swap_out", "swap_in", "block_copies")
_PAIRS = ("swap_out", "swap_in", "block_copies")  # [n, 2]
HEADER = 4 + len(_COUNTS) + len(_ARRAYS)
# Ints in the first broadcast of every message (header included): 16 KiB.
INLINE = 4096


class StepArrays:
    """A step's arrays as :class:`pagedcore.StepBatch` names them (numpy views)."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def pack_step(batch: object, block_size: int, previous_len: int, buf: np.ndarray) -> np.ndarray:
    """The message of ``batch`` (a StepBatch) in ``buf`` (int32, grown when short:
    the buffer used is returned). ``previous_len``: the length of the previous
    step's sampled ids that follow on the device group (0: none)."""
    width = 0
    if batch.num_seqs:
        width = (int(batch.seq_lens.max()) + block_size - 1) // block_size
    parts = [getattr(batch, name) for name in _ARRAYS]
    parts[_ARRAYS.index("block_tables")] = batch.block_tables[:, :width]
    total = HEADER + sum(p.size for p in parts)
    if buf.size < max(total, INLINE):
        buf = np.zeros(max(total, 2 * buf.size, INLINE), dtype=np.int32)
    buf[:4] = (STEP, total, previous_len, width)
    buf[4:4 + len(_COUNTS)] = [getattr(batch, name) for name in _COUNTS]
    buf[4 + len(_COUNTS):HEADER] = [p.size for p in parts]
    at = HEADER
    for p in parts:
        buf[at:at + p.size] = p.reshape(-1)
        at += p.size
    return buf


def control_message(kind: int, *values: int) -> np.ndarray:
    """A header-only message (LOGITS: rows, hidden size; SHUTDOWN)."""
    buf = np.zeros(INLINE, dtype=np.int32)
    buf[0], buf[1] = kind, HEADER
    buf[2:2 + len(values)] = values
    return buf


def message_kind(buf: np.ndarray) -> int:
    return int(buf[0])


def message_len(buf: np.ndarray) -> int:
    return int(buf[1])


def header_values(buf: np.ndarray, count: int) -> list[int]:
    return [int(v) for v in buf[2:2 + count]]


def unpack_step(buf: np.ndarray) -> tuple[StepArrays, int]:
    """The step of a STEP message (views into ``buf``) and the previous-samples
    length that follows it."""
    previous_len, width = int(buf[2]), int(buf[3])
    fields: dict[str, object] = {name: int(v) for name, v in zip(_COUNTS, buf[4:4 + len(_COUNTS)])}
    at = HEADER
    for name, size in zip(_ARRAYS, buf[4 + len(_COUNTS):HEADER]):
        view = buf[at:at + int(size)]
        if name == "block_tables":
            view = view.reshape(-1, width) if width else view.reshape(fields["num_seqs"], 0)
        elif name in _PAIRS:
            view = view.reshape(-1, 2)
        fields[name] = view
        at += int(size)
    return StepArrays(**fields), previous_len
