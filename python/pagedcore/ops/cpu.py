"""Settings of the CPU kernels: their thread pool and instruction set."""

from __future__ import annotations

import numbers
import operator

from .. import _C


def set_num_threads(n: int) -> None:
    """Set the number of threads of the CPU kernels (the calling thread included).

    The default is ``std::thread::hardware_concurrency()``. Independent of
    ``torch.set_num_threads``: on a small machine give the two together no more threads
    than cores.

    Parameters
    ----------
    n : int
        ``>= 1``.

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.set_num_threads(2)
    >>> ops.get_num_threads()
    2
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    _C.cpu_set_num_threads(n)


def get_num_threads() -> int:
    """Number of threads the CPU kernels use (see :func:`set_num_threads`).

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.get_num_threads() >= 1
    True
    """
    return _C.cpu_get_num_threads()


def cpu_isa() -> str:
    """Instruction set the attention kernel runs with: ``"avx512"``, ``"avx2"`` or
    ``"generic"`` (the best the CPU supports, unless :func:`set_cpu_isa` chose another).

    Examples
    --------
    >>> from pagedcore import ops
    >>> ops.cpu_isa() in ("avx512", "avx2", "generic")
    True
    """
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> None:
    """Select the attention kernel's instruction set (for tests and benchmarks).

    Parameters
    ----------
    isa : str
        ``"avx512"``, ``"avx2"`` or ``"generic"``; raises ``ValueError`` when unknown or
        not supported by this CPU.

    Examples
    --------
    >>> from pagedcore import ops
    >>> best = ops.cpu_isa()
    >>> ops.set_cpu_isa("generic")
    >>> ops.set_cpu_isa(best)
    """
    _C.cpu_set_isa(isa)
