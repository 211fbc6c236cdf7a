"""The generation loop: requests in, engine steps, model, sampler, outputs out.

:class:`LLMEngine` ties the C++ :class:`pagedcore.Engine` (who runs, which
blocks) to the :class:`ModelRunner` (tensors), the :class:`Sampler` and the
detokenizers. ``LLM`` (offline) and the server drive it with ``add_request``
and ``step``.

Per-request sampling parameters live in arrays indexed by the engine's request
slot, so building a step's sampling metadata is a few numpy gathers, not a
loop over sequences.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _C
from .compact_outputs import CompactOutputs, compact_eligible
from .detokenizer import IncrementalDetokenizer
from .distributed.driver import TP_ONE_GPU_ENV, TP_ONE_RANK_ENV, TensorParallelDriver, tp_one_gpu, tp_one_rank
from .distributed.group import ALLREDUCE_ENV, allreduce_kind
from .distributed.weights import iter_safetensors_shard
from .distributed.worker import WorkerLaunch
from .model_loader import (
    build_uninitialized,
    iter_safetensors,
    load_config_json,
    load_tokenizer_in_background,
    resolve_dtype,
    resolve_model_path,
    with_load_progress,
)
from .kv_scales import K_DIVISOR, V_DIVISOR, calculate_kv_scales, calibration_token_ids
from .model_runner import ModelRunner, kv_bytes_per_block, kv_cache_size_line, profile_peak_memory
from .models import CausalLM, ModelSpec, model_spec_from_config
from .models.parallel import ParallelCausalLM, TensorParallelShard
from .models.spec import config_from_json
from .ops import SUPPORTED_HEAD_DIMS
from .outputs import CompletionOutput, Logprob, RequestOutput
from .prompt_logprobs import logprob_dicts, score_prompt_tokens
from .sampler import HostSamplerOutput, Sampler, SamplerOutput, SamplingMetadata, pack_for_host, unpack_on_host
from .sampling_params import SamplingParams
from .structured_outputs import BitmaskStaging, MaskJob, StructuredOutputManager, device_wait_enabled

logger = logging.getLogger("pagedcore")

#: Seconds a step waiting for its masks (async scheduling) lets the mask thread finish
#: right after the sampler is queued, before it queues the next forward pass.
MASK_HANDOVER_S = 0.0002

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
KV_CACHE_BYTES_ENV = "PAGEDCORE_KV_CACHE_BYTES"
BLOCK_SIZES = (8, 16, 32, 64, 128)  # those the attention kernels are built for
# kv_cache_dtype names (vLLM's) -> the cache's dtype (None: the model's).
# fp8 stores K / k_scale and V / v_scale as e4m3, per layer (see kv_scales.py).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}
_FINISH = {1: "stop", 2: "length", 3: "abort"}


@dataclass
class EngineArgs:
    """Everything ``LLM(...)`` and ``pagedcore serve`` accept, with vLLM's names."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # A step that runs decode rows computes at most this many tokens (its decode
    # rows included; None / 0: no cap), plus as many prompt tokens again for every
    # mixed_prefill_waiting_per_cap requests waiting (0: none), while at most
    # mixed_prefill_max_waiting requests wait; see
    # EngineConfig in cpp/include/pagedcore/config.h. `pagedcore serve` sets it
    # (its --max-num-mixed-prefill-tokens): the streams' inter-token latency.
    max_num_mixed_prefill_tokens: int | None = None
    mixed_prefill_waiting_per_cap: int = 0
    mixed_prefill_max_waiting: int = 8
    # A queue over mixed_prefill_max_waiting lifts the cap to this many tokens
    # (0: the whole budget) while at most mixed_prefill_lift_max_waiting wait.
    mixed_prefill_lift_tokens: int = 0
    mixed_prefill_lift_max_waiting: int = 64
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4
    kv_cache_dtype: str = "auto"
    # fp8 cache: measure each layer's K / V scales at start-up (kv_scales.py), over the
    # checkpoint's if it has some; False: the checkpoint's, else 1 (measured as accurate
    # on the default model: bench/RESULTS.md).
    calculate_kv_scales: bool = False
    seed: int = 0
    enforce_eager: bool = False
    load_format: str = "auto"
    async_output_proc: bool | None = None  # None: on for CUDA, off for the CPU
    # Schedule and launch step n+1 before step n's sampled ids reach the host.
    # None: on for CUDA (unless async_output_proc is False), off for the CPU.
    async_scheduling: bool | None = None
    # Ranks the model is split over (Megatron tensor parallelism; docs/architecture.md).
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        """Checks every field before anything is loaded.

        Raises
        ------
        ValueError
            Naming the first invalid field and its value.
        """
        def positive(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return value

        def flag(name: str, value: Any) -> None:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")

        positive("block_size", self.block_size)
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size!r}")
        positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("max_num_seqs", self.max_num_seqs)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        for name in ("max_num_mixed_prefill_tokens", "mixed_prefill_waiting_per_cap", "mixed_prefill_max_waiting",
                     "mixed_prefill_lift_tokens", "mixed_prefill_lift_max_waiting"):
            value = getattr(self, name)
            if value is None and name == "max_num_mixed_prefill_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not 0 < number("gpu_memory_utilization", self.gpu_memory_utilization) <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if number("swap_space", self.swap_space) < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space!r}")
        flag("enable_prefix_caching", self.enable_prefix_caching)
        flag("enforce_eager", self.enforce_eager)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        flag("calculate_kv_scales", self.calculate_kv_scales)
        if self.calculate_kv_scales and self.tensor_parallel_size > 1:
            # (the calibration pass runs rank 0's shard alone; the workers would not join it)
            raise ValueError(f"calculate_kv_scales does not combine with tensor_parallel_size > 1, got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.async_output_proc not in (None, True, False):
            raise ValueError(f"async_output_proc must be True, False or None, got {self.async_output_proc!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.async_scheduling is True and self.async_output_proc is False:
            raise ValueError("async_scheduling=True needs async_output_proc (a step's outputs come from "
                             "the next call of step()); got async_output_proc=False")


@dataclass
class _Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Streaming: how much of text / tokens / logprobs went out in earlier deltas.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_done: bool = False
    # Structured outputs: the llguidance matcher (None when unconstrained) and
    # whether the grammar's completion ended it (its last token is text, not EOS).
    matcher: Any = None
    grammar_ended: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    first_seq_id: int
    slot: int
    completions: list[_Completion]
    num_finished: int = 0
    stream: bool = False  # outputs are deltas, emitted every step
    # SamplingParams.prompt_logprobs: one entry per prompt token scored so far
    # (None for the first); a streamed request sends them once, whole.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    compact: bool = False  # its tokens go to take_compact_outputs() (add_request's compact_key)

    @property
    def seq_ids(self) -> range:
        return range(self.first_seq_id, self.first_seq_id + len(self.completions))


@dataclass
class _Launched:
    """A step launched with async scheduling whose sampled ids the engine waits for."""

    num_samples: int
    copy: _HostCopy | None  # their way to the host (None: no samples)
    device_ids: torch.Tensor | None  # [num_samples] int64 on the device: the next step's deferred inputs
    compact: tuple[np.ndarray, np.ndarray] | None = None  # see LLMEngine._compact_rows


@dataclass
class _StepOutputs:
    """One updated step's results, copied to the host, waiting to be processed."""

    seq_ids: list[int]
    token_ids: list[int]
    finish_reasons: list[int]
    stop_reasons: list[int]
    sampled_logprobs: list[float] | None  # None: no request of the step wants logprobs
    top: tuple[list, list, list] | None  # logprob token ids, logprobs, ranks
    # (slots, compact keys) of the sample rows at schedule time (LLMEngine._compact_rows),
    # and the update's token ids, finish reasons and stop reasons as arrays; None when
    # no compact request was live then.
    compact: tuple[np.ndarray, np.ndarray] | None = None
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class _HostCopy:
    """One step's sampler output on its way to the host (see :class:`_HostCopies`)."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None, like: SamplerOutput) -> None:
        self._host, self._event, self._like = host, event, like

    def wait(self) -> HostSamplerOutput:
        """Waits for the copy (CUDA) and unpacks it; the buffer is free again afterwards."""
        if self._event is not None:
            self._event.synchronize()
        return unpack_on_host(self._host, self._like)


class _HostCopies:
    """Brings each step's sampler output to the host in one copy.

    On CUDA the output is packed on the device (:func:`pack_for_host`: tokens,
    sampled logprobs and, when asked for, the top-k ids, logprobs and ranks), copied
    without blocking into a pinned buffer, and an event is recorded behind the copy;
    the host waits on that event alone, instead of one synchronising ``.cpu()`` per
    field. On the CPU the packed tensor is read where it is (no pinning, no copy).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        # NOTE: two buffers, used in turn, each with its event: a step's copy never
        # lands in the buffer the host read last, so nothing the host may still be
        # unpacking is overwritten (today at most one step is in flight and it is
        # read before the next launch; the second buffer keeps that from mattering).
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else []
        self._next = 0

    def launch(self, out: SamplerOutput) -> _HostCopy:
        packed = pack_for_host(out)
        if not self._cuda:
            return _HostCopy(packed, None, out)
        i, self._next = self._next, 1 - self._next
        size = packed.numel()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < size:  # grown rarely: reused across steps
            old = 0 if buffer is None else buffer.numel()
            buffer = self._buffers[i] = torch.empty(max(size, 2 * old), dtype=torch.float64, pin_memory=True)
        host = buffer[:size]
        host.copy_(packed, non_blocking=True)
        self._events[i].record()
        return _HostCopy(host, self._events[i], out)


class _SlotArrays:
    """Per-request sampling parameters, indexed by the engine's request slot."""

    def __init__(self) -> None:
        self.size = 0
        self._grow(64)

    def _grow(self, size: int) -> None:
        def resized(name: str, dtype: Any, fill: Any) -> np.ndarray:
            out = np.full(size, fill, dtype=dtype)
            old = getattr(self, name, None)
            if old is not None:
                out[: old.shape[0]] = old
            return out

        self.temperature = resized("temperature", np.float32, 1.0)
        self.top_k = resized("top_k", np.int32, 0)
        self.top_p = resized("top_p", np.float32, 1.0)
        self.min_p = resized("min_p", np.float32, 0.0)
        self.num_logprobs = resized("num_logprobs", np.int32, -1)  # -1: no logprobs
        self.seeded = resized("seeded", np.bool_, False)
        self.seed = resized("seed", np.int64, 0)
        self.min_tokens = resized("min_tokens", np.int32, 0)
        self.penalized = resized("penalized", np.bool_, False)
        self.compact_key = resized("compact_key", np.int64, -1)  # -1: not a compact request
        self.size = size

    def set(self, slot: int, p: SamplingParams) -> None:
        if slot >= self.size:
            self._grow(max(2 * self.size, slot + 1))
        int32_max = np.iinfo(np.int32).max  # beyond any vocabulary or length: same meaning
        self.temperature[slot] = p.temperature
        self.top_k[slot] = min(p.top_k, int32_max)
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.seeded[slot] = p.seed is not None
        self.seed[slot] = p.seed or 0
        self.min_tokens[slot] = min(p.min_tokens, int32_max)
        self.penalized[slot] = (
            p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        )
        self.compact_key[slot] = -1


class _Phases:
    """Wall time of each start-up phase, for the debug log."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.times.append((name, now - self.last))
        logger.debug("start-up: %s in %.3f s", name, now - self.last)
        self.last = now

    def log(self) -> None:
        logger.debug("start-up: ready in %.3f s (%s)", self.last - self.start,
                     ", ".join(f"{name} {t:.3f} s" for name, t in self.times))


WARM_SAMPLING_ENV = "PAGEDCORE_WARM_SAMPLING"


def warm_sampling() -> bool:
    """Whether a CUDA engine runs a step's sampling for every row count at start-up
    (LLMEngine._warm_sampling): PAGEDCORE_WARM_SAMPLING, 1 (the default) or 0."""
    value = os.environ.get(WARM_SAMPLING_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{WARM_SAMPLING_ENV} must be 0 or 1, got {value!r}")
    return value != "0"


def _prompt_ids(token_ids: Sequence[int], vocab_size: int) -> tuple[list[int], int | None]:
    """The prompt's ids as Python ints, and the first one outside [0, vocab_size)
    (None if none is). A list or array of integers goes through numpy (a Python loop
    over a 4k-token prompt costs ~0.5 ms); anything else through int()."""
    if isinstance(token_ids, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError):  # (ragged nesting: int() below says what is wrong)
            arr = np.zeros((0, 0))
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            outside = np.flatnonzero((arr < 0) | (arr >= vocab_size))
            return arr.tolist(), (int(arr[outside[0]]) if outside.size else None)
    ids = [int(t) for t in token_ids]
    return ids, next((t for t in ids if not 0 <= t < vocab_size), None)


class LLMEngine:
    """Generation over a paged KV cache; see :class:`pagedcore.LLM` for the arguments."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        phases = _Phases()
        self.device = self._pick_device(args.device)
        model_path = resolve_model_path(args.model)
        # NOTE: config.json is parsed directly (config_from_json gives what
        # transformers' AutoConfig gives, tested field by field): importing
        # transformers' config machinery takes ~2 s.
        hf_config = config_from_json(load_config_json(model_path))
        self.spec: ModelSpec = model_spec_from_config(hf_config)
        if self.spec.head_dim not in SUPPORTED_HEAD_DIMS:
            # NOTE: refused here, before any weight loads; the first forward pass
            # would otherwise fail inside the attention op.
            raise ValueError(f"unsupported head_dim: {self.spec.head_dim} (config.json of {model_path}); "
                             f"the attention kernels serve head dims {SUPPORTED_HEAD_DIMS}")
        self.dtype = resolve_dtype(args.dtype, hf_config, device=self.device.type)
        self.kv_dtype = self._kv_dtype(args.kv_cache_dtype)
        warm = warm_sampling()  # (the switch checked on every device, before anything loads)
        # The tokenizer loads in a thread while the weights load (see load_tokenizer_in_background).
        tokenizer = load_tokenizer_in_background(resolve_model_path(args.tokenizer) if args.tokenizer else model_path)
        phases.done("config")
        torch.manual_seed(args.seed)

        # Tensor parallelism: this process is rank 0 (the engine and the sampler live
        # here); the workers build their shards alongside, in step with the
        # collectives below (pagedcore.distributed).
        self.tp: TensorParallelDriver | None = None
        shard = None
        if self._tp_one_rank() or args.tensor_parallel_size > 1:  # (the switch checked first, always)
            shard = TensorParallelShard(self.spec, 0, args.tensor_parallel_size)  # (checks the shapes)
            self.tp = self._start_workers(model_path)
        try:
            self.model = load_model(args, model_path, self.spec, self.dtype, self.device, shard, phases)
            if self.tp is not None:
                self.tp.connect()  # (the workers imported torch while the weights loaded)
            self.tokenizer = tokenizer.result()
            self.eos_token_ids = self._eos_token_ids(model_path)
            phases.done("tokenizer (rest)")
            self.kv_scale_source: str | None = None  # fp8 caches: where the layers' scales came from
            if self.kv_dtype == torch.float8_e4m3fn:
                # NOTE: before the runner captures CUDA graphs, which bake the scales in.
                self.kv_scale_source = self._set_kv_scales(args.calculate_kv_scales)
                phases.done("KV-cache scales")
            with self._tp_guard():
                engine_config = self._engine_config()
            if engine_config.max_model_len != self.model.max_positions:  # capped to the cache
                self.model.init_rotary(engine_config.max_model_len)
            self.engine = _C.Engine(engine_config)
            with self._tp_guard():
                self.runner = ModelRunner(self.model, engine_config, self.device, self.kv_dtype, args.enforce_eager,
                                          tp_driver=self.tp)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise
        phases.done("KV cache" if self.device.type == "cpu" or args.enforce_eager else "KV cache, CUDA graphs")
        self.sampler = Sampler()
        self._host_copies = _HostCopies(self.device)
        if self.device.type == "cuda" and self.tp is None and warm:
            self._warm_sampling(engine_config.max_num_seqs)
            phases.done("sampling warm-up")
        phases.log()
        self._slots = _SlotArrays()
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, tuple[_Request, int]] = {}
        self._prompt_masks: dict[str, torch.Tensor] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._structured: StructuredOutputManager | None = None  # built on first use
        self._matchers: dict[int, Any] = {}  # seq id -> matcher of a live constrained sequence
        self._bitmask_staging: BitmaskStaging | None = None  # built on first use
        # The masks of the next sampling step, being computed (see _start_masks).
        self._mask_job: MaskJob | None = None
        self._next_id = 0
        # Async output processing: step() launches step n+1 on the device before it
        # turns step n's tokens into outputs (see step()).
        self._async_output = (self.device.type == "cuda" if args.async_output_proc is None
                              else args.async_output_proc)
        # Async scheduling: step() schedules and launches step n+1 before step n's
        # sampled ids reach the host (see _step_async).
        self._async_scheduling = (self.device.type == "cuda" and args.async_output_proc is not False
                                  if args.async_scheduling is None else args.async_scheduling)
        self._launched: _Launched | None = None
        # (serving diagnostics) prompt tokens (chunks of more than one token) of the
        # steps that the last step() call scheduled: see step_prompt_tokens.
        self.step_prompt_tokens = 0
        # A step scheduled and its forward pass launched, not yet sampled (see _step_async).
        self._prelaunched: tuple[_C.StepBatch, torch.Tensor] | None = None
        self._inflight: tuple[_C.StepBatch, _HostCopy | None, Any] | None = None
        self._pending: _StepOutputs | None = None
        self._num_compact = 0  # live compact requests (add_request's compact_key)
        self._compact_parts: list[CompactOutputs] = []  # for take_compact_outputs()
        # Sequences a stop string finished while a step holding them was in flight:
        # the engine finishes them once that step is updated (its token is dropped).
        self._late_stops: list[tuple[int, str]] = []  # (seq id, request id)
        # Requests the engine has forgotten (all sequences finished) whose last
        # outputs are not processed yet.
        self._engine_done: set[str] = set()

    # ---- set-up -------------------------------------------------------------

    def _tp_one_rank(self) -> bool:
        """$PAGEDCORE_TP_ONE_RANK=1 (see distributed/driver.py), checked against the arguments."""
        if not tp_one_rank():
            return False
        if self.args.tensor_parallel_size != 1:
            raise ValueError(f"${TP_ONE_RANK_ENV}=1 runs the tensor-parallel path in a group of one rank: it needs "
                             f"tensor_parallel_size=1, got tensor_parallel_size={self.args.tensor_parallel_size}")
        return True

    def _start_workers(self, model_path: str) -> TensorParallelDriver:
        size = self.args.tensor_parallel_size
        one_gpu, symm_mem = None, allreduce_kind() == "symm_mem"
        if symm_mem and self.device.type != "cuda":
            raise ValueError(f"${ALLREDUCE_ENV}=symm_mem needs GPUs (NCCL), got device {self.device.type}")
        if symm_mem and tp_one_gpu():
            raise ValueError(f"${ALLREDUCE_ENV}=symm_mem needs a GPU a rank, got ${TP_ONE_GPU_ENV}=1 (its kernel "
                             f"spins until every rank's has arrived; two processes' kernels do not run side by side "
                             f"on one GPU)")
        if tp_one_gpu() and self.device.type == "cuda":
            # A test of the GPU path's sharding on one GPU (distributed/group.py's
            # staged collectives): gloo cannot be captured in a CUDA graph, and the
            # ranks' memory profiles would see each other's.
            if not self.args.enforce_eager:
                raise ValueError(f"${TP_ONE_GPU_ENV}=1 needs enforce_eager=True (its collectives go through "
                                 f"host copies, which CUDA graphs cannot capture), got enforce_eager=False")
            if self.args.num_kv_blocks is None:
                raise ValueError(f"${TP_ONE_GPU_ENV}=1 needs num_kv_blocks (the ranks share one GPU's memory), "
                                 f"got num_kv_blocks=None")
            one_gpu = self.device.index if self.device.index is not None else torch.cuda.current_device()
        elif self.device.type == "cuda":
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees "
                                 f"{torch.cuda.device_count()}")
            # Rank r runs on cuda:r; the driver is rank 0.
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        launch = WorkerLaunch(args=self.args, model_path=model_path, spec=self.spec, dtype=self.dtype,
                              kv_dtype=self.kv_dtype, device_type=self.device.type, size=size, port=0,
                              log_level=max(logger.getEffectiveLevel(), logging.WARNING), one_gpu_index=one_gpu,
                              symm_mem=symm_mem)
        return TensorParallelDriver(launch, self.device)

    def _tp_guard(self) -> Any:
        """Start-up collectives with the workers: a dead worker becomes a clear error."""
        return self.tp.guard() if self.tp is not None else contextlib.nullcontext()

    def healthy(self) -> bool:
        """False once a tensor-parallel worker has died (the engine cannot step any more)."""
        return self.tp is None or self.tp.alive()

    def health_error(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker died or
        failed: which one, its exit code), or None while :meth:`healthy`."""
        return None if self.tp is None else self.tp.failure()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing to do with one rank). The
        engine cannot step afterwards. Idempotent; also runs at interpreter exit."""
        if self.tp is not None:
            self.tp.shutdown()

    @staticmethod
    def _pick_device(device: str) -> torch.device:
        cuda_ok = torch.cuda.is_available() and _C.cuda_info()["compiled"]
        if device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if cuda_ok else torch.device("cpu")
        if device == "cuda":
            if not cuda_ok:
                raise ValueError(
                    "device='cuda' needs a GPU and pagedcore built with its CUDA kernels "
                    f"(torch sees {torch.cuda.device_count()} GPUs; cuda_info: {_C.cuda_info()})"
                )
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(device)

    def _kv_dtype(self, name: str) -> torch.dtype:
        if KV_CACHE_DTYPES[name] is None:
            return self.dtype
        if self.device.type == "cuda" and self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"kv_cache_dtype {name!r} on CUDA needs a bfloat16/float16 model, got dtype {self.dtype}"
            )
        return KV_CACHE_DTYPES[name]

    def _set_kv_scales(self, calculate: bool) -> str:
        """Sets the layers' fp8 cache scales: calculated at start-up when ``calculate``,
        else the checkpoint's, else 1. Returns where they came from: ``"calculated"``,
        ``"checkpoint"`` or ``"one"``."""
        model = self.model
        ids: list[int] = []
        if calculate:
            # (Ids the model's embedding lacks are dropped: a tokenizer from another directory.)
            ids = [i for i in calibration_token_ids(self.tokenizer) if i < self.spec.vocab_size]
            ids = ids[:model.max_positions]
        if ids:
            calculate_kv_scales(model, ids)
            source, how = "calculated", f"calculated over {len(ids)} tokens (amax / {K_DIVISOR:g}, {V_DIVISOR:g})"
        elif model.checkpoint_kv_scales:
            source, how = "checkpoint", "the checkpoint"
        else:  # (the layers' default)
            source, how = "one", "none (1)"
        ks, vs = [layer.k_scale for layer in model.layers], [layer.v_scale for layer in model.layers]
        logger.info("fp8 KV-cache scales: %s; k_scale %.4g..%.4g, v_scale %.4g..%.4g", how, min(ks), max(ks),
                    min(vs), max(vs))
        return source

    def _eos_token_ids(self, path: str) -> list[int]:
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        # generation_config.json's eos_token_id (what GenerationConfig.from_pretrained
        # reads), parsed directly: importing transformers' generation package is slow.
        try:
            with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None  # none, or unreadable: the config's and the tokenizer's ids
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return sorted(ids)

    def _engine_config(self) -> _C.EngineConfig:
        a, spec = self.args, self.spec
        # Per rank under tensor parallelism: each rank caches its own kv heads.
        rank_spec = self.model.spec
        per_block = kv_bytes_per_block(rank_spec, a.block_size, self.kv_dtype)
        max_batched = max_batched_tokens(a, self.device)
        if self.tp is not None:
            self.tp.group.barrier()  # (the workers' weights are loaded: the profiling pass runs on all)
        num_blocks = local_kv_blocks(a, self.model, self.kv_dtype, self.device, max_batched)
        if self.tp is not None:
            num_blocks = self.tp.group.min_int(num_blocks)  # the rank with the least memory decides
        max_model_len = a.max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} is larger than the model's "
                f"max_position_embeddings ({spec.max_position_embeddings})"
            )
        capacity = num_blocks * a.block_size
        if a.max_model_len is None and capacity < max_model_len:
            logger.info("max_model_len %d (the model's) capped to %d, what the KV cache holds",
                        max_model_len, capacity)
            max_model_len = capacity
        if capacity < max_model_len:
            raise ValueError(
                f"max_model_len {max_model_len} needs more KV cache than {num_blocks} blocks "
                f"x {a.block_size} tokens ({capacity}); raise num_kv_blocks / "
                f"kv_cache_memory_bytes or lower max_model_len"
            )
        num_cpu_blocks = 0
        if a.preemption_mode == "swap":
            num_cpu_blocks = max(1, int(a.swap_space * 2**30) // per_block)
        logger.info("# KV cache blocks: %d", num_blocks)
        logger.info(kv_cache_size_line(rank_spec, num_blocks, a.block_size, self.kv_dtype))
        if self.tp is not None:
            size = a.tensor_parallel_size
            ranks = [kv_bytes_per_block(TensorParallelShard(spec, r, size).local_spec, a.block_size, self.kv_dtype)
                     for r in range(size)]
            logger.info("KV cache per rank: %s (kv heads %s of %d); %d rank%s: %s in total",
                        " / ".join(_bytes(num_blocks * b) for b in ranks),
                        " / ".join(str(TensorParallelShard(spec, r, size).num_kv_heads) for r in range(size)),
                        spec.num_kv_heads, size, "s" if size > 1 else "", _bytes(num_blocks * sum(ranks)))
        fields = dict(
            num_blocks=num_blocks,
            block_size=a.block_size,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_prefix_caching=a.enable_prefix_caching,
            preemption_mode=a.preemption_mode,
            num_cpu_blocks=num_cpu_blocks,
            sliding_window=spec.sliding_window or None,
            vocab_size=spec.vocab_size,
            max_num_mixed_prefill_tokens=a.max_num_mixed_prefill_tokens or 0,
            mixed_prefill_waiting_per_cap=a.mixed_prefill_waiting_per_cap,
            mixed_prefill_max_waiting=a.mixed_prefill_max_waiting,
            mixed_prefill_lift_tokens=a.mixed_prefill_lift_tokens,
            mixed_prefill_lift_max_waiting=a.mixed_prefill_lift_max_waiting,
        )
        if self.tp is not None:
            self.tp.group.broadcast_object(fields)
        return _C.EngineConfig(**fields)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    # ---- requests -------------------------------------------------------------

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int] | None,
        params: SamplingParams,
        stream: bool = False,
        add_special_tokens: bool = True,
        detokenize: bool = True,
        compact_key: int | None = None,
    ) -> None:
        """Tokenizes (if needed), validates and queues one request.

        With ``stream``, :meth:`step` returns this request's new text and tokens
        every step (``RequestOutput`` with ``finished=False`` and delta
        completions), not only the full result at the end. ``detokenize=False``
        (streamed requests without stop strings only) leaves the deltas' text
        empty: the caller turns the token ids into text (the server does, in its
        HTTP process, off the engine's path). The token that ends a completion
        with finish_reason "stop" (EOS or a stop token) is not text.

        ``compact_key`` (an integer >= 0, with ``stream=True, detokenize=False``
        and params that :func:`~pagedcore.compact_outputs.compact_eligible`
        accepts): the request's tokens come out of :meth:`take_compact_outputs`
        as rows under that key, not from :meth:`step` (which returns nothing
        for it; :meth:`abort` still returns its final output). The caller keeps
        keys unique among live requests.

        Raises ValueError (nothing is queued) for an empty or too long prompt,
        a max_tokens that does not fit the context, or a bad token id.
        """
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a prompt needs either text or prompt_token_ids")
            # NOTE: a chat-templated prompt holds its special tokens already.
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not detokenize and (not stream or params.stop):
            raise ValueError("detokenize=False needs stream=True and no stop strings (they are matched on the text)")
        if compact_key is not None:
            if isinstance(compact_key, bool) or not isinstance(compact_key, int) or compact_key < 0:
                raise ValueError(f"compact_key must be an integer >= 0, got {compact_key!r}")
            if detokenize or not compact_eligible(params):
                raise ValueError("compact_key needs stream=True, detokenize=False and one sample without "
                                 "logprobs, prompt logprobs, stop strings, penalties or an output constraint")
        if not self._async_scheduling and any(owner == request_id for _, owner in self._late_stops):
            # A stop string ended it while a step held it: the engine lets the id go
            # once that step is updated.
            self._complete_inflight()
        ids, bad = _prompt_ids(prompt_token_ids, self.spec.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})"
            )
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside [0, {self.spec.vocab_size})")
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(room, 1)
        if params.max_tokens is not None and params.max_tokens > max(room, 1):
            raise ValueError(
                f"max_tokens {params.max_tokens} is larger than what max_model_len "
                f"({self.max_model_len}) leaves after the {len(ids)}-token prompt ({room})"
            )
        stop_ids = list(params.stop_token_ids or [])
        engine_params = _C.RequestParams(
            n=params.n,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=stop_ids,
            prompt_logprobs=params.prompt_logprobs is not None,
        )
        # Everything that can fail is built before the engine takes the request,
        # so that a failure leaves nothing half-admitted.
        detokenizers = [None] * params.n
        if params.stop or (stream and detokenize):
            detokenizers = [
                IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                    stop=list(params.stop or []), include_stop_str_in_output=params.include_stop_str_in_output,
                )
                for _ in range(params.n)
            ]
        mask = None
        if params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1:
            mask = torch.zeros(self.spec.vocab_size, dtype=torch.bool)
            mask[torch.tensor(ids)] = True
        logprobs = params.logprobs is not None
        completions = [
            _Completion(index=i, logprobs=[] if logprobs else None, detokenizer=detokenizers[i])
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer, self.spec.vocab_size,
                                                           self.eos_token_ids)
            try:
                for c in completions:  # each sample its own matcher
                    c.matcher = self._structured.new_matcher(params.structured_outputs)
            except BaseException:
                self._free_matchers(completions)
                raise
        try:
            first = self.engine.add_request(request_id, ids, engine_params)
        except BaseException:
            self._free_matchers(completions)
            raise
        try:
            slot = self.engine.request_slot(request_id)
            self._slots.set(slot, params)
            if compact_key is not None:
                self._slots.compact_key[slot] = compact_key
        except BaseException:
            self._free_matchers(completions)
            self._complete_inflight()  # the engine takes no abort while a step is pending
            self.engine.abort(request_id)
            raise
        request = _Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=ids, params=params,
            first_seq_id=first, slot=slot, completions=completions, stream=stream,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            compact=compact_key is not None,
        )
        self._num_compact += request.compact
        self._requests[request_id] = request
        for i in range(params.n):
            self._seq_owner[first + i] = (request, i)
            if completions[i].matcher is not None:
                self._matchers[first + i] = completions[i].matcher
        if mask is not None:
            self._prompt_masks[request_id] = mask

    def _free_matchers(self, completions: list[_Completion]) -> None:
        """Lets the matchers of a request that was not admitted go (the C++ grammar
        worker's are freed explicitly)."""
        for c in completions:
            if c.matcher is not None:
                self._structured.free(c.matcher)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drops a request; returns its output (finish_reason 'abort') if it was live."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        # The engine takes no abort while a step is pending (scheduled, its tokens not
        # given); with async scheduling none is between calls: unresolved ones drop
        # the request's samples when they resolve.
        self._complete_inflight()
        if request_id not in self._engine_done:
            self.engine.abort(request_id)
        for c in request.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        return self._finish_request(request)

    def has_request(self, request_id: str) -> bool:
        """Whether the request is live (added, its final output not yet returned)."""
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        # NOTE: a step in flight may hold only sequences whose requests are done
        # (stop strings found while it ran); the next step() settles it.
        return (bool(self._requests) or self._inflight is not None or self._launched is not None
                or self._prelaunched is not None)

    def stats(self) -> dict[str, Any]:
        return _C_stats(self.engine)

    def take_compact_outputs(self) -> CompactOutputs | None:
        """The tokens of compact requests (add_request's ``compact_key``) that
        the :meth:`step` calls since the last call produced, in order; None if none."""
        if not self._compact_parts:
            return None
        parts, self._compact_parts = self._compact_parts, []
        return CompactOutputs.concat(parts)

    def _compact_rows(self, batch: _C.StepBatch) -> tuple[np.ndarray, np.ndarray] | None:
        """(slot, compact key) of each sample row as the step is scheduled; None
        while no compact request is live. NOTE: taken now, not when the step is
        processed: a request aborted meanwhile may have passed its slot on (see _process)."""
        if not self._num_compact or not batch.num_samples:
            return None
        slots = np.array(batch.sample_slots, dtype=np.int64)
        return slots, self._slots.compact_key[slots]

    # ---- one step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the finished requests (and stream deltas).

        With async output processing (``async_output_proc``, on by default on
        CUDA) a step's sampled tokens are turned into outputs during the next
        call, while the device runs the next step's forward pass: a call
        updates the step launched by the previous call, schedules and launches
        a new one, then detokenizes and returns the previous step's outputs.
        A sequence that a stop string ends this way was already scheduled
        once more; that step's token for it is dropped and the engine finishes
        it when the step is updated. Greedy and seeded outputs are the same
        either way (up to the batch-size sensitivity of GPU kernels).

        With async scheduling (``async_scheduling``, on by default on CUDA) the
        next step is also scheduled and launched before the previous step's
        tokens reach the host: see :meth:`_step_async`.
        """
        self.step_prompt_tokens = 0
        if self._async_scheduling:
            return self._step_async()
        self._complete_inflight()
        batch = self._schedule()
        try:
            logits = self.runner.execute(batch)
            # NOTE: before the sampling metadata, whose penalties count the outputs so far.
            outputs = self._process_pending(step_pending=True, next_batch=batch)
            sampled = None
            if batch.num_samples:
                # One copy of everything the host needs, waited for in _complete_inflight.
                sampled = self._host_copies.launch(self.sampler(logits, self._sampling_metadata(batch)))
            self._join_masks()
            if batch.num_prompt_logprob_tokens:
                self._score_prompts(batch)
        except BaseException:
            self._join_masks(failed=True)
            self._fail_step(batch.num_samples)
            raise
        self._inflight = (batch, sampled, self._compact_rows(batch))
        if not self._async_output or batch.num_samples == 0:
            self._complete_inflight()
            try:
                outputs += self._process_pending(step_pending=False)
            except BaseException:
                self._abort_all()
                raise
            if self._requests and not self.engine.has_unfinished_requests():
                # An internal error, never expected: without this, callers looping on
                # has_unfinished_requests() would spin forever.
                raise RuntimeError(f"the engine ended every request, yet {sorted(self._requests)} remain")
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One step with async scheduling: schedules step n+1 and launches it before
        step n's sampled ids reach the host, then resolves step n and returns its outputs.

        The engine appends a placeholder token per sample of step n+1 right away
        (sequences grow, length stops apply); the runner takes the inputs of
        step n+1's decode rows from step n's sampled ids on the device. A sequence
        that step n ends (EOS, stop token, stop string) was scheduled once more; that
        sample is dropped when step n+1 resolves. Steps whose sampling needs step n's
        tokens on the host (penalties count them, grammars consume them) resolve step
        n before their sampling metadata is built: the forward pass is queued by then.
        Such a step also schedules and launches the next forward pass right after its
        sampling (``_prelaunched``, taken by the next call): the device then runs it
        while the host returns, resolves this step and builds the next masks, instead
        of idling through the next call's scheduling and launch.
        """
        prev, self._launched = self._launched, None
        outputs: list[RequestOutput] = []
        prelaunched, self._prelaunched = self._prelaunched, None
        if prelaunched is None:
            batch = self._schedule()
            self.engine.append_placeholders()
        else:
            batch, logits = prelaunched
        waited = False
        try:
            if prelaunched is None:
                logits = self.runner.execute(batch, None if prev is None else prev.device_ids)
            if prev is not None and batch.num_samples and self._needs_host_tokens(batch):
                prev, outputs, waited = None, self._resolve_launched(prev, next_batch=batch), True
            launched = _Launched(batch.num_samples, None, None)
            if batch.num_samples:
                out = self.sampler(logits, self._sampling_metadata(batch))
                launched = _Launched(batch.num_samples, self._host_copies.launch(out), out.sampled_token_ids,
                                     self._compact_rows(batch))
            if not waited:  # (masks started by the metadata: joined before the resolution below)
                self._join_masks()
            elif self._mask_job is not None and self._bitmask_staging.device_wait and self._structured.worker is None:
                # NOTE: the mask thread, done, may wait for the GIL to write the device's
                # flag (up to the 5 ms switch interval while this thread runs Python);
                # a short wait hands it over. Masks that are not done by then are joined
                # once the next forward pass is queued. (The C++ worker stores the flag
                # without the GIL: no hand-over.)
                self._mask_job.wait(MASK_HANDOVER_S)
            if batch.num_prompt_logprob_tokens:
                self._score_prompts(batch)
        except BaseException:
            self._join_masks(failed=True)
            self._fail_unresolved()
            raise
        self._launched = launched
        if prev is not None:
            outputs += self._resolve_launched(prev)
        if launched.num_samples == 0:  # nothing to wait for: resolved at once
            self._launched = None
            self._resolve_launched(launched)
        elif waited and self.engine.has_unfinished_requests():
            # NOTE: the engine holds two unresolved steps at most, as in the other
            # path: this one and the next, which the next call resolves this one before
            # it samples (it needs this step's tokens on the host, as this one did).
            try:
                following = self._schedule()
                self.engine.append_placeholders()
                self._prelaunched = (following, self.runner.execute(following, launched.device_ids))
            except BaseException:
                self._join_masks(failed=True)
                self._fail_unresolved()
                raise
        if waited:
            # NOTE: the masks are joined only once the next forward pass is queued too:
            # when they take longer than queuing the sampler, the device then runs the
            # sampler and that forward pass back to back once they are in.
            try:
                self._join_masks()
            except BaseException:
                self._fail_unresolved()
                raise
        if self._requests and self._launched is None and not self.engine.has_unfinished_requests():
            raise RuntimeError(f"the engine ended every request, yet {sorted(self._requests)} remain")
        return outputs

    def _warm_sampling(self, max_rows: int) -> None:
        """Runs a greedy step's logits, sampling and copy to the host once for every
        row count up to ``max_rows``, at start-up (CUDA).

        NOTE: outside the decode graphs these are eager launches whose kernels
        depend on the row count (cuBLAS's product for the logits, or ops.linear's
        up to its rows; the sampler's reductions and element-wise kernels pick
        variants by size). With CUDA's lazy loading (the default since 12.2) a
        kernel's first use loads it, and loading may synchronise the context: the
        host then waits for the step in flight. Serving at half load, the mixed
        passes' host time had p99 4.8-5.2 ms against 1.4 at p50 (SmolLM2), 10.9
        against 1.3 (the 8B shape: about one device step). PAGEDCORE_WARM_SAMPLING=0
        skips this (a measurement switch). Measured on an H100 at 19f3a1c: without
        it, a fresh server's first half-load turns spent ~5.5 ms of CPU after their
        launch (bench/RESULTS.md, the thirty-sixth session). Under `serve`'s eager
        module loading (cli.prefer_eager_module_loading) it is still needed: without
        it, 2 and 6 such turns in the first 0.5 s (the thirty-seventh session)."""
        dev = self.device
        hidden = torch.zeros((max_rows, self.spec.hidden_size), dtype=self.dtype, device=dev)
        for rows in range(1, max_rows + 1):
            logits = self.runner.compute_logits(hidden[:rows])
            md = SamplingMetadata(
                temperature=torch.zeros(rows, dtype=torch.float32, device=dev),
                top_k=torch.zeros(rows, dtype=torch.int32, device=dev),
                top_p=torch.ones(rows, dtype=torch.float32, device=dev),
                min_p=torch.zeros(rows, dtype=torch.float32, device=dev),
                all_greedy=True, all_random=False, no_top_k=True, no_top_p=True, no_min_p=True,
                need_sampled_logprobs=False,
            )
            self._host_copies.launch(self.sampler(logits, md)).wait()

    @property
    def pipelined(self) -> bool:
        """Whether a :meth:`step` call returns the outputs of a step that an
        earlier call launched (async output processing or scheduling): its wall
        time then is mostly the wait for that step's forward pass."""
        return self._async_output or self._async_scheduling

    def _schedule(self) -> _C.StepBatch:
        """The next step's batch (Engine.schedule), its prompt tokens counted in step_prompt_tokens."""
        batch = self.engine.schedule()
        # (leading rows have one new token each: decode rows; the rest are prompt chunks)
        self.step_prompt_tokens += batch.num_tokens - batch.num_decode_seqs
        return batch

    def _needs_host_tokens(self, batch: _C.StepBatch) -> bool:
        """Whether sampling the step needs the previous step's tokens on the host:
        penalties count the outputs, grammar matchers consume them.

        NOTE: only the step's own rows count: a matcher of a sequence outside the
        batch (waiting, preempted) is advanced when the step holding its last token
        resolves, which is before that sequence samples again.
        """
        if self._matchers and any(seq_id in self._matchers for seq_id in batch.sample_seq_ids.tolist()):
            return True
        return bool(self._slots.penalized[batch.sample_slots].any())

    def _resolve_launched(self, launched: _Launched, next_batch: _C.StepBatch | None = None) -> list[RequestOutput]:
        """Waits for a launched step's sampled ids, gives them to the engine
        (``resolve``) and turns them into outputs (``next_batch``: see _process)."""
        try:
            token_ids, sampled_lp, top = self._host_tokens(launched.copy)
        except BaseException:
            self._fail_unresolved()
            raise
        try:
            result = self.engine.resolve(token_ids)
            out = _step_outputs(result, sampled_lp, top, launched.compact)
            self._note_update(out.seq_ids, out.finish_reasons, result.finished_request_ids)
            outputs = self._process(out, next_batch)
            # NOTE: the engine finishes stop strings' sequences at once (no step is
            # pending); the unresolved step that holds them drops their samples.
            self._apply_late_stops()
            return outputs
        except BaseException:
            self._fail_unresolved()
            raise

    def _fail_unresolved(self) -> None:
        """After a failure with async scheduling: placeholders for every step the
        engine waits on, then every request dropped (see _fail_step)."""
        self._launched = self._prelaunched = None
        ended: set[int] = set()
        while self.engine.num_unresolved_steps:
            result = self.engine.resolve(np.zeros(self.engine.num_unresolved_samples, dtype=np.int32))
            ended |= self._note_update(result.seq_ids.tolist(), result.finish_reasons.tolist(),
                                       result.finished_request_ids)
        self._abort_all(ended)

    def _host_tokens(self, copy: _HostCopy | None) -> tuple[np.ndarray, Any, Any]:
        """A step's sampled ids, sampled logprobs and top logprobs, once on the host
        (``copy``: the step's host copy; None: it sampled nothing).

        Under tensor parallelism the group's failure, if any, is raised first, before
        anything uses the step (its prompt logprobs too). NOTE: a worker that died
        while the step ran leaves the driver's NCCL all-reduces waiting; the watchdog
        then aborts the group, which ends them with partial sums, so the step's
        tokens are not the model's. The watchdog names the worker before it aborts:
        a step whose tokens could be wrong always finds the failure here. (A step
        that ran whole before the worker died is dropped the same way: the two
        cannot be told apart.)"""
        host = copy.wait() if copy is not None else None
        if self.tp is not None:
            self.tp.check()
        if host is None:
            return np.empty(0, dtype=np.int32), None, None
        if (host.token_ids < 0).any():  # the sampler's mark of NaN / all -inf logits
            raise RuntimeError("the model produced logits with nothing to sample (NaN?)")
        return host.token_ids, host.sampled_logprobs, host.top

    def _complete_inflight(self) -> None:
        """Waits for the launched step's tokens and updates the engine with them."""
        if self._inflight is None:
            return
        batch, sampled, compact = self._inflight
        self._inflight = None
        try:
            token_ids, sampled_lp, top = self._host_tokens(sampled)
        except BaseException:
            self._fail_step(batch.num_samples)
            raise
        try:
            result = self.engine.update(token_ids)
            out = self._pending = _step_outputs(result, sampled_lp, top, compact)
            self._apply_late_stops(self._note_update(out.seq_ids, out.finish_reasons, result.finished_request_ids))
        except BaseException:
            self._abort_all()
            raise

    def _note_update(self, seq_ids: list[int], reasons: list[int], finished_request_ids: list[str]) -> set[int]:
        """Notes the requests an update ended in the engine; returns the sequences it ended."""
        self._engine_done.update(r for r in finished_request_ids if r in self._requests)
        return {seq_id for seq_id, reason in zip(seq_ids, reasons) if reason}

    def _apply_late_stops(self, ended: set[int] | frozenset[int] = frozenset()) -> None:
        """Finishes in the engine the sequences stop strings ended while a step held
        them, except those the update of that step ended (``ended``). Call only when
        no step is pending."""
        while self._late_stops:
            seq_id, _ = self._late_stops.pop()
            if seq_id in ended:  # the updated step ended it too (EOS, length)
                continue
            owner = self._seq_owner.get(seq_id)
            if self.engine.finish(seq_id) and owner is not None:
                self._engine_done.add(owner[0].request_id)

    def _fail_step(self, num_samples: int) -> None:
        # NOTE: the engine waits for this step's tokens; give it placeholders
        # and drop every request, whose outputs can no longer be trusted.
        self._inflight = None
        result = self.engine.update(np.zeros(num_samples, dtype=np.int32))
        self._abort_all(self._note_update(result.seq_ids.tolist(), result.finish_reasons.tolist(),
                                          result.finished_request_ids))

    def _abort_all(self, ended: set[int] | frozenset[int] = frozenset()) -> None:
        """Drops every request (no step may be pending; ``ended``: see _apply_late_stops)."""
        try:
            self._apply_late_stops(ended)  # done in Python already: the engine must end them too
        finally:
            self._pending = None
            self._late_stops.clear()
            for request_id in list(self._requests):
                self.abort(request_id)

    def _process_pending(self, step_pending: bool, next_batch: _C.StepBatch | None = None) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        outputs = self._process(pending, next_batch)
        if not step_pending:  # (stop strings are looked for only in sequences the update left running)
            self._apply_late_stops()
        return outputs

    def _sampling_metadata(self, batch: _C.StepBatch) -> SamplingMetadata:
        slots = batch.sample_slots
        s = self._slots
        temperature = s.temperature[slots]
        top_k, top_p, min_p = s.top_k[slots], s.top_p[slots], s.min_p[slots]
        # NOTE: logprobs=0 still returns the sampled token's rank (vLLM); the sampler
        # computes ranks only along a top-k of at least 1.
        num_logprobs = int(s.num_logprobs[slots].max())
        num_logprobs = max(num_logprobs, 1) if num_logprobs >= 0 else 0
        host_top_k, host_top_p = torch.from_numpy(top_k), torch.from_numpy(top_p)
        md = SamplingMetadata(
            temperature=self._to_device(torch.from_numpy(temperature)),
            top_k=self._to_device(host_top_k),
            top_p=self._to_device(host_top_p),
            min_p=self._to_device(torch.from_numpy(min_p)),
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature != 0).all()),
            no_top_k=bool((top_k == 0).all()),
            no_top_p=bool((top_p >= 1).all()),
            no_min_p=bool((min_p == 0).all()),
            generators=self._row_generators(batch, slots),
            host_top_k=host_top_k,
            host_top_p=host_top_p,
            num_logprobs=num_logprobs,
            # NOTE: the sampled tokens' logprobs feed logprobs and cumulative_logprob,
            # which only requests with logprobs report (vLLM); without one in the step
            # the sampler skips the raw log_softmax.
            need_sampled_logprobs=num_logprobs > 0,
        )
        self._add_min_tokens(md, batch, slots)
        self._add_penalties(md, batch, slots)
        if self._matchers or self._mask_job is not None:
            self._add_token_bitmask(md, batch)
        return md

    def _add_token_bitmask(self, md: SamplingMetadata, batch: _C.StepBatch) -> None:
        """The grammar bitmasks of the step's constrained rows.

        Every matcher has consumed all tokens sampled before this step: step()
        updates the previous step and processes its outputs (which advance the
        matchers) before it builds this metadata, so this holds with async
        output processing and async scheduling too (_needs_host_tokens). The
        processing started the masks' computation (_start_masks) as soon as the
        matchers had their tokens; where it did not run, it starts here.
        """
        if self._mask_job is None:
            self._start_masks(batch)
            if self._mask_job is None:
                return
        md.bitmask_rows, md.token_bitmask, md.bitmask_status = self._bitmask_staging.finish(self._mask_job)

    def _start_masks(self, batch: _C.StepBatch) -> None:
        """Starts computing the masks of ``batch``'s constrained rows, into
        BitmaskStaging's buffers, on the mask pool when there is one (the masks are
        then computed while this thread goes on: see _join_masks).

        NOTE: the rows are those with a live matcher now; one that the rest of the
        step's processing finishes keeps its mask, and its token is dropped.
        """
        rows, matchers = [], []
        for row, seq_id in enumerate(batch.sample_seq_ids.tolist()):
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                rows.append(row)
                matchers.append(matcher)
        if not rows:
            return
        if self._bitmask_staging is None:
            self._bitmask_staging = BitmaskStaging(self._structured.num_words, self.device,
                                                   device_wait=self._structured.background and device_wait_enabled())
        masks, release = self._bitmask_staging.begin(rows)
        self._mask_job = self._structured.start_masks(matchers, masks, release, ready=self._bitmask_staging.ready)

    def _join_masks(self, failed: bool = False) -> None:
        """Waits for the step's masks (computed in the background), whose matchers
        nothing may touch until then. Called once the sampler is queued (with async
        scheduling, and the next forward pass): on CUDA with the device's wait, the
        device samples once the mask thread has written the flag, which needs the GIL;
        this wait hands it over. ``failed``: the step is failing; an error of the
        masks' own is not raised over it."""
        job, self._mask_job = self._mask_job, None
        if job is None:
            return
        try:
            job.wait()
        except BaseException:
            if not failed:
                raise

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on the device, queued without waiting for the device."""
        if self.device.type != "cuda":
            return t
        # NOTE: a copy from pageable memory waits for the work queued ahead of it (the
        # forward pass this metadata is built beside); from pinned memory it does not,
        # and the caching host allocator keeps the pinned block until the copy is done.
        return t.pin_memory().to(self.device, non_blocking=True)

    def _row_generators(self, batch: _C.StepBatch, slots: np.ndarray) -> dict[int, torch.Generator]:
        seeded = np.nonzero(self._slots.seeded[slots])[0]
        if seeded.size == 0:
            return {}
        generators = {}
        seq_ids = batch.sample_seq_ids
        for row in seeded.tolist():
            seq_id = int(seq_ids[row])
            gen = self._generators.get(seq_id)
            owner = self._seq_owner.get(seq_id)
            if gen is None and (owner is None or owner[0].completions[owner[1]].finish_reason is not None):
                # A row whose token will be dropped (see step()): its own throwaway
                # generator, so that it draws from no one else's stream.
                gen = torch.Generator(device=self.device)
            elif gen is None:
                # Sample i of a request draws from seed + i: the n samples differ,
                # and each depends only on its own seed, not on the batch.
                gen = torch.Generator(device=self.device)
                gen.manual_seed(int(self._slots.seed[slots[row]]) + owner[1])
                self._generators[seq_id] = gen
            generators[row] = gen
        return generators

    def _add_min_tokens(self, md: SamplingMetadata, batch: _C.StepBatch, slots: np.ndarray) -> None:
        rows = np.nonzero(batch.sample_num_outputs < self._slots.min_tokens[slots])[0]
        if rows.size == 0:
            return
        blocked_rows, blocked_tokens = [], []
        for row in rows.tolist():
            owner = self._seq_owner.get(int(batch.sample_seq_ids[row]))
            if owner is None:  # its token will be dropped (see step())
                continue
            request = owner[0]
            stops = list(request.params.stop_token_ids or [])
            if not request.params.ignore_eos:
                stops += self.eos_token_ids
            blocked_rows += [row] * len(stops)
            blocked_tokens += stops
        md.blocked_rows = self._to_device(torch.tensor(blocked_rows, dtype=torch.int64))
        md.blocked_tokens = self._to_device(torch.tensor(blocked_tokens, dtype=torch.int64))

    def _add_penalties(self, md: SamplingMetadata, batch: _C.StepBatch, slots: np.ndarray) -> None:
        rows = np.nonzero(self._slots.penalized[slots])[0]
        if rows.size == 0:
            return
        vocab = self.spec.vocab_size
        counts = torch.zeros((rows.size, vocab), dtype=torch.float32)
        prompt_mask = torch.zeros((rows.size, vocab), dtype=torch.bool)
        presence, frequency, repetition = [], [], []
        for i, row in enumerate(rows.tolist()):
            owner = self._seq_owner.get(int(batch.sample_seq_ids[row]))
            if owner is None:  # its token will be dropped (see step()): no penalties
                presence.append(0.0)
                frequency.append(0.0)
                repetition.append(1.0)
                continue
            request, index = owner
            outputs = request.completions[index].token_ids
            if outputs:
                counts[i].index_add_(0, torch.tensor(outputs), torch.ones(len(outputs)))
            prompt_mask[i] = self._prompt_masks[request.request_id]
            p = request.params
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
        md.penalty_rows = self._to_device(torch.from_numpy(rows.astype(np.int64)))
        md.presence_penalty = self._to_device(torch.tensor(presence, dtype=torch.float32))
        md.frequency_penalty = self._to_device(torch.tensor(frequency, dtype=torch.float32))
        md.repetition_penalty = self._to_device(torch.tensor(repetition, dtype=torch.float32))
        md.output_token_counts = self._to_device(counts)
        md.prompt_token_mask = self._to_device(prompt_mask)

    # ---- outputs ----------------------------------------------------------------

    def _process(self, out: _StepOutputs, next_batch: _C.StepBatch | None = None) -> list[RequestOutput]:
        """Turns a step's sampled tokens into outputs. With constrained sequences, their
        matchers take their tokens first; then, with ``next_batch`` (the step to be
        sampled next, already scheduled), that step's masks start (_start_masks) while
        the rest of the processing runs."""
        finished: list[RequestOutput] = []
        seq_ids, tokens, reasons, stop_tokens = out.seq_ids, out.token_ids, out.finish_reasons, out.stop_reasons
        sampled_lp, top = out.sampled_logprobs, out.top
        verdicts = self._advance_matchers(out) if self._matchers else {}
        if next_batch is not None and self._matchers and self._mask_job is None:
            self._start_masks(next_batch)
        streamed: dict[str, _Request] = {}
        rows: Sequence[int] = range(len(seq_ids))
        if out.compact is not None:
            rows = self._process_compact(out)
        for k in rows:
            if tokens[k] < 0:  # dropped: its sequence ended before the step resolved
                continue
            owner = self._seq_owner.get(seq_ids[k])
            if owner is None:  # aborted, or done by a stop string while this step ran
                continue
            request, index = owner
            c = request.completions[index]
            if c.finish_reason is not None:  # a stop string ended it while this step ran
                continue
            if request.stream:
                streamed[request.request_id] = request
            token = tokens[k]
            c.token_ids.append(token)
            if sampled_lp is not None:  # (None: no request of the step reports logprobs)
                c.cumulative_logprob += sampled_lp[k]
            if c.logprobs is not None:
                c.logprobs.append(self._logprob_entry(request, k, token, sampled_lp[k], top))
            reason = _FINISH.get(reasons[k])
            stop_str = None
            if c.detokenizer is not None:
                # NOTE: a token that ended the sequence by EOS/stop token is not text.
                stop_terminated = reason == "stop"
                if not stop_terminated:
                    # NOTE: as in vLLM, stop strings count only from min_tokens outputs on.
                    _, stop_str = c.detokenizer.append(
                        [token], check_stop=len(c.token_ids) >= request.params.min_tokens)
            if stop_str is not None:
                if reason is None:  # the engine finishes it once no step is pending
                    self._late_stops.append((seq_ids[k], request.request_id))
                reason, c.stop_reason = "stop", stop_str
            elif reason is not None and stop_tokens[k] >= 0:
                c.stop_reason = stop_tokens[k]
            if c.matcher is not None and (reason is not None or seq_ids[k] in verdicts):
                # (a grammar that goes on, in a sequence that goes on, changes nothing)
                reason = self._grammar_verdict(seq_ids[k], request, c, token, reason, verdicts.get(seq_ids[k]))
            if reason is not None:
                c.finish_reason = reason
                request.num_finished += 1
                self._generators.pop(seq_ids[k], None)
                if request.num_finished == len(request.completions):
                    finished.append(self._finish_request(request))
                    streamed.pop(request.request_id, None)
        for request in streamed.values():
            deltas = [d for d in (self._delta(request, c) for c in request.completions) if d is not None]
            if deltas:
                finished.append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                              deltas, finished=False,
                                              prompt_logprobs=self._take_prompt_logprobs(request)))
        return finished

    def _process_compact(self, out: _StepOutputs) -> list[int]:
        """Takes the rows of compact requests into _compact_parts (arrays, no
        Python per row but for a request's last); returns the other rows."""
        slots, keys = out.compact
        token_ids, finish, stop_reasons = out.arrays
        # NOTE: a row whose request was aborted since the step was scheduled is
        # dropped: its token is -1 (async scheduling), or its slot's key changed
        # (now -1, or a newer request's). Keys are never reused while live.
        live = (keys >= 0) & (token_ids >= 0) & (self._slots.compact_key[slots] == keys)
        if live.any():
            rows = CompactOutputs(keys[live], token_ids[live], finish[live], stop_reasons[live])
            self._compact_parts.append(rows)
            for k in np.nonzero(live & (finish != 0))[0].tolist():
                self._finish_compact(out.seq_ids[k], out.finish_reasons[k], out.stop_reasons[k])
        return np.nonzero(keys < 0)[0].tolist()

    def _finish_compact(self, seq_id: int, reason: int, stop_token: int) -> None:
        owner = self._seq_owner.get(seq_id)
        if owner is None:
            return
        request = owner[0]
        c = request.completions[0]  # (one sample)
        c.finish_reason = _FINISH[reason]
        if stop_token >= 0:
            c.stop_reason = stop_token
        request.num_finished = 1
        self._forget(request)

    def _advance_matchers(self, out: _StepOutputs) -> dict[int, str]:
        """Feeds each constrained sequence's token of the step to its matcher (those
        that _process appends: the same conditions). Returns the sequences whose
        grammar does not simply go on: "stopped" if it is complete and admits nothing
        more, or llguidance's error if the token was refused (the others are absent):
        what _grammar_verdict needs, read now, since a mask job may hold the matchers
        by then.

        NOTE: a sequence with a live matcher is one _process appends to: a matcher
        leaves ``_matchers`` whenever its sequence finishes or its request goes (see
        _grammar_verdict, _forget), so no owner lookup per row is needed here.
        """
        matchers = self._matchers
        fed_seq_ids, fed, tokens = [], [], []
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            if token >= 0:
                matcher = matchers.get(seq_id)
                if matcher is not None:
                    fed_seq_ids.append(seq_id)
                    fed.append(matcher)
                    tokens.append(token)
        if not fed:
            return {}
        accepted = self._structured.consume(fed, tokens)
        verdicts: dict[int, str] = {}
        if self._structured.worker is not None:  # (the verdicts came back with the tokens)
            for seq_id, matcher, ok in zip(fed_seq_ids, fed, accepted):
                if not ok:
                    verdicts[seq_id] = f"error: {matcher.error}"
                elif matcher.stopped:
                    verdicts[seq_id] = "stopped"
            return verdicts
        for seq_id, matcher, ok in zip(fed_seq_ids, fed, accepted):
            if not ok:
                verdicts[seq_id] = f"error: {matcher.ll.get_error()}"
            elif matcher.ll.is_stopped():
                verdicts[seq_id] = "stopped"
        return verdicts

    def _grammar_verdict(self, seq_id: int, request: _Request, c: _Completion, token: int,
                         reason: str | None, verdict: str | None) -> str | None:
        """A constrained sequence's finish reason, given its matcher's verdict on the
        token (_advance_matchers)."""
        if verdict is not None and verdict != "stopped":
            # Never expected: the sampler only returns allowed tokens.
            logger.error("request %r: token %d is outside its grammar (%s); aborting the sequence",
                         request.request_id, token, verdict)
            if reason is None:
                self._late_stops.append((seq_id, request.request_id))
            reason = "abort"
        elif verdict == "stopped" and reason != "stop":
            # The grammar is complete and admits nothing more (EOS included): done,
            # also when max_tokens ran out on this very token.
            if reason is None:  # the engine finishes it once no step is pending
                self._late_stops.append((seq_id, request.request_id))
            reason, c.grammar_ended = "stop", True
        if reason is not None:
            matcher = self._matchers.pop(seq_id, None)
            if matcher is not None:
                self._structured.free(matcher)
        return reason

    def _delta(self, request: _Request, c: _Completion) -> CompletionOutput | None:
        """What a streamed completion produced since its last delta (None if nothing)."""
        if c.sent_done:
            return None
        done = c.finish_reason is not None
        if done and c.detokenizer is not None:
            c.detokenizer.flush()
        text = c.detokenizer.text if c.detokenizer is not None else ""  # (None: the caller detokenizes)
        if not done and len(text) == c.sent_text and len(c.token_ids) == c.sent_tokens:
            return None
        out = CompletionOutput(
            index=c.index,
            text=text[c.sent_text:],
            token_ids=c.token_ids[c.sent_tokens:],
            cumulative_logprob=c.cumulative_logprob if request.params.logprobs is not None else None,
            logprobs=c.logprobs[c.sent_tokens:] if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        c.sent_text, c.sent_tokens, c.sent_done = len(text), len(c.token_ids), done
        return out

    def _logprob_entry(self, request: _Request, k: int, token: int, logprob: float, top: Any) -> dict[int, Logprob]:
        entry = {}
        num = request.params.logprobs or 0
        if top is not None:
            ids, values, ranks = top
            for rank, (tid, value) in enumerate(zip(ids[k][:num], values[k][:num]), start=1):
                entry[tid] = Logprob(value, rank, self.tokenizer.decode([tid]))
            rank_of_sampled = ranks[k]
        else:
            rank_of_sampled = None
        if token not in entry:
            entry[token] = Logprob(logprob, rank_of_sampled, self.tokenizer.decode([token]))
        return entry

    def _forget(self, request: _Request) -> None:
        """Drops a finished or aborted request's state."""
        del self._requests[request.request_id]
        self._engine_done.discard(request.request_id)
        self._prompt_masks.pop(request.request_id, None)
        for seq_id in request.seq_ids:
            self._seq_owner.pop(seq_id, None)
            self._generators.pop(seq_id, None)
            matcher = self._matchers.pop(seq_id, None)
            if matcher is not None:
                self._structured.free(matcher)
        if request.compact:
            self._slots.compact_key[request.slot] = -1
            self._num_compact -= 1

    def _finish_request(self, request: _Request) -> RequestOutput:
        self._forget(request)
        if request.stream:
            deltas = [d for d in (self._delta(request, c) for c in request.completions) if d is not None]
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, deltas,
                                 finished=True, prompt_logprobs=self._take_prompt_logprobs(request))
        outputs = []
        skip = request.params.skip_special_tokens
        for c in request.completions:
            if c.detokenizer is not None:
                c.detokenizer.flush()  # releases text held back for a possible stop string
                text = c.detokenizer.text
            else:
                ids = c.token_ids
                if c.finish_reason == "stop" and not c.grammar_ended:
                    ids = ids[:-1]  # the EOS or stop token that ended it is not text
                text = self.tokenizer.decode(ids, skip_special_tokens=skip)
            outputs.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob if request.params.logprobs is not None else None,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=True,
            prompt_logprobs=request.prompt_logprobs,
        )

    # ---- prompt logprobs ----------------------------------------------------------

    def _score_prompts(self, batch: _C.StepBatch) -> None:
        """Appends the prompt logprobs of the step's runs to their requests.

        The engine lists each prompt position once over a request's life, in
        order, so a run continues its request's list exactly where it stopped.
        """
        owners = [self._seq_owner.get(int(seq_id)) for seq_id in batch.prompt_logprob_seq_ids]
        live = [o[0] for o in owners if o is not None]
        if not live:  # (aborted since they were scheduled)
            return
        num_top = max(r.params.prompt_logprobs for r in live)
        token_ids = batch.prompt_logprob_token_ids.astype(np.int64)
        scores = score_prompt_tokens(self.runner.prompt_hidden, self.runner.compute_logits,
                                     torch.from_numpy(token_ids).to(self.device), num_top)
        ids = np.unique(np.concatenate([token_ids, scores.top_ids.ravel()])).tolist()
        texts = dict(zip(ids, self.tokenizer.batch_decode([[i] for i in ids])))
        start_loc, first_positions = batch.prompt_logprob_start_loc, batch.prompt_logprob_first_positions
        for run, owner in enumerate(owners):
            if owner is None:
                continue
            request = owner[0]
            if int(first_positions[run]) != len(request.prompt_logprobs):
                raise RuntimeError(
                    f"internal error: request {request.request_id!r} has prompt logprobs for "
                    f"{len(request.prompt_logprobs)} tokens, the engine scores from position "
                    f"{int(first_positions[run])}")
            request.prompt_logprobs += logprob_dicts(scores, int(start_loc[run]), int(start_loc[run + 1]),
                                                     token_ids, request.params.prompt_logprobs, texts)

    @staticmethod
    def _take_prompt_logprobs(request: _Request) -> list[dict[int, Logprob] | None] | None:
        """A streamed request's prompt logprobs, the first time only (vLLM's
        delta outputs carry them once, with the first output after the prompt)."""
        if request.prompt_logprobs is None or request.prompt_logprobs_sent:
            return None
        request.prompt_logprobs_sent = True
        return request.prompt_logprobs


