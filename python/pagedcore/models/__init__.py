"""Model implementations over the paged KV cache."""

from .decoder import AttentionMetadata, CausalLM
from .spec import SUPPORTED_ARCHITECTURES, ModelSpec, model_spec_from_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CausalLM",
    "ModelSpec",
    "model_spec_from_config",
]
