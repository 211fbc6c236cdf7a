"""kv_cache_dtype: names vLLM users pass, and clear errors where they cannot work."""

from __future__ import annotations

import pytest

from pagedcore import LLM
from pagedcore.llm_engine import EngineArgs
from test_models_hf import make_checkpoint


def test_unknown_kv_cache_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'int4'"):
        EngineArgs(model="unused", kv_cache_dtype="int4").validate()


def test_fp8_cache_needs_cuda(tmp_path) -> None:
    path = make_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' needs device='cuda' and a bfloat16/float16 model, "
                                         "got device cpu"):
        LLM(model=str(path), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16)
