"""The engine loop of the server: one thread steps the engine; asyncio handlers
talk to it through queues.

The engine (C++ core, model runner, tokenizer) is used by that thread alone.
Handlers enqueue commands (add, abort); the thread applies them between steps
and hands each request's outputs to that request's stream. A handler that goes
away (client disconnect) aborts its request, which frees its blocks at the
next step boundary.

The fan-out is batched: a step's outputs for every stream cross to the event
loop in one ``call_soon_threadsafe`` (one wake-up of the loop, not one per
stream), and a handler takes every output its stream holds at once, merged
into one output (:meth:`RequestStream.merged`), so a handler that fell behind
by several steps catches up with one server-sent event and one write.

Detokenization: a streamed request without stop strings or an output
constraint (the engine needs the text of those) is turned into text here, on
the handler's side, not by the engine: the engine sends token ids only, and
the handler decodes what arrived since it last ran in one call (one decode per
write, however many tokens it carries). With the engine in a process of its
own (engine_process.py) that takes the work off the engine's critical path.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..compact_outputs import FINISH_REASONS, compact_eligible
from ..detokenizer import IncrementalDetokenizer
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from . import step_trace

if TYPE_CHECKING:  # (torch: not for the HTTP processes of --api-server-count, which need no engine)
    from ..llm_engine import LLMEngine

logger = logging.getLogger("pagedcore.server")


class QueueFullError(RuntimeError):
    """The server holds max_queue_len waiting requests already."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or died of an error): nothing
    more is generated."""


class EngineDiedError(EngineDeadError):
    """The engine died (not a shutdown): its loop raised, a tensor-parallel
    worker died, or its process exited. ``str()`` is ``engine died: <reason>``.

    NOTE: the reason is the only argument, so that the error pickles as itself
    (it crosses the engine process's pipe)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"engine died: {self.reason}"


SHUTTING_DOWN = "server shutting down"


class _Stream:
    """One request's items (outputs, or an exception that ends it), filled on
    its event loop by the engine thread's fan-out, read by the handler."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:  # (on the loop)
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list:
        """Every item there is, waiting for one if there is none."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items = list(self.items)
        self.items.clear()
        return items


class _CompactStream(_Stream):
    """(engine process, HTTP side) The stream of a compact request (see
    compact_outputs.py): its items are token ids (ints) and, last, a _Finish."""

    __slots__ = ("request_id", "key")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str, key: int) -> None:
        super().__init__(loop)
        self.request_id, self.key = request_id, key


class _Finish:
    """A compact request's last token and how it finished (a finish code of
    compact_outputs.FINISH_REASONS; the stop token, or -1)."""

    __slots__ = ("token", "reason", "stop")

    def __init__(self, token: int, reason: int, stop: int) -> None:
        self.token, self.reason, self.stop = token, reason, stop


