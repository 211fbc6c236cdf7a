"""Runs one engine step through the model: KV-cache tensors, step inputs, forward.

The runner owns every tensor (weights, KV caches, staging buffers) and never
decides who runs: it takes a :class:`pagedcore.StepBatch` and returns the
logits of the rows to sample. The step's arrays are copied once into
preallocated buffers (no per-sequence Python work).

With async scheduling, a step's decode rows may take their input token from the
previous step's sampled ids, still on the device (``StepBatch.deferred_input_*``):
the runner copies them into its input-ids buffer on the device before the forward
pass (a gather and a scatter, queued behind the previous step).

On CUDA, steps made only of decode rows replay CUDA graphs captured at start-up
for a ladder of batch sizes (the batch padded up to the next size; padding rows
write no cache slot and read the null block), unless ``enforce_eager``. Other steps
(prefill chunks, mixed) replay piecewise graphs for a ladder of token counts: one
graph per layer boundary holding everything but attention, which runs eagerly
between them with the step's own plan (padding tokens write no cache slot).
Steps of up to ``PAGEDCORE_MIXED_GRAPHS`` tokens (default 8192; 0: off) instead
replay one whole graph with attention inside, over a plan of fixed size
(:class:`pagedcore.ops.planning.PaddedPlan`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _C, ops
from .models import AttentionMetadata, CausalLM, ModelSpec

if TYPE_CHECKING:
    from .distributed.driver import TensorParallelDriver

logger = logging.getLogger("pagedcore")


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one block over all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


def kv_cache_size_line(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype) -> str:
    """The start-up log line with the arithmetic, as vLLM prints it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = num_blocks * kv_bytes_per_block(spec, block_size, dtype)
    return (
        f"KV cache size: {num_blocks} blocks x {block_size} tokens x {spec.num_layers} layers x "
        f"{spec.num_kv_heads} kv heads x {spec.head_dim} head dim x 2 (K, V) x {itemsize} bytes "
        f"= {total / 2**30:.2f} GiB"
    )


def _empty_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cache = torch.empty(shape, dtype=dtype, device=device)
    cache[0].zero_()  # the null block
    return cache


