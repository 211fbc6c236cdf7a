"""What the decoder needs to know about a checkpoint, read from its HF config.

One decoder (:mod:`pagedcore.models.decoder`) serves the Llama family and its
relatives; a :class:`ModelSpec` says which variant a checkpoint is: biases on
q/k/v, q/k norms, rotary scaling, sliding window, tied embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def model_spec_from_config(config: Any) -> ModelSpec:
    """Reads a ``transformers`` config into a :class:`ModelSpec`.

    Raises
    ------
    ValueError
        For an architecture outside :data:`SUPPORTED_ARCHITECTURES` (the message
        names the supported ones) or an unsupported rotary scaling.
    """
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