def _step_outputs(result: _C.StepResult, sampled_lp: Any, top: Any,
                  compact: tuple[np.ndarray, np.ndarray] | None) -> _StepOutputs:
    """An update's result copied out of the engine's buffers (the next update reuses them)."""
    arrays = None
    if compact is not None:
        arrays = (np.array(result.token_ids), np.array(result.finish_reasons), np.array(result.stop_reasons))
    return _StepOutputs(
        seq_ids=result.seq_ids.tolist(), token_ids=result.token_ids.tolist(),
        finish_reasons=result.finish_reasons.tolist(), stop_reasons=result.stop_reasons.tolist(),
        sampled_logprobs=sampled_lp, top=top, compact=compact, arrays=arrays,
    )


def load_model(args: EngineArgs, model_path: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               shard: TensorParallelShard | None = None, phases: _Phases | None = None) -> CausalLM:
    """The model of ``spec`` (or rank ``shard.rank``'s shard of it) with its weights
    on ``device`` and its rotary table made for ``args.max_model_len``."""
    # Parameters are allocated uninitialised in the model's dtype on its device,
    # then every one is filled (load_weights raises for a missing weight).
    if shard is None:
        model = build_uninitialized(lambda: CausalLM(spec), dtype, device)
    else:
        model = build_uninitialized(lambda: ParallelCausalLM(shard), dtype, device)
    if phases is not None:
        phases.done("model")
    if args.load_format == "dummy":  # random weights, drawn on the device (benchmarks)
        model.init_dummy_weights(args.seed)
    elif shard is None:
        model.load_weights(with_load_progress(iter_safetensors(model_path, dtype=dtype), model_path))
    else:  # this rank's slices only
        weights = iter_safetensors_shard(model_path, dtype, shard)
        model.load_weights(with_load_progress(weights, model_path) if shard.rank == 0 else weights)
    model.inv_freq.data = spec.inv_freq().to(device)  # kept in float32
    max_positions = spec.max_position_embeddings
    model.init_rotary(min(args.max_model_len or max_positions, max_positions))
    if phases is not None:
        phases.done("weights")
    return model


