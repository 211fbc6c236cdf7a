"""server/loop_stalls.py: the sampler records what the loop's thread runs only
while its heartbeat is overdue, named by the innermost frame."""

from __future__ import annotations

import time

from pagedcore.server.loop_stalls import LoopStallSampler


def spin_without_beating(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_samples_come_only_from_a_loop_that_missed_its_heartbeat() -> None:
    # (a 50 ms heartbeat: a loaded test machine's oversleeps stay well inside it)
    sampler = LoopStallSampler(interval_s=0.05, stall_s=0.004, sample_s=0.001)
    sampler.start()
    try:
        for _ in range(40):  # a punctual loop: beats every 5 ms, sleeping between (0.2 s)
            sampler.beat()
            time.sleep(0.005)
        punctual = dict(sampler.counts)
        sampler.beat()
        spin_without_beating(0.3)  # a stalled one: late after 54 ms
    finally:
        sampler.stop()
    assert punctual == {}
    places = dict(sampler.counts)
    assert list(places) == ["test_server_loop_stalls.py:spin_without_beating"]
    # (the sampler gets the GIL once the switch interval, 5 ms, has passed: ~49 of them in 246 ms)
    assert places["test_server_loop_stalls.py:spin_without_beating"] >= 10
