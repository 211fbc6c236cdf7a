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
        places = dict(sampler.counts)  # (before stop(): the heartbeat is still overdue there)
    finally:
        sampler.stop()
    assert punctual == {}
    spinning = places.pop("test_server_loop_stalls.py:spin_without_beating", 0)
    # (the sampler gets the GIL once the switch interval, 5 ms, has passed: ~49 of them in
    # 246 ms; at most one sample may land on the lines after the spin before the copy)
    assert spinning >= 10 and sum(places.values()) <= 1, (spinning, places)
