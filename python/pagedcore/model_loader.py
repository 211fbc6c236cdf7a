"""Config, weights and dtype of a Hugging Face model directory.

pagedcore loads models from a local Hugging Face directory: ``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json`` checkpoint.
Pickled checkpoints (``*.bin``, ``*.pt``, ...) are refused, never unpickled:
loading a pickle runs arbitrary code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

# Checkpoint files that torch.load would unpickle; used only to explain a refusal.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_model_config(path: str) -> Any:
    """Read the ``transformers`` config of a local model directory.

    Parameters
    ----------
    path : str
        A local Hugging Face model directory (nothing is downloaded).

    Returns
    -------
    transformers.PretrainedConfig
        The config, as ``transformers.AutoConfig.from_pretrained(path)`` reads it
        (for a Llama checkpoint a ``LlamaConfig``).

    Raises
    ------
    ValueError
        If ``path`` does not exist or is not a directory, holds only pickled
        weights (``*.bin``, ``*.pt``, ...; named in the message, never loaded),
        has no ``config.json``, or its config cannot be read.

    Examples
    --------
    >>> from pagedcore.default_model import default_model_path
    >>> config = load_model_config(default_model_path())
    >>> config.model_type, config.num_hidden_layers
    ('llama', 30)
    """
    _check_model_dir(path)
    pickled = _pickled_only_files(path)
    if pickled:
        raise ValueError(_pickle_refusal(path, pickled))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"model path '{path}' has no config.json; expected a Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read config.json of model path '{path}': {e}") from e


def iter_safetensors(
    path: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a safetensors checkpoint.

    Reads ``model.safetensors``, or, when ``model.safetensors.index.json`` is
    present, every shard it names. Before the first tensor is yielded, a sharded
    checkpoint is checked whole: every shard of the index exists and holds the
    tensors the index assigns to it. Tensors are read one at a time with
    ``safetensors.safe_open`` (never ``torch.load``), so peak memory is one tensor
    beyond what the caller keeps.

    Parameters
    ----------
    path : str
        A local model directory, or the path of a single ``.safetensors`` file.
    dtype : torch.dtype, optional
        Convert floating-point tensors to this dtype (``torch.float32``,
        ``torch.bfloat16`` or ``torch.float16``); integer and bool tensors keep
        theirs. ``None`` keeps the stored dtype.
    device : str or torch.device, default "cpu"
        Device the tensors are created on.

    Yields
    ------
    name : str
        The checkpoint's tensor name, e.g. ``"model.layers.0.self_attn.q_proj.weight"``.
    tensor : torch.Tensor
        The tensor, shaped as stored (a Linear weight is ``[out_features, in_features]``).

    Raises
    ------
    ValueError
        If the path does not exist, holds no safetensors checkpoint (pickled files
        are named and refused), a shard named by the index is missing, a tensor
        named by the index is absent from its shard, or ``dtype`` is not one of
        the floating-point dtypes above.

    Examples
    --------
    >>> from pagedcore.default_model import default_model_path
    >>> weights = dict(iter_safetensors(default_model_path(), dtype=torch.bfloat16))
    >>> weights["model.embed_tokens.weight"].shape, weights["model.norm.weight"].dtype
    (torch.Size([49152, 576]), torch.bfloat16)
    """
    if dtype is not None and dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype!r} for iter_safetensors; expected one of "
            f"{', '.join(str(d) for d in _SUPPORTED_DTYPES)} or None"
        )
    # NOTE: validation runs eagerly, before the generator starts, so a broken
    # checkpoint fails at the call and never after part of a model was loaded.
    plan = _checkpoint_plan(path)
    return _iter_plan(plan, dtype, str(device) if isinstance(device, torch.device) else device)


