"""The LLM API around generation, on a tiny random float32 Llama checkpoint:
beam search (length_penalty) against transformers, the parameters beam search
refuses, the rollback of a list whose later prompt is refused, the CPU
KV-cache sizing and EngineArgs' checks, and the prefix-cache counters of a
sequence preempted by recompute."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedcore  # noqa: E402
from pagedcore import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagedcore.llm_engine import EngineArgs  # noqa: E402
from test_gpu_path import add_toy_tokenizer  # noqa: E402

VOCAB = 128
EOS = 2
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 32
BLOCK = 8
# float32 K and V of one block over all layers: the documented arithmetic.
BLOCK_BYTES = BLOCK * LAYERS * KV_HEADS * HEAD_DIM * 2 * 4
assert BLOCK_BYTES == 4096


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.3,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # NOTE: a louder EOS row makes EOS win at some steps and lose at others,
        # so beams finish at different lengths and length_penalty matters.
        model.lm_head.weight[EOS] *= 3
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    add_toy_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=str(checkpoint), block_size=BLOCK, num_kv_blocks=128, max_model_len=256)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 9, 13)]


def hf_generate(model, prompt: list[int], eos: int | None = EOS, **kwargs) -> list[list[int]]:
    """transformers' generate; ``eos=None``: no EOS at all (pagedcore's ignore_eos)."""
    x = torch.tensor([prompt])
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        out = model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, **kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    return [row[len(prompt):] for row in out.tolist()]


_HF_GREEDY: dict[tuple[int, ...], list[int]] = {}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens without EOS (cached: several tests ask for the same)."""
    key = (n, *prompt)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = hf_generate(model, prompt, eos=None, do_sample=False, max_new_tokens=n)[0]
    return _HF_GREEDY[key]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def engine_is_empty(llm: LLM) -> None:
    s = llm.stats()
    assert (s["num_requests"], s["num_running_seqs"], s["num_waiting_seqs"]) == (0, 0, 0)
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_used_blocks"] == 0
    assert not llm.llm_engine.has_unfinished_requests()


# ---- beam search ---------------------------------------------------------------------


def test_beam_search_length_penalty_equals_transformers(llm, hf_model) -> None:
    width, max_tokens = 3, 10
    ps = prompts()[:2]
    results, lengths = {}, set()
    for length_penalty in (2.0, 0.5):
        outs = llm.beam_search([{"prompt_token_ids": p} for p in ps], BeamSearchParams(
            beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty))
        for p, out in zip(ps, outs):
            x = torch.tensor([p])
            ref = hf_model.generate(
                x, attention_mask=torch.ones_like(x), pad_token_id=0, num_beams=width,
                num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens, early_stopping=False,
                length_penalty=length_penalty, return_dict_in_generate=True, output_scores=True)
            expected = [row[len(p):] for row in ref.sequences.tolist()]
            expected = [gen[: gen.index(EOS) + 1] if EOS in gen else gen for gen in expected]
            assert [s.tokens[len(p):] for s in out.sequences] == expected, (length_penalty, len(p))
            # transformers' score: the summed log-probabilities over generated_len ** length_penalty.
            torch.testing.assert_close(torch.tensor([s.score for s in out.sequences]), ref.sequences_scores,
                                       atol=1e-5, rtol=0)
            for s in out.sequences:
                lengths.add(len(s.tokens) - len(p))
                assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
        results[length_penalty] = [[s.tokens for s in out.sequences] for out in outs]
    # Hypotheses of different lengths, which the two penalties rank differently
    # here: the comparison above means something.
    assert len(lengths) > 1 and results[2.0] != results[0.5]
    engine_is_empty(llm)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", 0.7, "temperature must be 0.0 for beam search .*got 0.7"),
        ("temperature", 1e-6, "temperature must be 0.0 for beam search .*got 1e-06"),
        ("include_stop_str_in_output", True, "include_stop_str_in_output must be False .*got True"),
        ("length_penalty", math.nan, "length_penalty must be a finite number, got nan"),
        ("beam_width", 0, "beam_width must be at least 1, got 0"),
    ],
)
def test_beam_search_params_refuse_what_they_do_not_do(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})
    # The defaults are accepted (vLLM's signature).
    p = BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.0, include_stop_str_in_output=False)
    assert (p.temperature, p.include_stop_str_in_output) == (0.0, False)


def test_a_beam_search_whose_forward_pass_fails_leaves_the_engine_usable(llm, hf_model, monkeypatch) -> None:
    runner = llm.llm_engine.runner
    real = runner.execute
    calls = []

    def failing(batch):
        calls.append(batch.num_samples)
        if len(calls) == 3:  # mid-search: beams forked, a step scheduled
            raise RuntimeError("forward pass failed")
        return real(batch)

    monkeypatch.setattr(runner, "execute", failing)
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    p = prompts()[1]
    with pytest.raises(RuntimeError, match="forward pass failed"):
        llm.beam_search({"prompt_token_ids": p}, params)
    engine_is_empty(llm)
    out = llm.beam_search({"prompt_token_ids": p}, params)[0]
    ref = hf_generate(hf_model, p, eos=None, num_beams=2, num_return_sequences=2, do_sample=False,
                      max_new_tokens=6, early_stopping=False, length_penalty=1.0)
    assert [s.tokens[len(p):] for s in out.sequences] == ref


