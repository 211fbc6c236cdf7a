"""Reads a rank's slices of a safetensors checkpoint (never the whole tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model_loader import _checkpoint_plan
from ..models.parallel import TensorParallelShard


def iter_safetensors_shard(path: str, dtype: torch.dtype | None, shard: TensorParallelShard,
                           device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` as :func:`pagedcore.model_loader.iter_safetensors`
    does, each tensor cut to what rank ``shard.rank`` holds
    (:meth:`TensorParallelShard.weight_slice`), read with safetensors'
    ``get_slice`` so that only those bytes are read. The vocabulary rows of the
    last rank are zero-padded to ``shard.vocab_rows``; a row-parallel bias is
    whole on rank 0 and zeros on the others."""
    from safetensors import safe_open

    plan = _checkpoint_plan(path)  # (validates the checkpoint before the first tensor)
    for file_path, names in plan:
        with safe_open(file_path, framework="pt", device=device) as f:
            for name in names if names is not None else f.keys():
                view = f.get_slice(name)
                shape = tuple(view.get_shape())
                short = name[len("model."):] if name.startswith("model.") else name
                how = shard.weight_slice(short, shape)
                if how is None:
                    tensor = view[:]
                elif how == "rank0":
                    tensor = view[:]
                    if shard.rank != 0:
                        tensor = torch.zeros_like(tensor)
                else:
                    dim, start, stop = how
                    tensor = view[start:stop] if dim == 0 else view[:, start:stop]
                    if dim == 0 and short in ("embed_tokens.weight", "lm_head.weight") \
                            and tensor.shape[0] < shard.vocab_rows:
                        pad = torch.zeros((shard.vocab_rows - tensor.shape[0],) + tuple(tensor.shape[1:]),
                                          dtype=tensor.dtype, device=tensor.device)
                        tensor = torch.cat([tensor, pad])
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