def max_batched_tokens(args: EngineArgs, device: torch.device) -> int:
    """The token budget of a step: ``max_num_batched_tokens`` or the device's default."""
    return args.max_num_batched_tokens or max(8192 if device.type == "cuda" else 2048, args.max_num_seqs)


def local_kv_blocks(args: EngineArgs, model: CausalLM, kv_dtype: torch.dtype, device: torch.device,
                    max_batched: int, quiet: bool = False) -> int:
    """The KV blocks this process's memory holds (``num_kv_blocks`` when given).
    On CUDA a profiling pass measures the peak activations (under tensor
    parallelism every rank runs it at once: its collectives pair up)."""
    per_block = kv_bytes_per_block(model.spec, args.block_size, kv_dtype)
    log = logger.debug if quiet else logger.info
    if args.num_kv_blocks is not None:
        log("KV cache sized by num_kv_blocks=%d", args.num_kv_blocks)
        return args.num_kv_blocks
    if device.type == "cuda":
        return _gpu_blocks(args, model, kv_dtype, per_block, max_batched, device, log)
    budget, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if budget is None:
        budget, source = _env_kv_cache_bytes()
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"{source} {budget} holds no block of {per_block} bytes")
    # NOTE: vLLM users pass gpu_memory_utilization everywhere; say that it
    # does not size a CPU cache, and what does.
    log(
        "KV cache on the CPU sized by %s: %d bytes (%.2f GiB%s); gpu_memory_utilization (%s) "
        "applies to GPUs only (set kv_cache_memory_bytes, $%s or num_kv_blocks instead)",
        source, budget, budget / 2**30, " per rank" if args.tensor_parallel_size > 1 else "",
        args.gpu_memory_utilization, KV_CACHE_BYTES_ENV,
    )
    return num_blocks


