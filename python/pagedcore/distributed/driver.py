"""The driver's side of tensor parallelism (rank 0, the process of the LLMEngine).

:class:`TensorParallelDriver` spawns the workers (ranks 1..N-1), joins the
group with them, sends each step (:mod:`.step_message`; through shared memory,
:mod:`.control_ring`, unless ``PAGEDCORE_TP_CONTROL=gloo``) and watches them:

- a watchdog thread waits on the workers' process sentinels and pipes; a worker
  that exits (or reports an error) marks the group failed, and on NCCL aborts
  the device group so that a collective waiting for the dead rank returns;
  gloo ends such a collective by itself (the peer's sockets close);
- every driver-side collective runs inside :meth:`guard`: a failure there
  becomes a :class:`TensorParallelError` naming the worker and its exit code
  (or its own error), the other workers are ended, and every later call raises
  the same error at once;
- :meth:`shutdown` (also registered with atexit) tells the workers to stop,
  then terminates (and at last kills) what is left, and destroys the group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from . import step_message as msg
from .control_ring import ControlRing, ring_path_allowed
from .group import SYMM_MEM_MAX_BYTES, TensorParallelGroup, free_port, init_tp_group
from .worker import WorkerLaunch, worker_main

logger = logging.getLogger("pagedcore")

# Spawned workers import torch and pagedcore before they say hello (~3-5 s on a
# loaded 2-core machine).
HELLO_TIMEOUT_S = 300.0
# How long a failed collective waits for the watchdog to name the dead worker.
DEATH_GRACE_S = 5.0
# How the driver's step messages travel: "shm" (the shared-memory ring, where the
# host has /dev/shm; the default) or "gloo" (a broadcast on the control group).
CONTROL_ENV = "PAGEDCORE_TP_CONTROL"


def control_channel() -> str:
    """$PAGEDCORE_TP_CONTROL, checked: "shm" (default) or "gloo"."""
    value = os.environ.get(CONTROL_ENV, "shm") or "shm"
    if value not in ("shm", "gloo"):
        raise ValueError(f"${CONTROL_ENV} must be 'shm' or 'gloo', got {value!r}")
    return value


# "1": every rank on the driver's GPU, the device collectives by gloo on host
# copies (a test of the GPU path's sharding on a machine of one GPU; see group.py).
TP_ONE_GPU_ENV = "PAGEDCORE_TP_ONE_GPU"


def _switch(name: str) -> bool:
    """The environment switch ``name``, checked: "0" (default) or "1"."""
    value = os.environ.get(name, "0") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"${name} must be '0' or '1', got {value!r}")
    return value == "1"


def tp_one_gpu() -> bool:
    """$PAGEDCORE_TP_ONE_GPU, checked."""
    return _switch(TP_ONE_GPU_ENV)


# "1" with tensor_parallel_size=1: the tensor-parallel path with the driver alone in
# a group of one rank (NCCL on a GPU, gloo on the CPU): the sharded model, the step
# messages and the model's collectives run as with more ranks (real NCCL or
# symmetric-memory calls, captured in the CUDA graphs), without a peer. A test of
# that path on a machine of one GPU; no use otherwise.
TP_ONE_RANK_ENV = "PAGEDCORE_TP_ONE_RANK"


def tp_one_rank() -> bool:
    """$PAGEDCORE_TP_ONE_RANK, checked."""
    return _switch(TP_ONE_RANK_ENV)


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot run any more."""


# A rendezvous that a dead worker left waiting: its thread cannot be stopped, and
# torch.distributed cannot be set up again in this process while it waits.
_stuck_rendezvous: threading.Thread | None = None


