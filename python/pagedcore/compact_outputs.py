"""A step's new tokens of plain streamed requests as four arrays, not objects.

The server streams most requests with nothing but token ids from the engine
(one sample, no logprobs, no stop strings or penalties or output constraint:
the HTTP side turns the ids into text). For those the engine needs no
``RequestOutput`` per request and step: ``LLMEngine.add_request(...,
compact_key=K)`` names such a request by an integer, and each step's tokens of
all of them come out of ``LLMEngine.take_compact_outputs()`` as the rows of
:class:`CompactOutputs`, which cross a pipe as four byte strings
(:meth:`CompactOutputs.to_bytes`). The rows are chosen with numpy, so a
step's cost in Python does not grow with the number of such streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from .sampling_params import SamplingParams

# finish codes (the engine's FinishReason): 0 running, 1 stop, 2 length, 3 abort
FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}


class CompactOutputs(NamedTuple):
    """One row per new token, in the order the engine produced them.

    keys : int64 [rows], the compact_key of the token's request
    token_ids : int32 [rows]
    finish : uint8 [rows], 0 while the request runs, else its finish code
        (:data:`FINISH_REASONS`); the row that finishes a request is its last
    stop_reasons : int32 [rows], the stop token that finished it, else -1
    """

    keys: np.ndarray
    token_ids: np.ndarray
    finish: np.ndarray
    stop_reasons: np.ndarray

    def __len__(self) -> int:  # (rows, not fields)
        return int(self.keys.shape[0])

    @staticmethod
    def concat(parts: list[CompactOutputs]) -> CompactOutputs:
        if len(parts) == 1:
            return parts[0]
        return CompactOutputs(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def rows(self) -> Iterator[tuple[int, int, int, int]]:
        """The rows in order as (key, token_id, finish, stop_reason) tuples of
        Python ints. NOTE: each array goes through ``tolist()`` once: the server's
        per-row delivery loops look keys up in dicts, where numpy scalars would
        cost a conversion per row."""
        return zip(self.keys.tolist(), self.token_ids.tolist(), self.finish.tolist(), self.stop_reasons.tolist())

    def select(self, mask: np.ndarray) -> CompactOutputs:
        return CompactOutputs(self.keys[mask], self.token_ids[mask], self.finish[mask], self.stop_reasons[mask])

    def to_bytes(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.keys.tobytes(), self.token_ids.tobytes(), self.finish.tobytes(), self.stop_reasons.tobytes())

    @staticmethod
    def from_bytes(raw: tuple[bytes, bytes, bytes, bytes]) -> CompactOutputs:
        return CompactOutputs(np.frombuffer(raw[0], dtype=np.int64), np.frombuffer(raw[1], dtype=np.int32),
                              np.frombuffer(raw[2], dtype=np.uint8), np.frombuffer(raw[3], dtype=np.int32))


def compact_eligible(params: SamplingParams) -> bool:
    """Whether a streamed request whose text the caller makes may be compact:
    the engine keeps nothing per token for it in Python (one sample; no
    logprobs, prompt logprobs, stop strings, penalties or output constraint)."""
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None and not params.stop
            and params.structured_outputs is None and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1)
