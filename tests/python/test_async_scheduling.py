"""Async scheduling (step n+1 scheduled and launched before step n's sampled ids
reach the host) on the CPU, where ``async_scheduling=True`` runs the same code
path as on a GPU: greedy outputs equal transformers' greedy tokens cut by the
stop rules (EOS the model actually samples, stop tokens, stop strings,
max_tokens, min_tokens), and greedy and seeded outputs equal those of the
same model with async scheduling off, through n > 1, prefix caching,
preemption, aborts and streaming, with every block free at the end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore.llm_engine import EngineArgs  # noqa: E402
from test_models_hf import VOCAB, make_checkpoint  # noqa: E402

HF_TOKENS = 24
PROMPT_LENS = (3, 17, 40, 77, 5, 29)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def load_hf(path: Path, device: str = "cpu"):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, ps: list[list[int]], n: int, **kw) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, EOS ignored (``kw``: more
    generate() arguments, e.g. its ``repetition_penalty``, the same rule as vLLM's:
    logits of prompt and output tokens divided by it when positive, multiplied
    when negative)."""
    outs = []
    for p in ps:
        x = torch.tensor([p], device=model.device)
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0, **kw)
        outs.append(y[0, len(p):].tolist())
    return outs


def pick_eos(greedy: list[list[int]]) -> int:
    """A token the greedy runs sample mid-way (never among the first two tokens):
    made the model's EOS, so that EOS really ends sequences mid-run."""
    first_seen: dict[int, list[int]] = {}
    for out in greedy:
        for t in set(out):
            first_seen.setdefault(t, []).append(out.index(t))
    counts = Counter({t: len(pos) for t, pos in first_seen.items() if 2 <= min(pos) and max(pos) <= 16})
    return counts.most_common(1)[0][0]


def cut(tokens: list[int], max_tokens: int, stops: set[int] = frozenset(), min_tokens: int = 0) -> list[int]:
    """The reference: the greedy tokens up to the first stop token (from min_tokens
    outputs on, the stop included) or max_tokens."""
    for i, t in enumerate(tokens[:max_tokens]):
        if t in stops and i + 1 >= min_tokens:
            return tokens[:i + 1]
    return tokens[:max_tokens]


def stop_string(tokenizer, tokens: list[int], start: int) -> tuple[str, int]:
    """A stop string from the text of two reference tokens at ``start`` or after
    (whole characters only), and how many tokens the reference takes to show it."""
    for i in range(start, len(tokens) - 1):
        stop = tokenizer.decode(tokens[i:i + 2])
        if len(stop.strip()) >= 2 and "\ufffd" not in stop:
            return stop, next(k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    raise AssertionError("no clean stop string in the reference")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from pagedcore import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:  # the GPU machine has no default model: a word-level tokenizer over the ids
        from test_gpu_path import add_toy_tokenizer

        path = tmp_path_factory.mktemp("tokenizer")
        add_toy_tokenizer(path, VOCAB)
        return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint, hf) -> tuple[Path, list[list[int]], list[list[int]], int]:
    """A tiny random Llama whose EOS is a token its greedy runs reach mid-way;
    returns its path, the prompts, transformers' greedy tokens and that EOS."""
    path = checkpoint
    ps = make_prompts()
    greedy = hf_greedy(hf, ps, HF_TOKENS)
    eos = pick_eos(greedy)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path, ps, greedy, eos


def spy_deferred(llm: LLM) -> list[int]:
    """Counts the inputs the runner took from the previous step's samples."""
    runner, seen = llm.llm_engine.runner, [0]
    execute = runner.execute

    def counting(batch, previous_sampled=None):
        seen[0] += batch.num_deferred_inputs
        return execute(batch, previous_sampled)

    runner.execute = counting
    return seen


@pytest.fixture(scope="module")
def llms(model, tokenizer_dir) -> dict[bool, LLM]:
    path = model[0]
    # (None: the default, off on the CPU.)
    return {
        mode: LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=256, max_model_len=256,
                  max_num_seqs=16, async_scheduling=True if mode else None)
        for mode in (False, True)
    }


def as_tuple(out) -> tuple:
    """Everything a completion reports but the log-probabilities' values."""
    return tuple(
        (c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
         None if c.logprobs is None else tuple(tuple(sorted((t, lp.rank) for t, lp in e.items()))
                                              for e in c.logprobs))
        for c in out.outputs
    )


def logprob_values(outs) -> list[float]:
    return [v for o in outs for c in o.outputs if c.logprobs is not None
            for v in [c.cumulative_logprob] + [lp.logprob for e in c.logprobs for _, lp in sorted(e.items())]]