class TensorParallelDriver:
    """Starts ``size - 1`` workers (then :meth:`connect` joins the group with
    them); see the module docstring."""

    def __init__(self, launch: WorkerLaunch, device: torch.device) -> None:
        if _stuck_rendezvous is not None and _stuck_rendezvous.is_alive():
            raise TensorParallelError(
                "an earlier tensor-parallel start-up in this process failed at the rendezvous (a worker died); "
                "torch.distributed cannot be set up again in this process: start a new one")
        self.size = launch.size
        self._failure: str | None = None
        self._error: TensorParallelError | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._worker_errors: dict[int, str] = {}
        launch.port = free_port()
        # The step messages' ring (its file goes once every worker has mapped it:
        # connect) and a wake-up pipe to each worker.
        self._ring: ControlRing | None = None
        if control_channel() == "shm" and ring_path_allowed():
            try:
                self._ring = ControlRing.create(self.size - 1)
            except OSError as e:
                logger.warning("tensor parallelism: no shared-memory ring (%s); the steps go by gloo", e)
        launch.control_path = self._ring.path if self._ring is not None else None
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._wakes: list[Any] = []
        start = time.perf_counter()
        try:
            for rank in range(1, self.size):
                receive, send = ctx.Pipe(duplex=False)
                wake_receive, wake_send = ctx.Pipe(duplex=False) if self._ring is not None else (None, None)
                proc = ctx.Process(target=worker_main, args=(launch, rank, send, wake_receive),
                                   name=f"pagedcore-tp-rank{rank}", daemon=True)
                proc.start()
                send.close()
                if wake_receive is not None:
                    wake_receive.close()
                    self._wakes.append(wake_send)
                self._procs.append(proc)
                self._conns.append(receive)
        except BaseException:
            self.shutdown()  # (the workers started so far, the ring's file)
            raise
        atexit.register(self.shutdown)
        self._started = start
        self._port, self._device = launch.port, device
        self._staged = launch.one_gpu_index is not None  # (PAGEDCORE_TP_ONE_GPU: gloo on host copies)
        self._symm_dtype = launch.dtype if launch.symm_mem else None
        self._nccl = device.type == "cuda" and not self._staged
        self._buf = np.zeros(msg.INLINE, dtype=np.int32)

    def connect(self) -> None:
        """Waits for the workers to start (they import torch meanwhile: the driver
        loads its weights between __init__ and this call) and joins the group."""
        try:
            self._await_hello()
            if self._ring is not None:  # (every worker mapped it before its hello)
                self._ring.unlink()
            self.group: TensorParallelGroup = self._rendezvous()
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="pagedcore-tp-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("tensor parallelism: %d rank%s (%s, workers %s; steps by %s) up in %.1f s", self.size,
                    "s" if self.size > 1 else "",
                    (f"NCCL, all-reduces up to {SYMM_MEM_MAX_BYTES >> 10} KiB on symmetric memory"
                     if self.group.symm_mem else "NCCL") if self._nccl
                    else f"gloo on host copies, every rank on {self._device}" if self._staged
                    else "gloo", [p.pid for p in self._procs],
                    "shared memory" if self._ring is not None else "gloo", time.perf_counter() - self._started)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- liveness -------------------------------------------------------------------

    def _await_hello(self) -> None:
        waiting = dict(zip(self._conns, range(1, self.size)))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(f"tensor-parallel workers {sorted(waiting.values())} did not start "
                                          f"within {HELLO_TIMEOUT_S:.0f} s")
            for ready in multiprocessing.connection.wait(list(waiting) + list(sentinels), timeout=left):
                if ready in waiting:
                    rank = waiting[ready]
                    try:
                        message = ready.recv()
                    except EOFError:
                        message = ("error", "exited during start-up")
                    if message[0] == "error":
                        raise TensorParallelError(f"tensor-parallel worker {rank} failed to start: {message[1]}")
                    del waiting[ready]
                elif ready in sentinels:
                    rank = sentinels.pop(ready)
                    proc = self._procs[rank - 1]
                    proc.join(1.0)
                    raise TensorParallelError(f"tensor-parallel worker {rank} (pid {proc.pid}) exited during "
                                              f"start-up with exit code {proc.exitcode} (its stderr says why; a script that "
                                              "starts one must guard its code with if __name__ == '__main__': "
                                              "workers are spawned)")

    def _rendezvous(self) -> TensorParallelGroup:
        """Joins the group in a helper thread, watching the workers meanwhile: a
        worker that dies before it joins would leave the driver waiting at the
        rendezvous for the group's whole timeout."""
        joined: list[Any] = []

        def join() -> None:
            try:
                joined.append(init_tp_group(0, self.size, self._port, self._device, staged=self._staged,
                                            symm_dtype=self._symm_dtype))
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                joined.append(e)

        thread = threading.Thread(target=join, name="pagedcore-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = [(rank, p) for rank, p in enumerate(self._procs, start=1) if not p.is_alive()]
            if dead and thread.is_alive():
                rank, proc = dead[0]
                proc.join(1.0)
                why = ""
                with contextlib.suppress(EOFError, OSError):
                    conn = self._conns[rank - 1]
                    while conn.poll(0.2):
                        message = conn.recv()
                        if message[0] == "error":
                            why = f": {message[1]}"
                # NOTE: the helper thread stays blocked at the rendezvous (a daemon:
                # it does not keep the process alive, but no group can be set up
                # beside it: later drivers refuse to start).
                global _stuck_rendezvous
                _stuck_rendezvous = thread
                raise TensorParallelError(f"tensor-parallel worker {rank} (pid {proc.pid}) exited during the "
                                          f"rendezvous with code {proc.exitcode}{why}")
        if isinstance(joined[0], BaseException):
            raise TensorParallelError(f"the tensor-parallel rendezvous failed: {joined[0]}") from joined[0]
        return joined[0]

    def _watch(self) -> None:
        conns = {c: rank for rank, c in enumerate(self._conns, start=1)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        while sentinels:
            try:
                ready = multiprocessing.connection.wait(list(conns) + list(sentinels))
            except OSError:  # closed by shutdown
                return
            for obj in ready:
                if obj in conns:
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        del conns[obj]
                        continue
                    if message[0] == "error":
                        self._worker_errors[conns[obj]] = message[1]
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    if self._closing:
                        continue
                    self._mark_failed(rank, self._procs[rank - 1])

    def _mark_failed(self, rank: int, proc: Any) -> None:
        proc.join(1.0)  # (its sentinel fires a moment before its exit code can be read)
        # The worker writes its error before it exits: give the pipe a moment.
        conn = self._conns[rank - 1]
        with contextlib.suppress(EOFError, OSError):
            while rank not in self._worker_errors and conn.poll(0.2):
                message = conn.recv()
                if message[0] == "error":
                    self._worker_errors[rank] = message[1]
        why = self._worker_errors.get(rank)
        text = f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        if why:
            text += f": {why}"
        with self._lock:
            if self._failure is None:
                self._failure = text
        logger.error("%s", text)
        if self._nccl:
            # NOTE: an NCCL collective waiting for the dead rank would wait for the
            # group's timeout; aborting the group ends it with an error now.
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group(dist.group.WORLD)

    def alive(self) -> bool:
        """Whether every worker runs and the group has not failed."""
        return self._error is None and self._failure is None and all(p.is_alive() for p in self._procs)

    def failure(self) -> str | None:
        """Why the group cannot run any more (the worker that died, its exit code
        and error), or None while :meth:`alive`."""
        if self._failure is not None:
            return self._failure
        if self._error is not None:
            return str(self._error)
        if self._closing:
            return "the tensor-parallel workers have been shut down"
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():  # (dead; the watchdog has not named it yet)
                return f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def check(self) -> None:
        """Raises the group's failure, if any."""
        if self._error is not None:
            raise self._error
        if self._failure is not None or not all(p.is_alive() for p in self._procs):
            raise self._fail(None)

    def _fail(self, cause: BaseException | None) -> TensorParallelError:
        """Ends the group after a failure; returns the error to raise (the same one from now on)."""
        if self._error is not None:
            return self._error
        deadline = time.monotonic() + DEATH_GRACE_S
        while self._failure is None and time.monotonic() < deadline:  # the watchdog names the dead worker
            time.sleep(0.05)
        text = self._failure or f"the tensor-parallel group failed: {type(cause).__name__}: {cause}"
        self._error = TensorParallelError(text + " (the engine has stopped; start a new one)")
        self.shutdown()
        return self._error

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Runs driver-side collectives; any failure inside ends the group (the
        workers are then out of step) and raises a TensorParallelError, except
        ValueError and TypeError (bad input: raised as they are, the group ended)."""
        self.check()
        try:
            yield
        except TensorParallelError:
            raise
        except (ValueError, TypeError) as e:
            self._error = TensorParallelError(f"the engine stopped after an error: {type(e).__name__}: {e}")
            self.shutdown()
            raise
        except Exception as e:
            raise self._fail(e) from e

    # ---- messages -------------------------------------------------------------------

    def _send(self, buf: np.ndarray, deadline: float | None = None) -> None:
        """The message in ``buf``: its first ``INLINE`` ints through the ring (or
        gloo), the rest on gloo. A full ring is waited for until ``deadline``
        (time.monotonic(); None: while the workers live)."""
        total = msg.message_len(buf)
        if self._ring is not None:
            def check() -> None:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the tensor-parallel workers did not take the last messages")
                self.check()

            self._ring.send(buf, self._wakes, check)
        else:
            self.group.broadcast_host(torch.from_numpy(buf[:msg.INLINE]))
        if total > msg.INLINE:
            self.group.broadcast_host(torch.from_numpy(buf[msg.INLINE:total]))

    def send_step(self, batch: Any, block_size: int, previous: torch.Tensor | None) -> None:
        """Broadcasts ``batch`` (and, when it takes deferred inputs, ``previous``,
        the previous step's sampled ids on the device)."""
        previous_len = previous.shape[0] if batch.num_deferred_inputs and previous is not None else 0
        self._buf = msg.pack_step(batch, block_size, previous_len, self._buf)
        self._send(self._buf)
        if previous_len:
            self.group.broadcast_device(previous.contiguous())

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Has the workers run the LM head over ``hidden`` ``[rows, hidden_size]`` with the driver."""
        self._send(msg.control_message(msg.LOGITS, hidden.shape[0], hidden.shape[1]))
        self.group.broadcast_device(hidden.contiguous())

    # ---- the end --------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the workers (a message, then terminate, then kill) and leaves the group. Idempotent."""
        if self._closing:
            return
        self._closing = True
        group = getattr(self, "group", None)
        if group is None or self._error is not None or self._failure is not None:
            # Not connected (the workers wait at the rendezvous), or failed (they wait
            # in a collective that will not complete): no message can reach them.
            timeout = 0.0
        if group is not None and self._failure is None and self._error is None \
                and all(p.is_alive() for p in self._procs):
            with contextlib.suppress(Exception):
                self._send(msg.control_message(msg.SHUTDOWN), deadline=time.monotonic() + timeout)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if group is not None:
            with contextlib.suppress(Exception):
                group.destroy()
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(2.0)  # it ends once every worker's sentinel has fired
        for conn in self._conns + self._wakes:
            conn.close()
        if self._ring is not None:
            self._ring.unlink()
            self._ring.close()
        atexit.unregister(self.shutdown)
