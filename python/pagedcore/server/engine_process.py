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

A plain stream (one sample, token ids only: compact_outputs.compact_eligible;
its text is made on the HTTP side) is a compact request of the engine: its
tokens cross as rows of four arrays, one set per step and HTTP process
(compact_outputs.py), decoded into its stream on the HTTP side; no object per
stream and step on the engine's side. Other requests' outputs cross as
before (a request's prompt once, a plain delta as a tuple).

Several HTTP processes can share one engine process (``serve
--api-server-count N``): each has its own pair of pipes (a channel); the
engine process reads the commands of all of them and sends each one the
outputs of its own requests (a compact key names its channel: key % N).
A channel's "stop" detaches it (its requests end with EngineDeadError); the
engine process ends when every channel has detached.

:class:`EngineProcess` offers what the routes and the shutdown use of
:class:`~.async_engine.AsyncEngine`: ``add``, ``abort``, ``alive``,
``shutdown``, ``stats``, ``errors``, ``num_waiting``, ``max_queue_len``, and
``engine.tokenizer`` / ``engine.max_model_len``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
from types import SimpleNamespace
from typing import Any

from ..compact_outputs import CompactOutputs, compact_eligible
from ..outputs import CompletionOutput, RequestOutput
from .async_engine import (
    _ACCEPTED,
    SHUTTING_DOWN,
    AsyncEngine,
    EngineDeadError,
    EngineDiedError,
    QueueFullError,
    RequestStream,
    _CompactRebuilder,
    _CompactStream,
    _Detokenizers,
    _fan_out,
    _Finish,
    _Stream,
    detokenized_here,
)

logger = logging.getLogger("pagedcore.server")

_ACCEPTED_MARK = "__accepted__"  # _ACCEPTED across the pipe (an object() does not pickle as itself)


class _PipeEngine(AsyncEngine):
    """(child) The engine thread, handing its outputs to the channels' pipes: a
    "stream" is (channel, request id); one message per hand-over and channel,
    with the stats.

    NOTE: the engine thread only queues its outputs; a sender thread encodes,
    pickles and writes them. A write blocks while the pipe is full (the HTTP
    side is busy): the engine thread must never wait for that, and while the
    sender waits, the outputs of later steps gather and go in one message."""

    def __init__(self, engine, outs: list, send_locks: list[threading.Lock]) -> None:
        self._outs, self._send_locks = outs, send_locks
        self._sent_stats: dict | None = None
        self._started: set[str] = set()  # (sender thread) requests whose prompt went over already
        self._queued = threading.Condition()
        # under _queued: items for the sender, in order: ((channel, request id), item), or
        # (None, CompactOutputs) for a step's compact rows
        self._to_send: list[tuple[tuple[int, str] | None, Any]] = []
        self._send_stats: dict | None = None  # under _queued: the stats to send with them (None: nothing new)
        self._sender_done = False  # under _queued: send what is left, then end
        self._aborted: list[str] = []  # under _queued: requests for _started to forget
        self._closing: list[int] = []  # under _queued: channels to send "closed" to, after their items
        self._closed_channels: set[int] = set()  # (sender thread) no more messages to these
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

    def _deliver_compact(self, rows: CompactOutputs) -> None:
        # (the rows cross as they are; the HTTP side routes them: see EngineProcess._compact_deliveries)
        self._forget_finished_compact(rows)
        self._outbox.append((None, rows))  # (in order with the items: an add's verdict comes first)

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
        """(sender thread) Sends what the engine thread queued, all of it in one
        message per channel: its parts in order, each a list of (request id,
        item) or a tuple of compact rows (CompactOutputs.to_bytes)."""
        count = len(self._outs)
        while True:
            with self._queued:
                while not self._to_send and self._send_stats is None and not self._closing and not self._sender_done:
                    self._queued.wait()
                if not self._to_send and self._send_stats is None and not self._closing:
                    return  # (done, nothing left)
                death = self._death
                items, stats, self._to_send, self._send_stats = self._to_send, self._send_stats, [], None
                aborted, self._aborted = self._aborted, []
                closing, self._closing = self._closing, []
            parts: list[list] = [[] for _ in range(count)]
            for stream, item in items:
                if stream is None:  # a step's compact rows: each channel its own (key % count)
                    if count == 1:
                        parts[0].append(item.to_bytes())
                        continue
                    owner = item.keys % count
                    for channel in range(count):
                        mine = owner == channel
                        if mine.any():
                            parts[channel].append(item.select(mine).to_bytes())
                    continue
                channel, rid = stream
                mine = parts[channel]
                if not mine or mine[-1].__class__ is not list:
                    mine.append([])
                mine[-1].append((rid, self._encode(rid, item)))
            self._started.difference_update(aborted)
            for channel in range(count):
                if channel in self._closed_channels:
                    continue
                if parts[channel] or stats is not None or death is not None:
                    self._write(channel, ("out", parts[channel], stats, self.errors, death))
                if channel in closing:
                    self._write(channel, ("closed",))
                    self._closed_channels.add(channel)
            if len(self._closed_channels) == count:
                self._stop.set()  # (every HTTP side has gone: the engine loop ends)
                self._wake.set()
                return

    def _write(self, channel: int, message: tuple) -> None:
        try:
            with self._send_locks[channel]:
                self._outs[channel].send_bytes(_dumps(message))
        except (OSError, ValueError):  # that HTTP side has gone: nothing to tell it
            self._closed_channels.add(channel)

    def abort(self, request_id: str) -> None:
        with self._queued:
            self._aborted.append(request_id)
        super().abort(request_id)

    def detach(self, channel: int) -> None:
        """Ends the requests of one channel (EngineDeadError each) and then sends
        it "closed" (the engine thread does it between steps)."""
        self._commands.put(("detach", channel))
        self._wake.set()

    def _command(self, command: tuple) -> None:
        if command[0] != "detach":
            super()._command(command)
            return
        channel = command[1]
        for request_id, stream in list(self._streams.items()):
            if stream[0] == channel:
                del self._streams[request_id]
                self._forget_compact(request_id)
                self.engine.abort(request_id)
                self._deliver(stream, EngineDeadError(SHUTTING_DOWN))
        self._flush()
        with self._queued:
            self._closing.append(channel)
            self._queued.notify()

    def close_sender(self, timeout: float = 30.0) -> None:
        """Sends what is queued and ends the sender thread (call after shutdown())."""
        with self._queued:
            self._sender_done = True
            self._queued.notify()
        self._sender.join(timeout)

    def submit(self, channel: int, request_id: str, prompt, ids, params, special: bool, here: bool,
               key: int | None) -> None:
        with self._lock:
            if not self._dead:
                self._pending += 1
                self._commands.put(("add", request_id, prompt, ids, params, special, here, key,
                                    (channel, request_id)))
                self._wake.set()
                return
        self._write(channel, ("out", [[(request_id, self._dead_error())]], None, self.errors, self._death))


def _child_main(engine_args, channels, log_level: str, engine_factory) -> None:
    # The HTTP side owns the signals: it asks this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_process_name("pagedcore-engine")
    from ..cli import loading_threads
    from ..logging_setup import configure_cli_logging

    configure_cli_logging(log_level)
    commands = [c for c, _ in channels]
    outs = [o for _, o in channels]
    try:
        threads = contextlib.nullcontext()
        if engine_factory is None:
            from ..llm_engine import LLMEngine  # (torch: not for a stub engine)

            engine_factory, threads = LLMEngine, loading_threads()
        with threads:
            engine = engine_factory(engine_args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        outs[0].send(("failed", e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    from .lifecycle import freeze_startup_objects, set_serving_threads

    set_serving_threads(engine)
    freeze_startup_objects()
    ready = ("ready", {"max_model_len": engine.max_model_len, "stats": engine.stats()})
    for out in outs:
        try:
            out.send(ready)
        except (OSError, ValueError):
            pass
    send_locks = [threading.Lock() for _ in outs]
    runner = _PipeEngine(engine, outs, send_locks)
    open_channels = dict(enumerate(commands))
    try:
        while open_channels:
            for conn in multiprocessing.connection.wait(list(open_channels.values())):
                channel = commands.index(conn)
                try:
                    command = conn.recv()
                except (EOFError, OSError):  # that HTTP process has gone
                    command = ("stop",)
                if command[0] == "add":
                    runner.submit(channel, *command[1:])
                elif command[0] == "abort":
                    runner.abort(command[1])
                else:  # "stop": the last channel stops the engine (below), another detaches
                    del open_channels[channel]
                    if open_channels:
                        runner.detach(channel)
    finally:
        runner.shutdown(timeout=60.0)  # the thread ends every request left (an error each)
        runner.close_sender()  # (its last messages go before "closed")
        for channel, out in enumerate(outs):
            if channel in runner._closed_channels:
                continue
            try:
                with send_locks[channel]:
                    out.send(("closed",))
            except (OSError, ValueError):
                pass


def set_process_name(name: str) -> None:
    """Names the process as `ps` and /proc/PID/comm show it (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
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


class _Channel:
    """The HTTP side's ends of one channel's pipes, picklable for a spawned HTTP
    process (see api_servers.py), with what it needs to know of the engine."""

    def __init__(self, index: int, count: int, commands, out, ready: dict) -> None:
        self.index, self.count, self.commands, self.out, self.ready = index, count, commands, out, ready


class EngineProcess:
    """The engine in a child process, for the routes (see the module's docstring).

    Construction starts the child and returns once its engine has loaded
    (raising the child's ValueError for bad arguments, RuntimeError otherwise).
    ``engine_factory`` (a picklable callable of the engine args; default
    LLMEngine) lets a benchmark put a stub engine there, or a test a faulty
    one; with ``engine_args`` None there is no tokenizer (prompts as token ids
    only) unless ``tokenizer_path`` names one for the HTTP side. ``api_server_count`` N > 1: the
    child serves N channels; this object uses channel 0 and
    :meth:`worker_channels` gives the others, each for
    :meth:`EngineProcess.attach` in another HTTP process.
    """

    def __init__(self, engine_args, log_level: str = "WARNING", max_queue_len: int | None = None,
                 engine_factory=None, api_server_count: int = 1, tokenizer_path: str | None = None,
                 _channel: _Channel | None = None) -> None:
        from ..model_loader import load_tokenizer_in_background
        from ..model_path import resolve_model_path

        self.max_queue_len = max_queue_len
        self._proc = None
        self._workers: list[_Channel] = []
        if _channel is None:  # (start the engine process)
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = [], []
            for _ in range(api_server_count):
                commands_in, commands = ctx.Pipe(duplex=False)
                out, out_end = ctx.Pipe(duplex=False)
                ours.append((commands, out))
                theirs.append((commands_in, out_end))
            self._proc = ctx.Process(target=_child_main, args=(engine_args, theirs, log_level, engine_factory),
                                     name="pagedcore-engine", daemon=True)
            self._proc.start()
            for commands_in, out_end in theirs:
                commands_in.close()
                out_end.close()
            for _, out in ours:
                _widen_pipe(out.fileno())
            if engine_args is not None and tokenizer_path is None:
                tokenizer_path = resolve_model_path(engine_args.tokenizer or engine_args.model)
            tokenizer = load_tokenizer_in_background(tokenizer_path) if tokenizer_path is not None else None
            self._commands, self._out = ours[0]
            try:
                message = self._out.recv()
            except EOFError:
                raise RuntimeError(f"the engine process exited with {self._proc.exitcode} while loading") from None
            if message[0] == "failed":
                self._proc.join(10)
                raise message[1]
            ready = message[1]
            for index, (commands, out) in enumerate(ours[1:], 1):
                self._workers.append(_Channel(index, api_server_count, commands, out,
                                              {**ready, "tokenizer_path": tokenizer_path}))
            self._index, self._count = 0, api_server_count
        else:  # (attach to a channel of a running engine process)
            self._commands, self._out = _channel.commands, _channel.out
            ready = _channel.ready
            tokenizer_path = ready.get("tokenizer_path")
            tokenizer = load_tokenizer_in_background(tokenizer_path) if tokenizer_path is not None else None
            self._index, self._count = _channel.index, _channel.count
            message = self._out.recv()  # (the engine's "ready" for this channel)
        self.engine = SimpleNamespace(tokenizer=tokenizer.result() if tokenizer is not None else None,
                                      max_model_len=ready["max_model_len"])
        self._stats: dict[str, Any] = ready["stats"]
        self.errors = 0
        self._streams: dict[str, _Stream] = {}
        self._compact_streams: dict[int, _CompactStream] = {}
        self._next_key = 0  # compact keys: _next_key * count + index (this channel's, never reused)
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

    @classmethod
    def attach(cls, channel: _Channel, max_queue_len: int | None = None) -> EngineProcess:
        """(another HTTP process) The client of one channel of :meth:`worker_channels`."""
        return cls(None, max_queue_len=max_queue_len, _channel=channel)

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's latest stats (for /metrics). NOTE: the first read on the
        event loop starts reading the pipe, if no request has yet: an HTTP
        process that took no request still follows the engine (the stats come
        with every message), so that a scrape of any HTTP process is current."""
        if self._loop is None and _running_loop() is not None:
            self._follow(_running_loop())
        return self._stats

    def _follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reads the pipe on this event loop from now on."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._out.fileno())
        self._loop = loop
        loop.add_reader(self._out.fileno(), self._on_readable)

    def worker_channels(self) -> list[_Channel]:
        """The channels 1..N-1 (api_server_count N), for the other HTTP processes."""
        return list(self._workers)

    def close_worker_channels(self) -> None:
        """Closes this process's copies of the other channels (once their HTTP
        processes hold them): the engine process then sees their end."""
        for channel in self._workers:
            channel.commands.close()
            channel.out.close()
        self._workers = []

    # ---- the routes' side (event loop) -------------------------------------------

    def num_waiting(self) -> int:
        return self._stats.get("num_waiting_seqs", 0) + self._pending

    def health_error(self) -> str | None:
        """As :meth:`AsyncEngine.health_error`: None while the engine serves,
        ``engine died: <reason>`` once it died (its loop raised, or the process
        exited: noticed here, by the pipe's reader or by an add, whichever
        comes first), or that the server is shutting down. (An HTTP process of
        --api-server-count other than the main one learns of the engine
        process's exit from its pipe alone.)"""
        if self._death is None and not self._stopping and self._proc is not None and not self._proc.is_alive():
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
        if self._loop is not loop:  # (the first request; or a new loop, as in tests: the old one is gone)
            self._follow(loop)
        here = detokenized_here(self.engine.tokenizer, params)
        key = None
        if here and compact_eligible(params):
            key = self._next_key * self._count + self._index
            self._next_key += 1
            stream: _Stream = _CompactStream(loop, request_id, key)
            self._compact_streams[key] = stream
        else:
            stream = _Stream(loop)
        self._streams[request_id] = stream
        self._pending += 1
        try:
            self._send(("add", request_id, prompt, prompt_token_ids, params, add_special_tokens, here, key))
            items = await stream.take()
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            self._pending -= 1
        verdict = items[0]
        if isinstance(verdict, BaseException):
            self._streams.pop(request_id, None)
            if key is not None:
                self._compact_streams.pop(key, None)
            raise verdict
        stream.items.extendleft(reversed(items[1:]))
        rebuild = (_CompactRebuilder(request_id, prompt, prompt_token_ids) if key is not None
                   else _Rebuilder(request_id))
        return RequestStream(self, request_id, stream, _Detokenizers(self.engine.tokenizer, params) if here else None,
                             rebuild)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if stream.__class__ is _CompactStream:
            self._compact_streams.pop(stream.key, None)
        if not self._dead:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine process (this channel's requests end with
        EngineDeadError: the routes answer 503); with several HTTP processes, a
        channel other than the last one detaches (the others go on)."""
        self.close_channel(timeout)
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)

    def close_channel(self, timeout: float = 5.0) -> None:
        """Ends this channel: its requests end with EngineDeadError, and what the
        engine process sends on it is read up to its "closed" (the engine process
        goes on while another channel is open; the last channel's end stops it).
        Once its HTTP server has stopped, a channel must close before the process
        waits for the others: nothing reads its pipe any more, and the engine
        process's one sender thread, blocked on that full pipe (the stats of every
        step), would hold up the other channels' outputs (their streams stalled
        until the main process gave up on them, 20 s). Closing twice is a no-op."""
        if self._closed.is_set():
            return
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
        if self._proc is None:  # (another HTTP process's channel: the pipe is all it sees)
            return "the engine process closed its pipe"
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
        if message[0] == "ready":  # (a worker channel's copy, read at attach: not expected here)
            return True
        _, parts, stats, errors, death = message
        if stats is not None:
            self._stats = stats
        self.errors = errors
        if death is not None and self._death is None:
            # (the engine process logged it; its streams' errors come in this message)
            self._death, self._dead = death, True
        deliveries: list = []
        for part in parts:
            if part.__class__ is tuple:
                self._compact_deliveries(part, deliveries)
                continue
            # NOTE: the items stay as they crossed (a plain delta: a tuple); the
            # stream's handler rebuilds RequestOutputs once per chunk, for all the
            # deltas it takes at once (_Rebuilder), not one per delta here.
            for request_id, item in part:
                if item.__class__ is tuple:
                    finished = item[6]
                elif isinstance(item, str):  # _ACCEPTED_MARK
                    item, finished = _ACCEPTED, False
                else:
                    finished = isinstance(item, BaseException) or item.finished
                stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
                if stream is not None:
                    if finished and stream.__class__ is _CompactStream:
                        self._compact_streams.pop(stream.key, None)
                    deliveries.append((stream, item))
        self._deliver(deliveries, on_loop)
        return True

    def _compact_deliveries(self, raw: tuple, deliveries: list) -> None:
        """A step's compact rows to their streams: a token id (int) each, the last
        one of a request as a _Finish. NOTE: one row per stream and step, so a
        plain loop; a row of a stream aborted here meanwhile is dropped."""
        rows = CompactOutputs.from_bytes(raw)
        streams = self._compact_streams
        for key, token, finish, stop in rows.rows():
            stream = streams.get(key)
            if stream is None:
                continue
            if finish:
                del streams[key]
                self._streams.pop(stream.request_id, None)
                deliveries.append((stream, _Finish(token, finish, stop)))
            else:
                deliveries.append((stream, token))

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
        self._compact_streams = {}
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
