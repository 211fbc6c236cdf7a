"""The tensor-parallel process group of this process (one per process at a time).

Two torch.distributed groups over the same ranks:

- the *device* group (the default group): the model's collectives (all-reduce
  after o and down, the embedding's all-reduce, the logits' all-gather). NCCL
  between GPUs (rank r on ``cuda:r``), gloo between CPU processes. NCCL
  collectives issued while a CUDA graph is captured are captured with it (the
  group exists, and has run a collective, before the first capture). *Staged*
  (``PAGEDCORE_TP_ONE_GPU=1``, every rank on one GPU: NCCL refuses two ranks on
  one device): gloo on host copies of the GPU tensors, eager steps only; a test
  of the GPU path's sharding on a machine of one GPU, not a way to run fast.
- the *control* group: gloo, on host tensors, for the driver's messages (each
  step's batch, shutdown). Its timeout is long: a worker waits there for as long
  as the engine is idle. A peer that dies closes its sockets, which ends a
  pending gloo operation with an error at once (no timeout needed).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single;
# the GPU machine's torch 2.11 may have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# How the model's all-reduces of at most SYMM_MEM_MAX_BYTES run between GPUs:
# "nccl" (the default) or "symm_mem" (torch's symmetric memory: a one-shot kernel
# that copies the rank's input into its buffer, waits for the peers' and sums them
# all, no NCCL proxy or ring; larger all-reduces stay on NCCL). Opt-in: never run yet.
ALLREDUCE_ENV = "PAGEDCORE_TP_ALLREDUCE"
SYMM_MEM_MAX_BYTES = 512 << 10  # a decode step of 64 rows of the 8B shape's 4096 bf16


def allreduce_kind() -> str:
    """$PAGEDCORE_TP_ALLREDUCE, checked: "nccl" (default) or "symm_mem"."""
    value = os.environ.get(ALLREDUCE_ENV, "nccl") or "nccl"
    if value not in ("nccl", "symm_mem"):
        raise ValueError(f"${ALLREDUCE_ENV} must be 'nccl' or 'symm_mem', got {value!r}")
    return value


# A worker waits on the control group between steps; the server may idle for days.
CONTROL_TIMEOUT = datetime.timedelta(days=30)
# The model's collectives run in lockstep (every rank is inside the same forward pass).
DEVICE_TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelGroup:
    """This process's rank in the tensor-parallel group and its collectives."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device, staged: bool = False,
                 symm_dtype: torch.dtype | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is initialised already in this process: one tensor-parallel engine "
                "per process at a time (shut the other down first: LLM.shutdown())"
            )
        self.rank, self.size, self.device = rank, size, device
        # staged: the device collectives on host copies (gloo), the results copied back
        self.staged = staged and device.type == "cuda"
        backend = "nccl" if device.type == "cuda" and not self.staged else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
            timeout=CONTROL_TIMEOUT if backend == "gloo" else DEVICE_TIMEOUT,
            device_id=device if backend == "nccl" else None,
        )
        self.device_group = dist.group.WORLD
        self.control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        # symm_dtype (PAGEDCORE_TP_ALLREDUCE=symm_mem, NCCL groups): every rank's
        # buffer of SYMM_MEM_MAX_BYTES, mapped by its peers (a collective).
        self._symm: torch.Tensor | None = None
        if symm_dtype is not None and backend == "nccl":
            import torch.distributed._symmetric_memory as symm_mem

            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
                raise RuntimeError(f"${ALLREDUCE_ENV}=symm_mem needs torch's symm_mem.one_shot_all_reduce_copy_out, "
                                   f"which torch {torch.__version__} does not have")
            itemsize = torch.empty((), dtype=symm_dtype).element_size()
            self._symm = symm_mem.empty(SYMM_MEM_MAX_BYTES // itemsize, dtype=symm_dtype, device=device)
            symm_mem.rendezvous(self._symm, self.device_group.group_name)
            self._group_name = self.device_group.group_name

    # ---- model collectives (device group) ----------------------------------------

    @property
    def symm_mem(self) -> bool:
        """Whether the small all-reduces run on torch's symmetric memory."""
        return self._symm is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` itself, summed in place, or (the
        symmetric-memory all-reduce) a new tensor; use the result."""
        if self._symm is not None and x.dtype == self._symm.dtype and x.is_contiguous():
            nbytes = x.numel() * x.element_size()
            if nbytes <= SYMM_MEM_MAX_BYTES and nbytes % 16 == 0:
                # (into a new tensor: the kernel's copy of x into the buffer and its sums
                # into out are not ordered across its blocks, so out must not alias x)
                out = torch.empty_like(x)
                return torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                    self._symm[:x.numel()].view_as(x), x, "sum", self._group_name, out)
        if self.staged:
            host = x.cpu()
            dist.all_reduce(host, group=self.device_group)
            return x.copy_(host)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[size * rows, cols]``: every rank's ``x`` ``[rows, cols]``, rank 0's first."""
        local = x.cpu().contiguous() if self.staged else x.contiguous()
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=local.device)
        _all_gather_single(out, local, group=self.device_group)
        return out.to(x.device) if self.staged else out

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (a device tensor)."""
        if self.staged:
            host = x.cpu()
            dist.broadcast(host, 0, group=self.device_group)
            return x.copy_(host)
        dist.broadcast(x, 0, group=self.device_group)
        return x

    # ---- control messages (host tensors, gloo) ------------------------------------

    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, 0, group=self.control_group)
        return x

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; for start-up, not for steps)."""
        box = [obj]
        dist.broadcast_object_list(box, 0, group=self.control_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control_group)

    def destroy(self) -> None:
        global _GROUP
        if _GROUP is self:
            _GROUP = None
        if dist.is_initialized():
            dist.destroy_process_group()


_GROUP: TensorParallelGroup | None = None


def init_tp_group(rank: int, size: int, port: int, device: torch.device, staged: bool = False,
                  symm_dtype: torch.dtype | None = None) -> TensorParallelGroup:
    """Joins the group (blocks until all ``size`` ranks have joined) and makes it
    this process's; ``staged``: see the module docstring; ``symm_dtype``: the
    symmetric-memory all-reduce's buffer (PAGEDCORE_TP_ALLREDUCE=symm_mem)."""
    global _GROUP
    _GROUP = TensorParallelGroup(rank, size, port, device, staged, symm_dtype)
    return _GROUP


def get_tp_group() -> TensorParallelGroup:
    if _GROUP is None:
        raise RuntimeError("internal error: a tensor-parallel layer ran outside a tensor-parallel group")
    return _GROUP
