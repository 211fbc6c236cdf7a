"""What each turn of the engine loop spent its time on, for the inter-token
latency's tail (issue 14): a diagnostic, off unless ``PAGEDCORE_STEP_TRACE`` names
a file (bench_serving.py sets it for the server it starts).

Each turn of :meth:`AsyncEngine._loop` that steps the engine appends one JSON line:

- ``wall``: the turn's start (``time.time()``: the benchmark's clients share it);
- ``cmd``, ``step``, ``out``, ``flush``: milliseconds applying the queued commands
  (adds and aborts, with the verdicts' hand-over), in ``LLMEngine.step()``, handing the
  outputs to their streams and publishing the stats, and handing them over
  (``_flush``); ``adds``: requests admitted in ``cmd``;
- ``spans``: the forward passes that the step launched (ModelRunner.step_spans):
  ``[path, tokens, rows, prompt tokens, longest row, host ms in execute, device ms,
  host ms of it waiting for the device before staging, host ms of it up to the
  first launch, the host thread's CPU ms over it, host ms of it in CUDA graph
  replay calls]``,
  the device's time from an event queued just before the step's first kernel or
  graph (after its host staging) to one after its last (null off CUDA): the
  device's work, and any wait of the device for the host's later launches within
  the step (the pieces' eager loop).

A step() that fails adds no line; the forward passes it launched count in the next
turn's.

With a pipelined engine (``LLMEngine.pipelined``) a turn's ``step`` mostly waits for
the forward pass that the turn before launched: compare it with the previous
turn's spans.

The lines are written while the loop is idle (and as it ends), never between steps
but every MAX_ROWS turns of a loop that never idles (a pause there).
"""

from __future__ import annotations

import json
import logging
import os
import time

ENV = "PAGEDCORE_STEP_TRACE"
MAX_ROWS = 20_000  # turns held (with their CUDA events) before a write, idle or not

logger = logging.getLogger("pagedcore.server")


def trace_path() -> str | None:
    return os.environ.get(ENV) or None


class StepTrace:
    """Made on the engine thread with the engine it traces; :meth:`turn` after
    each stepping turn, :meth:`write` while idle."""

    def __init__(self, path: str, engine) -> None:
        self.path = path
        self.rows: list[tuple] = []
        runner = self._runner = getattr(engine, "runner", None)
        self.spans = None
        if runner is not None and hasattr(runner, "step_spans"):
            runner.step_spans = self.spans = []
        self._taken = 0  # spans already given to a turn
        self.off = False  # (a write failed: nothing more is recorded)

    def turn(self, wall: float, began: float, stepped: float, step_seconds: float, published: float,
             ended: float, adds: int) -> None:
        """One turn: ``wall`` (time.time()) and ``began`` (perf_counter) at its start,
        ``stepped`` as step() began, ``published`` after the outputs and stats,
        ``ended`` after the flush."""
        if self.off:
            return
        spans = ()
        if self.spans is not None:
            spans = self.spans[self._taken:]
            self._taken = len(self.spans)
        self.rows.append((wall, stepped - began, step_seconds, published - stepped - step_seconds,
                          ended - published, adds, spans))
        if len(self.rows) >= MAX_ROWS:
            self.write()

    def write(self) -> None:
        """Appends the turns so far to the file (the device's times are read now:
        call when the engine is idle, its work done). A trace that cannot be
        written (the file, the device) is logged once and turned off: a
        diagnostic never stops the engine."""
        if not self.rows:
            return
        try:
            self._write()
        except (OSError, RuntimeError) as e:
            logger.warning("step trace to %s turned off: %s", self.path, e)
            self.off = True
            self.rows.clear()
            if self.spans is not None:
                self._runner.step_spans = self.spans = None

    def _write(self) -> None:
        lines = []
        for wall, cmd, step, out, flush, adds, spans in self.rows:
            lines.append(json.dumps({
                "wall": round(wall, 6), "cmd": _ms(cmd), "step": _ms(step), "out": _ms(out), "flush": _ms(flush),
                "adds": adds,
                "spans": [[s.path, s.num_tokens, s.num_seqs, s.prompt_tokens, s.max_seq_len, _ms(s.host_seconds),
                           _ms(s.gpu_seconds()), _ms(s.wait_seconds), _ms(s.staged_seconds),
                           _ms(s.cpu_seconds), _ms(s.replay_seconds)] for s in spans],
            }))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        self.rows.clear()
        if self.spans is not None:
            del self.spans[:self._taken]
            self._taken = 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def now() -> tuple[float, float]:
    """(time.time(), time.perf_counter()) together."""
    return time.time(), time.perf_counter()
