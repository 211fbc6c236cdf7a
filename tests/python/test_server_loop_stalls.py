"""server/loop_stalls.py: the sampler records what the loop's thread runs only
while its heartbeat is overdue, named by the innermost frame."""

from __future__ import annotations

import time

from pagedcore.server.loop_stalls import LoopStallSampler


def spin_without_beating(sampler: LoopStallSampler, samples: int, seconds: float) -> None:
    """Runs Python, never beating, until the sampler has taken ``samples`` samples
    (``seconds`` at most). (Counted, not a fixed spin: on a loaded machine this
    process gets a share of a core, and the sampler fewer turns per second.)"""
    end = time.perf_counter() + seconds
    while sum(sampler.counts.values()) < samples and time.perf_counter() < end:
        pass


def test_samples_come_only_from_a_loop_that_missed_its_heartbeat() -> None:
    # (a 100 ms heartbeat: a loaded test machine's oversleeps stay well inside it)
    sampler = LoopStallSampler(interval_s=0.1, stall_s=0.004, sample_s=0.001)
    sampler.start()
    try:
        for _ in range(40):  # a punctual loop: beats every 5 ms, sleeping between (0.2 s)
            sampler.beat()
            time.sleep(0.005)
        punctual = dict(sampler.counts)
        sampler.beat()
        spin_without_beating(sampler, 10, 10.0)  # a stalled one: late after 104 ms
        places = dict(sampler.counts)  # (before stop(): the heartbeat is still overdue there)
    finally:
        sampler.stop()
    assert punctual == {}
    spinning = places.pop("test_server_loop_stalls.py:spin_without_beating", 0)
    # (the sampler gets the GIL once the switch interval, 5 ms, has passed. Samples after
    # the spin, still overdue, can only name this function: its lines after the call. On a
    # loaded machine there can be several: the sampler may take the GIL again before this
    # thread is back on a core.)
    assert spinning >= 10, (spinning, places)
    assert set(places) <= {"test_server_loop_stalls.py:test_samples_come_only_from_a_loop_that_missed_its_heartbeat"}, \
        places
