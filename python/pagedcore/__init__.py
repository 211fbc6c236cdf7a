"""pagedcore: an LLM inference engine built around PagedAttention.

The core (block allocator, KV cache manager, scheduler, engine) is C++ and is
exposed here as :class:`Engine`. See docs/architecture.md.
"""

from __future__ import annotations

import atexit
import logging

from . import _C
from ._C import (
    EngineConfig,
    EngineStats,
    FinishReason,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    RequestParams,
    StepBatch,
    StepResult,
    cuda_info,
    cuda_smoke_test,
)
from .engine import Engine, stats_dict

__version__ = _C.__version__

# The model layer needs torch and transformers; it is imported on first use so
# that `import pagedcore` (the engine alone) needs neither.
_LAZY = {
    "LLM": ".llm",
    "SamplingParams": ".sampling_params",
    "BeamSearchParams": ".sampling_params",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "BeamSearchOutput": ".beam_search",
    "default_model_path": ".default_model",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedcore' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "default_model_path",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "InternalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "NotFoundError",
    "RequestParams",
    "StepBatch",
    "StepResult",
    "cuda_info",
    "cuda_smoke_test",
    "stats_dict",
]

logger = logging.getLogger("pagedcore")


def _log_sink(level: _C.LogLevel, message: str) -> None:
    logger.log(int(level.value), message)


_C.set_log_sink(_log_sink)
# NOTE: the sink holds a Python callable inside a C++ global; drop it before the
# interpreter goes away, or its destructor would run without an interpreter.
atexit.register(_C.set_log_sink, None)
