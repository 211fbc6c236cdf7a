"""The engine loop of the server: one thread steps the engine; asyncio handlers
talk to it through queues.

The engine (C++ core, model runner, tokenizer) is used by that thread alone.
Handlers enqueue commands (add, abort); the thread applies them between steps
and hands each request's outputs to that request's asyncio queue. A handler
that goes away (client disconnect) aborts its request, which frees its blocks
at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


_ACCEPTED = object()  # first item of a stream: the request passed validation


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
    ) -> AsyncIterator[RequestOutput]:
        """Queues a request and returns, once the engine has accepted it, an async
        iterator of its delta outputs (closing it early aborts the request).

        Raises ValueError (bad request), QueueFullError (no room) or
        EngineDeadError (the engine thread has stopped); a caller that never
        iterates the result must :meth:`abort` the request itself.
        """
        if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
            raise QueueFullError(f"the server has {self.num_waiting()} requests waiting (max_queue_len {self.max_queue_len})")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead:
                raise EngineDeadError("the engine loop has stopped")
            self._pending += 1
            self._commands.put(("add", request_id, prompt, prompt_token_ids, params, add_special_tokens, stream))
        self._wake.set()
        try:
            verdict = await stream.queue.get()
        except BaseException:
            # NOTE: cancelled while waiting for the verdict: the abort command
            # queues behind the add, so the request cannot survive us.
            self.abort(request_id)
            raise
        if isinstance(verdict, BaseException):
            raise verdict
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------

    def _deliver(self, stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
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
                if not self.engine.has_unfinished_requests():
                    self.stats = self.engine.stats()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
            except Exception as e:  # the engine aborted every request; tell them
                logger.exception("engine step failed")
                self.errors += 1
                self._fail_dropped(e)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                self._deliver(stream, out)
            self.stats = self.engine.stats()

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