def assert_same_outputs(got, expected) -> None:
    """The same completions; log-probabilities equal up to float32 rounding, which
    depends on the batch's size (async scheduling computes a sequence that the step
    before ended once more, so batches differ)."""
    assert [as_tuple(o) for o in got] == [as_tuple(o) for o in expected]
    torch.testing.assert_close(torch.tensor(logprob_values(got)), torch.tensor(logprob_values(expected)),
                               rtol=0, atol=1e-4)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    stats = llm.stats()
    assert not engine.has_unfinished_requests() and engine.engine.num_unresolved_steps == 0
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def greedy_matrix(model, tokenizer) -> tuple[list[SamplingParams], list[list[list[int]]], list[str | None]]:
    """Greedy requests over every prompt (twice: prefix-cache hits) with the stop
    rules varied, and the reference tokens of each of their samples (and stop
    string, where one ends it)."""
    _, ps, greedy, eos = model
    eos_ids = {eos, tokenizer.eos_token_id}
    params, expected, stop_strs = [], [], []
    for i, (p, g) in enumerate(zip(ps + ps, greedy + greedy)):
        kind = i % 6
        if kind == 0:  # max_tokens only
            sp = SamplingParams(temperature=0, max_tokens=min(7 + 3 * i, HF_TOKENS), ignore_eos=True)
            want = cut(g, sp.max_tokens)
        elif kind == 1:  # EOS (the model's own) ends it mid-run, or max_tokens
            sp = SamplingParams(temperature=0, max_tokens=HF_TOKENS)
            want = cut(g, HF_TOKENS, eos_ids)
        elif kind == 2:  # a stop token taken from the reference
            sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[g[4 + i % 5]], ignore_eos=True)
            want = cut(g, 20, {g[4 + i % 5]})
        elif kind == 3:  # EOS not before min_tokens
            sp = SamplingParams(temperature=0, max_tokens=HF_TOKENS, min_tokens=8)
            want = cut(g, HF_TOKENS, eos_ids, min_tokens=8)
        elif kind == 4:  # n > 1 (top_k=1: each sample is the greedy one)
            sp = SamplingParams(temperature=1.0, top_k=1, n=3, seed=i, max_tokens=6 + i, logprobs=2)
            want = cut(g, 6 + i, eos_ids)
        else:  # a stop string from the reference's text
            stop, k = stop_string(tokenizer, g, 3)
            sp = SamplingParams(temperature=0, max_tokens=HF_TOKENS, stop=[stop], ignore_eos=True)
            want = g[:k]
        params.append(sp)
        expected.append([want] * sp.n)
        stop_strs.append(sp.stop[0] if sp.stop else None)
    return params, expected, stop_strs


def test_greedy_equals_transformers_and_the_synchronous_engine(model, llms) -> None:
    _, ps, greedy, eos = model
    async_llm = llms[True]
    assert async_llm.llm_engine._async_scheduling and not llms[False].llm_engine._async_scheduling
    tokenizer = async_llm.get_tokenizer()
    assert eos in async_llm.llm_engine.eos_token_ids
    params, expected, stop_strs = greedy_matrix(model, tokenizer)
    deferred = spy_deferred(async_llm)
    outs = {}
    for mode, llm in llms.items():
        outs[mode] = llm.generate([{"prompt_token_ids": p} for p in ps + ps], params, use_tqdm=False)
        assert_idle(llm)
    assert deferred[0] > 50  # decode inputs came from the previous step's samples
    for i, (out, want, stop) in enumerate(zip(outs[True], expected, stop_strs)):
        assert [c.token_ids for c in out.outputs] == want, f"request {i}"
        if stop is not None:
            assert out.outputs[0].stop_reason == stop and stop not in out.outputs[0].text
    assert_same_outputs(outs[True], outs[False])
    reasons = Counter(c.finish_reason for o in outs[True] for c in o.outputs)
    ended_by_eos = [o for o, sp in zip(outs[True], params) if not sp.ignore_eos and not sp.stop
                    and o.outputs[0].token_ids[-1] == eos]
    assert len(ended_by_eos) >= 2 and reasons["stop"] >= 5 and reasons["length"] >= 4
    assert async_llm.stats()["prefix_cache_hits"] > 0


def test_seeded_sampling_is_the_same_as_with_async_scheduling_off(model, llms) -> None:
    _, ps, _, _ = model
    params = [
        SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=12, logprobs=3),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, top_k=20, top_p=0.9),
        # Penalties need the previous tokens on the host: those steps sample after
        # the step before has resolved.
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.4,
                       repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=12, min_tokens=6),
        SamplingParams(temperature=1.2, seed=9, max_tokens=12, min_p=0.05),
    ]
    prompts = [{"prompt_token_ids": p} for p in ps[:5]]
    outs = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in llms.items()}
    assert_same_outputs(outs[True], outs[False])
    for llm in llms.values():
        assert_idle(llm)


