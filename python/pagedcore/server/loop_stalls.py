"""What the HTTP side's event loop runs while it is late: a sampler thread that,
whenever the loop's heartbeat (Metrics.watch_loop_lag, every 10 ms) is overdue
by more than ``stall_s``, records where the loop's thread is (its innermost
frame and the innermost frame of pagedcore's own code). /metrics shows the
counts (``pagedcore_http_loop_stall_samples_total{where=...}``): what blocks
every stream's writes, for the event-loop lag's tail.

Off unless ``PAGEDCORE_LOOP_STALLS=1`` (bench_serving.py sets it for the server
it starts, so its serving figures include the sampler's cost). NOTE: the
sampler's overdue check is Python: it takes the GIL every ``sample_s`` (2 ms)
whether or not the loop is late; while the loop runs Python, the sampler gets
the GIL after the switch interval (5 ms), so it samples exactly the long
callbacks and costs a switch per sample.
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
import threading
import time

ENV = "PAGEDCORE_LOOP_STALLS"
MAX_PLACES = 32  # distinct places counted; later ones count as "other"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


_STDLIB = sysconfig.get_paths()["stdlib"]


def place_of(frame) -> str:
    """``file:function`` of the innermost frame, then ``<- file:function`` of
    the innermost frame outside the standard library (the server's, uvicorn's,
    starlette's code that called it), if that is another one."""
    def name(f) -> str:
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"

    inner, caller = name(frame), None
    f = frame
    while f is not None:
        if not f.f_code.co_filename.startswith(_STDLIB) and not f.f_code.co_filename.startswith("<"):
            caller = name(f)
            break
        f = f.f_back
    return inner if caller is None or caller == inner else f"{inner} <- {caller}"


class LoopStallSampler:
    """Create on the loop's thread; call :meth:`beat` from the loop at every
    heartbeat (``interval_s`` apart), :meth:`start` and :meth:`stop`."""

    def __init__(self, interval_s: float, stall_s: float = 0.004, sample_s: float = 0.002) -> None:
        self.loop_thread = threading.get_ident()
        self.interval_s, self.stall_s, self.sample_s = interval_s, stall_s, sample_s
        self.last_beat = time.monotonic()
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedcore-stall-sampler", daemon=True)

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def start(self) -> None:
        self.last_beat = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            if time.monotonic() - self.last_beat < self.interval_s + self.stall_s:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if frame is None:  # (the loop's thread has ended)
                return
            where = place_of(frame)
            del frame
            if where not in self.counts and len(self.counts) >= MAX_PLACES:
                where = "other"
            self.counts[where] += 1
