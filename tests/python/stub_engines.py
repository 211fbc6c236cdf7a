"""Stub engines for the server's tests (test_serve_fanout.py,
test_engine_channels.py): what AsyncEngine and the engine process use of
LLMEngine, with no model. Each step gives every running request its next
token (its k-th: ``first_token + k - 1``) until its max_tokens."""

from __future__ import annotations

import time

import numpy as np

from pagedcore.compact_outputs import CompactOutputs
from pagedcore.outputs import CompletionOutput, RequestOutput


class StubEngine:
    """Requests run until max_tokens; a step (~``step_s``) gives each its next
    token as a RequestOutput (text ``"<k>"`` for its k-th token)."""

    tokenizer = None
    max_model_len = 4096
    first_token = 1  # the id of every request's first token (then +1 a step)
    step_s = 0.001

    def __init__(self) -> None:
        # request id -> [tokens so far, max_tokens, compact key or None]
        self.running: dict[str, list] = {}
        self.aborted: list[str] = []

    def stats(self) -> dict:
        return {"num_requests": len(self.running)}

    def add_request(self, request_id, prompt, prompt_token_ids, params, stream=True, add_special_tokens=True,
                    detokenize=True, compact_key=None):
        self.running[request_id] = [0, params.max_tokens, compact_key]

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.running

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def advance(self) -> list[tuple[str, int, bool, int | None]]:
        """(request id, k, done, compact key) for every running request, which
        takes its k-th token; done requests are forgotten."""
        moved = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            moved.append((request_id, state[0], done, state[2]))
            if done:
                del self.running[request_id]
        return moved

    def output(self, request_id: str, k: int, done: bool) -> RequestOutput:
        return RequestOutput(request_id, None, [1], [CompletionOutput(
            0, f"<{k}>", [self.first_token + k - 1], None, None, "length" if done else None)], done)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        return [self.output(request_id, k, done) for request_id, k, done, _ in self.advance()]


class CompactStubEngine(StubEngine):
    """StubEngine whose requests added with a compact_key come out as rows of
    take_compact_outputs() (finish code 2, length), not as RequestOutputs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[CompactOutputs] = []

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outs, keys, tokens, finish = [], [], [], []
        for request_id, k, done, key in self.advance():
            if key is None:
                outs.append(self.output(request_id, k, done))
                continue
            keys.append(key)
            tokens.append(self.first_token + k - 1)
            finish.append(2 if done else 0)
        if keys:
            self.rows.append(CompactOutputs(np.array(keys, dtype=np.int64), np.array(tokens, dtype=np.int32),
                                            np.array(finish, dtype=np.uint8), np.full(len(keys), -1, np.int32)))
        return outs

    def take_compact_outputs(self) -> CompactOutputs | None:
        rows, self.rows = self.rows, []
        return CompactOutputs.concat(rows) if rows else None
