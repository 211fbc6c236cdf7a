"""Config, weights and dtype of a Hugging Face model directory.

pagedcore loads models from a local Hugging Face directory: ``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json`` checkpoint.
Pickled checkpoints (``*.bin``, ``*.pt``, ...) are refused, never unpickled:
loading a pickle runs arbitrary code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .logging_setup import format_bytes, format_rate
from .model_path import hf_hub_cache_dir, resolve_model_path

logger = logging.getLogger("pagedcore")

__all__ = [
    "build_uninitialized", "checkpoint_size", "hf_hub_cache_dir", "iter_safetensors", "kv_scale_name",
    "load_config_json",
    "load_model_config", "load_tokenizer", "load_tokenizer_in_background", "resolve_dtype",
    "resolve_model_path", "with_load_progress",
]

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


def load_config_json(path: str) -> dict[str, Any]:
    """Read ``config.json`` of a local model directory as a plain dict.

    The fast path of start-up: no transformers import (its config machinery takes
    seconds). :func:`pagedcore.models.model_spec_from_config` and
    :func:`resolve_dtype` take the dict's :func:`~pagedcore.models.spec.config_from_json`
    view, which gives what ``transformers.AutoConfig`` gives for the supported
    architectures.

    Raises
    ------
    ValueError
        As :func:`load_model_config`, and when ``config.json`` is not a JSON object.

    Examples
    --------
    >>> from pagedcore.default_model import default_model_path
    >>> load_config_json(default_model_path())["num_hidden_layers"]
    30
    """
    _check_model_dir(path)
    pickled = _pickled_only_files(path)
    if pickled:
        raise ValueError(_pickle_refusal(path, pickled))
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"model path '{path}' has no config.json; expected a Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read config.json of model path '{path}': {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"config.json of model path '{path}' is not a JSON object")
    return raw


def load_tokenizer(path: str) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path)``, without its AutoConfig.

    AutoTokenizer reads the model's config only for its ``model_type``, name and
    ``tokenizer_class``; building it through AutoConfig imports transformers'
    config machinery (2 s on two cores). When ``tokenizer_config.json`` names its
    tokenizer class and neither file asks for remote code (``auto_map``), the
    config passed in is a bare ``PreTrainedConfig`` carrying those fields of
    ``config.json``; otherwise AutoTokenizer runs unchanged.
    """
    from transformers import AutoTokenizer

    config = _tokenizer_config_stand_in(path)
    if config is None:
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, config=config)


def _tokenizer_config_stand_in(path: str) -> Any:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_config = json.load(f)
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(model_config, dict) or not isinstance(tokenizer_config, dict)
            or not model_config.get("model_type") or not tokenizer_config.get("tokenizer_class")
            or "auto_map" in model_config or "auto_map" in tokenizer_config):
        return None
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig()
    config.model_type = model_config["model_type"]
    config._name_or_path = path  # what AutoConfig.from_pretrained(path) records
    for key in ("model_name", "tokenizer_class"):
        if key in model_config:
            setattr(config, key, model_config[key])
    return config


