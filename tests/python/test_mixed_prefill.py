"""max_num_mixed_prefill_tokens (EngineConfig, LLM, `pagedcore serve`): while
decode rows run, a step computes at most that many tokens, its decode rows
included (a long prompt is chunked over more steps, so the running streams'
next token is not held up by it), plus another cap's worth of prompt tokens for
every mixed_prefill_waiting_per_cap requests waiting, unless more than
mixed_prefill_max_waiting requests wait; the outputs are the same greedy tokens as transformers' on the
same weights."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from test_models_hf import hf_greedy, make_checkpoint, prompts  # noqa: E402

CAP = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("mixed"))


def record_steps(llm: LLM) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of every step the runner executes from now on."""
    runner = llm.llm_engine.runner
    execute = runner.execute
    steps: list[tuple[int, int]] = []

    def recording(batch, *args, **kwargs):
        steps.append((int(batch.num_decode_seqs), int(batch.num_tokens) - int(batch.num_decode_seqs)))
        return execute(batch, *args, **kwargs)

    runner.execute = recording
    return steps


def test_a_prompt_that_arrives_while_another_decodes_is_chunked_at_the_cap(checkpoint) -> None:
    from pagedcore import default_model_path

    short, long_ = prompts()[0], prompts()[3]  # 3 and 77 tokens
    llm = LLM(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=64, max_model_len=256,
              max_num_mixed_prefill_tokens=CAP)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    steps = record_steps(llm)
    engine.add_request("short", None, short, params)
    done: dict[str, list[int]] = {}
    reported: list[int] = []  # step_prompt_tokens after each step() (the server's step kinds)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        reported.append(engine.step_prompt_tokens)

    step()  # its prompt
    step()  # one decode
    engine.add_request("long", None, long_, params)
    while engine.has_unfinished_requests():
        step()
    # The short prompt alone (no decode row yet: no cap), one decode; then the long
    # prompt 15 tokens a step beside the short one's decode row (16 in all; 77 =
    # 5 x 15 + 2), then both decode.
    assert steps[:8] == [(0, 3), (1, 0), (1, 15), (1, 15), (1, 15), (1, 15), (1, 15), (1, 2)]
    assert all(prompt_tokens == 0 for _, prompt_tokens in steps[8:])
    assert reported == [prompt_tokens for _, prompt_tokens in steps]  # (the CPU: one batch a call)
    assert done["short"] == hf_greedy(checkpoint, short, 24)[0]
    assert done["long"] == hf_greedy(checkpoint, long_, 24)[0]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("per_cap, max_waiting, first_step", [(8, 16, 35), (4, 16, 55), (0, 16, 15), (0, 8, 120)])
def test_the_cap_grows_with_the_waiting_queue_and_a_long_queue_lifts_it(checkpoint, per_cap, max_waiting,
                                                                        first_step) -> None:
    # 10 prompts of 12 tokens arrive while one decodes: the step takes the cap's
    # 16 - 1 prompt tokens plus 16 * 10 / per_cap for the queue (8: 15 + 20, 4:
    # 15 + 40, 0: none); more than max_waiting waiting lift the cap: the whole
    # budget (2048 tokens on the CPU), every prompt at once.
    from pagedcore import default_model_path

    llm = LLM(model=str(checkpoint), tokenizer=default_model_path(), num_kv_blocks=128, max_model_len=256,
              max_num_mixed_prefill_tokens=CAP, mixed_prefill_waiting_per_cap=per_cap,
              mixed_prefill_max_waiting=max_waiting)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("first", None, [5, 6, 7], params)
    engine.step()
    steps = record_steps(llm)
    ps = [[10 + i] * 12 for i in range(10)]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", None, p, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert steps[0] == (1, first_step)
    got = {o.request_id: o.outputs[0].token_ids for o in outs}
    for i in (0, 9):
        assert got[f"r{i}"] == hf_greedy(checkpoint, ps[i], 4)[0]


@pytest.mark.parametrize("field, value", [("max_num_mixed_prefill_tokens", -1),
                                          ("max_num_mixed_prefill_tokens", True),
                                          ("mixed_prefill_waiting_per_cap", None),
                                          ("mixed_prefill_waiting_per_cap", -1),
                                          ("mixed_prefill_max_waiting", None),
                                          ("mixed_prefill_lift_tokens", -1),
                                          ("mixed_prefill_lift_max_waiting", 2.5)])