@dataclass
class _Staging:
    """Host buffers the step's numpy views are copied into (one copy each)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    sample_indices: torch.Tensor
    # Async scheduling: [token indices | sample indices] of the deferred inputs.
    deferred: torch.Tensor

    @classmethod
    def allocate(cls, config: _C.EngineConfig, pin: bool) -> _Staging:
        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, pin_memory=pin)

        tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
        # (the row arrays hold one row more: the mixed graphs' padding row)
        return cls(
            input_ids=buf(tokens),
            positions=buf(tokens),
            slot_mapping=buf(tokens),
            seq_lens=buf(seqs + 1),
            query_start_loc=buf(seqs + 2),
            block_tables=buf(seqs + 1, config.max_blocks_per_seq),
            sample_indices=buf(seqs),
            deferred=torch.zeros(2 * seqs, dtype=torch.int64, pin_memory=pin),
        )


# Decode batch sizes captured as CUDA graphs (up to max_num_seqs).
GRAPH_BATCH_SIZES = (1, 2, 4, 8) + tuple(range(16, 257, 16)) + tuple(range(288, 513, 32))


# Token counts of the steps whose layer bodies replay CUDA graphs (prefill and mixed
# steps; the ones below max_num_batched_tokens, and that budget): the step padded up
# to the next size.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class _PrefillGraphs:
    """One token count's piecewise graphs: ``graphs[0]`` embeds the tokens and runs
    layer 0 up to attention; ``graphs[i]`` (i >= 1) runs layer i - 1 after attention
    and layer i up to attention (the last one: the final norm into ``hidden``).
    Attention runs eagerly between them, from the shared qkv buffer into the shared
    attention buffer (its work split depends on the step's lengths)."""

    graphs: list[torch.cuda.CUDAGraph]
    hidden: torch.Tensor  # [tokens, hidden_size], the final norm's output, written by the last graph


# NOTE: measured on the H200 at 73b39de (bench_e2e_gpu.py --mixed, SmolLM2, 40 rows
# decoding): steps with 16-512 prompt tokens took 5.1-6.3 ms (4.0-5.4 of host time in
# execute) in pieces and 1.8-3.9 ms (1.2-3.7) as whole graphs; decode steps ~1.2-1.9 both.
# 1024 until the twenty-sixth session; then (bench_serving.py, SmolLM2, four HTTP
# processes, at c4615e7 with 1,024 against 8,192, the whole budget): the steps that
# the mixed-prefill cap's lift fills (~2,500 tokens at half load) took 5.5-5.9 ms of
# device time in pieces, 2.6 (p50) in the whole graphs; ITL p99 over p50 at half load
# 4.74 and 3.34 against 2.55 and 2.25 (two runs each, alternating); offline
# LLM.generate, three calls in one process each, 102-105k output tok/s against
# 108-120k (the first call paying the whole graphs' first replays).
DEFAULT_MIXED_GRAPH_TOKENS = 8192


def mixed_graph_tokens() -> int:
    """PAGEDCORE_MIXED_GRAPHS=N (read when a runner is made; default
    :data:`DEFAULT_MIXED_GRAPH_TOKENS`): steps of up to N tokens that no decode graph
    takes (prefill chunks, mixed steps) replay one whole CUDA graph each, attention
    included (the sizes of PREFILL_GRAPH_TOKENS up to N). 0: off (the pieces)."""
    value = os.environ.get("PAGEDCORE_MIXED_GRAPHS", "") or str(DEFAULT_MIXED_GRAPH_TOKENS)
    try:
        tokens = int(value)
    except ValueError:
        raise ValueError(f"PAGEDCORE_MIXED_GRAPHS must be a token count (0: off), got {value!r}") from None
    if tokens < 0:
        raise ValueError(f"PAGEDCORE_MIXED_GRAPHS must be >= 0 (0: off), got {tokens}")
    return tokens

# Rows cut into tiles (prefill chunks) a step may have to replay them: each one adds
# padding CTAs to every layer's attention, and a mixed step has few. Graphs over
# 1024 tokens (PAGEDCORE_MIXED_GRAPHS above it) hold one a 128 tokens: a step the
# mixed-prefill cap lifts admits a prompt every ~200 tokens (SmolLM2 serving).
MIXED_GRAPH_TILE_ROWS = 8


def mixed_graph_tile_rows(tokens: int) -> int:
    """Rows cut into tiles that the whole mixed graph of ``tokens`` tokens holds."""
    return max(MIXED_GRAPH_TILE_ROWS, tokens // 128)

# Sizes up to this many tokens also get a whole graph whose tiles split their keys
# (ops.planning.padded_tile_splits), for the steps whose chunks hold more keys than
# the unsplit graphs take: a capped mixed step (serve's 256 tokens) continuing a
# long prompt. NOTE: measured on the H200 at e06df39 (bench_serving.py, SmolLM2 at
# half load): such steps, 7% of all, ran in pieces at 4.3 / 5.4 ms of host time in
# execute() (p50 / p99) and 4.3 / 5.5 of device time, against 1.1 / 1.9 and 2.7 / 3.8
# for the whole graphs' steps, and the turns that launched or waited for them made
# most of the inter-token gaps over twice the median. At 9f29c1f (with the decode-split
# rule of PaddedPlan.fill) they took these graphs at 2.6-2.8 ms of device time and the
# half-load run had no pieces left. With the mixed-prefill cap's share for the waiting
# queue on (EngineConfig.mixed_prefill_waiting_per_cap, opt-in), capped steps grow to
# 400-1000 tokens: then up to the whole graphs' size (at 897a652-43899e5, SmolLM2 with
# 4 HTTP processes at half load: 13-25 such steps a run took them, 3.6-3.8 ms of device
# time, none ran in pieces).
MIXED_SPLIT_GRAPH_TOKENS = 256


def split_mixed_graph_top(config: _C.EngineConfig, max_tokens: int) -> int:
    """The largest whole mixed graph size (of those up to ``max_tokens``) that also
    gets a variant with split tiles: MIXED_SPLIT_GRAPH_TOKENS, or as many tokens as
    a capped step can grow to while the streams run: the whole size with the
    queue's share (mixed_prefill_waiting_per_cap), the lifted cap's tokens
    (mixed_prefill_lift_tokens) with the lift. PAGEDCORE_MIXED_SPLIT_GRAPHS=N
    (read when a runner is made; a measurement switch) puts it at N instead.

    NOTE: measured on the H200 at 068f05e (bench_serving.py, SmolLM2 at half load,
    serve's lift to 1,024 tokens): the lifted steps that continued long prompts
    found no graph with split tiles over 256 tokens and ran in pieces, 12-21 a run
    at 3.5-5.0 / 4.8-5.9 ms of device / host time (p50), against 2.5-2.8 / 1.2-1.7
    for a mixed step: the host time alone of the turn that launched one was about
    twice the loop's median turn (2.5-3.0 ms), the ITL's bound at half load."""
    value = os.environ.get("PAGEDCORE_MIXED_SPLIT_GRAPHS", "")
    if value:
        if not value.isdigit():
            raise ValueError(f"PAGEDCORE_MIXED_SPLIT_GRAPHS must be a token count, got {value!r}")
        return int(value)
    if config.mixed_prefill_waiting_per_cap > 0:
        return max_tokens
    top = MIXED_SPLIT_GRAPH_TOKENS
    if config.max_num_mixed_prefill_tokens > 0 and config.mixed_prefill_lift_tokens > 0:
        top = max(top, min(config.mixed_prefill_lift_tokens, max_tokens))
    return top


@dataclass
class _MixedGraph:
    """A step of up to one ladder size of tokens as one graph: the layer pieces
    of _PrefillGraphs with attention between them over ``plan`` (fixed size;
    rows up to ``max_rows``, the padding row after them)."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [tokens, hidden_size], written by each replay
    plan: ops.planning.PaddedPlan
    max_rows: int


@dataclass
class StepSpan:
    """One execute() call, traced (ModelRunner.step_spans): how the step ran
    (ModelRunner.last_path), its size, the host's time in execute() and, on
    CUDA, events from just before its first kernel or graph (after the host
    staged its inputs) to after its logits: the device's time for the step, with
    any wait for launches that the host makes within it (the pieces' loop).
    ``wait_seconds``: the part of the host's time spent waiting for the device
    before staging (:meth:`ModelRunner._staging_free`: the step before's input
    copies, queued behind its predecessor's work). ``staged_seconds``: the host's
    time up to the step's first launch (:meth:`ModelRunner._mark_launch`: the
    staging and planning; the rest is launches, the logits' included);
    ``cpu_seconds``: the CPU time of the host's thread over ``host_seconds``
    (``time.thread_time``: far less than ``host_seconds`` when the thread waited,
    for the device, the GIL or a core); ``replay_seconds``: the host's time in
    CUDA graph replay calls."""

    path: str
    num_tokens: int
    num_seqs: int
    prompt_tokens: int
    max_seq_len: int
    host_seconds: float
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    wait_seconds: float = 0.0
    staged_seconds: float = 0.0
    cpu_seconds: float = 0.0
    replay_seconds: float = 0.0

    def gpu_seconds(self) -> float | None:
        """The device's time from start to end (None off CUDA or before it got there)."""
        if self.start is None or not self.end.query():
            return None
        return self.start.elapsed_time(self.end) / 1e3


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [batch, vocab] float32, written by each replay
    # NOTE: the graph holds raw addresses of the plan's device arrays and scratch:
    # the metadata (and its plan) must live as long as the graph.
    md: AttentionMetadata


def _pool_note(device: torch.device, reserved_before: int) -> str:
    """What a capture took from the caching allocator (the graphs' pool, the warm-ups'
    buffers and plans), for the start-up log: it lives outside the KV cache's budget,
    in the 1 - gpu_memory_utilization headroom (_gpu_blocks sets aside one eager
    step's peak, not the pools)."""
    grown = torch.cuda.memory_reserved(device) - reserved_before
    return f"; {grown / 2**30:+.2f} GiB reserved"


def _put(dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
    """Copies a 1-D view into the head of a staging buffer; returns that head."""
    n = src.shape[0]
    np.copyto(dst.numpy()[:n], src)
    return dst[:n]


class ModelRunner:
    """Executes step batches of a :class:`pagedcore.Engine` on one device.

    Parameters
    ----------
    model : CausalLM
        Loaded weights, already on ``device``.
    engine_config : EngineConfig
        Sizes the KV caches (``num_blocks + 1`` rows, row 0 the null block)
        and the staging buffers.
    kv_dtype : torch.dtype
        Element type of the KV cache.
    enforce_eager : bool
        CUDA: run every step eagerly (no CUDA graphs).
    tp_driver : TensorParallelDriver, optional
        Tensor parallelism, on rank 0: each step (and each LM-head call of
        :meth:`compute_logits`) is broadcast to the workers first, whose runners
        then run it in step with this one (``model`` is rank 0's shard).
    """

    def __init__(
        self,
        model: CausalLM,
        engine_config: _C.EngineConfig,
        device: torch.device,
        kv_dtype: torch.dtype,
        enforce_eager: bool = False,
        tp_driver: TensorParallelDriver | None = None,
    ) -> None:
        self.model = model
        self.tp_driver = tp_driver
        self.spec = model.spec
        self.device = device
        self.block_size = engine_config.block_size
        shape = (engine_config.num_blocks + 1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        # NOTE: the caches are left unfilled (zero-filling 1 GiB takes 0.4 s on
        # two cores): the kernels read only slots that this step or an earlier one
        # wrote (slot < seq_len of a block the table maps), and the tests run them
        # over NaN-filled caches. Only the null block is zeroed: CUDA-graph padding
        # rows read it, and their (discarded) logits stay finite.
        self.kv_caches = [(_empty_cache(shape, kv_dtype, device), _empty_cache(shape, kv_dtype, device))
                          for _ in range(self.spec.num_layers)]
        self.cpu_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if engine_config.num_cpu_blocks > 0:
            cpu_shape = (engine_config.num_cpu_blocks + 1,) + shape[1:]
            pin = device.type == "cuda"
            self.cpu_kv_caches = [
                (torch.empty(cpu_shape, dtype=kv_dtype, pin_memory=pin),
                 torch.empty(cpu_shape, dtype=kv_dtype, pin_memory=pin))
                for _ in range(self.spec.num_layers)
            ]
        self.staging = _Staging.allocate(engine_config, pin=device.type == "cuda")
        # CUDA: marks the end of the last step's copies out of the staging buffers.
        self._staged: torch.cuda.Event | None = None
        # Hidden states [num_prompt_logprob_tokens, hidden_size] of the last
        # executed step's prompt-logprob rows (StepBatch.prompt_logprob_indices);
        # None when it had none. compute_logits turns slices of it into logits.
        self.prompt_hidden: torch.Tensor | None = None
        self.graphs: dict[int, _DecodeGraph] = {}
        self.graph_replays = 0  # decode steps served by a graph
        self.prefill_graphs: dict[int, _PrefillGraphs | None] = {}  # None: run_prefill_in_pieces
        self.prefill_graph_replays = 0  # other steps whose layer bodies replayed graphs
        self.mixed_graphs: dict[int, _MixedGraph] = {}
        self.mixed_graph_replays = 0  # steps, not pure decode, served by one whole graph
        # Whole graphs whose tiles split their keys (split_mixed_graph_top), tried
        # after mixed_graphs; their replays are counted in mixed_graph_replays too.
        self.split_mixed_graphs: dict[int, _MixedGraph] = {}
        self.split_mixed_graph_replays = 0
        # How the last step ran: "decode" (a decode graph), "mixed" (one whole graph),
        # "split" (one whole graph whose tiles split their keys), "pieces" (graph
        # pieces around eager attention), "eager", or "empty".
        self.last_path = ""
        # A list to trace the steps into (server.step_trace): one StepSpan per execute().
        self.step_spans: list[StepSpan] | None = None
        self._launch_event: torch.cuda.Event | None = None  # (traced steps) see _mark_launch
        self._staging_wait = 0.0  # (traced steps) seconds in _staging_free this step
        self._launched_at: float | None = None  # (traced steps) perf_counter() at _mark_launch
        self._replay_time = 0.0  # (traced steps) seconds in graph replays this step
        if device.type == "cuda" and not enforce_eager:
            self._capture_decode_graphs(engine_config)
            self._capture_prefill_graphs(engine_config)
            if mixed_graph_tokens() > 0:
                self._capture_mixed_graphs(engine_config, mixed_graph_tokens())

    # ---- CUDA graphs for decode steps ------------------------------------------

    def _mark_launch(self) -> None:
        """Traced steps: the host's time at the step's first kernel or graph, after
        its staging, and on CUDA an event there (the device's time of a step
        starts there)."""
        if self.step_spans is not None and self._launched_at is None:
            self._launched_at = time.perf_counter()
            if self.device.type == "cuda":
                self._launch_event = torch.cuda.Event(enable_timing=True)
                self._launch_event.record()

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """A graph's replay in a step (traced: its host time counted apart, for a
        launch that blocks, e.g. behind a full launch queue)."""
        if self.step_spans is None:
            graph.replay()
            return
        began = time.perf_counter()
        graph.replay()
        self._replay_time += time.perf_counter() - began

    def _capture_decode_graphs(self, config: _C.EngineConfig) -> None:
        spec = self.spec
        group = spec.num_heads // spec.num_kv_heads
        if not _C.cuda_decode_supported(group, spec.head_dim, self.model.dtype.itemsize):
            logger.info("CUDA graphs off: the decode kernel does not serve this shape")
            return
        limit = min(config.max_num_seqs, config.max_num_batched_tokens)
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= limit]
        if not sizes:
            return
        top, dev = sizes[-1], self.device
        # Static inputs, padding values everywhere: no cache slot written, the
        # null block read, one token per row.
        self._g_input_ids = torch.zeros(top, dtype=torch.int32, device=dev)
        self._g_positions = torch.zeros(top, dtype=torch.int32, device=dev)
        self._g_slot_mapping = torch.full((top,), -1, dtype=torch.int32, device=dev)
        self._g_seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self._g_query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self._g_block_tables = torch.zeros((top, config.max_blocks_per_seq), dtype=torch.int32, device=dev)
        torch.cuda.empty_cache()  # the profiling pass's cached blocks: the graphs' pool needs memory
        pool = torch.cuda.graph_pool_handle()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
        from tqdm import tqdm

        with ops.unchecked_indices():
            # Largest first: the smaller ones reuse its pool.
            for b in tqdm(list(reversed(sizes)), desc="Capturing CUDA graphs", unit="graph", dynamic_ncols=True):
                md = AttentionMetadata(
                    slot_mapping=self._g_slot_mapping[:b], block_tables=self._g_block_tables[:b],
                    seq_lens=self._g_seq_lens[:b], query_start_loc=self._g_query_start_loc[:b + 1],
                    plan=ops.plan_decode(b, spec.num_kv_heads, dev, config.max_model_len),
                )
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # warm-up: lazily made buffers exist before capture
                    self._decode_forward(b, md)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_forward(b, md)
                # NOTE: replayed once now, over the padding inputs (no cache slot
                # written, the null block read; every rank alike under tensor
                # parallelism, whose workers capture the same graphs), as the mixed
                # graphs are: its first replay's cost (the executable graph's upload)
                # falls on the start-up instead of on the first step of its batch
                # size. The served SmolLM2 shape's decode passes at half load took
                # 0.83 ms of host time at the median and 4.69 at the 99th
                # percentile (H100, 52ff871), where the batch sizes of up to ~112 rows
                # had partly not run before. Not yet measured with this replay.
                graph.replay()
                self.graphs[b] = _DecodeGraph(graph, logits, md)
        self.graphs = dict(sorted(self.graphs.items()))  # ascending: replay picks the first that fits
        torch.cuda.synchronize(dev)
        logger.info("CUDA graphs captured for decode batch sizes %s in %.1f s%s", sizes, time.perf_counter() - start,
                    _pool_note(dev, reserved))

    # ---- piecewise CUDA graphs for prefill and mixed steps ------------------------

    def _capture_prefill_graphs(self, config: _C.EngineConfig) -> None:
        """Captures the layer bodies of steps of each size of PREFILL_GRAPH_TOKENS
        below max_num_batched_tokens, and of that budget: everything but attention, whose plan depends on
        the step's lengths (vLLM v1's piecewise graphs). A prefill step otherwise
        launches ~10 kernels per layer from Python, which costs more host time than
        the GPU spends on a short prompt."""
        # The ladder below the token budget, then the budget itself: every step fits one.
        top = config.max_num_batched_tokens
        sizes = [t for t in PREFILL_GRAPH_TOKENS if t < top] + [top]
        spec, dev = self.spec, self.device
        self._allocate_prefill_buffers(sizes[-1])
        pool = torch.cuda.graph_pool_handle()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
        with ops.unchecked_indices():
            for t in reversed(sizes):  # largest first: the smaller ones reuse its pool
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # warm-up: lazily made buffers exist before capture
                    for i in range(spec.num_layers + 1):
                        self._prefill_segment(t, i)
                torch.cuda.current_stream(dev).wait_stream(side)
                graphs, hidden = [], None
                for i in range(spec.num_layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._prefill_segment(t, i)
                    graphs.append(graph)
                self.prefill_graphs[t] = _PrefillGraphs(graphs, hidden)
        self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))
        torch.cuda.synchronize(dev)
        logger.info("CUDA graphs captured for prefill steps of %s tokens (%d pieces each) in %.1f s%s", sizes,
                    spec.num_layers + 1, time.perf_counter() - start, _pool_note(dev, reserved))

    def _allocate_prefill_buffers(self, top: int) -> None:
        """Static inputs and the buffers attention reads and writes, shared by every
        size and layer (pieces run one at a time, attention between them)."""
        spec, dtype, dev = self.spec, self.model.dtype, self.device
        self._p_input_ids = torch.zeros(top, dtype=torch.int32, device=dev)
        self._p_positions = torch.zeros(top, dtype=torch.int32, device=dev)
        self._p_slot_mapping = torch.full((top,), -1, dtype=torch.int32, device=dev)
        # (one row more: the query token of the mixed graphs' padding row, after a step's last)
        self._p_qkv = torch.zeros((top + 1, spec.q_size + 2 * spec.kv_size), dtype=dtype, device=dev)
        self._p_attn = torch.zeros((top + 1, spec.num_heads, spec.head_dim), dtype=dtype, device=dev)
        self._p_residual = torch.zeros((top, spec.hidden_size), dtype=dtype, device=dev)

    def run_prefill_in_pieces(self, sizes: tuple[int, ...]) -> None:
        """Runs prefill and mixed steps of up to ``max(sizes)`` tokens the way their
        CUDA graphs do, piece by piece, but eagerly and on any device: a test hook
        that checks the split of the layers and the padding on the CPU, where no
        graph is captured."""
        if max(sizes) > self.staging.input_ids.shape[0]:
            raise ValueError(f"run_prefill_in_pieces: sizes up to {max(sizes)} exceed the token budget "
                             f"{self.staging.input_ids.shape[0]}")
        self._allocate_prefill_buffers(max(sizes))
        self.prefill_graphs = {t: None for t in sorted(sizes)}

    def _prefill_segment(self, t: int, i: int) -> torch.Tensor | None:
        """Piece ``i`` of a ``t``-token step (see _PrefillGraphs); returns the final
        hidden states from the last piece."""
        model, layers = self.model, self.model.layers
        table = model.cos_sin_cache
        positions, slots = self._p_positions[:t], self._p_slot_mapping[:t]
        qkv, residual = self._p_qkv[:t], self._p_residual[:t]
        if i == 0:
            model.embed(self._p_input_ids[:t], out=residual)
            key_cache, value_cache = self.kv_caches[0]
            layers[0].pre_attention(positions, residual, None, table, key_cache, value_cache, slots, qkv_out=qkv)
            return None
        hidden, _ = layers[i - 1].post_attention(self._p_attn[:t], residual)
        if i == len(layers):
            return model.norm.add_forward(hidden, residual)
        key_cache, value_cache = self.kv_caches[i]
        layers[i].pre_attention(positions, hidden, residual, table, key_cache, value_cache, slots, qkv_out=qkv)
        return None

    # ---- whole CUDA graphs for small mixed steps ------------------------------------

    def _capture_mixed_graphs(self, config: _C.EngineConfig, max_tokens: int) -> None:
        """Captures, for each size of the prefill ladder up to ``max_tokens``, the
        whole step in one graph: the layer pieces and attention between them over a
        plan of fixed size. A small mixed step otherwise pays ~30 eager attention
        calls and graph launches, more than its kernels take (issue 14)."""
        spec, dev = self.spec, self.device
        sizes = [t for t in self.prefill_graphs if t <= max_tokens]
        if not sizes:
            return
        top_rows = min(config.max_num_seqs, sizes[-1])
        # Row metadata with the padding row; the token buffers are the pieces' own.
        self._m_seq_lens = torch.ones(top_rows + 1, dtype=torch.int32, device=dev)
        self._m_query_start_loc = torch.zeros(top_rows + 2, dtype=torch.int32, device=dev)
        self._m_block_tables = torch.zeros((top_rows + 1, config.max_blocks_per_seq), dtype=torch.int32, device=dev)
        layer0 = self.model.layers[0]
        scale, window = layer0.scale, spec.sliding_window
        pool = torch.cuda.graph_pool_handle()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
        # (largest first: the smaller ones reuse its pool; each size's graph, then
        # for the small ones its variant with split tiles)
        # (a graph with split tiles takes only what short contexts never make)
        with_split = ops.planning.split_tiles_useful(config.max_model_len)
        split_top = split_mixed_graph_top(config, max_tokens)
        variants = [(t, split) for t in reversed(sizes) for split in (False, True)
                    if not split or (with_split and t <= split_top)]
        with ops.unchecked_indices():
            for t, split in variants:
                rows = min(config.max_num_seqs, t)
                tile_splits = 1
                if split:
                    tile_splits = ops.planning.padded_tile_splits(t, spec.num_heads, spec.num_kv_heads,
                                                                  self.model.dtype, dev, config.max_model_len)
                padded = ops.planning.PaddedPlan(
                    t, rows, mixed_graph_tile_rows(t), spec.num_heads, spec.num_kv_heads, spec.head_dim,
                    self.model.dtype, dev, config.max_model_len, tile_splits=tile_splits)
                if split:  # (its decode scratch is the unsplit graph's of this size, captured just before)
                    padded.plan.share_scratch(self.mixed_graphs[t].plan.plan)
                md = AttentionMetadata(slot_mapping=self._p_slot_mapping[:t], block_tables=self._m_block_tables[:rows + 1],
                                       seq_lens=self._m_seq_lens[:rows + 1],
                                       query_start_loc=self._m_query_start_loc[:rows + 2], plan=padded.plan)
                # Until a step fills them: row 0 one padding token over the null block.
                self._m_query_start_loc[:rows + 2] = 1
                self._m_query_start_loc[0] = 0
                # Attention over t + 1 query rows: the padding row's token is the one
                # after the step's last (the pieces never write row t: its q stays finite).
                q = self._p_qkv[:t + 1, :spec.q_size].view(t + 1, spec.num_heads, spec.head_dim)
                attn = self._p_attn[:t + 1]

                def forward() -> torch.Tensor:
                    hidden = self._prefill_segment(t, 0)
                    for i, (key_cache, value_cache) in enumerate(self.kv_caches):
                        layer = self.model.layers[i]
                        ops.paged_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens,
                                            md.query_start_loc, scale=scale, sliding_window=window, plan=md.plan,
                                            out=attn, k_scale=layer.k_scale, v_scale=layer.v_scale)
                        hidden = self._prefill_segment(t, i + 1)
                    return hidden

                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # warm-up: lazily made buffers (the plan's scratch) exist first
                    forward()
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = forward()
                # NOTE: replayed once now, over the padding inputs it was captured with
                # (no cache slot written), so that its first replay's cost (the
                # executable graph's upload, a whole graph's hundreds of nodes) falls on
                # the start-up, not on the first steps that take it: offline
                # LLM.generate's first call in a process ran 107.6k output tok/s
                # against 115-120k in its later calls (SmolLM2 shape, H200, 85d4d19).
                # Not yet measured with this replay.
                graph.replay()
                (self.split_mixed_graphs if split else self.mixed_graphs)[t] = _MixedGraph(graph, hidden, padded, rows)
        self.mixed_graphs = dict(sorted(self.mixed_graphs.items()))
        self.split_mixed_graphs = dict(sorted(self.split_mixed_graphs.items()))
        torch.cuda.synchronize(dev)
        logger.info("CUDA graphs captured for whole mixed steps of %s tokens (%s also with split tiles) in %.1f s%s",
                    sizes, list(self.split_mixed_graphs), time.perf_counter() - start, _pool_note(dev, reserved))

    def _replay_mixed(self, batch: _C.StepBatch, seq_lens: np.ndarray, width: int,
                      deferred: tuple[torch.Tensor, torch.Tensor] | None,
                      previous: torch.Tensor | None) -> torch.Tensor | None:
        """The final hidden states of the step's sampled rows, from the whole graph
        of the smallest size whose plan holds the step, the unsplit graphs tried
        before those with split tiles; None (nothing done) when none holds it."""
        n, r = batch.num_tokens, batch.num_seqs
        lists = None
        found: tuple[int, _MixedGraph, bool] | None = None  # (size, graph, whether its tiles split)
        # (a larger size has more tile items: the next one up may hold what this one
        # cannot; the graphs with split tiles only where no unsplit one holds the step)
        candidates = [(size, entry, False) for size, entry in self.mixed_graphs.items()]
        candidates += [(size, entry, True) for size, entry in self.split_mixed_graphs.items()]
        for size, candidate, split in candidates:
            if size < n or r > candidate.max_rows:
                continue
            if lists is None:
                lists = candidate.plan.lists(batch.query_start_loc, seq_lens)
            if candidate.plan.fill(batch.query_start_loc, seq_lens, pad_row=r, lists=lists):
                found = size, candidate, split
                break
        if found is None:
            return None
        t, entry, split = found
        self.split_mixed_graph_replays += split
        self.last_path = "split" if split else "mixed"
        s = self.staging
        sample_indices = self._to_device(_put(s.sample_indices, batch.sample_indices))
        ids, pos, slots = s.input_ids.numpy(), s.positions.numpy(), s.slot_mapping.numpy()
        ids[:n], pos[:n], slots[:n] = batch.input_ids, batch.positions, batch.slot_mapping
        ids[n:t], pos[n:t], slots[n:t] = 0, 0, -1
        # The padding row r: query token n (a padding token, or the buffers' extra row t
        # when the step fills the graph), one key, the null block.
        lens, starts = s.seq_lens.numpy(), s.query_start_loc.numpy()
        lens[:r], lens[r] = seq_lens, 1
        starts[:r + 1], starts[r + 1] = batch.query_start_loc, n + 1
        tables = s.block_tables.numpy()
        tables[:r, :width], tables[r, :width] = batch.block_tables[:, :width], 0
        self._p_input_ids[:t].copy_(s.input_ids[:t], non_blocking=True)
        self._p_positions[:t].copy_(s.positions[:t], non_blocking=True)
        self._p_slot_mapping[:t].copy_(s.slot_mapping[:t], non_blocking=True)
        self._m_seq_lens[:r + 1].copy_(s.seq_lens[:r + 1], non_blocking=True)
        self._m_query_start_loc[:r + 2].copy_(s.query_start_loc[:r + 2], non_blocking=True)
        self._m_block_tables[:r + 1, :width].copy_(s.block_tables[:r + 1, :width], non_blocking=True)
        entry.plan.upload()
        self._staging_copied()
        self._mark_launch()
        self._take_deferred(self._p_input_ids, deferred, previous)
        self._replay(entry.graph)
        self.mixed_graph_replays += 1
        return entry.hidden[sample_indices.long()]

    def _eager_metadata(self, batch: _C.StepBatch, seq_lens: np.ndarray, width: int,
                        slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """The step's attention metadata, queued to the device, and on CUDA its plan
        (``slot_mapping``: already on the device, else staged from the batch)."""
        s, num_seqs = self.staging, batch.num_seqs
        # The block tables packed at the head of their staging buffer: a copy from a
        # strided slice would go through a pageable temporary.
        tables = s.block_tables.view(-1)[:num_seqs * width].view(num_seqs, width)
        np.copyto(tables.numpy(), batch.block_tables[:, :width])
        md = AttentionMetadata(
            slot_mapping=(slot_mapping if slot_mapping is not None
                          else self._to_device(_put(s.slot_mapping, batch.slot_mapping))),
            block_tables=self._to_device(tables),
            seq_lens=self._to_device(_put(s.seq_lens, seq_lens)),
            query_start_loc=self._to_device(_put(s.query_start_loc, batch.query_start_loc)),
        )
        if self.device.type == "cuda":
            md.plan = ops.plan_attention(
                batch.query_start_loc, seq_lens, self.spec.num_heads, self.spec.num_kv_heads, self.device,
                self.spec.head_dim, self.model.dtype,
            )
        return md

    def _replay_prefill(self, batch: _C.StepBatch, seq_lens: np.ndarray, width: int,
                        deferred: tuple[torch.Tensor, torch.Tensor] | None = None,
                        previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's final hidden states ``[num_tokens, hidden_size]`` from the
        graphs of the next size up (padding tokens: id 0, position 0, no cache slot),
        and its sample indices on the device.

        NOTE: the first piece (embedding, layer 0 up to attention) is queued before
        the attention metadata and plan are built, so that the host builds them
        while the device runs it: on the H200 at f862100 the 8B shape's 4096-token
        prompt left the GPU idle 1.6 ms in its first 1.3 ms of kernels, the host
        staging and planning between the first copies and the first piece."""
        n = batch.num_tokens
        t = next(size for size in self.prefill_graphs if size >= n)
        entry, spec, s = self.prefill_graphs[t], self.spec, self.staging
        ids, pos = s.input_ids.numpy(), s.positions.numpy()
        ids[:n], pos[:n] = batch.input_ids, batch.positions
        ids[n:t], pos[n:t] = 0, 0
        slots = s.slot_mapping.numpy()
        slots[:n], slots[n:t] = batch.slot_mapping, -1  # (padding: -1, no cache write)

        def piece(i: int) -> torch.Tensor | None:
            if entry is None:  # run_prefill_in_pieces: eagerly
                return self._prefill_segment(t, i)
            self._replay(entry.graphs[i])
            return entry.hidden if i == spec.num_layers else None

        try:
            self._p_input_ids[:t].copy_(s.input_ids[:t], non_blocking=True)
            self._p_positions[:t].copy_(s.positions[:t], non_blocking=True)
            self._p_slot_mapping[:t].copy_(s.slot_mapping[:t], non_blocking=True)
            self._mark_launch()
            self._take_deferred(self._p_input_ids, deferred, previous)
            piece(0)
            md = self._eager_metadata(batch, seq_lens, width, slot_mapping=self._p_slot_mapping[:n])
            sample_indices = self._to_device(_put(s.sample_indices, batch.sample_indices))
        finally:  # (also when planning fails: the next step must not rewrite what is queued)
            self._staging_copied()
        q = self._p_qkv[:n, :spec.q_size].view(n, spec.num_heads, spec.head_dim)
        attn = self._p_attn[:n]
        scale, window = self.model.layers[0].scale, spec.sliding_window
        for i, (key_cache, value_cache) in enumerate(self.kv_caches):
            layer = self.model.layers[i]
            ops.paged_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                scale=scale, sliding_window=window, plan=md.plan, out=attn,
                                k_scale=layer.k_scale, v_scale=layer.v_scale)
            hidden = piece(i + 1)
        self.prefill_graph_replays += 1
        return hidden[:n], sample_indices

    def _decode_forward(self, b: int, md: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self._g_input_ids[:b], self._g_positions[:b], md, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _staging_free(self) -> None:
        """Waits until the previous step's copies have read the staging buffers.

        NOTE: the copies are asynchronous and queued behind that step's
        predecessor; steps without samples never synchronise, so without this
        the host could overwrite the pinned buffers before a queued copy runs.
        """
        if self._staged is not None:
            if self.step_spans is not None:  # (traced: the wait apart)
                began = time.perf_counter()
                self._staged.synchronize()
                self._staging_wait += time.perf_counter() - began
            else:
                self._staged.synchronize()
            self._staged = None

    def _staging_copied(self) -> None:
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _deferred_indices(self, batch: _C.StepBatch, previous: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deferred inputs' token indices and sample indices on the device (one
        copy), or None when the step has none."""
        n = batch.num_deferred_inputs
        if n == 0:
            return None
        if previous is None:
            raise RuntimeError(f"internal error: the step takes {n} input ids from the previous step's "
                               "samples, and execute() got none")
        both = self.staging.deferred.numpy()
        both[:n] = batch.deferred_input_indices
        both[n:2 * n] = batch.deferred_input_samples
        both = self._to_device(self.staging.deferred[:2 * n])
        return both[:n], both[n:]

    @staticmethod
    def _take_deferred(input_ids: torch.Tensor, deferred: tuple[torch.Tensor, torch.Tensor] | None,
                       previous: torch.Tensor | None) -> None:
        """Writes the previous step's sampled ids into the deferred inputs, in place."""
        if deferred is None:
            return
        tokens, samples = deferred
        # NOTE: -1 marks a row with nothing to sample (NaN logits); that step fails
        # when its ids reach the host, but this forward pass is queued already and
        # must not index the embedding with -1.
        values = previous.index_select(0, samples).clamp_(min=0).to(input_ids.dtype)
        input_ids.index_copy_(0, tokens, values)

    def _replay_decode(self, batch: _C.StepBatch, width: int,
                       deferred: tuple[torch.Tensor, torch.Tensor] | None = None,
                       previous: torch.Tensor | None = None) -> torch.Tensor:
        n = batch.num_seqs
        b = next(size for size in self.graphs if size >= n)  # dict in ascending order
        s = self.staging
        # The step's rows, then padding rows up to b, staged on the host and
        # copied in one transfer per buffer.
        ids, pos, slots, lens = (s.input_ids.numpy(), s.positions.numpy(), s.slot_mapping.numpy(),
                                 s.seq_lens.numpy())
        ids[:n], pos[:n], slots[:n], lens[:n] = batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens
        ids[n:b], pos[n:b], slots[n:b], lens[n:b] = 0, 0, -1, 1
        tables = s.block_tables.numpy()
        tables[:n, :width], tables[n:b, 0] = batch.block_tables[:, :width], 0
        self._g_input_ids[:b].copy_(s.input_ids[:b], non_blocking=True)
        self._g_positions[:b].copy_(s.positions[:b], non_blocking=True)
        self._g_slot_mapping[:b].copy_(s.slot_mapping[:b], non_blocking=True)
        self._g_seq_lens[:b].copy_(s.seq_lens[:b], non_blocking=True)
        self._g_block_tables[:b, :width].copy_(s.block_tables[:b, :width], non_blocking=True)
        self._staging_copied()
        self._mark_launch()
        self._take_deferred(self._g_input_ids, deferred, previous)
        entry = self.graphs[b]
        self._replay(entry.graph)
        self.graph_replays += 1
        return entry.logits[:n]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _move_blocks(self, batch: _C.StepBatch) -> None:
        # NOTE: the order is part of the engine's contract: a block freed by a
        # swap-out may be the destination of a swap-in or a copy of the same step.
        gpu = [t for pair in self.kv_caches for t in pair]
        cpu = [t for pair in self.cpu_kv_caches for t in pair]
        if batch.num_swap_out:
            ops.swap_out(gpu, cpu, torch.from_numpy(np.array(batch.swap_out)))
        if batch.num_swap_in:
            ops.swap_in(cpu, gpu, torch.from_numpy(np.array(batch.swap_in)))
        if batch.num_block_copies:
            pairs = self._to_device(torch.from_numpy(np.array(batch.block_copies)))
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], pairs)

    def execute(self, batch: _C.StepBatch, previous_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the step; returns float32 logits ``[batch.num_samples, vocab]``.

        Parameters
        ----------
        batch : StepBatch
            The step, just scheduled.
        previous_sampled : Tensor, optional
            ``[S]`` int64 on the device: the sampled ids of the step before
            (``SamplerOutput.sampled_token_ids``), still unresolved in the engine
            (async scheduling). Needed when ``batch.num_deferred_inputs > 0``:
            input ``deferred_input_indices[j]`` is
            ``previous_sampled[deferred_input_samples[j]]``.
        """
        if self.step_spans is not None:
            return self._traced(batch, previous_sampled)
        return self._run(batch, previous_sampled)

    def _run(self, batch: _C.StepBatch, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        # NOTE: the engine's slots and block ids are valid by construction; on the
        # GPU, checking them again would synchronise every layer.
        if self.tp_driver is not None:
            with self.tp_driver.guard(), ops.unchecked_indices():
                self.tp_driver.send_step(batch, self.block_size, previous_sampled)
                return self._execute(batch, previous_sampled)
        with ops.unchecked_indices():
            return self._execute(batch, previous_sampled)

    def _traced(self, batch: _C.StepBatch, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        """execute(), its step described in :attr:`step_spans` (events on CUDA:
        from just before its first kernel or graph, :meth:`_mark_launch`, to after
        its last)."""
        cuda = self.device.type == "cuda"
        start = end = None
        self._launch_event = None
        self._launched_at = None
        self._staging_wait = self._replay_time = 0.0
        began = time.perf_counter()
        cpu_began = time.thread_time()  # (inside the wall-clock span: cpu <= host)
        logits = self._run(batch, previous_sampled)
        cpu = time.thread_time() - cpu_began
        ended = time.perf_counter()
        host = ended - began
        staged = (self._launched_at if self._launched_at is not None else ended) - began
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            start = self._launch_event or end  # (a step with no kernel: none)
            self._launch_event = None
        seq_lens = batch.seq_lens
        self.step_spans.append(StepSpan(
            self.last_path, batch.num_tokens, batch.num_seqs, batch.num_tokens - batch.num_decode_seqs,
            int(seq_lens.max()) if len(seq_lens) else 0, host, start, end, self._staging_wait, staged, cpu,
            self._replay_time))
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of final hidden states (e.g. of
        :attr:`prompt_hidden`)."""
        if self.tp_driver is not None:
            with self.tp_driver.guard():
                self.tp_driver.send_logits(hidden)
                return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden)

    def _execute(self, batch: _C.StepBatch, previous: torch.Tensor | None) -> torch.Tensor:
        self.prompt_hidden = None
        self._move_blocks(batch)
        if batch.num_tokens == 0:
            self.last_path = "empty"
            return torch.empty((0, self.spec.vocab_size), dtype=torch.float32, device=self.device)
        s = self.staging
        num_seqs = batch.num_seqs
        seq_lens_np = batch.seq_lens
        width = (int(seq_lens_np.max()) + self.block_size - 1) // self.block_size
        self._staging_free()
        deferred = self._deferred_indices(batch, previous)
        # (A step with prompt-logprob rows has prompt chunks: never a graph's.)
        if (self.graphs and batch.num_tokens == num_seqs == batch.num_samples
                and batch.num_prompt_logprob_tokens == 0 and num_seqs <= max(self.graphs)):
            self.last_path = "decode"
            return self._replay_decode(batch, width, deferred, previous)
        if (self.mixed_graphs and batch.num_prompt_logprob_tokens == 0
                and batch.num_tokens <= next(reversed(self.mixed_graphs))):
            hidden = self._replay_mixed(batch, seq_lens_np, width, deferred, previous)
            if hidden is not None:
                return self.model.compute_logits(hidden)
        if self.prefill_graphs and batch.num_tokens <= max(self.prefill_graphs):
            self.last_path = "pieces"
            hidden, sample_indices = self._replay_prefill(batch, seq_lens_np, width, deferred, previous)
        else:
            self.last_path = "eager"
            md = self._eager_metadata(batch, seq_lens_np, width)
            sample_indices = self._to_device(_put(s.sample_indices, batch.sample_indices))
            input_ids = self._to_device(_put(s.input_ids, batch.input_ids))
            positions = self._to_device(_put(s.positions, batch.positions))
            self._staging_copied()
            self._mark_launch()
            self._take_deferred(input_ids, deferred, previous)
            hidden = self.model(input_ids, positions, md, self.kv_caches)
        if batch.num_prompt_logprob_tokens:
            # Only the rows that score a prompt token; their logits are made later,
            # a slice at a time (pagedcore.prompt_logprobs).
            rows = torch.from_numpy(batch.prompt_logprob_indices.astype(np.int64))
            self.prompt_hidden = hidden[self._to_device(rows)]
        return self.model.compute_logits(hidden[sample_indices.long()])


@torch.inference_mode()
def profile_peak_memory(model: CausalLM, num_tokens: int, num_samples: int, block_size: int,
                        kv_dtype: torch.dtype) -> int:
    """Peak CUDA memory (bytes, weights included) of one forward pass over
    ``num_tokens`` tokens and the logits of ``num_samples`` rows, with a KV cache
    just large enough for them, which is not counted."""
    spec, device = model.spec, next(model.parameters()).device
    seqs = max(1, min(num_samples, num_tokens))
    per_seq = -(-num_tokens // seqs)
    blocks_per_seq = -(-per_seq // block_size)
    shape = (1 + seqs * blocks_per_seq, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
              for _ in range(spec.num_layers)]
    cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
    lens = [per_seq] * (seqs - 1) + [num_tokens - per_seq * (seqs - 1)]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    rotary_positions = (positions % model.max_positions).astype(np.int32)  # inside the rotary table
    tables = (1 + np.arange(seqs * blocks_per_seq, dtype=np.int32)).reshape(seqs, blocks_per_seq)
    rows = np.repeat(np.arange(seqs), lens)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    md = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.from_numpy(qsl).to(device),
    )
    md.plan = ops.plan_attention(qsl, np.array(lens), spec.num_heads, spec.num_kv_heads, device, spec.head_dim,
                                 model.dtype)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    hidden = model(ids, torch.from_numpy(rotary_positions).to(device), md, caches)
    model.compute_logits(hidden[:num_samples])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden
    torch.cuda.empty_cache()
    return peak - cache_bytes