def resolve_dtype(
    dtype: str | torch.dtype,
    config: Any,
    device: str | torch.device = "cpu",
) -> torch.dtype:
    """Turn a user's ``dtype`` setting into the torch dtype the model runs in.

    ``"auto"`` follows vLLM: on a GPU, a bfloat16 or float16 checkpoint keeps
    its dtype and a float32 (or unspecified) one runs in bfloat16 (float16 where
    the GPU has no bfloat16). On the CPU ``"auto"`` is always float32: the CPU
    attention ops compute in float32 and half-precision matmuls are slow there.
    An explicit dtype is honoured on any device.

    Parameters
    ----------
    dtype : str or torch.dtype
        ``"auto"``, ``"float32"``/``"fp32"``/``"float"``, ``"bfloat16"``/``"bf16"``,
        ``"float16"``/``"fp16"``/``"half"`` (any case), or ``torch.float32``,
        ``torch.bfloat16``, ``torch.float16``.
    config : transformers.PretrainedConfig
        The model's config; its ``dtype`` (``torch_dtype`` in older transformers)
        is read for ``"auto"``.
    device : str or torch.device, default "cpu"
        Where the model runs.

    Returns
    -------
    torch.dtype
        One of ``torch.float32``, ``torch.bfloat16``, ``torch.float16``.

    Raises
    ------
    ValueError
        If ``dtype`` is none of the above; the message names the value.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> resolve_dtype("auto", SimpleNamespace(dtype=torch.bfloat16), device="cpu")
    torch.float32
    >>> resolve_dtype("auto", SimpleNamespace(dtype=torch.bfloat16), device="cuda")
    torch.bfloat16
    >>> resolve_dtype("fp16", None)
    torch.float16
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(_dtype_error(dtype))
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(_dtype_error(dtype))
    key = dtype.strip().lower()
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    if key != "auto":
        raise ValueError(_dtype_error(dtype))

    if torch.device(device).type == "cpu":
        return torch.float32
    stored = _config_dtype(config)
    if stored in (torch.bfloat16, torch.float16):
        return stored
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


# --------------------------------------------------------------------------------------


def _check_model_dir(path: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"model path '{path}' does not exist")
    if not os.path.isdir(path):
        raise ValueError(
            f"model path '{path}' is not a directory; expected a Hugging Face model "
            "directory (config.json + *.safetensors)"
        )


def _pickled_only_files(path: str) -> list[str]:
    """Pickled checkpoint files in ``path`` when it holds no safetensors at all."""
    names = os.listdir(path)
    if any(name.endswith(".safetensors") for name in names) or SAFETENSORS_INDEX_FILE in names:
        return []
    return sorted(name for name in names if name.endswith(_PICKLE_SUFFIXES))


def _pickle_refusal(path: str, pickled: list[str]) -> str:
    return (
        f"model path '{path}' has only pickled weights ({', '.join(pickled)}); pagedcore "
        "loads only safetensors and never unpickles (that can run arbitrary code). "
        "Convert the checkpoint to safetensors, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)"
    )


def _checkpoint_plan(path: str) -> list[tuple[str, list[str] | None]]:
    """List (file, tensor names or None for all) to read, after validating them."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [(path, None)]
    _check_model_dir(path)
    index_path = os.path.join(path, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(index_path):
        return _sharded_plan(path, index_path)
    single = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return [(single, None)]
    pickled = _pickled_only_files(path)
    if pickled:
        raise ValueError(_pickle_refusal(path, pickled))
    raise ValueError(
        f"model path '{path}' has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}"
    )


def _sharded_plan(path: str, index_path: str) -> list[tuple[str, list[str] | None]]:
    from safetensors import safe_open

    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the 'weight_map' of '{index_path}': {e}") from e

    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    if not by_shard:
        raise ValueError(f"'{index_path}' lists no tensors")

    missing_shards = sorted(s for s in by_shard if not os.path.isfile(os.path.join(path, s)))
    if missing_shards:
        raise ValueError(
            f"sharded checkpoint '{path}' is incomplete: shard(s) "
            f"{', '.join(missing_shards)} named in {SAFETENSORS_INDEX_FILE} do not exist"
        )

    plan: list[tuple[str, list[str] | None]] = []
    for shard in sorted(by_shard):
        shard_path = os.path.join(path, shard)
        with safe_open(shard_path, framework="pt") as f:
            present = set(f.keys())
        absent = sorted(set(by_shard[shard]) - present)
        if absent:
            shown = ", ".join(f"'{n}'" for n in absent[:5])
            more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
            raise ValueError(
                f"sharded checkpoint '{path}' is inconsistent: {SAFETENSORS_INDEX_FILE} "
                f"places tensor(s) {shown}{more} in shard '{shard}', which lacks them"
            )
        plan.append((shard_path, sorted(by_shard[shard])))
    return plan


def _iter_plan(
    plan: list[tuple[str, list[str] | None]], dtype: torch.dtype | None, device: str | int
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file_path, names in plan:
        with safe_open(file_path, framework="pt", device=device) as f:
            for name in names if names is not None else f.keys():
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _dtype_error(dtype: Any) -> str:
    return (
        f"unsupported dtype {dtype!r}; expected 'auto', 'float32' ('fp32', 'float'), "
        "'bfloat16' ('bf16'), 'float16' ('fp16', 'half') or torch.float32, "
        "torch.bfloat16, torch.float16"
    )
