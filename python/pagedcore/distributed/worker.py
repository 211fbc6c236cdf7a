"""A tensor-parallel worker process (ranks 1..N-1).

It builds its shard of the model and its own KV cache (its kv heads, the
driver's block count), captures the same CUDA graphs as the driver, then runs
what the driver broadcasts: each step's forward pass (joining the model's
collectives), the LM head over prompt-logprob rows, or the end. It never
schedules and never samples.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import step_message as msg

logger = logging.getLogger("pagedcore")


@dataclass
class WorkerLaunch:
    """What every worker is started with (pickled to the spawned process)."""

    args: Any  # EngineArgs
    model_path: str
    spec: Any  # ModelSpec (the whole model's)
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device_type: str
    size: int
    port: int
    log_level: int
    control_path: str | None = None  # the step messages' ring (None: they come by gloo)
    # PAGEDCORE_TP_ONE_GPU=1 (a test of the GPU path on a machine of one GPU): every
    # rank on the driver's GPU, this index, the device collectives by gloo through
    # host copies (NCCL refuses two ranks on one device). None: rank r on cuda:r.
    one_gpu_index: int | None = None
    # PAGEDCORE_TP_ALLREDUCE=symm_mem: the small all-reduces on torch's symmetric memory
    symm_mem: bool = False


def worker_main(launch: WorkerLaunch, rank: int, conn: Any, wake: Any = None) -> None:
    """Entry point of a spawned worker; ``conn`` sends ("hello",) once started
    and ("error", text) before a failure ends the process; ``wake``: the driver's
    wake-up pipe of the step messages' ring (with ``launch.control_path``)."""
    try:
        logging.basicConfig(level=launch.log_level, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
        logger.setLevel(launch.log_level)
        if launch.device_type == "cpu":
            # The ranks share the machine's cores (the driver keeps its own setting).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.size))
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", rank if launch.one_gpu_index is None else launch.one_gpu_index)
            torch.cuda.set_device(device)
        from .group import init_tp_group

        ring = None
        if launch.control_path is not None:  # (mapped before the hello, after which the driver removes its file)
            from .control_ring import ControlRing

            ring = ControlRing.attach(launch.control_path, launch.size - 1, rank - 1)
        conn.send(("hello",))
        group = init_tp_group(rank, launch.size, launch.port, device, staged=launch.one_gpu_index is not None,
                              symm_dtype=launch.dtype if launch.symm_mem else None)
        _serve(launch, group, device, ring, wake)
        group.destroy()
    except BaseException as e:  # noqa: BLE001 - the driver must hear why
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass  # the driver is gone
        os._exit(1)
    os._exit(0)


def _serve(launch: WorkerLaunch, group: Any, device: torch.device, ring: Any, wake: Any) -> None:
    from .. import _C
    from ..llm_engine import load_model, local_kv_blocks, max_batched_tokens
    from ..model_runner import ModelRunner
    from ..models.parallel import TensorParallelShard

    args = launch.args
    torch.manual_seed(args.seed)
    # NOTE: the same sequence of collectives as the driver's LLMEngine.__init__:
    # barrier, MIN of the block counts, the engine config, the CUDA-graph captures.
    shard = TensorParallelShard(launch.spec, group.rank, launch.size)
    model = load_model(args, launch.model_path, launch.spec, launch.dtype, device, shard)
    group.barrier()
    blocks = local_kv_blocks(args, model, launch.kv_dtype, device, max_batched_tokens(args, device), quiet=True)
    group.min_int(blocks)
    fields = group.broadcast_object()
    config = _C.EngineConfig(**fields)
    if config.max_model_len != model.max_positions:
        model.init_rotary(config.max_model_len)
    runner = ModelRunner(model, config, device, launch.kv_dtype, args.enforce_eager)
    inline = np.zeros(msg.INLINE, dtype=np.int32)
    inline_t = torch.from_numpy(inline)
    while True:
        if ring is not None:
            ring.recv_into(inline, wake)
        else:
            group.broadcast_host(inline_t)
        message, total = inline, msg.message_len(inline)
        if total > msg.INLINE:
            message = np.empty(total, dtype=np.int32)
            message[:msg.INLINE] = inline
            group.broadcast_host(torch.from_numpy(message[msg.INLINE:]))
        kind = msg.message_kind(message)
        if kind == msg.SHUTDOWN:
            return
        if kind == msg.STEP:
            batch, previous_len = msg.unpack_step(message)
            previous = None
            if previous_len:
                previous = group.broadcast_device(torch.empty(previous_len, dtype=torch.int64, device=device))
            runner.execute(batch, previous)
        elif kind == msg.LOGITS:
            rows, hidden_size = msg.header_values(message, 2)
            hidden = group.broadcast_device(torch.empty((rows, hidden_size), dtype=model.dtype, device=device))
            runner.compute_logits(hidden)
        else:
            raise RuntimeError(f"internal error: unknown tensor-parallel message kind {kind}")