class _CompactRebuilder:
    """(event loop) A compact request's items (token ids, the last a _Finish) as
    one RequestOutput (merge) or one per token."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids

    def __call__(self, items: list, merge: bool) -> list[RequestOutput]:
        if merge:
            return [self._output(items)]
        return [self._output([item]) for item in items]

    def _output(self, items: list) -> RequestOutput:
        last = items[-1]
        reason = stop = None
        if last.__class__ is _Finish:
            items = items[:-1] + [last.token]
            reason = FINISH_REASONS[last.reason]
            stop = last.stop if last.stop >= 0 else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [CompletionOutput(0, "", items, None, None, reason, stop)], reason is not None)


def _fan_out(deliveries: list[tuple[_Stream, Any]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


_ACCEPTED = object()  # first item of a stream: the request passed validation


def detokenized_here(tokenizer, params: SamplingParams) -> bool:
    """Whether the server, not the engine, turns a streamed request's tokens
    into text: it can when the engine needs no text (no stop strings) and the
    finish tells which last token is not text (no output constraint: a
    completed grammar's last token is text, an EOS is not, and both finish
    with "stop")."""
    return tokenizer is not None and not params.stop and params.structured_outputs is None


class _Detokenizers:
    """The text of one request's completions, made from the token ids of its
    deltas (see the module's docstring): one incremental detokenizer per
    completion, fed everything that arrived since it last ran."""

    __slots__ = ("tokenizer", "skip_special_tokens", "by_index")

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, params.skip_special_tokens
        self.by_index: dict[int, IncrementalDetokenizer] = {}

    def fill(self, out: RequestOutput) -> None:
        """Sets the text of out's completions (their token ids are new since the last call)."""
        for c in out.outputs:
            d = self.by_index.get(c.index)
            if d is None:
                d = self.by_index[c.index] = IncrementalDetokenizer(
                    self.tokenizer, (), skip_special_tokens=self.skip_special_tokens)
            ids = c.token_ids
            if c.finish_reason == "stop" and ids:
                ids = ids[:-1]  # NOTE: the EOS or stop token that ended it is not text (as in the engine)
            text = d.append(ids)[0] if ids else ""
            if c.finish_reason is not None:
                text += d.flush()
            c.text = text


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One delta output for a request's consecutive deltas (vLLM's merge of a
    stream's pending outputs): per completion the texts concatenated, token
    ids and logprobs appended, the latest cumulative logprob and finish; the
    prompt logprobs that one of them carried."""
    if len(outs) == 1:
        return outs[0]
    merged: dict[int, CompletionOutput] = {}
    for out in outs:
        for c in out.outputs:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)
                continue
            m.text += c.text
            m.token_ids += c.token_ids
            if c.logprobs is not None:
                m.logprobs = (m.logprobs or []) + c.logprobs
            m.cumulative_logprob = c.cumulative_logprob
            if c.finish_reason is not None:
                m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
    first, last = outs[0], outs[-1]
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids,
                         [merged[k] for k in sorted(merged)], last.finished, last.metrics, prompt_logprobs)


class RequestStream:
    """The delta outputs of one request: ``async for out in stream`` one by one,
    ``async for outs in stream.batches()`` as lists of what has arrived, or
    ``async for out in stream.merged()`` as one output per list. Leaving any of
    them early aborts the request. An error that ends the request (the engine
    stopped, a step failed) is raised after the outputs before it."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream,
                 detokenizers: _Detokenizers | None = None, rebuild=None) -> None:
        self._engine, self.request_id, self._stream = engine, request_id, stream
        self._detokenizers = detokenizers
        # (engine process) rebuild(items, merge) -> the RequestOutputs the stream's
        # items stand for (they stay as they crossed the pipe until taken here).
        self._rebuild = rebuild

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._one_by_one()

    async def _one_by_one(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for out in batch:
                yield out

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        async for batch in self._raw_batches():
            if self._rebuild is not None:
                batch = self._rebuild(batch, merge=False)
            if self._detokenizers is not None:
                for out in batch:
                    self._detokenizers.fill(out)
            yield batch

    async def merged(self) -> AsyncIterator[RequestOutput]:
        """One output for everything that arrived since the last one (a consumer
        that keeps up gets one per engine step; one that fell behind, fewer and
        longer ones): text detokenized once per output, not once per token."""
        async for batch in self._raw_batches():
            out = merge_outputs(self._rebuild(batch, merge=True) if self._rebuild is not None else batch)
            if self._detokenizers is not None:
                self._detokenizers.fill(out)
            yield out

    async def _raw_batches(self) -> AsyncIterator[list[RequestOutput]]:
        finished = False
        try:
            while not finished:
                items = await self._stream.take()
                batch = []
                for item in items:
                    cls = item.__class__
                    if cls is int:  # (a compact request's token)
                        batch.append(item)
                        continue
                    if isinstance(item, BaseException):
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    # (a tuple: a plain delta as it crossed the engine process's pipe; a
                    # _Finish: a compact request's last token)
                    if cls is _Finish or (item[6] if cls is tuple else item.finished):
                        finished = True
                        break
                if batch:
                    yield batch
        finally:
            if not finished:
                self._engine.abort(self.request_id)


# Upper bounds (seconds) of the engine-step histogram's buckets (/metrics).
STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.2, 0.5, 1.0, 2.0)


