"""Structured outputs' CUDA kernels (``cuda/bitmask_kernels.cu``): a step's grammar
bitmasks applied to the logits in one pass, and the stream's wait for masks that the
host is still computing.

The sampler applies bitmasks on the CPU with numpy (:func:`pagedcore.sampler.apply_token_bitmask`);
these wrappers take CUDA tensors only.
"""

from __future__ import annotations

import torch

from .. import _C
from ._checks import _CUDA_DTYPES, _contiguous, _dim, _index, _stream, _tensor

__all__ = ["apply_token_bitmask_", "wait_host_flag"]


def _cuda(op: str, name: str, t: object) -> torch.Tensor:
    _tensor(op, name, t)
    if t.device.type != "cuda":
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
    return t


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                         status: torch.Tensor | None = None) -> torch.Tensor:
    """Sets ``logits[rows[i], t] = -inf`` in place for every token ``t`` whose bit (bit
    ``t % 32`` of word ``t // 32`` of ``bitmask[i]``) is 0; tokens past the bitmask's
    ``32 * W`` are blocked too. One kernel, on the current stream.

    Parameters
    ----------
    logits : torch.Tensor
        ``[S, V]`` CUDA, float32 / bfloat16 / float16, unit column stride.
    bitmask : torch.Tensor
        ``[B, W]`` int32, contiguous, on the logits' device.
    rows : torch.Tensor, optional
        ``[B]`` int32 or int64, distinct rows of ``logits`` (out of range: skipped).
        None: row ``i`` for mask ``i`` (then ``B <= S``).
    status : torch.Tensor, optional
        ``[1]`` int32 on the device (see :func:`wait_host_flag`): when nonzero
        the rows are set to NaN instead, so that nothing can be sampled from them.

    Returns
    -------
    torch.Tensor
        ``logits``.

    Examples
    --------
    >>> logits = torch.zeros(2, 3, device="cuda")  # doctest: +SKIP
    >>> apply_token_bitmask_(logits, torch.tensor([[0b101]], dtype=torch.int32, device="cuda"),
    ...                      torch.tensor([1], device="cuda"))[1].tolist()  # doctest: +SKIP
    [0.0, -inf, 0.0]
    """
    op = "apply_token_bitmask_"
    _cuda(op, "logits", logits)
    _cuda(op, "bitmask", bitmask)
    dtype = _CUDA_DTYPES.get(logits.dtype)
    if dtype is None or logits.dtype == torch.float8_e4m3fn:
        raise TypeError(f"{op}: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    _dim(op, "logits", logits, 2, "[num_rows, vocab]")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"{op}: logits must have unit column stride, got strides {logits.stride()}")
    _dim(op, "bitmask", bitmask, 2, "[num_masks, num_words]")
    _index(op, "bitmask", bitmask, (torch.int32,))
    _contiguous(op, "bitmask", bitmask)
    num_masks = bitmask.shape[0]
    devices = [bitmask.device]
    rows_ptr, rows_int64 = 0, False
    if rows is None:
        if num_masks > logits.shape[0]:
            raise ValueError(f"{op}: {num_masks} masks without rows need as many logits rows, got {logits.shape[0]}")
    else:
        _cuda(op, "rows", rows)
        _index(op, "rows", rows, (torch.int32, torch.int64))
        if rows.shape != (num_masks,):
            raise ValueError(f"{op}: rows must be [num_masks] = [{num_masks}], got shape {tuple(rows.shape)}")
        _contiguous(op, "rows", rows)
        rows_ptr, rows_int64 = rows.data_ptr(), rows.dtype == torch.int64
        devices.append(rows.device)
    status_ptr = 0
    if status is not None:
        _cuda(op, "status", status)
        _index(op, "status", status, (torch.int32,))
        if status.numel() != 1:
            raise ValueError(f"{op}: status must hold one int32, got shape {tuple(status.shape)}")
        status_ptr = status.data_ptr()
        devices.append(status.device)
    if any(d != logits.device for d in devices):
        raise ValueError(f"{op}: every tensor must be on {logits.device}, got {[str(d) for d in devices]}")
    if num_masks > 65535:
        raise ValueError(f"{op}: at most 65535 masks per call, got {num_masks}")
    _C.cuda_apply_token_bitmask(
        logits.data_ptr(), bitmask.data_ptr(), rows_ptr, rows_int64, status_ptr, num_masks, logits.shape[0],
        logits.shape[1], bitmask.shape[1], logits.stride(0), dtype, _stream(logits.device))
    return logits


def wait_host_flag(flag: torch.Tensor, ticket: int, status: torch.Tensor, timeout_s: float) -> None:
    """Holds ``status``'s device's current stream until the host writes ``ticket`` (or a
    later one, as a 32-bit counter) into ``flag``: what is queued behind it runs once
    the host is done with what the ticket stands for, though the host queued it first.
    ``status`` is set to 0 then, or to 1 if ``timeout_s`` passed first (the stream
    goes on either way: nothing waits for ever).

    NOTE: a host thread that synchronizes with that stream before it writes the
    flag waits for the timeout; write it from a thread that does not wait.

    Parameters
    ----------
    flag : torch.Tensor
        ``[1]`` int32 in pinned host memory; the host writes it as a uint32.
    ticket : int
        ``0 <= ticket < 2**32``.
    status : torch.Tensor
        ``[1]`` int32 on the CUDA device.
    timeout_s : float
        Seconds, > 0.
    """
    op = "wait_host_flag"
    _tensor(op, "flag", flag)
    if flag.device.type != "cpu" or not flag.is_pinned() or flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"{op}: flag must be one int32 in pinned host memory, got {flag.dtype} "
                         f"{tuple(flag.shape)} on {flag.device} (pinned: {flag.is_pinned()})")
    _cuda(op, "status", status)
    if status.dtype != torch.int32 or status.numel() != 1:
        raise ValueError(f"{op}: status must hold one int32, got {status.dtype} {tuple(status.shape)}")
    if isinstance(ticket, bool) or not isinstance(ticket, int) or not 0 <= ticket < 2**32:
        raise ValueError(f"{op}: ticket must be an int in [0, 2**32), got {ticket!r}")
    if not timeout_s > 0:
        raise ValueError(f"{op}: timeout_s must be > 0, got {timeout_s!r}")
    _C.cuda_wait_host_flag(flag.data_ptr(), ticket, int(timeout_s * 1e9), status.data_ptr(),
                           _stream(status.device))