def test_a_repetition_penalty_sees_the_previous_token(model, hf, llms) -> None:
    # The penalty counts the tokens sampled so far, the last one included: steps
    # with penalized rows sample only once the step before has resolved. (Below 1
    # it favours tokens seen: the greedy run repeats its last token, which only a
    # penalty that sees that token does.)
    path, ps, greedy, _ = model
    expected = hf_greedy(hf, ps[:3], 16, repetition_penalty=0.4)
    assert expected != [g[:16] for g in greedy[:3]]  # the penalty changes the greedy tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=0.4)
    for llm in llms.values():
        outs = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_idle(llm)


def test_structured_outputs_see_the_previous_token(tokenizer_dir, tmp_path) -> None:
    # A grammar's mask for a step needs the matcher to have consumed the token
    # of the step before: those steps, too, sample once it has resolved.
    pytest.importorskip("llguidance")
    import re

    from pagedcore.structured_outputs import StructuredOutputsParams

    # A tiny random model over the whole vocabulary of the tokenizer (llguidance's need).
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=128,
              async_scheduling=True)
    regex = r"[0-9]{3}-[a-z]{2,4}"
    params = [SamplingParams(temperature=1.0, n=2, seed=5 + i, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for i in range(2)]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))  # unconstrained beside them
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [40, 41], [9, 10, 11, 12])]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    for out in outs[:2]:
        for c in out.outputs:  # (a stale matcher refuses a token: finish_reason "abort")
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c


def test_preemption_keeps_greedy_outputs(model, tokenizer_dir) -> None:
    # 28 blocks of 8 for six sequences of up to 101 tokens: preemptions (swap is
    # covered by the engine's tests: tests/cpp/test_engine_async.cpp).
    path, ps, greedy, _ = model
    llm = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=28, block_size=8, max_model_len=128,
              max_num_seqs=8, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=HF_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy
    assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)


