"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .beam_search import BeamSearchOutput, run_beam_search
from .llm_engine import EngineArgs, LLMEngine
from .logging_setup import configure_default_logging
from .outputs import RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("pagedcore")

PromptType = str | dict[str, Any]


class LLM:
    """A model loaded for generation over a paged KV cache.

    Parameters
    ----------
    model : str, optional
        A Hugging Face model directory (config.json + safetensors). ``None``:
        the default model, SmolLM2-135M-Instruct (:func:`pagedcore.default_model_path`).
    tokenizer : str, optional
        Tokenizer directory; defaults to ``model``.
    dtype : str or torch.dtype
        ``"auto"`` (float32 on the CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
    device : str
        ``"auto"``, ``"cpu"`` or ``"cuda"``.
    block_size : int
        Tokens per KV-cache block: 8, 16, 32, 64 or 128.
    gpu_memory_utilization : float
        Fraction of GPU memory for weights, activations and KV cache (GPU only).
    num_kv_blocks : int, optional
        The number of KV blocks, overriding what memory would give (any device).
    kv_cache_memory_bytes : int, optional
        KV-cache budget on the CPU; default ``$PAGEDCORE_KV_CACHE_BYTES`` or 1 GiB.
        It holds ``budget // (block_size x layers x kv_heads x head_dim x 2 (K, V)
        x bytes of the cache dtype)`` blocks.
    max_model_len : int, optional
        Context length; default: the model's, capped to what the cache holds
        (``num_blocks x block_size``); an explicit one beyond that is refused.
    max_num_seqs, max_num_batched_tokens : int
        Sequences per step, tokens per step (default ``max(2048, max_num_seqs)``).
    max_num_mixed_prefill_tokens : int, optional
        A step that runs decode rows computes at most this many tokens, its
        decode rows included (at least half as many prompt tokens as decode
        rows; longer prompts are chunked over more steps), plus as many prompt tokens again
        for every ``mixed_prefill_waiting_per_cap`` requests waiting (0, the
        default: no share for the queue), while at most
        ``mixed_prefill_max_waiting`` (8) requests wait; None (default): no cap
        but ``max_num_batched_tokens``. For the inter-token latency of streams
        (``pagedcore serve`` sets 256). A longer queue lifts the cap: to
        ``mixed_prefill_lift_tokens`` (0, the default: to the whole
        ``max_num_batched_tokens``) while at most ``mixed_prefill_lift_max_waiting``
        (64) requests wait, to the whole budget beyond.
    mixed_prefill_waiting_per_cap, mixed_prefill_max_waiting : int
    mixed_prefill_lift_tokens, mixed_prefill_lift_max_waiting : int
        See ``max_num_mixed_prefill_tokens``.
    enable_prefix_caching : bool
        Reuse the KV of common prompt prefixes.
    preemption_mode : {"recompute", "swap"}
        What happens to a sequence preempted when blocks run out.
    swap_space : float
        GiB of CPU memory for swapped-out blocks (``preemption_mode="swap"``).
    kv_cache_dtype : str
        ``"auto"``: the model's dtype; ``"fp8"`` (or ``"fp8_e4m3"``): e4m3, half
        the bytes of bf16 (CUDA: bfloat16/float16 models; the CPU: any dtype), with
        per-layer K and V scales from the checkpoint (``k_scale`` / ``v_scale``
        tensors, as vLLM reads them) or calculated at start-up.
    calculate_kv_scales : bool
        fp8 cache: measure each layer's scales at start-up (``amax / 200`` for K,
        ``amax / 100`` for V, vLLM's divisors, over a fixed calibration text),
        replacing the checkpoint's. False (default, as vLLM): the checkpoint's,
        else 1; on the default model scales of 1 measure as accurate as calculated
        ones (bench/RESULTS.md). Worth it for a model whose keys or values exceed
        e4m3's 448.
    enforce_eager : bool
        CUDA: never replay CUDA graphs (decode steps run eagerly).
    load_format : {"auto", "safetensors", "dummy"}
        ``"dummy"``: random weights in the checkpoint's shape (config.json only is
        read), for benchmarks.
    async_output_proc : bool or None
        Turn step n's tokens into outputs (detokenizing, stop strings) while the
        device runs step n+1. None: on for CUDA, off for the CPU (where nothing
        runs in parallel). Greedy and seeded outputs do not depend on it.
    async_scheduling : bool or None
        Schedule and launch step n+1 before step n's sampled tokens reach the
        host (the device copies them into step n+1's inputs), hiding the host's
        per-step work behind the device. Steps whose sampling needs the previous
        tokens on the host (presence/frequency/repetition penalties, structured
        outputs) wait for them before sampling. None: on for CUDA (unless
        ``async_output_proc=False``), off for the CPU. Greedy and seeded outputs
        do not depend on it.
    seed : int
        Seeds torch's global RNG (requests without their own seed).
    tensor_parallel_size : int
        Split the model over this many ranks (Megatron tensor parallelism over
        torch.distributed: NCCL between GPUs, rank r on ``cuda:r``; gloo between
        CPU processes). This process is rank 0 (scheduler, sampler); ranks 1..N-1
        are spawned worker processes, ended by :meth:`shutdown` or at exit. The
        KV cache is per rank (``kv_cache_memory_bytes`` and ``num_kv_blocks``
        size each rank's). One tensor-parallel LLM per process at a time.

    Examples
    --------
    >>> from pagedcore import LLM, SamplingParams
    >>> llm = LLM(block_size=16, gpu_memory_utilization=0.9)             # doctest: +SKIP
    >>> outputs = llm.generate(["Hello"], SamplingParams(temperature=0.8, n=3, max_tokens=32))
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: Any = "auto",
        device: str = "auto",
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space: float = 4,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        load_format: str = "auto",
        async_output_proc: bool | None = None,
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        calculate_kv_scales: bool = False,
        max_num_mixed_prefill_tokens: int | None = None,
        mixed_prefill_waiting_per_cap: int = 0,
        mixed_prefill_max_waiting: int = 8,
        mixed_prefill_lift_tokens: int = 0,
        mixed_prefill_lift_max_waiting: int = 64,
    ) -> None:
        configure_default_logging()
        if model is None:
            from .default_model import default_model_path

            model = default_model_path()
        self.llm_engine = LLMEngine(
            EngineArgs(
                model=model, tokenizer=tokenizer, dtype=dtype, device=device, block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization, num_kv_blocks=num_kv_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
                swap_space=swap_space, kv_cache_dtype=kv_cache_dtype, seed=seed,
                enforce_eager=enforce_eager, load_format=load_format, async_output_proc=async_output_proc,
                async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size,
                calculate_kv_scales=calculate_kv_scales, max_num_mixed_prefill_tokens=max_num_mixed_prefill_tokens,
                mixed_prefill_waiting_per_cap=mixed_prefill_waiting_per_cap,
                mixed_prefill_max_waiting=mixed_prefill_max_waiting,
                mixed_prefill_lift_tokens=mixed_prefill_lift_tokens,
                mixed_prefill_lift_max_waiting=mixed_prefill_lift_max_waiting,
            )
        )

    def shutdown(self) -> None:
        """Ends the tensor-parallel worker processes (a no-op with one rank); the
        LLM cannot generate afterwards. Idempotent; also runs at interpreter exit."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, Any]:
        """Engine counters: ``num_blocks``, ``num_free_blocks`` (cached blocks count
        as free), ``num_preemptions``, ``prefix_cache_hit_rate``, and more."""
        return self.llm_engine.stats()

    # ---- generation -----------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt, batched continuously.

        Parameters
        ----------
        prompts
            A string, a ``{"prompt_token_ids": [...]}`` dict (optionally with
            ``"prompt"``), or a list mixing both.
        sampling_params
            One for all prompts, or one per prompt; default ``SamplingParams()``.
        use_tqdm
            Show a progress bar (when there is more than one prompt).

        Returns
        -------
        list[RequestOutput]
            In the order of ``prompts``.
        """
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, through the
        tokenizer's chat template."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        items = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # NOTE: the template already holds the special tokens (BOS...).
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            items.append((text, ids))
        params = self._normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """Beam search over the engine (beams share blocks copy-on-write); the
        result matches transformers' ``num_beams`` search with ``do_sample=False``."""
        items = self._normalize_prompts(prompts)
        token_lists = [ids if ids is not None else self.get_tokenizer().encode(text) for text, ids in items]
        return run_beam_search(self.llm_engine, token_lists, params)

    # ---- helpers ------------------------------------------------------------------

    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                items.append((p, None))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                items.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                items.append((p["prompt"], None))
            else:
                raise ValueError(
                    f"prompts[{i}] must be a string or a dict with 'prompt_token_ids' or 'prompt', got {type(p).__name__}"
                )
        return items

    @staticmethod
    def _normalize_params(params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        return params

    def _run(self, items, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for (text, token_ids), p in zip(items, params):
                request_id = engine.new_request_id()
                engine.add_request(request_id, text, token_ids, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave nothing half-admitted
                engine.abort(request_id)
            raise
        bar = None
        # NOTE: no bar for a single prompt (one chat turn): it would only flash
        # 0/1 -> 1/1 over the reply.
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        results: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in results:
                    engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
