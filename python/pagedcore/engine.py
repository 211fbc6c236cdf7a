"""Python face of the C++ engine: construction from keyword arguments."""

from __future__ import annotations

from typing import Any

from . import _C


class Engine(_C.Engine):
    """The scheduling core: requests in, step batches out, sampled tokens back.

    Parameters
    ----------
    config : EngineConfig, optional
        A full configuration. Alternatively pass its fields as keyword
        arguments (``num_blocks``, ``block_size``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``,
        ``preemption_mode``, ``scheduling_policy``, ``num_cpu_blocks``,
        ``sliding_window``, ``vocab_size``, ``prefix_hash_bits``,
        ``reserve_max_model_len``).

    Examples
    --------
    >>> import numpy as np, pagedcore
    >>> engine = pagedcore.Engine(num_blocks=64, block_size=16, max_model_len=256)
    >>> engine.add_request("r0", [1, 2, 3], pagedcore.RequestParams(max_tokens=2))
    0
    >>> batch = engine.schedule()          # one prefill row of 3 tokens
    >>> batch.input_ids.tolist(), batch.sample_indices.tolist()
    ([1, 2, 3], [2])
    >>> result = engine.update(np.array([7], dtype=np.int32))
    >>> result.token_ids.tolist(), result.finish_reasons.tolist()
    ([7], [0])
    """

    def __init__(self, config: _C.EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = _C.EngineConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        super().__init__(config)


def stats_dict(stats: _C.EngineStats) -> dict[str, Any]:
    """The fields of an :class:`EngineStats` as a plain dict."""
    return {name: getattr(stats, name) for name in dir(stats) if not name.startswith("_")}
