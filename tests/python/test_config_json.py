"""config.json parsed directly (the fast start-up path) gives, for every supported
architecture, the fields transformers' AutoConfig gives: the model spec built from
either is the same, and each config attribute the spec reads equals AutoConfig's.

Configs: every one of tests/python/test_models_hf.py (saved by transformers 5, in
its rope_parameters format), the default model's, and hand-written ones in the
classic Hub format (rope_theta + rope_scaling, torch_dtype) that leave fields out,
so that each class default is exercised (Qwen3's head_dim 128, Mistral's
sliding_window 4096, Qwen2's use_sliding_window and max_window_layers, llama3 rope
scaling without original_max_position_embeddings, "type" instead of "rope_type").
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore.model_loader import load_config_json, resolve_dtype  # noqa: E402
from pagedcore.models import model_spec_from_config  # noqa: E402
from pagedcore.models.spec import config_from_json  # noqa: E402

from test_models_hf import COMMON, CONFIGS  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
         "vocab_size": 100}

HAND_WRITTEN = {
    "llama-minimal": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL},
    "llama31-classic": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL, "num_key_value_heads": 2,
        "rope_theta": 500000.0, "max_position_embeddings": 1024, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
        "eos_token_id": [5, 7, 9], "bos_token_id": 3, "torch_dtype": "bfloat16",
    },
    "llama3-no-original-len": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL, "max_position_embeddings": 512,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    },
    "llama-linear-type-key": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 20000.0, "dtype": "float16",
    },
    "mistral-minimal": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **SMALL},
    "mistral-no-window": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", **SMALL, "sliding_window": None,
        "head_dim": 32, "rope_theta": 1000000.0,
    },
    "qwen2-minimal": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SMALL},
    "qwen25-classic": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SMALL, "num_key_value_heads": 2,
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "eos_token_id": 151645, "bos_token_id": 151643,
        "torch_dtype": "bfloat16", "rope_scaling": None,
    },
    "qwen2-all-sliding": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SMALL, "use_sliding_window": True,
        "sliding_window": 32, "max_window_layers": 0,
    },
    "qwen2-window-unused": {  # use_sliding_window, but no layer at or past max_window_layers
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SMALL, "use_sliding_window": True,
        "sliding_window": 32, "max_window_layers": 28,
    },
    "qwen3-minimal": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SMALL},
    "qwen3-classic": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SMALL, "head_dim": 16,
        "attention_bias": True, "rope_theta": 1000000.0, "num_key_value_heads": 1, "eos_token_id": 4,
    },
}

# The config attributes model_spec_from_config and resolve_dtype read.
ATTRIBUTES = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "layer_types", "rope_parameters", "partial_rotary_factor", "hidden_act", "bos_token_id", "eos_token_id",
    "dtype",
)


def _saved_by_transformers(name: str, root: Path) -> Path:
    cls_name, extra = CONFIGS[name]
    path = root / name
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]  # as model.save_pretrained writes
    config.save_pretrained(path)
    return path


def _written(name: str, root: Path) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HAND_WRITTEN[name]))
    return path


CASES = [("saved", n) for n in CONFIGS] + [("written", n) for n in HAND_WRITTEN] + [("default", "SmolLM2")]


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    dirs = {f"saved-{n}": _saved_by_transformers(n, root) for n in CONFIGS}
    dirs.update({f"written-{n}": _written(n, root) for n in HAND_WRITTEN})
    from pagedcore import default_model_path

    dirs["default-SmolLM2"] = Path(default_model_path())
    return dirs


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_config_json_matches_autoconfig(config_dirs, kind: str, name: str) -> None:
    path = str(config_dirs[f"{kind}-{name}"])
    reference = transformers.AutoConfig.from_pretrained(path)
    ours = config_from_json(load_config_json(path))
    for attribute in ATTRIBUTES:
        want = getattr(reference, attribute, None)
        got = getattr(ours, attribute, None)
        if attribute == "dtype" and isinstance(got, str):
            got = getattr(torch, got)
        assert got == want, f"{attribute}: config.json parsed gives {got!r}, AutoConfig {want!r}"

    spec_ref = model_spec_from_config(reference)
    spec = model_spec_from_config(load_config_json(path))  # the dict itself, as LLMEngine passes it
    for field in dataclasses.fields(spec):
        got, want = getattr(spec, field.name), getattr(spec_ref, field.name)
        assert got == want, f"spec.{field.name}: {got!r} from config.json, {want!r} from AutoConfig"
    assert torch.equal(spec.inv_freq(), spec_ref.inv_freq())
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available() and ours.dtype not in ("bfloat16", "float16"):
            continue  # "auto" would ask the GPU whether it has bfloat16
        assert resolve_dtype("auto", ours, device) == resolve_dtype("auto", reference, device)


def test_unsupported_architecture_is_refused_from_config_json(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        model_spec_from_config(load_config_json(str(tmp_path)))


@pytest.mark.parametrize("content,match", [
    ("{not json", "cannot read config.json"),
    ("[1, 2]", "is not a JSON object"),
])
def test_unreadable_config_json_is_a_value_error(tmp_path, content: str, match: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_config_json(str(tmp_path))
