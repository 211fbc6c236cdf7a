"""The server's life: the port bound before the model loads, "serving ... on"
logged once requests are answered, and a shutdown that drains.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes (new connections are
refused) and one line says how many requests are in flight and how long they
may take at most (``--shutdown-timeout``). They finish unless the timeout
passes or a second signal comes; then the engine loop stops, which ends each
of them with an error (a streamed one: an error event, then ``[DONE]``), and
the process exits with 0, without the tracebacks of cancelled tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:  # (its import pulls in torch: bind_socket must not wait for that)
    from .async_engine import AsyncEngine

logger = logging.getLogger("pagedcore.server")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a cut, how long the responses get to send their error event and [DONE],
# then how long after their connections are closed, before any task is cancelled.
_CUT_GRACE_S = 2.0


class BindError(OSError):
    """The address to serve on cannot be bound (another server holds it, or it
    is not an address of this machine)."""


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Binds and listens on host:port, as uvicorn would, and returns the socket.

    Call before loading the model: a busy port is then refused at once, not after
    seconds of loading. Connections made while the model loads wait in the
    listen backlog and are answered once serving starts. ``reuse_port``
    (SO_REUSEPORT, --api-server-count): the other HTTP processes bind the same
    port too, and the kernel spreads the connections over them.

    Raises ValueError for a port outside 0..65535 and BindError (naming
    host:port) when the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # NOTE: SO_REUSEADDR (uvicorn's choice too) lets a restarted server bind while
    # the old one's connections sit in TIME_WAIT; it never lets two sockets
    # listen on one port, and this one listens at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "the address is already in use (another server? choose another --port)"
        else:
            why = e.strerror or str(e)
        raise BindError(f"cannot serve on {host}:{port}: {why}") from None
    return sock


def freeze_startup_objects() -> None:
    """Takes every object made so far (the model, the tokenizer, the imported
    modules: ~235k with the tiny model) out of the garbage collector's sight.

    NOTE: a full collection walks every tracked object: ~160 ms on the 2-core
    CPU with the engine loaded, a pause of the engine's steps (or of the event
    loop's writes) that every stream's inter-token gap takes; after the freeze
    it walks only what serving made. Call once start-up is over (vLLM does the
    same in its engine core and API server).
    """
    import gc

    gc.collect()
    gc.freeze()
    # NOTE: Python's thresholds are kept. Serving SmolLM2 on the H200 at half load
    # (ebdd2cc) the HTTP process collected 70 times in 4 s (young 0.51 ms, middle 3.3,
    # one full 6.3); with a young threshold of 10000 (2c2a9fb) once, yet the event
    # loop's lag p99 stayed ~5 ms and the inter-token tail did not shrink.


def set_serving_threads(engine) -> int | None:
    """Sets torch's intra-op threads for an engine that serves; call once it has
    loaded (cli.loading_threads gives its count back at the end of loading).
    Returns the count set, or None where left alone: OMP_NUM_THREADS set (the
    user's choice), or an engine without a ``device`` (the tests' stubs).

    On CUDA: 1. The host side's torch ops are small, and a pool of a thread per
    core wakes (and spins) for each of them (vLLM's GPU workers take 1 too).
    On the CPU: one fewer than now (at least 1), a core left to the HTTP side,
    which every streamed token needs: on the 2-core machine the tiny shape's
    saturation run (256 streams, --engine-process) took 1.3-2.4 s with one
    thread against 6.5-9.1 s with two (engine CPU per token 63-67 us against
    248-389 us): two threads on two cores beside the HTTP process and the
    client waited at every op's barrier for a descheduled peer.
    """
    import torch

    device = getattr(engine, "device", None)
    if device is None or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = 1 if torch.device(device).type == "cuda" else max(1, torch.get_num_threads() - 1)
    torch.set_num_threads(threads)
    return threads


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server with pagedcore's start-up line and shutdown (see the
    module's docstring). Run it with ``server.run(sockets=[bind_socket(...)])``."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, served_model_name: str,
                 shutdown_timeout: float, on_exit_request=None, own_signals: bool = True, on_started=None) -> None:
        super().__init__(config)
        self.engine = engine
        self.served_model_name = served_model_name
        self.shutdown_timeout = shutdown_timeout
        self._signal_names: list[str] = []
        # (api_servers.py) on_exit_request(why): called with each request to stop
        # (the other HTTP processes hear of it); own_signals False: this process
        # takes no signal, the main one tells it (request_exit) when to stop;
        # on_started(): called once it accepts connections.
        self.on_exit_request = on_exit_request
        self.own_signals = own_signals
        self.on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn's version raises the caught signal again once it has
        # stopped: SIGINT became a KeyboardInterrupt traceback, SIGTERM killed the
        # process with 143 after a clean shutdown. Here a signal only asks to stop.
        if not self.own_signals:
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        # NOTE: no logging here (a signal handler may run inside a logging call);
        # main_loop and shutdown() notice the flags within 0.1 s and log.
        self.request_exit(signal.Signals(sig).name)

    def request_exit(self, why: str) -> None:
        """A signal's effect: the first asks to drain and stop, a second cuts."""
        self._signal_names.append(why)
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        if self.on_exit_request is not None:
            self.on_exit_request(why)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()
        if self.started and sockets and self.own_signals:  # (one line for all HTTP processes: the main one's)
            logger.info("serving %s on %s (OpenAI API under /v1)", self.served_model_name, url_of(sockets[0]))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for server in self.servers:  # new connections are refused from here on
            server.close()
        for sock in sockets or []:
            sock.close()
        why = self._signal_names[0] if self._signal_names else "shutdown requested"
        tasks = self.server_state.tasks
        if tasks:
            logger.info("%s: shutting down, draining %d in-flight request%s for at most %g s "
                        "(--shutdown-timeout); a second signal cuts %s now",
                        why, len(tasks), "" if len(tasks) == 1 else "s", self.shutdown_timeout,
                        "it" if len(tasks) == 1 else "them")
        else:
            logger.info("%s: shutting down, no request in flight", why)
        # Idle keep-alive connections close now, busy ones after their response.
        for connection in list(self.server_state.connections):
            connection.shutdown()
        deadline = loop.time() + self.shutdown_timeout
        while tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if tasks:
            reason = "a second signal" if self.force_exit else f"the {self.shutdown_timeout:g} s shutdown timeout"
            logger.warning("cutting %d request%s (%s): each ends with an error", len(tasks),
                           "" if len(tasks) == 1 else "s", reason)
            await self._cut()
        await self.lifespan.shutdown()

    async def _cut(self) -> None:
        """Ends the requests in flight: the engine loop stops and hands each an
        error, which the routes send as an error (event) in OpenAI's shape."""
        loop = asyncio.get_running_loop()
        tasks = self.server_state.tasks
        # (joins the engine thread, which finishes its step first, or reads an engine
        # process's channel to its end: not on the loop; the engine process itself goes
        # on while another HTTP process's channel is open)
        await asyncio.to_thread(self.engine.close_channel)
        deadline = loop.time() + _CUT_GRACE_S
        while tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if not tasks:
            return
        # A client that does not read blocks its response's writes: closing the
        # connection makes them return, and the response ends as after a disconnect.
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        deadline = loop.time() + _CUT_GRACE_S
        while tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for task in list(tasks):  # the last resort
            task.cancel()