def test_streams_and_aborts_mid_run(model, llms) -> None:
    _, ps, greedy, eos = model
    llm = llms[True]
    engine = llm.llm_engine
    eos_ids = set(engine.eos_token_ids)
    engine.add_request("stream", None, ps[1], SamplingParams(temperature=0, max_tokens=HF_TOKENS), stream=True)
    engine.add_request("aborted", None, ps[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       stream=True)
    engine.add_request("kept", None, ps[3], SamplingParams(temperature=0, max_tokens=HF_TOKENS, ignore_eos=True))
    got: dict[str, list] = {"stream": [], "aborted": [], "kept": []}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
        steps += 1
        if steps == 6:
            # A step is in flight (unresolved in the engine) and holds the request.
            assert engine.engine.num_unresolved_steps == 1
            got["aborted"].append(engine.abort("aborted"))
    assert_idle(llm)
    streamed = [t for o in got["stream"] for t in o.outputs[0].token_ids]
    assert streamed == cut(greedy[1], HF_TOKENS, eos_ids)
    assert len(got["stream"]) > 3 and got["stream"][-1].finished
    text = "".join(o.outputs[0].text for o in got["stream"])
    whole = llms[False].generate([{"prompt_token_ids": ps[1]}], SamplingParams(temperature=0, max_tokens=HF_TOKENS),
                                 use_tqdm=False)[0].outputs[0]
    assert text == whole.text and streamed == whole.token_ids
    aborted = [t for o in got["aborted"] for t in o.outputs[0].token_ids]
    assert 2 <= len(aborted) < 20 and aborted == greedy[2][:len(aborted)]
    assert got["aborted"][-1].outputs[0].finish_reason == "abort"
    assert [o.outputs[0].token_ids for o in got["kept"]] == [greedy[3]]


def test_a_stop_string_frees_the_sequence_while_the_next_step_holds_it(model, llms) -> None:
    # The step in flight still computes the stopped sequence; the engine drops
    # that sample: one token more went through the model, none to the engine.
    _, ps, greedy, _ = model
    llm = llms[True]
    tokenizer = llm.get_tokenizer()
    stop, k = stop_string(tokenizer, greedy[0], 2)
    before = llm.stats()["num_generation_tokens"]
    out = llm.generate([{"prompt_token_ids": ps[0]}],
                       SamplingParams(temperature=0, max_tokens=HF_TOKENS, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[0][:k] and out.stop_reason == stop
    assert llm.stats()["num_generation_tokens"] - before == k
    assert_idle(llm)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_a_failed_step_aborts_everything_and_the_engine_stays_usable(model, llms, fault) -> None:
    # The sampler of the third step fails (or returns the NaN mark): two steps are
    # unresolved in the engine then; both get placeholders and every request is
    # dropped, and the next generate() is as good as new.
    _, ps, greedy, _ = model
    llm = llms[True]
    engine = llm.llm_engine
    sampler, calls = engine.sampler, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3 and fault == "raise":
            raise Boom("sampler call 3")
        out = sampler(*args, **kwargs)
        if calls[0] == 3:
            out.sampled_token_ids[:] = -1
        return out

    params = SamplingParams(temperature=0, max_tokens=HF_TOKENS, ignore_eos=True)
    engine.add_request("a", None, ps[0], params)
    engine.add_request("b", None, ps[1], params, stream=True)
    engine.sampler = failing
    try:
        with pytest.raises(Boom if fault == "raise" else RuntimeError,
                           match="sampler call 3" if fault == "raise" else "NaN"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.sampler = sampler
    assert_idle(llm)
    again = llm.generate([{"prompt_token_ids": p} for p in ps[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == greedy[:2]


def test_async_scheduling_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None, got 'yes'"):
        EngineArgs(model="x", async_scheduling="yes").validate()
    with pytest.raises(ValueError, match="async_scheduling=True needs async_output_proc"):
        EngineArgs(model="x", async_scheduling=True, async_output_proc=False).validate()
    from pagedcore.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args(["serve"]).async_scheduling is None



# ---- on the GPU (the lead runs these: `pytest -m cuda tests/python/test_async_scheduling.py`) ----

@pytest.fixture(scope="module")
def gpu_greedy(model) -> list[list[int]]:
    path, ps, _, _ = model
    return hf_greedy(load_hf(path, "cuda"), ps, HF_TOKENS)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", ["whole", "pieces", "eager"])
def test_greedy_equals_transformers_and_the_synchronous_engine_on_gpu(model, gpu_greedy, tokenizer_dir,
                                                                      graphs, monkeypatch) -> None:
    # 64-token steps: the 77-token prompt is chunked, so mixed steps (whole graphs by
    # default, piecewise prefill graphs with PAGEDCORE_MIXED_GRAPHS=0) carry deferred
    # decode inputs too; pure decode steps replay the decode graphs with theirs.
    eager = graphs == "eager"
    if graphs == "pieces":
        monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", "0")
    else:
        monkeypatch.delenv("PAGEDCORE_MIXED_GRAPHS", raising=False)
    path, ps, _, eos = model
    kw = dict(model=str(path), tokenizer=tokenizer_dir, device="cuda", dtype="float32", num_kv_blocks=256,
              max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, enforce_eager=eager)
    llms = {mode: LLM(**kw, async_scheduling=mode) for mode in (False, True)}
    assert LLM(**kw).llm_engine._async_scheduling  # the default on CUDA
    gpu_model = (path, ps, gpu_greedy, eos)
    params, expected, _ = greedy_matrix(gpu_model, llms[True].get_tokenizer())
    deferred = spy_deferred(llms[True])
    outs = {}
    for mode, llm in llms.items():
        outs[mode] = llm.generate([{"prompt_token_ids": p} for p in ps + ps], params, use_tqdm=False)
        assert_idle(llm)
    assert deferred[0] > 50
    for i, (out, want) in enumerate(zip(outs[True], expected)):
        assert [c.token_ids for c in out.outputs] == want, f"request {i}"
    assert_same_outputs(outs[True], outs[False])
    if not eager:
        runner = llms[True].llm_engine.runner
        assert runner.graph_replays > 20
        assert (runner.mixed_graph_replays if graphs == "whole" else runner.prefill_graph_replays) > 0
    # Seeded sampling, penalties (their steps wait for the previous tokens) included.
    seeded = [
        SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=18, min_tokens=6),
    ]
    prompts = [{"prompt_token_ids": p} for p in ps[:3]]
    sampled = {mode: llm.generate(prompts, seeded, use_tqdm=False) for mode, llm in llms.items()}
    assert_same_outputs(sampled[True], sampled[False])
    for llm in llms.values():
        assert_idle(llm)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs_on_gpu(model, gpu_greedy, tokenizer_dir, mode) -> None:
    path, ps, _, _ = model
    llm = LLM(model=str(path), tokenizer=tokenizer_dir, device="cuda", dtype="float32", num_kv_blocks=28,
              block_size=8, max_model_len=128, max_num_seqs=8, preemption_mode=mode, swap_space=0.01,
              async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=HF_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == gpu_greedy
    assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)