class _Background:
    """Runs ``fn()`` in a thread; :meth:`result` joins it and returns its value or
    raises its exception."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def load_tokenizer_in_background(path: str) -> _Background:
    """Start :func:`load_tokenizer` in a thread (it is mostly Python: JSON and
    imports, while loading weights is mostly torch copies that release the GIL,
    so the two overlap); ``.result()`` returns the tokenizer."""
    return _Background(lambda: load_tokenizer(path), name="pagedcore-tokenizer")


# torch.nn.init's in-place initialisers, which modules' reset_parameters call.
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)


@contextlib.contextmanager
def _uninitialized_parameters(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    # NOTE: while this is active, in the constructing thread only, every parameter
    # a module registers is replaced by an uninitialised torch.empty of its shape
    # in `dtype` on `device`, and torch.nn.init's initialisers leave tensors
    # untouched; buffers (the rotary inv_freq, any cos/sin table) are computed
    # for real as the model's __init__ says. Not the meta device: the first
    # normal_ on a meta tensor imports torch._dynamo (3 s).
    register = nn.Module.register_parameter
    originals = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    owner = threading.get_ident()

    def empty_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and threading.get_ident() == owner:
            kind = dtype if param.is_floating_point() else param.dtype
            param = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                 requires_grad=param.requires_grad)
        register(module, name, param)

    def skipped(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return tensor if threading.get_ident() == owner else original(tensor, *args, **kwargs)
        return init

    nn.Module.register_parameter = empty_parameter  # type: ignore[method-assign]
    for name, original in originals.items():
        setattr(nn.init, name, skipped(original))
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, original in originals.items():
            setattr(nn.init, name, original)


# fp8 KV-cache scale tensors of quantized checkpoints, as vLLM reads them
# (weight_utils.maybe_remap_kv_scale_name and the quantization configs'
# get_cache_scale), named after the layer's "model." prefix is dropped:
#   layers.N.self_attn.k_scale / v_scale          llm-compressor, vLLM's own
#   layers.N.self_attn.kv_scale                   older AutoFP8: one scale for K and V
#   layers.N.self_attn.k_proj.k_scale / v_proj.v_scale        NVIDIA ModelOpt
#   layers.N.self_attn.k_proj.output_scale / v_proj...        compressed-tensors, Quark
# Query and softmax scales of fp8 attention (q_scale, q_proj.output_scale,
# prob_output_scale) are recognised and not used: the queries stay unquantized.
_KV_SCALE_NAMES = (
    re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv|q|prob)_scale"),
    re.compile(r"layers\.(\d+)\.self_attn\.(k)_proj\.k_scale"),
    re.compile(r"layers\.(\d+)\.self_attn\.(v)_proj\.v_scale"),
    re.compile(r"layers\.(\d+)\.self_attn\.(k|v|q)_proj\.output_scale"),
    re.compile(r"layers\.(\d+)\.self_attn\.(prob)_output_scale"),
)


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """``(layer, which)`` when ``name`` (a checkpoint tensor name without its
    ``model.`` prefix) is an fp8 KV-cache scale, else None. ``which`` is ``"k"``,
    ``"v"``, ``"kv"`` (one scale for both) or ``"unused"`` (a query or softmax
    scale).

    Examples
    --------
    >>> kv_scale_name("layers.3.self_attn.k_proj.output_scale")
    (3, 'k')
    >>> kv_scale_name("layers.0.self_attn.kv_scale")
    (0, 'kv')
    >>> kv_scale_name("layers.0.self_attn.k_proj.weight") is None
    True
    """
    for pattern in _KV_SCALE_NAMES:
        match = pattern.fullmatch(name)
        if match:
            which = match.group(2)
            return int(match.group(1)), which if which in ("k", "v", "kv") else "unused"
    return None


def build_uninitialized(
    factory: Callable[[], nn.Module], dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """Build a model whose parameters are allocated but not initialised.

    Every parameter that ``factory()`` registers is allocated with ``torch.empty``
    in ``dtype`` (floating ones) on ``device``, and ``torch.nn.init``'s
    initialisers do nothing meanwhile: drawing the random initial weights of a
    135M model that loading overwrites anyway costs a second on two cores.
    Buffers are computed by ``factory`` as usual, then moved (and cast, floating
    ones) as ``Module.to(device, dtype)`` does.

    The caller must fill every parameter: :meth:`CausalLM.load_weights` raises
    when the checkpoint misses one, :meth:`CausalLM.init_dummy_weights` draws them all.

    Examples
    --------
    >>> model = build_uninitialized(lambda: CausalLM(spec), torch.bfloat16, "cpu")   # doctest: +SKIP
    >>> model.load_weights(iter_safetensors(path, dtype=torch.bfloat16))             # doctest: +SKIP
    """
    device = torch.device(device)
    with _uninitialized_parameters(dtype, device):
        model = factory()
    return model.to(device=device, dtype=dtype)


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
        theirs, and so do fp8 KV-cache scales (:func:`kv_scale_name`). ``None``
        keeps the stored dtype.
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


def checkpoint_size(path: str) -> tuple[int, int]:
    """(bytes of the safetensors files, number of tensors) of a local model
    directory; (0, 0) where it cannot tell (iter_safetensors explains why)."""
    from safetensors import safe_open

    index_path = os.path.join(path, SAFETENSORS_INDEX_FILE)
    try:
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = {os.path.join(path, s) for s in weight_map.values()}
            return sum(os.path.getsize(f) for f in files), len(weight_map)
        single = os.path.join(path, SAFETENSORS_FILE)
        with safe_open(single, framework="pt") as f:  # reads the header only
            count = len(f.keys())
        return os.path.getsize(single), count
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, 0


# Checkpoints at least this large show a progress bar while they load.
PROGRESS_BAR_BYTES = 1 << 30


def with_load_progress(
    weights: Iterator[tuple[str, torch.Tensor]], path: str, desc: str = "Loading weights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` (those of the checkpoint at ``path``) through, showing
    progress: a tqdm bar over its tensors when the checkpoint has
    :data:`PROGRESS_BAR_BYTES` or more, and, at the end, an INFO line with the
    bytes loaded, the time and the rate."""
    nbytes, count = checkpoint_size(path)
    bar = None
    if nbytes >= PROGRESS_BAR_BYTES and count:
        from tqdm import tqdm

        bar = tqdm(total=count, desc=desc, unit="tensor", dynamic_ncols=True)
    start, done = time.perf_counter(), 0
    try:
        for name, tensor in weights:
            yield name, tensor
            done += tensor.numel() * tensor.element_size()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - start
    logger.info("loaded %s of weights in %.2f s (%s)", format_bytes(done), elapsed, format_rate(done, elapsed))


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
                # (fp8 KV-cache scales keep their precision: they are read as floats.)
                if (dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype
                        and kv_scale_name(name.removeprefix("model.")) is None):
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
