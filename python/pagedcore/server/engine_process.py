"""The server's engine in a process of its own (``pagedcore serve --engine-process``).

In one process, the engine thread and the event loop that streams the
responses share the GIL: the loop's work for every token of every stream
(SSE encoding, the response writes) delays the engine's launches, whose GIL
hand-backs wait up to the switch interval. Here the engine runs in a child
process (the engine thread of :class:`~.async_engine.AsyncEngine`, unchanged)
and the HTTP side keeps only the streams: prompts are tokenized on the HTTP
side (off the engine's path), and each step's outputs for every stream cross
the pipe in one message (with the engine's stats), as they cross to the event
loop in one call in the thread version. The engine's side writes from a
sender thread (the engine never waits for a busy HTTP side); the HTTP side's
event loop reads the pipe itself (no reader thread to hand the GIL to).

:class:`EngineProcess` offers what the routes and the shutdown use of
:class:`~.async_engine.AsyncEngine`: ``add``, ``abort``, ``alive``,
``shutdown``, ``stats``, ``errors``, ``num_waiting``, ``max_queue_len``, and
``engine.tokenizer`` / ``engine.max_model_len``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import threading
from types import SimpleNamespace
from typing import Any

from ..outputs import CompletionOutput, RequestOutput
from .async_engine import (
    _ACCEPTED,
    SHUTTING_DOWN,
    AsyncEngine,
    EngineDeadError,
    EngineDiedError,
    QueueFullError,
    RequestStream,
    _Detokenizers,
    _fan_out,
    _Stream,
    detokenized_here,
)

logger = logging.getLogger("pagedcore.server")

_ACCEPTED_MARK = "__accepted__"  # _ACCEPTED across the pipe (an object() does not pickle as itself)


class _PipeEngine(AsyncEngine):
    """(child) The engine thread, handing its outputs to the pipe: a "stream"
    is the request id; one message per hand-over, with the stats.

    NOTE: the engine thread only queues its outputs; a sender thread encodes,
    pickles and writes them. A write blocks while the pipe is full (the HTTP
    side is busy): the engine thread must never wait for that, and while the
    sender waits, the outputs of later steps gather and go in one message."""

    def __init__(self, engine, out, send_lock: threading.Lock) -> None:
        self._out, self._send_lock = out, send_lock
        self._sent_stats: dict | None = None
        self._started: set[str] = set()  # (sender thread) requests whose prompt went over already
        self._queued = threading.Condition()
        self._to_send: list[tuple[str, Any]] = []  # under _queued: items for the sender
        self._send_stats: dict | None = None  # under _queued: the stats to send with them (None: nothing new)
        self._sender_done = False  # under _queued: send what is left, then end
        self._aborted: list[str] = []  # under _queued: requests for _started to forget
        self._death_flushed = False  # (engine thread) the engine's death went to the sender
        self._sender = threading.Thread(target=self._send_loop, name="pagedcore-engine-sender", daemon=True)
        self._sender.start()
        super().__init__(engine)

    def _encode(self, request_id: str, item: Any) -> Any:
        """An item as it crosses the pipe. NOTE: pickling a RequestOutput costs
        ~3 us (its prompt's ids each step, far more), a tuple ~0.1 us: on the
        engine's path, once per stream and step. So the prompt goes once, with
        the request's first output, and a plain delta (one completion, no
        logprobs) as a tuple; the other side rebuilds the RequestOutput."""
        if item is _ACCEPTED:
            return _ACCEPTED_MARK
        if not isinstance(item, RequestOutput):
            return item  # an exception
        first = request_id not in self._started
        if item.finished:
            self._started.discard(request_id)
        elif first:
            self._started.add(request_id)
        if first:
            return item
        if len(item.outputs) == 1 and item.prompt_logprobs is None and not item.metrics:
            c = item.outputs[0]
            if c.logprobs is None:
                return (c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, c.stop_reason,
                        item.finished)
        item.prompt, item.prompt_token_ids = None, None  # (a delta of this step: nobody else holds it)
        return item

    def _flush(self) -> None:
        """(engine thread) Hands the queued items and the stats to the sender."""
        stats = self.stats
        # (the death is read by the sender from self._death: set before this call, seen under _queued)
        death_news = self._death is not None and not self._death_flushed
        if not self._outbox and stats == self._sent_stats and not death_news:
            return
        self._death_flushed = self._death is not None
        with self._queued:
            self._to_send += self._outbox
            self._send_stats = stats
            self._queued.notify()
        self._outbox = []
        self._sent_stats = stats

    def _send_loop(self) -> None:
        """(sender thread) Sends what the engine thread queued, all of it in one message."""
        while True:
            with self._queued:
                while not self._to_send and self._send_stats is None and not self._sender_done:
                    self._queued.wait()
                if not self._to_send and self._send_stats is None:
                    return  # (done, nothing left)
                items, stats, self._to_send, self._send_stats = self._to_send, self._send_stats, [], None
                aborted, self._aborted = self._aborted, []
            message = ("out", [(rid, self._encode(rid, item)) for rid, item in items], stats, self.errors,
                       self._death)
            self._started.difference_update(aborted)
            try:
                with self._send_lock:
                    self._out.send_bytes(_dumps(message))
            except (OSError, ValueError):  # the HTTP side has gone: nothing to tell
                self._stop.set()
                self._wake.set()
                return

    def abort(self, request_id: str) -> None:
        with self._queued:
            self._aborted.append(request_id)
        super().abort(request_id)

    def close_sender(self, timeout: float = 30.0) -> None:
        """Sends what is queued and ends the sender thread (call after shutdown())."""
        with self._queued:
            self._sender_done = True
            self._queued.notify()
        self._sender.join(timeout)

    def submit(self, request_id: str, prompt, ids, params, special: bool, here: bool) -> None:
        with self._lock:
            if not self._dead:
                self._pending += 1
                self._commands.put(("add", request_id, prompt, ids, params, special, here, request_id))
                self._wake.set()
                return
        with self._send_lock:
            self._out.send(("out", [(request_id, self._dead_error())], None, self.errors, self._death))


def _child_main(engine_args, commands, out, log_level: str, engine_factory) -> None:
    # The HTTP side owns the signals: it asks this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ..cli import loading_threads
    from ..llm_engine import LLMEngine
    from ..logging_setup import configure_cli_logging

    configure_cli_logging(log_level)
    try:
        with loading_threads():
            engine = (engine_factory or LLMEngine)(engine_args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        out.send(("failed", e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    out.send(("ready", {"max_model_len": engine.max_model_len, "stats": engine.stats()}))
    send_lock = threading.Lock()
    runner = _PipeEngine(engine, out, send_lock)
    try:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):
                break
            if command[0] == "add":
                runner.submit(*command[1:])
            elif command[0] == "abort":
                runner.abort(command[1])
            else:  # "stop"
                break
    finally:
        runner.shutdown(timeout=60.0)  # the thread ends every request left (an error each)
        runner.close_sender()  # (its last messages go before "closed")
        try:
            with send_lock:
                out.send(("closed",))
        except (OSError, ValueError):
            pass


class _Rebuilder:
    """(event loop) A request's outputs as _PipeEngine._encode sent them, back
    as RequestOutputs: the first one whole (its prompt is kept), later ones
    without the prompt (put back), plain deltas as tuples. With ``merge``, each
    run of tuples becomes one output (the deltas' texts joined, token ids
    appended, the last finish): one object per chunk the handler sends, however
    many steps it carries."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids")

    def __init__(self, request_id: str) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, None, []

    def __call__(self, items: list, merge: bool) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        run: list[tuple] = []
        for item in items:
            if item.__class__ is tuple:
                run.append(item)
                if merge:
                    continue
            if run:
                outs.append(self._from_tuples(run))
                run = []
            if item.__class__ is tuple:
                continue
            if item.prompt_token_ids is not None:  # (the request's first output)
                self.prompt, self.prompt_token_ids = item.prompt, item.prompt_token_ids
            else:
                item.prompt, item.prompt_token_ids = self.prompt, self.prompt_token_ids
            outs.append(item)
        if run:
            outs.append(self._from_tuples(run))
        return outs

    def _from_tuples(self, run: list[tuple]) -> RequestOutput:
        completions: dict[int, CompletionOutput] = {}
        for index, text, token_ids, cumulative, finish_reason, stop_reason, _ in run:
            c = completions.get(index)
            if c is None:
                completions[index] = CompletionOutput(index, text, list(token_ids), cumulative, None, finish_reason,
                                                      stop_reason)
                continue
            c.text += text
            c.token_ids += token_ids
            c.cumulative_logprob = cumulative
            if finish_reason is not None:
                c.finish_reason, c.stop_reason = finish_reason, stop_reason
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [completions[k] for k in sorted(completions)], run[-1][6])


