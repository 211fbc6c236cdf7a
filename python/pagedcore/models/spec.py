"""What the decoder needs to know about a checkpoint, read from its HF config.

One decoder (:mod:`pagedcore.models.decoder`) serves the Llama family and its
relatives; a :class:`ModelSpec` says which variant a checkpoint is: biases on
q/k/v, q/k norms, rotary scaling, sliding window, tied embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

# HF architecture name -> the features that set it apart from Llama.
# (qkv_bias / o_bias None: the config's attention_bias decides.)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": None, "o_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "o_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "o_bias": None, "qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int  # 0: full attention in every layer
    rope_type: str
    rope_theta: float
    rope_scaling: dict[str, Any]
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, float32 ``[head_dim // 2]``, computed
        the way Hugging Face computes them so that positions match bit for bit."""
        dim = self.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(self.rope_scaling["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.rope_scaling, self.max_position_embeddings)
        return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], max_pos: int) -> torch.Tensor:
    # Llama 3.1 frequency scaling: long wavelengths are divided by `factor`,
    # short ones kept, and the band between them interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings") or max_pos)
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # configs written before transformers 5
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def _sliding_window(config: Any) -> int:
    window = getattr(config, "sliding_window", None) or 0
    if not window:
        return 0
    if getattr(config, "use_sliding_window", True) is False:
        return 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return 0
        if kinds != {"sliding_attention"}:
            raise ValueError(
                "models that mix sliding-window and full-attention layers are not supported "
                f"(layer_types has {sorted(kinds)})"
            )
    return int(window)


# What the transformers (5.x) config class of each architecture puts in place of a
# field that config.json leaves out. NOTE: model_spec_from_config on a plain
# config.json dict must give exactly the spec that transformers' AutoConfig gives
# (tests/python/test_config_json.py checks it field by field): a default that
# differs here silently changes the model (Qwen3's head_dim is 128, not
# hidden_size // num_heads; Mistral's sliding_window is 4096, not none).
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "head_dim": None,
}
_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
    "bos_token_id": None, "eos_token_id": None,
}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _LLAMA_DEFAULTS,
    "MistralForCausalLM": {
        **{k: v for k, v in _LLAMA_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
        "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": _QWEN_DEFAULTS,
    "Qwen3ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False},
}
_DEFAULT_ROPE_THETA = 10000.0
# transformers' names for layer kinds written by older versions.
_LEGACY_LAYER_TYPES = {"attention": "full_attention"}


def config_from_json(raw: Mapping[str, Any]) -> SimpleNamespace:
    """The attributes transformers' config class would have for a config.json dict.

    Fills what the file leaves out with the class defaults of its architecture and
    applies the normalisations of the class (``head_dim`` and
    ``num_key_value_heads`` from the head count, Qwen's ``use_sliding_window`` and
    ``layer_types``, rotary parameters gathered into ``rope_parameters`` with
    ``rope_theta`` and ``rope_type``, ``torch_dtype`` read as ``dtype``), without
    importing transformers (its config machinery takes seconds to import).
    Fields of an architecture pagedcore does not support are taken as they are.

    Parameters
    ----------
    raw : Mapping[str, Any]
        The parsed ``config.json``.

    Returns
    -------
    types.SimpleNamespace
        One attribute per field, for :func:`model_spec_from_config` and
        :func:`pagedcore.model_loader.resolve_dtype`.
    """
    architectures = list(raw.get("architectures") or [])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    values = {**CONFIG_DEFAULTS.get(arch, {}), **raw}
    if arch is None:
        return SimpleNamespace(**values)
    if values.get("head_dim") is None and arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention" if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
    if values.get("layer_types") is not None:
        values["layer_types"] = [_LEGACY_LAYER_TYPES.get(t, t) for t in values["layer_types"]]
    values["rope_parameters"] = _standard_rope_parameters(values)
    values["dtype"] = values.get("dtype") or values.get("torch_dtype")
    return SimpleNamespace(**values)


def _standard_rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    # As transformers' RotaryEmbeddingConfigMixin: rope_scaling (the classic key)
    # wins over rope_parameters; rope_theta and partial_rotary_factor are moved in;
    # scaled types get original_max_position_embeddings.
    params = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    params.setdefault("rope_theta", values.get("rope_theta", _DEFAULT_ROPE_THETA))
    if values.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", values["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in values:
            params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    return params


def model_spec_from_config(config: Any) -> ModelSpec:
    """Reads a ``transformers`` config, or a parsed ``config.json`` dict (through
    :func:`config_from_json`), into a :class:`ModelSpec`.

    Raises
    ------
    ValueError
        For an architecture outside :data:`SUPPORTED_ARCHITECTURES` (the message
        names the supported ones) or an unsupported rotary scaling.
    """
    if isinstance(config, Mapping):
        config = config_from_json(config)
    architectures = list(getattr(config, "architectures", None) or [])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {architectures or getattr(config, 'model_type', '?')}: "
            f"pagedcore supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    features = SUPPORTED_ARCHITECTURES[arch]
    rope = _rope_parameters(config)
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type '{rope_type}': pagedcore supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0) or rope.get(
        "partial_rotary_factor", 1.0
    ) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act '{hidden_act}': pagedcore supports silu")
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if features["qkv_bias"] is None else features["qkv_bias"],
        o_bias=attention_bias if features["o_bias"] is None else features["o_bias"],
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=features["qk_norm"],
        sliding_window=_sliding_window(config),
        rope_type=rope_type,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope,
        hidden_act=hidden_act,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=eos_ids,
    )