def test_a_bad_value_is_refused_before_anything_loads(field, value) -> None:
    from pagedcore.llm_engine import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match=f"^{field} must be an integer >= 0, got {value!r}$"):
        LLMEngine(EngineArgs(model="/nonexistent", **{field: value}))


def test_serve_passes_its_flags_to_the_engine_and_refuses_a_bad_api_server_count(monkeypatch, capsys,
                                                                                 tmp_path) -> None:
    # `pagedcore serve` builds EngineArgs with --max-num-mixed-prefill-tokens (default
    # 256), --mixed-prefill-waiting-per-cap (0), --mixed-prefill-max-waiting (8),
    # --mixed-prefill-lift-tokens (1024) and --mixed-prefill-lift-max-waiting (16); the
    # engine is a stub that keeps them and stops the command.
    import pagedcore.llm_engine as llm_engine
    from pagedcore import cli

    seen = []

    class Stop(ValueError):
        pass

    def stub(args):
        seen.append(args)
        raise Stop("stub engine")

    monkeypatch.setattr(llm_engine, "LLMEngine", stub)
    for flags, want in (([], (256, 0, 8, 1024, 16)),
                        (["--max-num-mixed-prefill-tokens", "64"], (64, 0, 8, 1024, 16)),
                        (["--max-num-mixed-prefill-tokens", "0", "--mixed-prefill-waiting-per-cap", "4",
                          "--mixed-prefill-max-waiting", "32", "--mixed-prefill-lift-tokens", "2048",
                          "--mixed-prefill-lift-max-waiting", "128"], (0, 4, 32, 2048, 128))):
        assert cli.main(["serve", "--model", str(tmp_path), "--port", "0", *flags]) == 2
        a = seen[-1]
        assert (a.max_num_mixed_prefill_tokens, a.mixed_prefill_waiting_per_cap, a.mixed_prefill_max_waiting,
                a.mixed_prefill_lift_tokens, a.mixed_prefill_lift_max_waiting) == want
    assert cli.main(["serve", "--model", str(tmp_path), "--port", "0", "--api-server-count", "0"]) == 2
    assert "--api-server-count must be >= 1, got 0" in capsys.readouterr().err
    assert len(seen) == 3  # (refused before anything loads)


@pytest.mark.parametrize("cap, per_cap, lift, top", [(0, 0, 0, 256), (0, 0, 1024, 256), (256, 0, 0, 256),
                                                     (256, 0, 128, 256), (256, 0, 1024, 1024),
                                                     (256, 0, 99999, 8192), (256, 4, 0, 8192), (0, 4, 1024, 8192)])
def test_whole_graphs_with_split_tiles_reach_as_far_as_a_capped_step_grows(monkeypatch, cap, per_cap, lift,
                                                                          top) -> None:
    # The whole mixed graphs up to this size also get a variant whose tiles split their
    # keys (a step continuing a long prompt): 256 tokens, serve's capped step; the lifted
    # cap's tokens while the cap is on (serve's 1024: its lifted steps over long prompts
    # otherwise ran in pieces); every size (8192 here) with the queue's share.
    from pagedcore import EngineConfig
    from pagedcore.model_runner import split_mixed_graph_top

    config = EngineConfig(max_num_batched_tokens=8192, max_num_mixed_prefill_tokens=cap,
                          mixed_prefill_waiting_per_cap=per_cap, mixed_prefill_lift_tokens=lift)
    assert split_mixed_graph_top(config, 8192) == top
    # PAGEDCORE_MIXED_SPLIT_GRAPHS (a measurement switch) sets it whatever the config
    monkeypatch.setenv("PAGEDCORE_MIXED_SPLIT_GRAPHS", "512")
    assert split_mixed_graph_top(config, 8192) == 512
    for bad in ("-1", "x", "2.5"):
        monkeypatch.setenv("PAGEDCORE_MIXED_SPLIT_GRAPHS", bad)
        with pytest.raises(ValueError, match=f"PAGEDCORE_MIXED_SPLIT_GRAPHS must be a token count, got '{bad}'"):
            split_mixed_graph_top(config, 8192)