def _gpu_blocks(args: EngineArgs, model: CausalLM, kv_dtype: torch.dtype, per_block: int, max_batched: int,
                device: torch.device, log: Any) -> int:
    """Blocks that fit in gpu_memory_utilization of the GPU once the weights and
    the peak activations of the largest step (measured by a profiling pass) and
    the memory other users hold are set aside."""
    a = args
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    peak = profile_peak_memory(model, max_batched, a.max_num_seqs, a.block_size, kv_dtype)
    # The sampler's work on [max_num_seqs, vocab] float32 (softmax, sort).
    sampler = 4 * a.max_num_seqs * model.spec.vocab_size * 4
    budget = int(total * a.gpu_memory_utilization) - others - peak - sampler
    log(
        "GPU memory (%s): %.2f GiB total, x %.2f utilization; weights + peak activations %.2f GiB, "
        "CUDA's own and other processes' %.2f GiB; KV cache gets %.2f GiB",
        device, total / 2**30, a.gpu_memory_utilization, peak / 2**30, others / 2**30, max(budget, 0) / 2**30,
    )
    if budget < per_block:
        raise ValueError(
            f"gpu_memory_utilization {a.gpu_memory_utilization} leaves no room for the KV cache "
            f"({budget / 2**30:.2f} GiB after weights and activations on {device})"
        )
    return budget // per_block


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _env_kv_cache_bytes() -> tuple[int, str]:
    """The CPU KV-cache budget from ``$PAGEDCORE_KV_CACHE_BYTES`` (default 1 GiB),
    and where it came from, for error messages."""
    raw = os.environ.get(KV_CACHE_BYTES_ENV)
    if raw is None:
        return DEFAULT_CPU_KV_CACHE_BYTES, "the default KV-cache budget"
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${KV_CACHE_BYTES_ENV} must be a positive integer (bytes), got {raw!r}")
    return value, f"${KV_CACHE_BYTES_ENV}"


def _C_stats(engine: _C.Engine) -> dict[str, Any]:
    from .engine import stats_dict

    return stats_dict(engine.stats())
