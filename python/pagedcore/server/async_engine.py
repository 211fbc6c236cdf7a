"""The engine loop of the server: one thread steps the engine; asyncio handlers
talk to it through queues.

The engine (C++ core, model runner, tokenizer) is used by that thread alone.
Handlers enqueue commands (add, abort); the thread applies them between steps
and hands each request's outputs to that request's stream. A handler that goes
away (client disconnect) aborts its request, which frees its blocks at the
next step boundary.

The fan-out is batched: a step's outputs for every stream cross to the event
loop in one ``call_soon_threadsafe`` (one wake-up of the loop, not one per
stream), and a handler takes every output its stream holds at once
(:meth:`RequestStream.batches`), so a handler that fell behind by several steps
catches up with one response write.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from ..llm_engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

logger = logging.getLogger("pagedcore.server")


class QueueFullError(RuntimeError):
    """The server holds max_queue_len waiting requests already."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or died of an error): nothing
    more is generated."""


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


def _fan_out(deliveries: list[tuple[_Stream, Any]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


_ACCEPTED = object()  # first item of a stream: the request passed validation


class RequestStream:
    """The delta outputs of one request: ``async for out in stream`` one by one,
    or ``async for outs in stream.batches()`` as lists of what has arrived.
    Leaving either early aborts the request. An error that ends the request
    (the engine stopped, a step failed) is raised after the outputs before it."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream) -> None:
        self._engine, self.request_id, self._stream = engine, request_id, stream

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._one_by_one()

    async def _one_by_one(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for out in batch:
                yield out

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        finished = False
        try:
            while not finished:
                items = await self._stream.take()
                batch = []
                for item in items:
                    if isinstance(item, BaseException):
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    if item.finished:
                        finished = True
                        break
                yield batch
        finally:
            if not finished:
                self._engine.abort(self.request_id)


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
        self._lock = threading.Lock()
        self._outbox: list[tuple[_Stream, Any]] = []  # (engine thread) items not handed over yet
        # NOTE: set under _lock by the engine thread as it ends; an add checks it
        # under the same lock, so every add either sees it or is queued before
        # the thread's last drain of the commands (which answers it).
        self._dead = False
        self.stats: dict[str, Any] = engine.stats()
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
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._dead:
                raise EngineDeadError("the engine loop has stopped")
            self._pending += 1
            self._commands.put(("add", request_id, prompt, prompt_token_ids, params, add_special_tokens, stream))
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
        return RequestStream(self, request_id, stream)

    def alive(self) -> bool:
        # LLMEngine.healthy(): False once a tensor-parallel worker has died, even
        # while idle (engines without it, e.g. test stubs, have no workers).
        healthy = getattr(self.engine, "healthy", None)
        return self._thread.is_alive() and not self._dead and (healthy is None or healthy())

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

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
                _, request_id, prompt, ids, params, special, stream = command
                with self._lock:
                    self._pending -= 1
                try:
                    self.engine.add_request(request_id, prompt, ids, params, stream=True, add_special_tokens=special)
                except Exception as e:  # bad input: nothing was queued
                    self._deliver(stream, e)
                    self._fail_dropped(e)  # (or the step in flight failed while it waited)
                    continue
                self._streams[request_id] = stream
                self._deliver(stream, _ACCEPTED)
            else:
                request_id = command[1]
                if self._streams.pop(request_id, None) is not None:
                    self.engine.abort(request_id)

    def _fail_dropped(self, error: Exception) -> None:
        """Tells the streams whose requests the engine dropped (a failed step aborts all)."""
        for request_id in [r for r in self._streams if not self.engine.has_request(r)]:
            self._deliver(self._streams.pop(request_id), RuntimeError(f"engine step failed: {error}"))

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - the thread ends; its callers must hear of it
            logger.exception("the engine loop died")
        finally:
            self._close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                # NOTE: an abort (and rarely an add) first completes the step in
                # flight, so a failure of that step can surface here too.
                self._apply_commands()
                self._flush()  # (the verdicts of the adds: a bad request hears at once)
                if not self.engine.has_unfinished_requests():
                    self._flush()
                    self.stats = self.engine.stats()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
            except Exception as e:  # the engine aborted every request; tell them
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
            # NOTE: the stats first: a client that has its last token reads them
            # already counting its request as done (/metrics right after a response).
            self.stats = self.engine.stats()
            self._flush()

    def _close(self) -> None:
        """Ends every caller's wait as the thread stops: the adds still queued and
        the running streams get an error (their requests are aborted)."""
        with self._lock:
            self._dead = True
        why = "server shutting down" if self._stop.is_set() else "the engine loop has stopped"
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                with self._lock:
                    self._pending -= 1
                self._deliver(command[-1], EngineDeadError(why))
        # NOTE: a request cut by a shutdown gets EngineDeadError (the routes answer
        # 503: the server is going away, the request may be retried elsewhere);
        # one whose engine loop died gets a RuntimeError (500, a server fault).
        cut = EngineDeadError if self._stop.is_set() else RuntimeError
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - a broken engine must not keep the others waiting
                logger.exception("aborting %s failed", request_id)
            self._deliver(stream, cut(why))
        self._flush()