# ---- rollback of a refused list ---------------------------------------------------------


@pytest.mark.parametrize(
    "bad, bad_params, message",
    [
        ([5] * 257, greedy(4), "the prompt has 257 tokens, more than max_model_len \\(256\\)"),
        ([5, VOCAB], greedy(4), f"prompt_token_ids contains {VOCAB}, outside \\[0, {VOCAB}\\)"),
        ([5] * 250, greedy(7), "max_tokens 7 is larger than what max_model_len \\(256\\) leaves"),
        ([], greedy(4), "the prompt is empty"),
    ],
)
def test_a_refused_third_prompt_leaves_nothing_admitted(llm, hf_model, bad, bad_params, message) -> None:
    ps = prompts()[:2]
    before = llm.stats()
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": p} for p in ps] + [{"prompt_token_ids": bad}],
                     [greedy(6), greedy(6), bad_params], use_tqdm=False)
    engine_is_empty(llm)
    after = llm.stats()
    # Nothing was scheduled: no step, no prompt token looked up or computed.
    for key in ("num_steps", "prefix_cache_queries", "num_prompt_tokens", "num_generation_tokens"):
        assert after[key] == before[key], key
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_model, p, 6) for p in ps
    ]
    engine_is_empty(llm)


# ---- CPU KV-cache sizing ----------------------------------------------------------------


def test_cpu_kv_cache_sizing(checkpoint, monkeypatch) -> None:
    def make(**kwargs) -> LLM:
        return LLM(model=str(checkpoint), block_size=BLOCK, device="cpu", **kwargs)

    def blocks_and_len(llm: LLM) -> tuple[int, int]:
        key_cache = llm.llm_engine.runner.kv_caches[0][0]
        # (+1: the null block padding rows point at.)
        assert key_cache.shape == (llm.stats()["num_blocks"] + 1, BLOCK, KV_HEADS, HEAD_DIM)
        return llm.stats()["num_blocks"], llm.llm_engine.max_model_len

    monkeypatch.setenv("PAGEDCORE_KV_CACHE_BYTES", str(7 * BLOCK_BYTES + 1))
    # The model's 256 positions are capped to what the blocks hold.
    assert blocks_and_len(make()) == (7, 7 * BLOCK)
    # The argument wins over the environment; a partial block is not a block.
    assert blocks_and_len(make(kv_cache_memory_bytes=10 * BLOCK_BYTES + BLOCK_BYTES - 1)) == (10, 80)
    # num_kv_blocks wins over both; bfloat16 halves the bytes of a block.
    assert blocks_and_len(make(kv_cache_memory_bytes=BLOCK_BYTES, num_kv_blocks=5)) == (5, 40)
    assert blocks_and_len(make(kv_cache_memory_bytes=10 * BLOCK_BYTES, dtype="bfloat16")) == (20, 160)
    # An explicit max_model_len is kept when the cache holds it, refused otherwise.
    assert blocks_and_len(make(kv_cache_memory_bytes=5 * BLOCK_BYTES, max_model_len=40)) == (5, 40)
    with pytest.raises(ValueError, match="max_model_len 41 needs more KV cache than 5 blocks x 8 tokens \\(40\\)"):
        make(kv_cache_memory_bytes=5 * BLOCK_BYTES, max_model_len=41)
    with pytest.raises(ValueError, match="max_model_len 257 is larger than the model's max_position_embeddings \\(256\\)"):
        make(num_kv_blocks=40, max_model_len=257)
    with pytest.raises(ValueError, match=f"kv_cache_memory_bytes {BLOCK_BYTES - 1} holds no block of {BLOCK_BYTES} bytes"):
        make(kv_cache_memory_bytes=BLOCK_BYTES - 1)
    monkeypatch.setenv("PAGEDCORE_KV_CACHE_BYTES", str(BLOCK_BYTES - 1))
    with pytest.raises(ValueError, match=f"\\$PAGEDCORE_KV_CACHE_BYTES {BLOCK_BYTES - 1} holds no block of {BLOCK_BYTES} bytes"):
        make()
    for raw in ("1GiB", "0", "-4096"):
        monkeypatch.setenv("PAGEDCORE_KV_CACHE_BYTES", raw)
        with pytest.raises(ValueError, match=f"\\$PAGEDCORE_KV_CACHE_BYTES must be a positive integer \\(bytes\\), got '{raw}'"):
            make()
    # Neither: 1 GiB, which holds the model's whole context (the runner, which
    # would allocate that GiB, is left out: only the engine's sizing is read).
    monkeypatch.delenv("PAGEDCORE_KV_CACHE_BYTES")
    monkeypatch.setattr(pagedcore.llm_engine, "ModelRunner", lambda *args, **kwargs: None)
    config = make().llm_engine.engine.config
    assert (config.num_blocks, config.max_model_len) == (2**30 // BLOCK_BYTES, 256)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0), ("block_size", 12), ("block_size", 256), ("block_size", 16.0),
        ("num_kv_blocks", 0), ("num_kv_blocks", True), ("kv_cache_memory_bytes", -1),
        ("kv_cache_memory_bytes", 1.5), ("max_model_len", 0), ("max_num_seqs", 0),
        ("max_num_batched_tokens", -2), ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", math.nan), ("swap_space", -1),
        ("swap_space", math.inf), ("swap_space", "4"), ("preemption_mode", "lifo"),
        ("kv_cache_dtype", "int8"), ("load_format", "pt"), ("device", "tpu"), ("async_output_proc", "yes"),
        ("enable_prefix_caching", 1), ("enforce_eager", "no"), ("seed", 1.0), ("seed", None),
    ],
)
def test_engine_args_validate_names_the_field_and_value(field, value) -> None:
    with pytest.raises(ValueError) as excinfo:
        EngineArgs(model="unused", **{field: value}).validate()
    message = str(excinfo.value)
    assert message.startswith(f"{field} must "), message
    assert message.endswith(f"got {value!r}"), message


