"""Several HTTP processes for one engine process (``pagedcore serve
--api-server-count N``, as vLLM's option of that name).

One HTTP process streams at most what one core can: the per-token work of
every stream (its text, the server-sent event, the write) runs on its event
loop. With N of them the streams spread over N cores. The main process (the
one ``serve`` started) binds the listening socket, starts the engine process
with N channels (engine_process.py) and N - 1 more HTTP processes, each with
a channel of its own; each binds the same address with SO_REUSEPORT, and the
kernel spreads the connections over the N sockets (by a hash of the client's
address and port). NOTE: not one listening socket shared: the event loop that
wakes first accepts every connection waiting (up to its backlog), so a burst
of them would go to one process. Each sends its requests down its own
channel, whose outputs come back to it alone.

Signals belong to the main process: the others ignore them and hear from it
over a control pipe (``drain`` for each SIGTERM / Ctrl-C it gets: the first
drains for at most --shutdown-timeout, a second cuts), or by its end (the pipe
closes: they drain and stop). The main process waits for them to exit before
it stops the engine. /metrics aggregates the histograms of every HTTP process
(prometheus_client's multiprocess mode over a temporary directory); the
engine's gauges and counters come from the engine's stats, the same in each.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
from dataclasses import dataclass

logger = logging.getLogger("pagedcore.server")


@dataclass
class ApiServer:
    """(main process) One of the other HTTP processes."""

    process: multiprocessing.process.BaseProcess
    control: multiprocessing.connection.Connection


def start_api_servers(engine, sock: socket.socket, served_model_name: str, api_key: str | None, log_level: str,
                      shutdown_timeout: float, max_queue_len: int | None, timeout: float = 300.0) -> list[ApiServer]:
    """Starts an HTTP process for each of ``engine.worker_channels()`` (an
    EngineProcess made with api_server_count > 1), serving on the address of
    ``sock`` (bound with reuse_port), and returns once each serves. Raises
    RuntimeError if one ends before."""
    address = sock.getsockname()[:2]
    ctx = multiprocessing.get_context("spawn")
    servers = []
    for channel in engine.worker_channels():
        control, their_control = ctx.Pipe()
        process = ctx.Process(target=_api_server_main, name=f"pagedcore-http-{channel.index}", daemon=True,
                              args=(channel, address, their_control, served_model_name, api_key, log_level,
                                    shutdown_timeout, max_queue_len))
        process.start()
        their_control.close()
        servers.append(ApiServer(process, control))
    # NOTE: the channels' pipes now live in their processes; this one's copies go,
    # so that the engine process sees a channel end when its HTTP process does.
    engine.close_worker_channels()
    for server in servers:  # each says "ready" once it accepts connections
        try:
            if not server.control.poll(timeout) or server.control.recv() != "ready":
                raise EOFError
        except (EOFError, OSError):
            stop_api_servers(servers, 5.0)
            raise RuntimeError(f"HTTP process {server.process.name} did not start (exit code "
                               f"{server.process.exitcode})") from None
    return servers


def tell_api_servers(servers: list[ApiServer], why: str) -> None:
    """(main process, also from a signal handler) Passes a request to stop on."""
    for server in servers:
        try:
            server.control.send(why)
        except (OSError, ValueError):
            pass  # (it has gone already)


def stop_api_servers(servers: list[ApiServer], timeout: float) -> None:
    """(main process) Asks each to stop (if not yet asked) and waits for its end,
    at most ``timeout`` seconds for all; then terminates what is left."""
    import time

    deadline = time.monotonic() + timeout
    for server in servers:
        server.control.close()  # (its end of the pipe closes: it drains and stops)
    for server in servers:
        server.process.join(max(0.0, deadline - time.monotonic()))
        if server.process.is_alive():
            logger.warning("HTTP process %s did not stop in %g s: terminating it", server.process.name, timeout)
            server.process.terminate()
            server.process.join(5)


def _api_server_main(channel, address: tuple[str, int], control, served_model_name: str, api_key: str | None,
                     log_level: str, shutdown_timeout: float, max_queue_len: int | None) -> None:
    import signal

    # The main process owns the signals (see the module's docstring).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ..logging_setup import configure_cli_logging
    from .engine_process import EngineProcess, set_process_name

    set_process_name("pagedcore-http")
    configure_cli_logging(log_level)
    import uvicorn

    from .app import build_app
    from .lifecycle import Server, bind_socket, freeze_startup_objects

    sock = bind_socket(*address, reuse_port=True)
    engine = EngineProcess.attach(channel, max_queue_len=max_queue_len)
    app = build_app(engine, served_model_name, api_key=api_key)
    config = uvicorn.Config(app, log_config=None, log_level=log_level.lower(), access_log=False)
    server = Server(config, engine, served_model_name, shutdown_timeout, own_signals=False,
                    on_started=lambda: control.send("ready"))
    freeze_startup_objects()
    threading.Thread(target=_follow, args=(control, server), name="pagedcore-control", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()


def _follow(control, server) -> None:
    """Each message from the main process is a request to stop; its end is one too."""
    while True:
        try:
            why = control.recv()
        except (EOFError, OSError):
            if not server.should_exit:
                server.request_exit("the main process stopping")
            return
        server.request_exit(why)
