"""Async output processing (step n's outputs made while step n+1 runs) against the
same engine processing every step before the next: the real default model on the
CPU, where ``async_output_proc=True`` runs the same code path the GPU uses by
default (only without the overlap)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")

import pagedcore  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "The history of the printing press",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "The three primary colors are",
    "自作PCで80万円の予算ならどんな構成がベスト?",
]


@pytest.fixture(scope="module")
def llms() -> dict[bool, LLM]:
    path = pagedcore.default_model_path()
    return {
        mode: LLM(model=path, num_kv_blocks=256, max_model_len=512, max_num_seqs=16, async_output_proc=mode)
        for mode in (False, True)
    }


def as_tuple(out) -> tuple:
    return tuple(
        (c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
         None if c.logprobs is None else tuple(tuple(sorted((t, lp.logprob, lp.rank, lp.decoded_token)
                                                            for t, lp in entry.items()))
                                              for entry in c.logprobs))
        for c in out.outputs
    )


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    stats = llm.stats()
    assert not engine.has_unfinished_requests() and not engine.engine.has_unfinished_requests()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_generate_is_the_same_with_async_output_processing(llms) -> None:
    sync, async_ = llms[False], llms[True]
    assert (sync.llm_engine._async_output, async_.llm_engine._async_output) == (False, True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = sync.generate(PROMPTS, greedy, use_tqdm=False)
    # A stop string early in each greedy text: it ends the sequence while (with
    # async processing) the next step, which holds it, is already running.
    stops = [out.outputs[0].text[6:10] for out in base]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[s]) for s in stops]
    params += [
        SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=16, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=16, presence_penalty=0.5, frequency_penalty=0.4,
                       repetition_penalty=1.3, stop=[stops[0]]),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop=[stops[1]]),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[base[2].outputs[0].token_ids[4]]),
        # Samples of one request that stop strings end at different steps: the
        # request lives on after the first one ends.
        SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=24, stop=["e"]),
    ]
    prompts = PROMPTS + PROMPTS[:5]
    results = {}
    for mode, llm in llms.items():
        before = llm.stats()["num_generation_tokens"]
        results[mode] = (llm.generate(prompts, params, use_tqdm=False), llm.stats()["num_generation_tokens"] - before)
        assert_idle(llm)
    (sync_out, sync_tokens), (async_out, async_tokens) = results[False], results[True]
    assert [as_tuple(o) for o in async_out] == [as_tuple(o) for o in sync_out]
    ended_by_strings = [c for o in sync_out for c in o.outputs if isinstance(c.stop_reason, str)]
    assert len(ended_by_strings) >= len(PROMPTS)
    assert all(len(c.token_ids) < 24 for c in ended_by_strings)
    samples = sync_out[-1].outputs
    assert all(c.stop_reason == "e" for c in samples) and len({len(c.token_ids) for c in samples}) > 1
    # Each sequence a stop string ended ran one step more with async processing; that
    # token went to the engine (and was dropped from the output), no other did.
    assert async_tokens - sync_tokens == len(ended_by_strings)


def run_engine(llm: LLM, requests, abort_after: dict[str, int]) -> dict[str, list]:
    """Drives LLMEngine.step() by hand; aborts request r after abort_after[r] steps."""
    engine = llm.llm_engine
    for request_id, prompt, params, stream in requests:
        engine.add_request(request_id, prompt, None, params, stream=stream)
    outputs: dict[str, list] = {r[0]: [] for r in requests}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        for request_id, after in abort_after.items():
            if steps == after:
                aborted = engine.abort(request_id)
                if aborted is not None:
                    outputs[request_id].append(aborted)
    return outputs


def test_streams_and_aborts_while_a_step_is_in_flight(llms) -> None:
    text = "The history of the printing press"
    requests = [
        # Its 2nd token ends it in the engine (length) in the step that an abort
        # after two steps completes: the abort must not ask the engine for it again.
        ("short", text, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), False),
        ("aborted", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), True),
        ("stream", PROMPTS[2], SamplingParams(temperature=0, max_tokens=24), True),
        ("kept", PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), False),
    ]
    base = llms[False].generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    requests[2][2].stop = [base[0].outputs[0].text[8:12]]
    got = {mode: run_engine(llm, requests, {"short": 2, "aborted": 4}) for mode, llm in llms.items()}
    for mode, llm in llms.items():
        assert_idle(llm)
        out = got[mode]
        assert [o.finished for o in out["short"]] == [True] and out["aborted"][-1].finished
        assert out["aborted"][-1].outputs[0].finish_reason == "abort"
    sync, async_ = got[False], got[True]
    # The short request: finished by length on its own step in the synchronous
    # engine, aborted before its last token was processed in the asynchronous one.
    assert sync["short"][0].outputs[0].finish_reason == "length"
    assert async_["short"][0].outputs[0].finish_reason == "abort"
    assert async_["short"][0].outputs[0].token_ids == sync["short"][0].outputs[0].token_ids[:1]
    for request_id in ("stream", "kept"):
        assert [as_tuple(o) for o in async_[request_id]] == [as_tuple(o) for o in sync[request_id]]
    streamed = {mode: "".join(o.outputs[0].text for o in got[mode]["stream"]) for mode in got}
    assert streamed[True] == streamed[False] == base[0].outputs[0].text[: base[0].outputs[0].text.index(
        requests[2][2].stop[0])]
    assert got[True]["stream"][-1].outputs[0].stop_reason == requests[2][2].stop[0]
    # Streamed deltas come one step later, never lost: the same tokens in all.
    tokens = {mode: [t for o in got[mode]["aborted"] for t in o.outputs[0].token_ids] for mode in got}
    assert tokens[True] == tokens[False][: len(tokens[True])] and len(tokens[True]) >= 2


def test_bad_async_output_proc_names_the_field() -> None:
    from pagedcore.llm_engine import EngineArgs

    with pytest.raises(ValueError, match="async_output_proc must be True, False or None, got 'yes'"):
        EngineArgs(model="x", async_output_proc="yes").validate()


class Boom(RuntimeError):
    pass


def failing_sampler(llm: LLM, when):
    """Replaces the engine's sampler by one that raises Boom when ``when(call)``."""
    engine = llm.llm_engine
    sampler, calls = engine.sampler, [0]

    def sample(*args, **kwargs):
        calls[0] += 1
        if when(calls[0]):
            raise Boom(f"sampler call {calls[0]}")
        return sampler(*args, **kwargs)

    engine.sampler = sample
    return sampler


