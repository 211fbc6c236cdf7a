"""The engine process's channels (server/engine_process.py) on a stub engine
whose k-th token of every request is 100 + k: plain streams cross as compact
rows and reach their stream in order, with their text made on the HTTP side;
a stream that is not plain (logprobs) crosses as RequestOutputs; with two
channels (api_server_count=2) each HTTP side gets its own requests' tokens
only; an aborted stream gets nothing more, and its engine request ends; a
channel's shutdown detaches it (its requests end with EngineDeadError) while
the other channel goes on."""

from __future__ import annotations

import asyncio

import pytest

from pagedcore.sampling_params import SamplingParams
from stub_engines import CompactStubEngine

pytest.importorskip("transformers")


class StubCompactEngine(CompactStubEngine):
    """(in the engine process) The k-th token of every request is 100 + k; the
    stats tell the aborted requests and how many objects the process froze."""

    first_token = 101

    def stats(self) -> dict:
        import gc

        return {"num_requests": len(self.running), "aborted": list(self.aborted), "frozen": gc.get_freeze_count()}


def _stub(engine_args) -> StubCompactEngine:
    return StubCompactEngine()


@pytest.fixture(scope="module")
def tokenizer_path() -> str:
    from pagedcore import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def channels(tokenizer_path):
    """An engine process with two channels, both used from this process (the
    second through channel 1's pipes as they are); the last test detaches it."""
    from pagedcore.server.engine_process import EngineProcess

    main = EngineProcess(None, engine_factory=_stub, api_server_count=2, tokenizer_path=tokenizer_path)
    [channel] = main.worker_channels()
    other = EngineProcess.attach(channel)
    try:
        yield main, other
    finally:
        other.shutdown()
        main.shutdown()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def read(stream) -> tuple[list[int], str, str | None]:
    ids, text, reason = [], "", None
    async for out in stream.merged():
        ids += out.outputs[0].token_ids
        text += out.outputs[0].text
        reason = out.outputs[0].finish_reason
    return ids, text, reason


def test_two_channels_each_get_their_own_streams_compact_and_not(channels, tokenizer_path) -> None:
    import transformers

    main, other = channels
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)

    async def run() -> tuple[list, list]:
        streams = []
        for i in range(6):
            client = (main, other)[i % 2]
            params = greedy(20 + i, logprobs=1) if i == 4 else greedy(20 + i)  # (4: not plain)
            streams.append(await client.add(f"r{i}", None, [5, 6, 7], params))
        got = await asyncio.wait_for(asyncio.gather(*[read(s) for s in streams]), 30)
        return got, [type(s._stream).__name__ for s in streams]

    got, kinds = asyncio.run(run())
    assert main._compact_streams == {} and other._compact_streams == {}  # (finished: forgotten)
    # The engine process froze its start-up objects (a full collection walks only what came after).
    assert main.stats["frozen"] > 10000
    assert kinds == ["_CompactStream"] * 4 + ["_Stream", "_CompactStream"]
    for i, (ids, text, reason) in enumerate(got):
        assert ids == [100 + k for k in range(1, 21 + i)], i
        assert reason == "length"
        assert text == tokenizer.decode(ids), i  # (made on the HTTP side, r4's too: it has no stop strings)


def test_an_aborted_stream_ends_its_request_and_a_detached_channel_leaves_the_other_serving(channels) -> None:
    from pagedcore.server.async_engine import EngineDeadError

    main, other = channels

    async def run() -> dict:
        result = {}
        gone = await main.add("gone", None, [5], greedy(100000))
        batches = gone.merged()
        await batches.__anext__()
        await batches.aclose()  # (leaving the stream aborts the request)
        long_ = await other.add("long", None, [5], greedy(100000))
        reader = asyncio.create_task(read(long_))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(other.shutdown)  # the other HTTP process goes: its request ends
        try:
            await asyncio.wait_for(reader, 30)
        except EngineDeadError as e:
            result["cut"] = str(e)
        # The engine goes on for this channel (its stats come with its outputs, now after the detach).
        short = await main.add("short", None, [5], greedy(40))
        result["short"] = await asyncio.wait_for(read(short), 30)
        result["aborted"] = main.stats["aborted"]
        return result

    result = asyncio.run(run())
    assert result["cut"] == "server shutting down"
    assert result["short"][0] == [100 + k for k in range(1, 41)]
    assert result["aborted"] == ["gone", "long"]


class StatsHeavyEngine(StubCompactEngine):
    """(in the engine process) Stats of ~20 kB that change every step: every
    step's message to every channel carries them."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def step(self):
        self.steps += 1
        return super().step()

    def stats(self) -> dict:
        return {"steps": self.steps, "pad": "x" * 20_000}


def _stats_heavy(engine_args) -> StatsHeavyEngine:
    return StatsHeavyEngine()


def test_a_closed_main_channel_leaves_the_other_channels_outputs_flowing(tokenizer_path) -> None:
    # serve --api-server-count 2, SIGTERM: the main HTTP process's server stops once its
    # own requests are done, and nothing reads its channel any more, while the other HTTP
    # process drains its streams. The engine process's one sender thread writes every
    # step's stats to every channel: without close_channel() the main channel's pipe fills
    # (1 MiB: ~50 steps here) and the sender blocks on it, so the other channel's stream
    # stalled until the main process gave up on it (test_serving_load.py's SIGTERM test:
    # cut after 25 s instead of 5, now and then). Here the main channel is never read.
    from pagedcore.server.engine_process import EngineProcess

    main = EngineProcess(None, engine_factory=_stats_heavy, api_server_count=2, tokenizer_path=tokenizer_path)
    [channel] = main.worker_channels()
    other = EngineProcess.attach(channel)
    try:
        main.close_channel()
        main.close_channel()  # (a no-op the second time)

        async def run() -> list[int]:
            long_ = await other.add("long", None, [5], greedy(2000))  # ~2000 steps of ~20 kB stats each
            return (await asyncio.wait_for(read(long_), 30))[0]

        assert asyncio.run(run()) == [100 + k for k in range(1, 2001)]
        assert other.stats["steps"] >= 2000
    finally:
        other.shutdown()
        main.shutdown()
    assert main._proc.exitcode == 0