class StepTimes:
    """Wall time of the engine's steps (each ``LLMEngine.step()`` call), apart
    for steps in which prompt tokens ran (a prefill or a chunk of one: kind
    "prefill") and the others (decode only): the steps that can stretch a
    stream's inter-token gap. Cumulative bucket counts, as a Prometheus histogram.

    NOTE: with a pipelined engine (LLMEngine.pipelined) a call waits for the
    forward pass that the previous call launched and launches the next one, so
    a call counts as "prefill" when either of them computed prompt tokens: a
    capped chunk that gives no request its first token yet (the cap's
    middle steps), or the eager launch of a mixed step, is no decode step."""

    KINDS = ("decode", "prefill")

    def __init__(self) -> None:
        self.counts = {kind: [0] * (len(STEP_BUCKETS) + 1) for kind in self.KINDS}
        self.sums = dict.fromkeys(self.KINDS, 0.0)

    def observe(self, seconds: float, prefill: bool) -> None:
        kind = "prefill" if prefill else "decode"
        self.counts[kind][bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.sums[kind] += seconds

    def snapshot(self) -> dict[str, tuple[tuple[int, ...], float]]:
        """{kind: (count per bucket, the last one past STEP_BUCKETS; sum of seconds)}."""
        return {kind: (tuple(self.counts[kind]), self.sums[kind]) for kind in self.KINDS}


class GcTimes:
    """Collections of Python's garbage collector in this process and the time
    they took, per generation (gc.callbacks): each one stops every thread of
    the process, the engine's steps included (a full collection walks every
    object the collector tracks: what serving made since
    lifecycle.freeze_startup_objects()).

    Counts since :meth:`install`; one instance per process is enough (see
    :func:`gc_times`)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started: float | None = None
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self._started = None

    def snapshot(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(collections per generation, seconds per generation)."""
        return tuple(self.counts), tuple(self.seconds)


_GC_TIMES: GcTimes | None = None


def gc_times() -> GcTimes:
    """This process's GcTimes, installed on first use."""
    global _GC_TIMES
    if _GC_TIMES is None:
        _GC_TIMES = GcTimes()
        _GC_TIMES.install()
    return _GC_TIMES


class AsyncEngine:
    """Runs an :class:`LLMEngine` in a background thread for asyncio callers."""

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0  # adds enqueued but not applied yet
        self._adds = 0  # (engine thread) requests admitted so far
        self._lock = threading.Lock()
        self._outbox: list[tuple[_Stream, Any]] = []  # (engine thread) items not handed over yet
        # (engine thread) compact key -> request id of live compact requests; their
        # tokens come from take_compact_outputs(), not step() (see _deliver_compact).
        self._compact_ids: dict[int, str] = {}
        self._compact_key_of: dict[str, int] = {}  # the other way round
        self._next_key = 0  # (under _lock) the next compact key (never reused)
        self._take_compact = getattr(engine, "take_compact_outputs", None)
        # NOTE: set under _lock by the engine thread as it ends; an add checks it
        # under the same lock, so every add either sees it or is queued before
        # the thread's last drain of the commands (which answers it).
        self._dead = False
        # Why the engine died (set by the engine thread before _dead); None for a shutdown.
        self._death: str | None = None
        self.step_times = StepTimes()
        self._last_step_prompt_tokens = 0  # (engine thread) of the previous step() call
        self.gc_times = gc_times()
        self.stats: dict[str, Any] = {**engine.stats(), "step_seconds": self.step_times.snapshot(),
                                      "gc": self.gc_times.snapshot()}
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="pagedcore-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ---------------------------------------------------------

    def num_waiting(self) -> int:
        return self.stats.get("num_waiting_seqs", 0) + self._pending

    async def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Queues a request and returns, once the engine has accepted it, a
        :class:`RequestStream` of its delta outputs (leaving it early aborts the
        request).

        Raises ValueError (bad request), QueueFullError (no room) or
        EngineDeadError (the engine thread has stopped); a caller that never
        iterates the result must :meth:`abort` the request itself.
        """
        if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
            raise QueueFullError(f"the server has {self.num_waiting()} requests waiting (max_queue_len {self.max_queue_len})")
        loop = asyncio.get_running_loop()
        here = detokenized_here(getattr(self.engine, "tokenizer", None), params)
        key = None
        if here and self._take_compact is not None and compact_eligible(params):
            # (a plain stream: the engine gives its tokens as rows, see _deliver_compact;
            # its prompt is tokenized here, as in the engine process's HTTP side, for its outputs)
            if prompt_token_ids is None:
                prompt_token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            with self._lock:
                key, self._next_key = self._next_key, self._next_key + 1
            stream: _Stream = _CompactStream(loop, request_id, key)
        else:
            stream = _Stream(loop)
        with self._lock:
            if self._dead:
                raise self._dead_error()
            self._pending += 1
            self._commands.put(("add", request_id, prompt, prompt_token_ids, params, add_special_tokens, here,
                                key, stream))
        self._wake.set()
        try:
            items = await stream.take()
        except BaseException:
            # NOTE: cancelled while waiting for the verdict: the abort command
            # queues behind the add, so the request cannot survive us.
            self.abort(request_id)
            raise
        verdict = items[0]
        if isinstance(verdict, BaseException):
            raise verdict
        stream.items.extendleft(reversed(items[1:]))  # outputs that came with the verdict
        rebuild = _CompactRebuilder(request_id, prompt, prompt_token_ids) if key is not None else None
        return RequestStream(self, request_id, stream, _Detokenizers(self.engine.tokenizer, params) if here else None,
                             rebuild)

    def health_error(self) -> str | None:
        """None while the engine serves; otherwise what /health answers with 503:
        ``engine died: <reason>`` (its loop raised, or LLMEngine.health_error():
        a tensor-parallel worker died, seen here even before the loop notices),
        or that the server is shutting down."""
        if self._death is not None:
            return str(EngineDiedError(self._death))
        reason = _engine_failure(self.engine)
        if reason is not None:
            return str(EngineDiedError(reason))
        if self._dead or self._stop.is_set() or not self._thread.is_alive():
            return SHUTTING_DOWN
        return None

    def alive(self) -> bool:
        return self.health_error() is None

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def close_channel(self, timeout: float = 5.0) -> None:
        """Ends every request in flight (EngineDeadError each): for an engine in
        this process, its :meth:`shutdown` (an engine process's channel closes
        alone: EngineProcess.close_channel)."""
        self.shutdown(timeout)

    # ---- engine thread -----------------------------------------------------------

    def _deliver(self, stream: _Stream, item: Any) -> None:
        """Queues an item for its stream; :meth:`_flush` hands them over."""
        self._outbox.append((stream, item))

    def _flush(self) -> None:
        """Hands the queued items to their event loops: one call each."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in self._outbox:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        self._outbox = []
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fan_out, deliveries)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                pass

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, ids, params, special, here, key, stream = command
                with self._lock:
                    self._pending -= 1
                try:
                    # (detokenize passed only when off: the benchmarks' stub engines lack it)
                    kwargs = {"detokenize": False} if here else {}
                    if key is not None:
                        kwargs["compact_key"] = key
                    self.engine.add_request(request_id, prompt, ids, params, stream=True, add_special_tokens=special,
                                            **kwargs)
                except Exception as e:  # bad input: nothing was queued
                    self._deliver(stream, e)
                    self._fail_dropped(e)  # (or the step in flight failed while it waited)
                    continue
                self._streams[request_id] = stream
                self._adds += 1
                if key is not None:
                    self._compact_ids[key] = request_id
                    self._compact_key_of[request_id] = key
                self._deliver(stream, _ACCEPTED)
            elif command[0] == "abort":
                request_id = command[1]
                if self._streams.pop(request_id, None) is not None:
                    self._forget_compact(request_id)
                    self.engine.abort(request_id)
            else:
                self._command(command)

    def _deliver_compact(self, rows) -> None:
        """(engine thread) A step's compact rows (CompactOutputs) to their streams:
        a token id each, a request's last one as a _Finish (one row per stream
        and step: a plain loop, no object but the last)."""
        ids, streams, outbox = self._compact_ids, self._streams, self._outbox
        for key, token, finish, stop in rows.rows():
            request_id = ids.get(key)
            if request_id is None:
                continue
            if finish:
                self._forget_compact(request_id)
                stream = streams.pop(request_id, None)
                if stream is not None:
                    outbox.append((stream, _Finish(token, finish, stop)))
            else:
                outbox.append((streams[request_id], token))  # (a live key has its stream)

    def _forget_finished_compact(self, rows) -> None:
        """(engine thread) Forgets the requests whose last row this is."""
        for key in rows.keys[rows.finish != 0].tolist():
            request_id = self._compact_ids.pop(key, None)
            if request_id is not None:
                del self._compact_key_of[request_id]
                self._streams.pop(request_id, None)

    def _forget_compact(self, request_id: str) -> None:
        key = self._compact_key_of.pop(request_id, None)
        if key is not None:
            del self._compact_ids[key]

    def _command(self, command: tuple) -> None:
        """(engine thread) A command other than add and abort (a subclass's)."""
        raise ValueError(f"unknown command {command[0]!r}")

    def _fail_dropped(self, error: Exception) -> None:
        """Tells the streams whose requests the engine dropped (a failed step aborts all)."""
        for request_id in [r for r in self._streams if not self.engine.has_request(r)]:
            self._forget_compact(request_id)
            self._deliver(self._streams.pop(request_id), RuntimeError(f"engine step failed: {error}"))

    def _dead_error(self) -> EngineDeadError:
        """What a request gets once the loop has ended (call only then)."""
        return EngineDiedError(self._death) if self._death is not None else EngineDeadError(SHUTTING_DOWN)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the thread ends; its callers must hear of it
            self._death = f"the engine loop raised {type(e).__name__}: {e}"
            logger.error("engine died: %s", self._death, exc_info=True)
        finally:
            self._close()

    def _healthy(self) -> bool:
        """Whether the engine can go on; if not, notes and logs why (once: the loop then ends)."""
        reason = _engine_failure(self.engine)
        if reason is None:
            return True
        self._death = reason
        logger.error("engine died: %s", reason)
        return False

    def _loop(self) -> None:
        path = step_trace.trace_path()
        trace = step_trace.StepTrace(path, self.engine) if path else None
        try:
            self._turns(trace)
        finally:
            if trace is not None:
                trace.write()

    def _turns(self, trace: step_trace.StepTrace | None) -> None:
        while not self._stop.is_set():
            try:
                if trace is not None:
                    wall, began = step_trace.now()
                    adds = self._adds
                # NOTE: checked while idle (a tensor-parallel worker can die then) and
                # before the adds that woke the loop: they are refused, not admitted.
                if not self.engine.has_unfinished_requests() and not self._healthy():
                    return
                # NOTE: an abort (and rarely an add) first completes the step in
                # flight, so a failure of that step can surface here too.
                self._apply_commands()
                self._flush()  # (the verdicts of the adds: a bad request hears at once)
                if not self.engine.has_unfinished_requests():
                    self._publish_stats()
                    self._flush()
                    if trace is not None:
                        trace.write()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                elapsed = time.perf_counter() - started
            except Exception as e:  # the engine aborted every request; tell them
                if not self._healthy():  # (and it cannot step any more)
                    return
                logger.exception("engine step failed")
                self.errors += 1
                self._fail_dropped(e)
                self._flush()
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                self._deliver(stream, out)
            compact = self._take_compact() if self._take_compact is not None else None
            if compact is not None:
                self._deliver_compact(compact)
            # NOTE: the stats first: a client that has its last token reads them
            # already counting its request as done (/metrics right after a response).
            self._publish_stats(elapsed)
            if trace is None:
                self._flush()
            else:
                published = time.perf_counter()
                self._flush()
                trace.turn(wall, began, started, elapsed, published, time.perf_counter(), self._adds - adds)

    def _step_had_prefill(self, stats: dict[str, Any]) -> bool:
        """(engine thread, after a step() call) Whether prompt tokens ran in the
        step(s) the call waited for: see StepTimes."""
        launched = getattr(self.engine, "step_prompt_tokens", None)
        if launched is None:  # (the benchmarks' and tests' stubs: a request's first token came out)
            return stats.get("num_prompt_tokens", 0) > self.stats.get("num_prompt_tokens", 0)
        previous, self._last_step_prompt_tokens = self._last_step_prompt_tokens, launched
        return launched > 0 or (previous > 0 and getattr(self.engine, "pipelined", False))

    def _publish_stats(self, step_seconds: float | None = None) -> None:
        """The engine's stats for /metrics, with the step just made (if any) counted."""
        stats = self.engine.stats()
        if step_seconds is not None:
            self.step_times.observe(step_seconds, self._step_had_prefill(stats))
        stats["step_seconds"] = self.step_times.snapshot()
        stats["gc"] = self.gc_times.snapshot()
        self.stats = stats

    def _close(self) -> None:
        """Ends every caller's wait as the thread stops: the adds still queued and
        the running streams get an error (their requests are aborted)."""
        if self._death is None and not self._stop.is_set():  # (never expected: _loop returns only so)
            self._death = "the engine loop ended"
        with self._lock:
            self._dead = True
        # NOTE: every request left gets the same error: EngineDeadError for a
        # shutdown (the routes answer 503: the server is going away, the request
        # may be retried elsewhere), EngineDiedError when the engine died (503
        # too, naming why: this server will not serve again).
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                with self._lock:
                    self._pending -= 1
                self._deliver(command[-1], self._dead_error())
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - a broken engine must not keep the others waiting
                logger.exception("aborting %s failed", request_id)
            self._deliver(stream, self._dead_error())
        self._flush()


def _engine_failure(engine) -> str | None:
    """LLMEngine.health_error(): why the engine cannot step any more (a dead
    tensor-parallel worker), or None. Engines without it (the benchmarks' and
    tests' stubs) have nothing that can fail so."""
    health_error = getattr(engine, "health_error", None)
    return health_error() if health_error is not None else None
