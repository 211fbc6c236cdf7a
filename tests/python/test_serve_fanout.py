"""The server's fan-out (server/async_engine.py) on a stub engine whose steps the
test releases one by one: a step's outputs for every stream cross to the event
loop in one call; a stream that was not read for several steps gets them all
in one batch, in order; outputs made before a failed step come out before
its error."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedcore.outputs import CompletionOutput, RequestOutput
from pagedcore.sampling_params import SamplingParams
from pagedcore.server import async_engine as ae
from stub_engines import StubEngine


class GatedEngine(StubEngine):
    """Each step waits for the test's release (once `wait_for` requests run),
    then gives every running request its next token: id k, text "<k>" for its
    k-th token, until max_tokens."""

    max_model_len = 64

    def __init__(self, wait_for: int = 1) -> None:
        super().__init__()
        self.wait_for = wait_for
        self.gate = threading.Semaphore(0)
        self.steps = 0
        self.fail_next = False

    def stats(self) -> dict:
        return {"num_waiting_seqs": 0}

    def step(self) -> list[RequestOutput]:
        if len(self.running) < self.wait_for:
            time.sleep(0.001)  # (the other adds are on their way)
            return []
        self.gate.acquire()
        if self.fail_next:  # as LLMEngine does: a failed step aborts every request
            self.running.clear()
            raise RuntimeError("boom")
        self.steps += 1
        return [self.output(request_id, k, done) for request_id, k, done, _ in self.advance()]


async def steps_done(engine: GatedEngine, n: int) -> None:
    """Waits until the stub has made n steps and the loop has run their fan-out."""
    while engine.steps < n:
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.05)


async def held(stream: ae.RequestStream, n: int) -> None:
    """Waits until n items wait unread in the stream: the engine thread has handed
    them over (on a loaded host that can come well after the stub made its steps)."""
    deadline = time.monotonic() + 30
    while len(stream._stream.items) < n:
        assert time.monotonic() < deadline, f"{len(stream._stream.items)} items reached the stream in 30 s, not {n}"
        await asyncio.sleep(0.002)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_one_hand_over_per_step_carries_every_streams_output(monkeypatch) -> None:
    calls: list[list] = []
    fan_out = ae._fan_out

    def recording(deliveries):
        calls.append([item for _, item in deliveries])
        fan_out(deliveries)

    monkeypatch.setattr(ae, "_fan_out", recording)
    stub = GatedEngine(wait_for=16)
    server = ae.AsyncEngine(stub)

    async def main() -> list[list[str]]:
        streams = await asyncio.gather(*[server.add(f"r{i}", None, [1, 2], params(4)) for i in range(16)])

        async def read(stream) -> list[str]:
            return [out.outputs[0].text async for out in stream]

        readers = [asyncio.create_task(read(s)) for s in streams]
        for n in range(1, 5):
            stub.gate.release()
            await steps_done(stub, n)
        return await asyncio.gather(*readers)

    try:
        texts = asyncio.run(main())
    finally:
        server.shutdown()
    assert texts == [["<1>", "<2>", "<3>", "<4>"]] * 16
    with_outputs = [c for c in calls if any(isinstance(item, RequestOutput) for item in c)]
    assert [len(c) for c in with_outputs] == [16, 16, 16, 16]  # one call per step, all 16 streams in it
    for k, call in enumerate(with_outputs, 1):
        assert sorted(out.request_id for out in call) == sorted(f"r{i}" for i in range(16))
        assert {out.outputs[0].token_ids[0] for out in call} == {k}


def test_a_stream_read_late_gets_every_step_since_in_one_batch() -> None:
    stub = GatedEngine()
    server = ae.AsyncEngine(stub)

    async def main() -> list[list[list[int]]]:
        stream = await server.add("r", None, [1, 2], params(8))
        for n in range(1, 6):  # five steps, nobody reading
            stub.gate.release()
        await held(stream, 5)  # (not a fixed sleep: the fan-out of the 5th step may come late)
        batches = stream.batches()
        first = [o.outputs[0].token_ids for o in await batches.__anext__()]
        for _ in range(3):
            stub.gate.release()
        await held(stream, 3)
        rest = [[o.outputs[0].token_ids for o in batch] async for batch in batches]
        return [first, *rest]

    try:
        got = asyncio.run(main())
    finally:
        server.shutdown()
    assert got == [[[1], [2], [3], [4], [5]], [[6], [7], [8]]]


def test_outputs_before_a_failed_step_come_out_before_its_error() -> None:
    stub = GatedEngine()
    server = ae.AsyncEngine(stub)

    async def main() -> tuple[list[str], BaseException | None, bool]:
        stream = await server.add("r", None, [1, 2], params(8))
        stub.gate.release()
        stub.gate.release()
        await steps_done(stub, 2)
        stub.fail_next = True
        stub.gate.release()
        await asyncio.sleep(0.1)
        seen: list[str] = []
        try:
            async for out in stream:
                seen.append(out.outputs[0].text)
        except RuntimeError as e:
            return seen, e, server.alive()
        return seen, None, server.alive()

    try:
        seen, error, alive = asyncio.run(main())
    finally:
        server.shutdown()
    assert seen == ["<1>", "<2>"]
    assert error is not None and str(error) == "engine step failed: boom"
    assert alive and server.errors == 1  # the engine thread lives on


def test_a_request_refused_by_the_engine_raises_from_add() -> None:
    stub = GatedEngine()

    def refuse(*args, **kwargs):
        raise ValueError("prompt too long")

    stub.add_request = refuse
    server = ae.AsyncEngine(stub)
    try:
        with pytest.raises(ValueError, match="prompt too long"):
            asyncio.run(server.add("r", None, [1], params(2)))
    finally:
        server.shutdown()


def test_outputs_cross_the_engine_process_pipe_unchanged() -> None:
    # What _PipeEngine._encode sends, the stream's _Rebuilder rebuilds: the prompt once (with
    # a request's first output), later plain deltas as tuples, anything else whole; taken
    # together (merge), a run of tuples is one output: the deltas joined.
    import copy
    import pickle

    from pagedcore.outputs import Logprob
    from pagedcore.server import engine_process as ep

    def out(rid, text, ids, finished=False, n=1, logprobs=None, reason=None):
        return RequestOutput(rid, "the prompt", [5, 6, 7], [
            CompletionOutput(j, text, ids, -1.5, logprobs, reason, None) for j in range(n)], finished)

    sequence = [
        ("a", out("a", " x", [11])),                      # a's first output: whole, with the prompt
        ("b", out("b", " y", [12], finished=True, reason="length")),  # first and last at once
        ("a", out("a", " z", [13])),                      # a plain delta
        ("c", out("c", " u", [14], n=2)),
        ("c", out("c", " v", [15], n=2)),                 # two completions: whole, prompt dropped
        ("d", out("d", " w", [16])),
        ("d", out("d", " q", [17], logprobs=[{17: Logprob(-0.5, 1, " q")}])),  # logprobs: whole
        ("a", out("a", " s", [18])),
        ("a", out("a", "", [2], finished=True, reason="stop")),
    ]
    sender = ep._PipeEngine.__new__(ep._PipeEngine)  # (its encoder alone: no engine thread)
    sender._started = set()
    wires: dict[str, list] = {}
    for rid, item in sequence:
        wires.setdefault(rid, []).append(pickle.loads(pickle.dumps(sender._encode(rid, copy.deepcopy(item)))))
    assert [w.__class__ is tuple for w in wires["a"]] == [False, True, True, True]
    for rid in wires:  # one at a time: each output as it was
        rebuild = ep._Rebuilder(rid)
        got = [o for w in wires[rid] for o in rebuild([copy.deepcopy(w)], merge=False)]
        assert got == [item for r, item in sequence if r == rid], rid
    # a's outputs taken at once: its first output, then its three plain deltas as one.
    merged = ep._Rebuilder("a")(copy.deepcopy(wires["a"]), merge=True)
    assert merged == [sequence[0][1], RequestOutput("a", "the prompt", [5, 6, 7], [
        CompletionOutput(0, " z s", [13, 18, 2], -1.5, None, "stop", None)], True)]


def _counting_engine(engine_args) -> StubEngine:
    """(in the engine process) Each step of ~1 ms gives every request its next
    token: id k, text "<k>" for its k-th token, until max_tokens."""
    return StubEngine()


def test_every_step_reaches_a_stream_whose_event_loop_stalled_while_the_engine_process_ran() -> None:
    # The HTTP side's loop is blocked while the engine process makes its 150 steps:
    # ~150 messages wait in the pipe, more than the loop reads at one wake-up. The
    # stream must get every token, in order, merged, and no error.
    from pagedcore.server.engine_process import EngineProcess

    engine = EngineProcess(None, engine_factory=_counting_engine)

    async def main() -> tuple[list[int], str, bool]:
        stream = await engine.add("r", None, [1, 2], params(150))
        time.sleep(1.5)  # (blocks the loop: nothing is read from the pipe meanwhile; 150 steps take ~0.2 s)
        ids, text, finished = [], "", False
        async for out in stream.merged():
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
            finished = out.finished
        return ids, text, finished

    try:
        ids, text, finished = asyncio.run(main())
    finally:
        engine.shutdown()
    assert ids == list(range(1, 151)) and finished
    assert text == "".join(f"<{k}>" for k in range(1, 151))


class ScriptedPrefillEngine(StubEngine):
    """StubEngine whose i-th step reports script[i] prompt tokens scheduled
    (LLMEngine.step_prompt_tokens), pipelined or not (LLMEngine.pipelined)."""

    def __init__(self, script: list[int], pipelined: bool) -> None:
        super().__init__()
        self.script, self.pipelined, self.step_prompt_tokens = script, pipelined, 0

    def step(self) -> list[RequestOutput]:
        self.step_prompt_tokens = self.script.pop(0)
        return super().step()


@pytest.mark.parametrize("pipelined, prefill_steps", [(False, 3), (True, 5)])
def test_steps_count_as_prefill_when_prompt_tokens_ran_in_them_or_pipelined_in_the_step_before(
        pipelined, prefill_steps) -> None:
    # Prompt tokens per step: 0, 40, 0, 0, 16, 16, 0, 0 (a 16-token chunk gives no first
    # token; the stats never show one). Unpipelined, the steps with prompt tokens are
    # prefill steps: 3. Pipelined, a call waits for the previous call's forward pass
    # too: steps 2, 3, 5, 6, 7: 5.
    script = [0, 40, 0, 0, 16, 16, 0, 0]
    stub = ScriptedPrefillEngine(list(script), pipelined)
    server = ae.AsyncEngine(stub)

    async def main() -> None:
        stream = await server.add("r", None, [1, 2], params(len(script)))
        async for _ in stream:
            pass

    try:
        asyncio.run(main())
        while sum(server.step_times.counts["decode"]) + sum(server.step_times.counts["prefill"]) < len(script):
            time.sleep(0.01)  # (the last step's count comes right after its outputs)
    finally:
        server.shutdown()
    assert sum(server.step_times.counts["prefill"]) == prefill_steps
    assert sum(server.step_times.counts["decode"]) == len(script) - prefill_steps


def test_the_engine_stats_count_garbage_collections_per_generation() -> None:
    # Collections made here, by generation, counted against gc.get_stats() (the
    # interpreter's own counts).
    import gc

    times = ae.gc_times()
    before_counts, _ = times.snapshot()
    before_stats = [s["collections"] for s in gc.get_stats()]
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    counts, seconds = times.snapshot()
    want = [s["collections"] - b for s, b in zip(gc.get_stats(), before_stats)]
    assert [c - b for c, b in zip(counts, before_counts)] == want
    assert want[0] >= 1 and want[2] == 2
    assert all(s >= 0 for s in seconds) and seconds[2] > 0
