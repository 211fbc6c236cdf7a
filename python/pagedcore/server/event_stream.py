"""A streamed response's two halves that Starlette's StreamingResponse does with
anyio: watching the client's connection, and writing the server-sent events.

Why not StreamingResponse: per request it makes a task group (a cancel scope,
a task for the disconnect listener, the scope's cancellation delivered by a
callback each turn of the loop until that task ends), after the route's own
watch (until_disconnect: two more tasks and an asyncio.wait). Here one task per
request watches the connection from the body's end to the response's end (the
prompt's wait, then the stream), and the work of each half runs in a task of
its own. In the HTTP process (bench/bench_server_fanout.py, 512 one-token
streams, 2-core CPU machine) a request's cost went from ~430 to ~320 us.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class Hangup:
    """Watches one request's connection; :meth:`guard` runs a step of the
    request's work in a task of its own, which the watcher cancels if the client
    goes meanwhile (the engine requests are aborted as the cancellation unwinds
    their generators).

    NOTE: the work runs in its own task, not the request's: a task resumes
    through every coroutine frame it is suspended in, and the request's task is
    ~20 frames deep in the server and the framework, the work's own task 2 (the
    events written from the request's task cost ~20% more a chunk, in-process
    with 256 streams on the 2-core CPU machine).
    """

    __slots__ = ("gone", "_target", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._target: asyncio.Task | None = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        # (call only once the request's body has been read: what comes next is the hang-up)
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._target is not None:
            self._target.cancel()

    async def guard(self, work: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
        """Runs ``work`` to its end: (True, its result), or (False, None) if the
        client went first (``work`` is then cancelled or, if the client had gone
        already, closed unstarted). Its errors are raised here."""
        if self.gone:
            work.close()
            return False, None
        task = self._target = asyncio.get_running_loop().create_task(work)
        try:
            return True, await task
        except asyncio.CancelledError:
            # (the watcher's cancellation of the work, not one of the request's task)
            if self.gone and task.cancelled() and not asyncio.current_task().cancelling():
                return False, None
            raise
        finally:
            self._target = None
            if not task.done():  # (the request's task was cancelled: so is the work)
                task.cancel()

    def stop(self) -> None:
        self._watcher.cancel()


class EventStream(Response):
    """A ``text/event-stream`` response of the strings ``chunks`` yields, each
    one write. ``closing``: an async generator to close when the response ends
    whatever way (the one whose ``finally`` aborts the engine's requests).
    ``hangup``: the request's :class:`Hangup`, which the stream takes over; it
    stops it when done."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], closing=None) -> None:
        self.chunks, self.closing = chunks, closing
        self.hangup: Hangup | None = None
        self.status_code = 200
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hangup = self.hangup
        try:
            if hangup is None:
                await self._write(send)
            else:
                await hangup.guard(self._write(send))
        finally:
            if hangup is not None:
                hangup.stop()
            if self.closing is not None:
                await self.closing.aclose()

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
