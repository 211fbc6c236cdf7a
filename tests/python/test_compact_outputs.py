"""LLMEngine's compact outputs (compact_outputs.py): a streamed request added with
a compact_key gives its tokens as rows of arrays from take_compact_outputs(),
not as RequestOutputs from step(); the rows are transformers' greedy tokens on
the same weights, a request's last row carries its finish, and a request
aborted mid-way gives no row after the abort, also when a new request takes
its slot while a step that held it is in flight (async output processing and
async scheduling, which the CPU runs when asked)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from pagedcore import SamplingParams  # noqa: E402
from pagedcore.compact_outputs import CompactOutputs, compact_eligible  # noqa: E402
from pagedcore.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from test_models_hf import hf_greedy, make_checkpoint, prompts  # noqa: E402

MODES = {"sync": dict(async_output_proc=False), "async-output": dict(async_output_proc=True),
         "async-scheduling": dict(async_scheduling=True, async_output_proc=True)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("compact"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[int, list[int]]:
    return {i: hf_greedy(checkpoint, p, 12)[0] for i, p in enumerate(prompts())}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_compact_rows_are_the_greedy_tokens_and_an_abort_ends_them(mode, checkpoint, reference) -> None:
    from pagedcore import default_model_path

    engine = LLMEngine(EngineArgs(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=64,
                                  max_model_len=256, **MODES[mode]))
    ps = prompts()
    # Compact requests under keys 10, 11, 12; request "plain" streams as RequestOutputs.
    engine.add_request("a", None, ps[0], greedy(12), stream=True, detokenize=False, compact_key=10)
    engine.add_request("b", None, ps[1], greedy(12), stream=True, detokenize=False, compact_key=11)
    engine.add_request("plain", None, ps[2], greedy(12), stream=True, detokenize=False)
    rows: list[CompactOutputs] = []
    plain: list[int] = []
    steps = 0

    def step() -> None:
        for out in engine.step():
            assert out.request_id == "plain"  # (compact requests give no RequestOutput)
            plain.extend(out.outputs[0].token_ids)
        got = engine.take_compact_outputs()
        if got is not None:
            rows.append(got)

    while steps < 5:
        step()
        steps += 1
    # b aborted mid-way; c takes the slot it frees (while a step that held b may be in flight).
    before_abort = len(rows)
    engine.abort("b")
    engine.add_request("c", None, ps[3], greedy(12), stream=True, detokenize=False, compact_key=12)
    while engine.has_unfinished_requests():
        step()
    out = CompactOutputs.concat(rows)
    by_key = {k: out.token_ids[out.keys == k].tolist() for k in (10, 11, 12)}
    assert by_key[10] == reference[0]
    assert by_key[12] == reference[3]
    assert 0 < len(by_key[11]) < 12 and by_key[11] == reference[1][:len(by_key[11])]
    assert plain == reference[2]
    # The last row of a and c finishes them (length), no other row does.
    for key in (10, 12):
        assert out.finish[out.keys == key].tolist() == [0] * 11 + [2]
    assert not out.finish[out.keys == 11].any()
    after_abort = CompactOutputs.concat(rows[before_abort:])
    assert 11 not in after_abort.keys.tolist()  # (the step in flight at the abort held a token of b)
    assert (out.stop_reasons == -1).all()
    assert out.keys.dtype == np.int64 and out.token_ids.dtype == np.int32 and out.finish.dtype == np.uint8
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.has_unfinished_requests()
    # The rows cross a pipe as bytes and come back equal.
    back = CompactOutputs.from_bytes(out.to_bytes())
    assert all(np.array_equal(a, b) for a, b in zip(back, out))


def test_rows_give_each_rows_four_fields_as_python_ints() -> None:
    out = CompactOutputs(np.array([10, 11, 10], dtype=np.int64), np.array([5, 7, 9], dtype=np.int32),
                         np.array([0, 2, 1], dtype=np.uint8), np.array([-1, -1, 9], dtype=np.int32))
    got = list(out.rows())
    assert got == [(10, 5, 0, -1), (11, 7, 2, -1), (10, 9, 1, 9)]
    assert all(type(x) is int for row in got for x in row)


def test_a_stop_token_finishes_a_compact_request_with_its_stop_reason(checkpoint, reference) -> None:
    from pagedcore import default_model_path

    engine = LLMEngine(EngineArgs(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=64,
                                  max_model_len=256))
    stop_at = reference[0][4]  # the 5th greedy token (its first occurrence ends it)
    first = reference[0].index(stop_at)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at])
    engine.add_request("a", None, prompts()[0], params, stream=True, detokenize=False, compact_key=0)
    while engine.has_unfinished_requests():
        assert engine.step() == []
    out = engine.take_compact_outputs()
    assert out.token_ids.tolist() == reference[0][:first + 1]
    assert out.finish.tolist() == [0] * first + [1] and out.stop_reasons.tolist() == [-1] * first + [stop_at]
    assert engine.take_compact_outputs() is None


@pytest.fixture(scope="module")
def small_engine(checkpoint) -> LLMEngine:
    from pagedcore import default_model_path

    return LLMEngine(EngineArgs(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=16,
                                max_model_len=128))


@pytest.mark.parametrize("params, kwargs", [
    (SamplingParams(n=2), {}), (SamplingParams(logprobs=1), {}), (SamplingParams(prompt_logprobs=1), {}),
    (SamplingParams(presence_penalty=0.5), {}), (SamplingParams(repetition_penalty=1.1), {}),
    (SamplingParams(), {"detokenize": True}), (SamplingParams(), {"compact_key": -1}),
    (SamplingParams(), {"compact_key": True}),
])
def test_compact_key_is_refused_where_the_engine_needs_more_than_token_ids(params, kwargs, small_engine) -> None:
    kw = {"detokenize": False, "compact_key": 3, **kwargs}
    with pytest.raises(ValueError, match="compact_key"):
        small_engine.add_request("r", None, [5, 6, 7], params, stream=True, **kw)
    assert not small_engine.has_unfinished_requests()
    assert compact_eligible(SamplingParams(seed=3, min_tokens=2, stop_token_ids=[4], temperature=0.7))


@pytest.mark.parametrize("mode", ["thread", "engine-process"])
def test_the_servers_plain_streams_are_the_greedy_tokens_and_their_text(mode, checkpoint, reference) -> None:
    # The server's engine (a thread, or a process of its own) streams plain requests as
    # compact rows; a stream's tokens are transformers' greedy ones, its text theirs.
    import asyncio

    import transformers

    from pagedcore import default_model_path
    from pagedcore.server.async_engine import AsyncEngine, _CompactStream
    from pagedcore.server.engine_process import EngineProcess

    args = EngineArgs(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=64, max_model_len=256)
    engine = AsyncEngine(LLMEngine(args)) if mode == "thread" else EngineProcess(args)
    ps = prompts()

    async def run() -> list:
        streams = [await engine.add(f"r{i}", None, p, greedy(12)) for i, p in enumerate(ps)]
        assert all(type(s._stream) is _CompactStream for s in streams)

        async def read(stream):
            ids, text = [], ""
            async for out in stream.merged():
                ids += out.outputs[0].token_ids
                text += out.outputs[0].text
            return ids, text, out.outputs[0].finish_reason

        return await asyncio.wait_for(asyncio.gather(*[read(s) for s in streams]), 60)

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    for i, (ids, text, reason) in enumerate(got):
        assert ids == reference[i], i
        assert text == tokenizer.decode(ids, skip_special_tokens=True) and reason == "length", i