def _widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Asks Linux for a pipe buffer of `size` bytes (64 KiB by default; 1 MiB is
    the usual unprivileged limit): the outputs of more steps fit in while the
    HTTP side is busy, before the engine's sender has to wait."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (ImportError, OSError):
        pass  # (not Linux, or over the limit: the default size works, only with more waits)


class EngineProcess:
    """The engine in a child process, for the routes (see the module's docstring).

    Construction starts the child and returns once its engine has loaded
    (raising the child's ValueError for bad arguments, RuntimeError otherwise).
    ``engine_factory`` (a picklable callable of the engine args; default
    LLMEngine) lets a benchmark put a stub engine there, or a test a faulty
    one; with ``engine_args`` None there is no tokenizer (prompts as token ids
    only).
    """

    def __init__(self, engine_args, log_level: str = "WARNING", max_queue_len: int | None = None,
                 engine_factory=None) -> None:
        from ..model_loader import load_tokenizer_in_background
        from ..model_path import resolve_model_path

        self.max_queue_len = max_queue_len
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._out, out_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, args=(engine_args, commands_in, out_end, log_level,
                                                           engine_factory), name="pagedcore-engine", daemon=True)
        self._proc.start()
        commands_in.close()
        out_end.close()
        _widen_pipe(self._out.fileno())
        tokenizer = (load_tokenizer_in_background(resolve_model_path(engine_args.tokenizer or engine_args.model))
                     if engine_args is not None else None)
        try:
            message = self._out.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with {self._proc.exitcode} while loading") from None
        if message[0] == "failed":
            self._proc.join(10)
            raise message[1]
        self.engine = SimpleNamespace(tokenizer=tokenizer.result() if tokenizer is not None else None,
                                      max_model_len=message[1]["max_model_len"])
        self.stats: dict[str, Any] = message[1]["stats"]
        self.errors = 0
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # adds sent, not answered yet
        self._send_lock = threading.Lock()
        self._dead = False
        # Why the engine died (its loop raised, as the engine process says, or the
        # process exited); None while it serves, and for a shutdown.
        self._death: str | None = None
        self._stopping = False
        # NOTE: the pipe is read by the event loop itself (add_reader), attached at the
        # first request, not by a thread: a reader thread must take the GIL from the
        # busy loop for every message, which waits up to the switch interval (5 ms)
        # and so delays every stream's tokens by as much.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = threading.Event()  # "closed" (or EOF) read: nothing more comes

    # ---- the routes' side (event loop) -------------------------------------------

    def num_waiting(self) -> int:
        return self.stats.get("num_waiting_seqs", 0) + self._pending

    def health_error(self) -> str | None:
        """As :meth:`AsyncEngine.health_error`: None while the engine serves,
        ``engine died: <reason>`` once it died (its loop raised, or the process
        exited: noticed here, by the pipe's reader or by an add, whichever
        comes first), or that the server is shutting down."""
        if self._death is None and not self._stopping and not self._proc.is_alive():
            self._died(self._exit_reason())
        if self._death is not None:
            return str(EngineDiedError(self._death))
        if self._dead or self._stopping:
            return SHUTTING_DOWN
        return None

    def alive(self) -> bool:
        return self.health_error() is None

    async def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params,
                  add_special_tokens: bool = True) -> RequestStream:
        """As :meth:`AsyncEngine.add`."""
        if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
            raise QueueFullError(f"the server has {self.num_waiting()} requests waiting "
                                 f"(max_queue_len {self.max_queue_len})")
        if self._dead or self._death is not None:  # (a death not seen yet: _send finds it)
            raise self._dead_error()
        if prompt_token_ids is None and prompt is not None:
            # NOTE: here, not in the engine's process: tokenizing is off the engine's path.
            prompt_token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._out.fileno(), self._on_readable)
        stream = _Stream(loop)
        here = detokenized_here(self.engine.tokenizer, params)
        self._streams[request_id] = stream
        self._pending += 1
        try:
            self._send(("add", request_id, prompt, prompt_token_ids, params, add_special_tokens, here))
            items = await stream.take()
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            self._pending -= 1
        verdict = items[0]
        if isinstance(verdict, BaseException):
            self._streams.pop(request_id, None)
            raise verdict
        stream.items.extendleft(reversed(items[1:]))
        return RequestStream(self, request_id, stream, _Detokenizers(self.engine.tokenizer, params) if here else None,
                             _Rebuilder(request_id))

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and not self._dead:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine process; the requests in flight end with
        EngineDeadError (the routes answer 503)."""
        self._stopping = True
        try:
            self._send(("stop",))
        except EngineDeadError:
            pass
        # (the child ends the step in flight, then every request left)
        loop = self._loop
        on_loop = loop is not None and loop.is_running() and _running_loop() is loop
        if loop is not None and loop.is_running() and not on_loop:
            self._closed.wait(timeout + 10)  # (the loop reads the rest)
        if not self._closed.is_set():  # the loop is gone (or is this thread): read the rest here
            if loop is not None and not loop.is_closed() and (on_loop or not loop.is_running()):
                loop.remove_reader(self._out.fileno())
            self._drain(timeout + 10)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send_bytes(_dumps(message))
        except (OSError, ValueError):
            if not self._stopping:
                self._died(self._exit_reason())
            raise self._dead_error() from None

    # ---- the engine's death ----------------------------------------------------------

    def _died(self, reason: str) -> None:
        """Notes why the engine died and logs it, once. (A death that the engine
        process reports comes through _handle: it logged it itself.)"""
        if self._death is None:
            self._death = reason
            logger.error("engine died: %s", reason)

    def _exit_reason(self) -> str:
        self._proc.join(1.0)  # (its pipe closes a moment before its exit code can be read)
        code = self._proc.exitcode
        if code is None:
            return "the engine process closed its pipe"
        if code < 0:
            try:
                return f"the engine process exited with code {code} ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return f"the engine process exited with code {code}"

    def _dead_error(self) -> EngineDeadError:
        return EngineDiedError(self._death) if self._death is not None else EngineDeadError(SHUTTING_DOWN)

    # ---- the pipe's reader (the event loop) ------------------------------------------

    def _on_readable(self) -> None:
        """(event loop) Handles the messages the pipe holds (a few at a time: the
        loop has streams to write too)."""
        try:
            for _ in range(64):
                if not self._out.poll():
                    return
                if not self._handle(self._out.recv(), on_loop=True):
                    break  # ("closed")
            else:
                return  # (more next time round: the pipe stays readable)
        except (EOFError, OSError):
            if not self._stopping:
                self._died(self._exit_reason())
        self._loop.remove_reader(self._out.fileno())
        self._end(on_loop=True)

    def _drain(self, timeout: float) -> None:
        """(any thread, no loop reading the pipe) Handles the messages up to "closed"."""
        try:
            while self._out.poll(timeout) and self._handle(self._out.recv(), on_loop=False):
                pass
        except (EOFError, OSError):
            pass
        self._end(on_loop=False)

    def _handle(self, message: tuple, on_loop: bool) -> bool:
        """Routes one message's items to their streams; False for "closed"."""
        if message[0] == "closed":
            return False
        _, items, stats, errors, death = message
        if stats is not None:
            self.stats = stats
        self.errors = errors
        if death is not None and self._death is None:
            # (the engine process logged it; its streams' errors come in this message)
            self._death, self._dead = death, True
        deliveries = []
        # NOTE: the items stay as they crossed (a plain delta: a tuple); the
        # stream's handler rebuilds RequestOutputs once per chunk, for all the
        # deltas it takes at once (_Rebuilder), not one per delta here.
        for request_id, item in items:
            if item.__class__ is tuple:
                finished = item[6]
            elif isinstance(item, str):  # _ACCEPTED_MARK
                item, finished = _ACCEPTED, False
            else:
                finished = isinstance(item, BaseException) or item.finished
            stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
            if stream is not None:
                deliveries.append((stream, item))
        self._deliver(deliveries, on_loop)
        return True

    def _deliver(self, deliveries: list, on_loop: bool) -> None:
        if on_loop:
            _fan_out(deliveries)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, part in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fan_out, part)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                pass

    def _end(self, on_loop: bool) -> None:
        """Nothing more comes from the engine: the streams left get an error."""
        self._dead = True
        if self._death is None and not self._stopping:  # (never expected: _died comes first)
            self._death = "the engine process has stopped"
        streams, self._streams = list(self._streams.values()), {}
        self._deliver([(stream, self._dead_error()) for stream in streams], on_loop)
        self._closed.set()


def _dumps(message: tuple) -> bytes:
    """A message for Connection.send_bytes (recv() on the other end reads it).
    NOTE: plain pickle: Connection.send builds a ForkingPickler (with its reducer
    table) per message, ~5% of a request's admission; messages hold no sockets
    or connections, which is all it is for."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
