"""Start-up: hub ids from the local Hugging Face cache, the command line refusing bad
arguments before loading anything, uninitialised parameters and KV cache that
change no output, and what start-up tells the user (the CPU cache sizing, the
start-up lines of `pagedcore generate`, no progress bar for a single chat, the
progress of the long parts: weight loading, the default model's one-time
conversion, CUDA-graph capture).

One tiny random float32 Llama (with the default model's tokenizer, so that text
prompts work) laid out as a Hugging Face cache snapshot serves every test.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams, cli  # noqa: E402
from pagedcore.model_loader import build_uninitialized, resolve_model_path  # noqa: E402
from pagedcore.models import CausalLM, model_spec_from_config  # noqa: E402

REPO_ID = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _tiny_llama(path: Path, seed: int) -> None:
    from pagedcore import default_model_path

    tokenizer_dir = default_model_path()
    vocab = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """<cache>/models--acme--tiny-llama with refs/main -> COMMIT and an older snapshot
    (different weights) that must not be picked."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / "models--acme--tiny-llama"
    _tiny_llama(repo / "snapshots" / COMMIT, seed=1)
    _tiny_llama(repo / "snapshots" / OLD_COMMIT, seed=2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture(scope="module")
def snapshot(hub_cache) -> str:
    return str(hub_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT)


@pytest.fixture(scope="module")
def llm(snapshot) -> LLM:
    return LLM(model=snapshot, num_kv_blocks=64, max_model_len=128, block_size=16)


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(num_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, **kwargs)


# ---- hub ids -------------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_id_resolves_to_the_snapshot_refs_main_names(hub_cache, snapshot, monkeypatch, variable) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv(variable, str(hub_cache if variable == "HF_HUB_CACHE" else hub_cache.parent))
    assert resolve_model_path(REPO_ID) == snapshot


def test_llm_loads_a_cached_hub_id(hub_cache, snapshot, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    llm = LLM(model=REPO_ID, num_kv_blocks=16, max_model_len=64)
    prompt = [5, 900, 77, 4000, 12]
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    assert out == _hf_greedy(snapshot, prompt, 6)


def test_uncached_hub_id_says_only_local_directories_and_cached_ids_work(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError) as e:
        LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(e.value)
    assert "hub id 'HuggingFaceTB/SmolLM2-135M-Instruct' is not in the local Hugging Face cache" in message
    assert str(tmp_path / "empty-cache") in message
    assert "loads local directories and hub ids already in the Hugging Face cache" in message
    assert "never downloads" in message
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"model path '{missing}' does not exist"):
        LLM(model=missing)


# ---- command line --------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "-1"], "max_tokens must be at least 1, got -1"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-model-len", "0"], "--max-model-len must be a positive integer, got 0"),
    (["--model", "nobody/no-such-model"], "not in the local Hugging Face cache"),
])
def test_generate_refuses_bad_arguments_before_loading(monkeypatch, capsys, args, message) -> None:
    def no_load(*_, **__):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("pagedcore.llm.LLM", no_load)
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-hf-cache")
    assert cli.main(["generate", "hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_shows_the_start_up_lines(snapshot, monkeypatch, capsys) -> None:
    # As in a fresh process: the root logger at WARNING, the pagedcore logger unset.
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    logger = logging.getLogger("pagedcore")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        assert cli.main(["generate", "Hello", "--model", snapshot, "--max-tokens", "3"]) == 0
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert any(line.startswith("# KV cache blocks: ") for line in lines), lines
    assert any(line.startswith("KV cache size: ") for line in lines), lines
    assert capsys.readouterr().out.strip()  # the completion, on stdout


def test_generate_loads_with_a_torch_thread_fewer_and_gives_it_back(tmp_path, monkeypatch, capsys) -> None:
    # The tokenizer loads in a thread while the weights load: with a copying thread
    # on every core they fight for the cores (see cli.loading_threads).
    from types import SimpleNamespace

    seen: dict[str, int] = {}

    class RecordingLLM:
        def __init__(self, **_) -> None:
            seen["loading"] = torch.get_num_threads()

        def generate(self, *_, **__) -> list:
            seen["generating"] = torch.get_num_threads()
            return [SimpleNamespace(outputs=[SimpleNamespace(text="text")])]

    monkeypatch.setattr("pagedcore.llm.LLM", RecordingLLM)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert cli.main(["generate", "Hello", "--model", str(tmp_path)]) == 0  # (a directory: not loaded)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert seen == {"loading": 2, "generating": 3}
    assert capsys.readouterr().out == "text\n"


# ---- what start-up says ---------------------------------------------------------------


def test_cpu_start_up_says_what_sized_the_cache(snapshot, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        LLM(model=snapshot, kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.5)
    assert ("KV cache on the CPU sized by kv_cache_memory_bytes: 1048576 bytes (0.00 GiB); "
            "gpu_memory_utilization (0.5) applies to GPUs only") in caplog.text


# A tqdm bar at its end: "<desc>: 100%|██████████| 21/21 [00:00<00:00, 150.31tensor/s]"
# (under one a second: "1.20s/tensor"; "#" where the stream cannot take "█").
def _finished_bar(desc: str, total: int, unit: str) -> str:
    rate = rf"(\d+\.\d\d{unit}/s|\d+\.\d\ds/{unit})"
    return rf"{re.escape(desc)}: 100%\|[█#]+\| {total}/{total} \[\d\d:\d\d<\d\d:\d\d, +{rate}\]"


_RATE = r"\d+\.\d+ (MiB|GiB)/s"


def test_loading_a_sharded_checkpoint_shows_a_bar_and_the_rate(snapshot, tmp_path, monkeypatch, capfd,
                                                               caplog) -> None:
    import pagedcore.model_loader as model_loader

    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(snapshot).save_pretrained(sharded, max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    # (a bar for checkpoints of PROGRESS_BAR_BYTES or more: 1 GiB, too large to write here)
    monkeypatch.setattr(model_loader, "PROGRESS_BAR_BYTES", 1)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        LLM(model=str(sharded), tokenizer=snapshot, num_kv_blocks=16, max_model_len=64)
    # One bar over every tensor of every shard, with its rate.
    err = capfd.readouterr().err
    assert re.search(_finished_bar("Loading weights", len(index["weight_map"]), "tensor"), err), err[-300:]
    # The line after it: every byte of the checkpoint's tensors (transformers' index counts
    # them), the time and the rate.
    total = index["metadata"]["total_size"]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert re.fullmatch(rf"loaded {total / 2**20:.1f} MiB of weights in \d+\.\d\d s \({_RATE}\)", line), line


def test_the_one_time_conversion_shows_its_progress(tmp_path, monkeypatch, capfd, caplog) -> None:
    pytest.importorskip("gguf")
    import pagedcore.default_model as dm

    from test_model_files import _write_tiny_gguf

    gguf_file = _write_tiny_gguf(str(tmp_path / "tiny.gguf"), vocab=256, tokenizer_fields=None)

    def no_tokenizer(gguf_path: str, out_dir: str, context_length: int) -> None:  # (seconds; not under test)
        (Path(out_dir) / "tokenizer_config.json").write_text("{}\n")

    monkeypatch.setattr(dm, "_save_tokenizer", no_tokenizer)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        path, converted = dm._ensure_converted(gguf_file.path, str(tmp_path / "models"), "tiny")
    assert converted
    # A bar over the tensors dequantized, with its rate ...
    err = capfd.readouterr().err
    assert re.search(_finished_bar("Converting the default model (once)", len(gguf_file.expected), "tensor"), err)
    # ... and a line before each part without one, then the total with the rate.
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("pagedcore")]
    assert lines[:3] == [
        f"converting {gguf_file.path} to a Hugging Face directory at {path} (done once)",
        f"reading tiny.gguf ({os.path.getsize(gguf_file.path) / 2**20:.1f} MiB)",
        "building the tokenizer from the GGUF file's vocabulary (transformers reads the file again)",
    ]
    assert re.fullmatch(rf"converted tiny.gguf in \d+\.\d s \({size / 2**20:.1f} MiB of float32 weights, {_RATE}\)",
                        lines[3]), lines[3]
    assert len(lines) == 4, lines


@pytest.mark.cuda
def test_cuda_graph_capture_shows_a_bar_and_its_time(tmp_path, capfd, caplog) -> None:
    from test_gpu_path import add_toy_tokenizer
    from test_models_hf import VOCAB, make_checkpoint

    path = make_checkpoint("llama", tmp_path)
    add_toy_tokenizer(path, VOCAB)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="pagedcore"):
        llm = LLM(model=str(path), device="cuda", num_kv_blocks=64, max_model_len=256)
    sizes = sorted(llm.llm_engine.runner.graphs)
    assert sizes and sizes[0] == 1
    err = capfd.readouterr().err
    assert re.search(_finished_bar("Capturing CUDA graphs", len(sizes), "graph"), err), err[-300:]
    lines = [r.getMessage() for r in caplog.records]
    # (and what the capture took from the caching allocator, outside the KV budget)
    assert any(re.fullmatch(rf"CUDA graphs captured for decode batch sizes {re.escape(str(sizes))} in \d+\.\d s; "
                            r"[+-]\d+\.\d\d GiB reserved", line)
               for line in lines), lines


def test_single_chat_shows_no_progress_bar(llm, capfd) -> None:
    llm.chat([{"role": "user", "content": "Hi"}], _greedy(2))
    assert "Processed prompts" not in capfd.readouterr().err
    llm.generate(["Hi", "Hello"], _greedy(2))
    assert "Processed prompts" in capfd.readouterr().err


# ---- no initialisation ---------------------------------------------------------------


def test_parameters_are_built_without_drawing_random_weights(snapshot) -> None:
    with open(os.path.join(snapshot, "config.json")) as f:
        spec = model_spec_from_config(json.load(f))
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    model = build_uninitialized(lambda: CausalLM(spec), torch.bfloat16, "cpu")
    assert torch.equal(torch.random.get_rng_state(), state), "nn.Linear/nn.Embedding drew initial weights"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.bfloat16  # buffers cast as Module.to casts them
    hf = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim))
    torch.testing.assert_close(model.inv_freq, hf.to(torch.bfloat16), rtol=0, atol=0)


