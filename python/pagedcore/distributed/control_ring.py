"""The driver's step messages to the workers through shared memory.

Each engine step the driver sends its workers the step's batch (:mod:`.step_message`).
Over gloo a broadcast costs 0.13-0.17 ms on one host (loopback TCP), a share of a
tensor-parallel decode step that the GPUs' time per token cannot afford. Here the
first ``INLINE`` ints of every message (all of a decode step's, as a rule) go through
a ring of ``SLOTS`` slots in a file under /dev/shm that every rank maps; the rest of
a longer message still follows on the gloo control group.

Layout (8-byte words, each counter on its own 64-byte line): the writer's count of
messages written; per reader, its count of messages read, and its sleep flag; then
the slots. The writer fills slot ``k % SLOTS`` once every reader has read message
``k - SLOTS``, then publishes ``k + 1``. A reader polls the count for a while
(``PAGEDCORE_TP_SPIN_US``, 1000 by default), then raises its sleep flag, looks once
more and blocks on its wake-up pipe; the writer sends a byte down the pipe of every
reader whose flag is up after it published. The counters and flags are loaded and
stored sequentially consistent (``_C.atomic_load_i64`` / ``atomic_store_i64``), so
that a message's payload is visible before its count, and a reader going to sleep
and the writer publishing never miss each other (each looks at the other's word
after writing its own).

A dead driver closes the readers' pipes (their wait ends with EOFError); a dead
reader leaves its count behind, and the writer, once the ring is full, asks its
``check`` (the driver's watchdog) whether to give up.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _C
from . import step_message as msg

SLOTS = 8
_LINE = 64  # bytes
_SLOT_BYTES = msg.INLINE * 4
SHM_DIR = "/dev/shm"
SPIN_ENV = "PAGEDCORE_TP_SPIN_US"


def _spin_seconds() -> float:
    raw = os.environ.get(SPIN_ENV, "1000")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"${SPIN_ENV} must be a non-negative integer (microseconds), got {raw!r}")
    return value / 1e6


class ControlRing:
    """One mapping of the ring: the writer's (:meth:`create`) or a reader's (:meth:`attach`)."""

    def __init__(self, path: str, readers: int, fd: int) -> None:
        self.path, self.readers = path, readers
        self._header = _LINE * (1 + 2 * readers)
        self._map = mmap.mmap(fd, self._header + SLOTS * _SLOT_BYTES)
        base = np.frombuffer(self._map, dtype=np.uint8)
        self._base = base.ctypes.data
        self._slots = np.frombuffer(self._map, dtype=np.int32, offset=self._header).reshape(SLOTS, msg.INLINE)
        self._seq = 0  # messages this mapping wrote / read
        self.reader: int | None = None  # (attach: which reader this mapping is)

    @classmethod
    def create(cls, readers: int) -> ControlRing:
        """A new ring for ``readers`` readers (the driver's side), zeroed. Raises OSError
        where shared memory cannot be had (no /dev/shm)."""
        path = os.path.join(SHM_DIR, f"pagedcore-tp-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _LINE * (1 + 2 * readers) + SLOTS * _SLOT_BYTES)
            ring = cls(path, readers, fd)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return ring

    @classmethod
    def attach(cls, path: str, readers: int, reader: int) -> ControlRing:
        """Reader ``reader`` (0-based) of the ring at ``path`` (a worker's side)."""
        fd = os.open(path, os.O_RDWR)
        try:
            ring = cls(path, readers, fd)
        finally:
            os.close(fd)
        ring.reader = reader
        return ring

    def unlink(self) -> None:
        """Removes the ring's file (the mappings stay valid until closed)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._slots = None  # (the views go before the mapping)
        try:
            self._map.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass

    # ---- the words -----------------------------------------------------------------

    def _written_at(self) -> int:
        return self._base

    def _read_at(self, reader: int) -> int:
        return self._base + _LINE * (1 + reader)

    def _sleep_at(self, reader: int) -> int:
        return self._base + _LINE * (1 + self.readers + reader)

    # ---- the writer ----------------------------------------------------------------

    def send(self, message: np.ndarray, wakes: list[Any], check: Callable[[], None]) -> None:
        """Writes ``message`` (``INLINE`` int32) as the next message and wakes the
        readers that sleep (``wakes[r]``: reader r's pipe). Waits while the ring is
        full, calling ``check`` (which raises to give up) every millisecond."""
        k = self._seq
        if k >= SLOTS:
            oldest = k - SLOTS + 1  # every reader must have read this many
            polls = 0
            while any(_C.atomic_load_i64(self._read_at(r)) < oldest for r in range(self.readers)):
                polls += 1
                if polls % 64 == 0:
                    check()
                    time.sleep(0.001 if polls > 4096 else 0)
        self._slots[k % SLOTS] = message[:msg.INLINE]
        _C.atomic_store_i64(self._written_at(), k + 1)
        self._seq = k + 1
        for r in range(self.readers):
            if _C.atomic_load_i64(self._sleep_at(r)):
                wakes[r].send_bytes(b"")

    # ---- a reader ------------------------------------------------------------------

    def recv_into(self, out: np.ndarray, wake: Any) -> None:
        """The next message into ``out`` (``INLINE`` int32): polls, then sleeps on
        ``wake`` (the driver's pipe to this reader; EOFError once the driver is gone)."""
        k, reader = self._seq, self.reader
        written, sleep_flag = self._written_at(), self._sleep_at(reader)
        deadline = time.perf_counter() + _spin_seconds()
        while _C.atomic_load_i64(written) <= k:
            if time.perf_counter() < deadline:
                continue
            _C.atomic_store_i64(sleep_flag, 1)
            if _C.atomic_load_i64(written) > k:  # published between the poll and the flag
                _C.atomic_store_i64(sleep_flag, 0)
                break
            wake.recv_bytes()
            _C.atomic_store_i64(sleep_flag, 0)
            while wake.poll():  # (the wake-ups of later messages sent meanwhile)
                wake.recv_bytes()
        out[:] = self._slots[k % SLOTS]
        _C.atomic_store_i64(self._read_at(reader), k + 1)
        self._seq = k + 1


def ring_path_allowed() -> bool:
    """Whether this host has the shared-memory directory the ring lives in."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
