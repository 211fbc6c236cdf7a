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
        ``reserve_max_model_len``, ``max_num_mixed_prefill_tokens``,
        ``mixed_prefill_waiting_per_cap``, ``mixed_prefill_max_waiting``,
        ``mixed_prefill_lift_tokens``, ``mixed_prefill_lift_max_waiting``).

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

    Async scheduling: the next step is scheduled before this one's value is known.

    >>> engine.add_request("r1", [4, 5], pagedcore.RequestParams(max_tokens=3))
    1
    >>> batch = engine.schedule()          # r0 decodes 7, r1's prompt
    >>> engine.append_placeholders()       # their samples: values owed; r0 reaches max_tokens
    >>> batch = engine.schedule()          # r1 alone, its input id still on the device
    >>> batch.input_ids.tolist(), batch.deferred_input_indices.tolist(), batch.deferred_input_samples.tolist()
    ([0], [0], [1])
    >>> engine.append_placeholders()
    >>> engine.resolve(np.array([8, 9], dtype=np.int32)).finish_reasons.tolist()  # r0: length
    [2, 0]
    >>> engine.resolve(np.array([6], dtype=np.int32)).token_ids.tolist()
    [6]
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