@pytest.mark.parametrize("mode", [False, True])
def test_a_failed_step_aborts_everything_and_the_engine_stays_usable(llms, mode) -> None:
    llm = llms[mode]
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    # The placeholder tokens of the failed step end "short" in the engine (its 3rd
    # token is its last): aborting it must not ask the engine for it again.
    engine.add_request("short", PROMPTS[0], None, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("long", PROMPTS[1], None, params, stream=True)
    original = failing_sampler(llm, lambda call: call == 3)
    try:
        with pytest.raises(Boom, match="sampler call 3"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.sampler = original
    assert_idle(llm)
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [as_tuple(o) for o in again] == [as_tuple(o) for o in expected]


def add_stopped_and_other(llm: LLM, request_id: str) -> str:
    """Adds ``request_id``, which a stop string early in its greedy text ends, and
    "other", which runs 24 tokens; returns the stop string."""
    base = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    stop = base[0].outputs[0].text[6:10]
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPTS[0], None, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    engine.add_request("other", PROMPTS[1], None, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return stop


def test_a_step_failing_after_a_late_stop_finishes_that_sequence_too(llms) -> None:
    llm = llms[True]
    engine = llm.llm_engine
    add_stopped_and_other(llm, "stopped")
    # Raise in the step whose processing found the stop string: the sequence is done
    # in Python and still held by the step that fails.
    original = failing_sampler(llm, lambda call: bool(engine._late_stops))
    try:
        with pytest.raises(Boom):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.sampler = original
    assert_idle(llm)


@pytest.mark.parametrize("mode", [False, True])
def test_request_ids_are_free_once_the_final_output_is_returned(llms, mode) -> None:
    llm = llms[mode]
    engine = llm.llm_engine
    stop = add_stopped_and_other(llm, "r")
    with pytest.raises(ValueError, match="request_id 'other' is already in use"):
        engine.add_request("other", PROMPTS[2], None, SamplingParams())
    done = []
    while not done:
        done = [o for o in engine.step() if o.request_id == "r"]
    assert done[0].outputs[0].stop_reason == stop
    # With async processing the engine still holds "r" here (its sequence is in the
    # step in flight); the id is the caller's again all the same.
    engine.add_request("r", PROMPTS[2], None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert len(outs["r"].outputs[0].token_ids) == 4 and len(outs["other"].outputs[0].token_ids) == 24
    assert_idle(llm)


def test_server_loop_reports_a_step_that_fails_under_an_abort(llms) -> None:
    # A client disconnects (abort) while the step in flight fails: the abort completes
    # that step first, so its failure surfaces in the abort; the other stream must get
    # the error, and the engine thread must live on.
    import asyncio

    from pagedcore.server.async_engine import AsyncEngine

    llm = llms[True]
    engine = llm.llm_engine
    sampler, calls, holder = engine.sampler, [0], {}

    def nan_on_the_third_step(*args, **kwargs):
        out = sampler(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            out.sampled_token_ids[:] = -1  # the sampler's mark of NaN logits
            holder["server"].abort("a")  # applied before the next step
        return out

    engine.sampler = nan_on_the_third_step
    step = engine.step

    def first_step_once_b_is_queued():
        # NOTE: b must run in the step that fails. The event loop sends b's add after a's
        # verdict, while the engine steps a: a loaded host's loop can be 3 steps late.
        # So the first step waits for b's add (30 s at most) and makes none.
        engine.step = step
        deadline = time.monotonic() + 30
        server = holder["server"]
        while not (server._pending or "b" in server._streams) and time.monotonic() < deadline:
            time.sleep(0.001)
        return []

    engine.step = first_step_once_b_is_queued

    async def main() -> None:
        server = holder["server"] = AsyncEngine(engine)
        try:
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            await server.add("a", PROMPTS[0], None, params)
            b = await server.add("b", PROMPTS[1], None, params)
            with pytest.raises(RuntimeError, match="engine step failed: the model produced logits") as err:
                async def drain():
                    async for _ in b:
                        pass
                await asyncio.wait_for(drain(), 60)
            assert server.alive() and server.errors == 1 and "NaN" in str(err.value)
        finally:
            server.shutdown()

    try:
        asyncio.run(main())
    finally:
        engine.sampler = sampler
        vars(engine).pop("step", None)
    assert_idle(llm)


def test_a_top_k_beyond_int32_means_no_top_k(llms) -> None:
    # The slot arrays hold int32: a larger top_k is clamped (it keeps every token
    # either way) instead of failing half-way through add_request.
    llm = llms[False]
    params = dict(temperature=0.9, seed=4, max_tokens=8, ignore_eos=True)
    huge = llm.generate(PROMPTS[:2], SamplingParams(top_k=2**40, **params), use_tqdm=False)
    plain = llm.generate(PROMPTS[:2], SamplingParams(**params), use_tqdm=False)
    assert [as_tuple(o) for o in huge] == [as_tuple(o) for o in plain]
    assert_idle(llm)


def test_a_late_stop_of_a_sequence_the_next_step_ends_anyway(llms) -> None:
    # The stop string completes one token before max_tokens: the step in flight
    # also ends the sequence (length), so the engine must not be asked to finish it.
    tok = llms[False].get_tokenizer()
    base = llms[False].generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ids, text = base[0].outputs[0].token_ids, base[0].outputs[0].text
    stop = text[6:10]
    m = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    params = SamplingParams(temperature=0, max_tokens=m + 1, stop=[stop])
    outs = {mode: llm.generate(PROMPTS[:1], params, use_tqdm=False) for mode, llm in llms.items()}
    assert [as_tuple(o) for o in outs[True]] == [as_tuple(o) for o in outs[False]]
    assert outs[True][0].outputs[0].stop_reason == stop and len(outs[True][0].outputs[0].token_ids) == m
    for llm in llms.values():
        assert_idle(llm)