def test_engine_args_defaults_are_valid() -> None:
    EngineArgs(model="unused").validate()
    EngineArgs(model="unused", block_size=128, gpu_memory_utilization=1, swap_space=0, num_kv_blocks=1,
               max_model_len=1, enable_prefix_caching=False, enforce_eager=True, seed=-5).validate()


# ---- prefix-cache counters across a preemption -------------------------------------------


def test_prefix_cache_counters_count_first_admissions_only(checkpoint, hf_model) -> None:
    """Two 12-token prompts sharing their first block, 10 tokens each, in four
    8-token blocks. By hand (FCFS, decode rows first):

    - step 1: A admitted, 12 tokens looked up, 0 hit (its first block is not
      cached yet); B admitted after A in the same step, 12 looked up, 8 hit
      (A's first block, registered when A was scheduled). 3 blocks used.
    - steps 2-5: decodes at positions 12-15 fill both second blocks.
    - step 6: position 16 needs a block each: A takes the last free one, B has
      none and is preempted by recompute (17 tokens, its second block cached).
    - steps 7-10: A alone; B's re-admission (2 cached blocks, 1 to revive and
      1 fresh) does not fit in the one cached block left. A ends at step 10.
    - step 11: B re-admitted: 16 of its 17 tokens hit. vLLM counts a
      preempted request's lookup apart from the hit rate (preempted_hits), so
      the counters stay at 24 queried, 8 hit. Steps 12-15: B's last 4 tokens.
    """
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (8,), generator=g).tolist()
    a, b = (shared + torch.randint(3, VOCAB, (4,), generator=g).tolist() for _ in range(2))
    llm = LLM(model=str(checkpoint), block_size=BLOCK, num_kv_blocks=4, max_model_len=32,
              enable_prefix_caching=True)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], greedy(10), use_tqdm=False)
    s = llm.stats()
    assert (s["num_preemptions"], s["num_recompute_preemptions"], s["num_steps"]) == (1, 1, 15)
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (24, 8)
    assert s["prefix_cache_hit_rate"] == 8 / 24
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_model, p, 10) for p in (a, b)
    ]
    engine_is_empty(llm)


def test_an_unsupported_head_dim_is_refused_before_loading(checkpoint, tmp_path, monkeypatch) -> None:
    # head_dim 16 (64 hidden / 4 heads): no attention kernel serves it. The LLM is
    # refused with the value and the supported ones, before any weight is read.
    import json
    import shutil

    path = tmp_path / "head16"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_attention_heads=4, head_dim=16)
    (path / "config.json").write_text(json.dumps(config))
    read = []
    import pagedcore.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "iter_safetensors", lambda *a, **k: read.append(a) or iter(()))
    with pytest.raises(ValueError, match=r"unsupported head_dim: 16 .*\(32, 64, 80, 96, 128, 256\)"):
        LLM(model=str(path), num_kv_blocks=16)
    assert read == []


@pytest.mark.parametrize("value, expected", [(None, True), ("", True), ("1", True), ("0", False)])
def test_the_sampling_warm_up_switch(monkeypatch, value, expected) -> None:
    # PAGEDCORE_WARM_SAMPLING: a CUDA engine's greedy logits, sampling and host copy for
    # every row count at start-up, on unless 0 (run on CUDA only: test_gpu_path.py).
    from pagedcore.llm_engine import warm_sampling

    if value is None:
        monkeypatch.delenv("PAGEDCORE_WARM_SAMPLING", raising=False)
    else:
        monkeypatch.setenv("PAGEDCORE_WARM_SAMPLING", value)
    assert warm_sampling() is expected


def test_a_bad_sampling_warm_up_switch_stops_the_engine_by_name(monkeypatch) -> None:
    # Checked on every device, before the weights load.
    from pagedcore.llm_engine import EngineArgs, LLMEngine

    monkeypatch.setenv("PAGEDCORE_WARM_SAMPLING", "yes")
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineArgs(model=pagedcore.default_model_path(), num_kv_blocks=16))
    assert str(e.value) == "PAGEDCORE_WARM_SAMPLING must be 0 or 1, got 'yes'"