def test_a_checkpoint_missing_a_weight_is_refused(snapshot, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(snapshot, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    for name in os.listdir(snapshot):
        if name != "model.safetensors":
            shutil.copy(os.path.join(snapshot, name), tmp_path)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no \(or partial\) weights for \['layers.1.gate_up_proj.weight'\]"):
        LLM(model=str(tmp_path), num_kv_blocks=8, max_model_len=64)


def test_uninitialised_kv_cache_changes_no_output(llm, snapshot) -> None:
    # Whatever torch.empty left in the cache, NaN included, no kernel reads it: a
    # slot is read only after this step or an earlier one wrote it. Covers
    # prefill, decode, prefix-cache hits (the repeated prompt) and copy-on-write
    # (n=2 forks share the prompt's last, partial block).
    for key, value in llm.llm_engine.runner.kv_caches:
        key.fill_(float("nan"))
        value.fill_(float("nan"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (7, 21, 21)]
    prompts[2] = list(prompts[1])
    # top_k=1 sampling is greedy, and allows n=2 (greedy itself takes n=1 only).
    params = SamplingParams(temperature=1.0, top_k=1, n=2, seed=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = _hf_greedy(snapshot, prompt, 8)
        assert [c.token_ids for c in out.outputs] == [expected, expected]
    assert llm.stats()["prefix_cache_hits"] > 0


# ---- the tokenizer without AutoConfig --------------------------------------------------


@pytest.mark.parametrize("model_type,tokenizer_class", [
    ("llama", None),                      # the default model's files as they are
    ("llama", "LlamaTokenizerFast"),      # AutoTokenizer's llama + ByteLevel special case
    ("qwen2", None),
    ("mistral", "LlamaTokenizerFast"),
])
def test_tokenizer_without_autoconfig_is_autotokenizers(tmp_path, model_type, tokenizer_class) -> None:
    from pagedcore import default_model_path
    from pagedcore.model_loader import load_tokenizer

    source = default_model_path()
    for name in (*TOKENIZER_FILES, "config.json"):
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer_class is not None:
        tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        tokenizer_config["tokenizer_class"] = tokenizer_class
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    ours = load_tokenizer(str(tmp_path))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(reference)
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.all_special_tokens == reference.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    for text in ("Hello world", " 自作PCで80万円", "<|im_start|>user\nHi<|im_end|>", "  spaces\tand\nlines "):
        assert ours(text).input_ids == reference(text).input_ids, text
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
