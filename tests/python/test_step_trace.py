"""server/step_trace.py: with PAGEDCORE_STEP_TRACE set, the engine loop writes a
line per stepping turn whose forward passes add up to the requests' tokens."""

from __future__ import annotations

import json

import pytest

import pagedcore

pytest.importorskip("fastapi")  # (the server's dependencies: `pip install pagedcore[serve]`)


def test_the_trace_accounts_for_every_prompt_and_output_token(tmp_path, monkeypatch) -> None:
    from starlette.testclient import TestClient

    from pagedcore.llm_engine import EngineArgs, LLMEngine
    from pagedcore.server.app import build_app
    from pagedcore.server.async_engine import AsyncEngine

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PAGEDCORE_STEP_TRACE", str(path))
    prompts = [[1, 520, 77, 9, 41], [1, 8, 300, 12, 5, 6, 7, 19, 2000], [1, 33]]
    max_tokens = 4
    engine = AsyncEngine(LLMEngine(EngineArgs(model=pagedcore.default_model_path(), num_kv_blocks=64,
                                              enable_prefix_caching=False)))
    try:
        with TestClient(build_app(engine, "smol")) as client:
            for prompt in prompts:
                r = client.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": max_tokens,
                                                         "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
    finally:
        engine.shutdown()
    turns = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(set(t) == {"wall", "cmd", "step", "out", "flush", "adds", "spans"} for t in turns)
    assert [t["wall"] for t in turns] == sorted(t["wall"] for t in turns)
    assert sum(t["adds"] for t in turns) == len(prompts)
    spans = [sp for t in turns for sp in t["spans"]]
    # [path, tokens, rows, prompt tokens, longest row, host ms, device ms, host ms waiting
    # for the device before staging, host ms up to the first launch, the thread's CPU ms,
    # host ms in graph replays]: the CPU runs each step eagerly (no graph) and has no
    # device time, nor anything to wait for;
    # its forward pass (after the launch mark) is most of the host's time, all of it on
    # the thread's CPU or less (torch's own threads do part of the work).
    assert {sp[0] for sp in spans} == {"eager"}
    assert all(len(sp) == 11 and sp[6] is None and sp[5] > 0 and sp[7] == 0 and sp[10] == 0 for sp in spans)
    assert all(0 < sp[8] <= sp[5] and 0 < sp[9] <= sp[5] + 1e-3 for sp in spans), spans
    assert sum(sp[8] for sp in spans) < sum(sp[5] for sp in spans) / 2, spans
    # One request at a time: a prefill, then a decode step per further output token
    # (the last output comes from the step of the one before: no step for it).
    assert sum(sp[3] for sp in spans) == sum(len(p) for p in prompts)
    assert sum(sp[1] - sp[3] for sp in spans) == len(prompts) * (max_tokens - 1)
    assert all(sp[2] == 1 for sp in spans)
    assert sorted(sp[4] for sp in spans if sp[3]) == sorted(len(p) for p in prompts)


def test_a_trace_that_cannot_be_written_turns_itself_off(tmp_path, caplog) -> None:
    # A diagnostic never stops the engine: the first failed write is logged, the
    # rows are dropped and the runner stops recording spans.
    from types import SimpleNamespace

    from pagedcore.server.step_trace import StepTrace

    runner = SimpleNamespace(step_spans=None)
    trace = StepTrace(str(tmp_path / "missing" / "steps.jsonl"), SimpleNamespace(runner=runner))
    assert runner.step_spans == []
    trace.turn(1.0, 0.0, 0.001, 0.002, 0.004, 0.005, adds=1)
    with caplog.at_level("WARNING", logger="pagedcore.server"):
        trace.write()
    assert "step trace to" in caplog.text and "turned off" in caplog.text
    assert trace.rows == [] and runner.step_spans is None
    caplog.clear()
    trace.turn(2.0, 0.0, 0.001, 0.002, 0.004, 0.005, adds=0)
    with caplog.at_level("WARNING", logger="pagedcore.server"):
        trace.write()
    assert trace.off and trace.rows == [] and caplog.text == ""  # (off: nothing recorded, no second message)
    assert not (tmp_path / "missing").exists()
