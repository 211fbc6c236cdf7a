"""Kernels the model code calls: paged attention and the KV-cache operations.

A layer's KV cache is two tensors ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot
``slot = block * block_size + offset`` of a sequence lives at
``cache[slot // block_size, slot % block_size]``. The kernels run in the C++ core
(``pagedcore._C``, no libtorch): these wrappers check dtype, device, shapes and
strides, raise ``TypeError`` / ``ValueError`` before any work is done, and pass
``tensor.data_ptr()`` with sizes and strides. Checks that need to look at every
index (slot ids, block ids, sequence lengths) run in C++ and raise
:class:`pagedcore.InvalidArgumentError` (a ``ValueError``) naming the field and
value; a call that raises has written nothing.

CPU tensors run the C++ kernels of the core, on a pool of threads it owns
(:func:`set_num_threads`); CUDA tensors run the CUDA kernels (``cuda/``) on the
current stream, asynchronously. Index ranges of CUDA inputs are checked (each
check costs a device synchronisation) except inside :func:`unchecked_indices`,
which the model runner uses: its indices come from the engine. The kernels
never dereference an index out of range either way.

The decoder layer's elementwise work runs in fused kernels too (:mod:`.layer`):
RMSNorm (plain, per head, fused with the residual add), rotary embedding from a
cos/sin table, SiLU-and-multiply. On the CPU the float32 products of decode steps
(a few rows against every weight matrix) run in a C++ kernel too (:mod:`.matmul`).

Modules by kernel family: :mod:`.attention` (paged attention), :mod:`.planning`
(its CUDA work split), :mod:`.cache` (cache write, block copy, swap),
:mod:`.layer` (the fused layer ops), :mod:`.matmul` (the CPU's float32 products
of decode steps), :mod:`.cpu` (thread pool and instruction set
of the CPU kernels) and :mod:`._checks` (argument checks shared by all wrappers).
"""

from __future__ import annotations

from ._checks import unchecked_indices
from .attention import SUPPORTED_HEAD_DIMS, paged_attention
from .cache import copy_blocks, reshape_and_cache, swap_blocks, swap_in, swap_out
from .cpu import cpu_isa, get_num_threads, set_cpu_isa, set_num_threads
from .layer import cos_sin_cache, fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from .linear_cuda import CUDA_LINEAR_MAX_ROWS, CUDA_LINEAR_MODEL_ROWS, cuda_linear_eligible
from .matmul import LINEAR_MAX_ROWS, linear, linear_silu_and_mul
from .planning import AttentionPlan, plan_attention, plan_decode

__all__ = [
    "CUDA_LINEAR_MAX_ROWS",
    "CUDA_LINEAR_MODEL_ROWS",
    "LINEAR_MAX_ROWS",
    "SUPPORTED_HEAD_DIMS",
    "AttentionPlan",
    "copy_blocks",
    "cos_sin_cache",
    "cpu_isa",
    "cuda_linear_eligible",
    "fused_add_rms_norm",
    "get_num_threads",
    "linear",
    "linear_silu_and_mul",
    "paged_attention",
    "plan_attention",
    "plan_decode",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "unchecked_indices",
    "swap_in",
    "swap_out",
    "set_cpu_isa",
    "set_num_threads",
    "swap_blocks",
]
