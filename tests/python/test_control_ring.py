"""The shared-memory ring of tensor parallelism's step messages
(pagedcore.distributed.control_ring), its readers in threads of this process, each
with a mapping of its own (the processes' case is test_tensor_parallel.py's: every
tensor-parallel test there sends its steps through the ring): every message in
order through a ring much shorter than the run, readers that fall behind (the
writer waits), readers that sleep between messages and are woken, a driver that
goes away (the reader's wait ends), a reader that died (the writer's check gives
up), the switches' bad values.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

from pagedcore.distributed import control_ring
from pagedcore.distributed import step_message as msg
from pagedcore.distributed.control_ring import SLOTS, ControlRing
from pagedcore.distributed.driver import control_channel

pytestmark = pytest.mark.skipif(not control_ring.ring_path_allowed(), reason="no /dev/shm on this host")


def message(k: int) -> np.ndarray:
    """Message k: every int a function of k and its place (a stale or torn slot shows)."""
    out = np.arange(msg.INLINE, dtype=np.int32) * 7 + k
    out[0] = k
    return out


def read(ring: ControlRing, wake, count: int, got: list, delay=lambda k: 0.0) -> None:
    out = np.empty(msg.INLINE, dtype=np.int32)
    try:
        for k in range(count):
            time.sleep(delay(k))
            ring.recv_into(out, wake)
            got.append(bool(np.array_equal(out, message(k))) or f"message {k} read as {int(out[0])}")
    except BaseException as e:  # noqa: BLE001 - the test reads it
        got.append(e)


def start(readers: int, count: int, delays=None):
    ring = ControlRing.create(readers)
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(readers)]
    gots = [[] for _ in range(readers)]
    threads = []
    for r in range(readers):
        mapping = ControlRing.attach(ring.path, readers, r)
        delay = delays[r] if delays else (lambda k: 0.0)
        t = threading.Thread(target=read, args=(mapping, pipes[r][0], count, gots[r], delay), daemon=True)
        t.start()
        threads.append(t)
    ring.unlink()  # (the mappings stay)
    return ring, [send for _, send in pipes], [receive for receive, _ in pipes], gots, threads


def test_every_message_arrives_in_order_through_a_short_ring(monkeypatch) -> None:
    # 40 times the ring's slots; one reader slow now and then (the writer waits for its
    # slot), the writer pausing past the readers' poll now and then (they sleep on their
    # pipes and are woken).
    monkeypatch.setenv(control_ring.SPIN_ENV, "200")
    count = 40 * SLOTS
    ring, wakes, _, gots, threads = start(2, count, delays=[lambda k: 0.0, lambda k: 0.003 if k % 37 == 0 else 0.0])
    for k in range(count):
        if k % 50 == 0:
            time.sleep(0.005)
        ring.send(message(k), wakes, check=lambda: None)
    for t in threads:
        t.join(30)
    for got in gots:
        assert got == [True] * count


def test_a_sleeping_reader_is_woken_at_once(monkeypatch) -> None:
    monkeypatch.setenv(control_ring.SPIN_ENV, "0")  # straight to its pipe
    ring, wakes, _, gots, threads = start(1, 3)
    for k in range(3):
        time.sleep(0.05)  # (the reader is asleep by now)
        sent = time.perf_counter()
        ring.send(message(k), wakes, check=lambda: None)
        while len(gots[0]) <= k and time.perf_counter() - sent < 5:
            time.sleep(0.0005)
        assert gots[0][k] is True
        assert time.perf_counter() - sent < 1.0
    threads[0].join(5)


def test_a_reader_ends_when_the_writer_is_gone(monkeypatch) -> None:
    monkeypatch.setenv(control_ring.SPIN_ENV, "100")
    ring, wakes, _, gots, threads = start(1, 2)
    ring.send(message(0), wakes, check=lambda: None)
    time.sleep(0.05)
    wakes[0].close()  # the driver's end of the wake-up pipe: what its exit closes
    threads[0].join(5)
    assert not threads[0].is_alive()
    assert gots[0][0] is True and isinstance(gots[0][1], EOFError)


def test_a_full_ring_asks_the_check_and_gives_up_with_its_error(monkeypatch) -> None:
    monkeypatch.setenv(control_ring.SPIN_ENV, "100")
    ring = ControlRing.create(1)  # a reader that never reads (died)
    try:
        receive, send = multiprocessing.Pipe(duplex=False)
        calls = []

        def check() -> None:
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("worker 1 died")

        for k in range(SLOTS):  # fills the ring without waiting
            ring.send(message(k), [send], check=check)
        assert calls == []
        with pytest.raises(RuntimeError, match="worker 1 died"):
            ring.send(message(SLOTS), [send], check=check)
    finally:
        ring.unlink()


def test_bad_switches_are_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv(control_ring.SPIN_ENV, "-5")
    ring, wakes, _, gots, threads = start(1, 1)
    threads[0].join(5)
    assert isinstance(gots[0][0], ValueError) and "PAGEDCORE_TP_SPIN_US" in str(gots[0][0])
    monkeypatch.setenv("PAGEDCORE_TP_CONTROL", "tcp")
    with pytest.raises(ValueError, match="PAGEDCORE_TP_CONTROL must be 'shm' or 'gloo', got 'tcp'"):
        control_channel()
    monkeypatch.setenv("PAGEDCORE_TP_CONTROL", "gloo")
    assert control_channel() == "gloo"
    monkeypatch.delenv("PAGEDCORE_TP_CONTROL")
    assert control_channel() == "shm"
