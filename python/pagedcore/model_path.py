"""Where a model named by the user lives: a local directory, or a hub id's
snapshot in the local Hugging Face cache. Imports neither torch nor
transformers, so that the command line can refuse a bad --model at once."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("pagedcore")

# A Hugging Face hub id: "name" or "owner/name" (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def hf_hub_cache_dir() -> str:
    """The Hugging Face hub cache as ``huggingface_hub`` finds it: ``$HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub`` (read from the environment at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        home = os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model_path(model: str, revision: str = "main") -> str:
    """A local directory for ``model``: the path itself, or a hub id's snapshot in
    the local Hugging Face cache.

    pagedcore never downloads. A ``model`` that exists on disk is returned as
    given. Otherwise, when it looks like a hub id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``),
    the snapshot that the cache's ``refs/<revision>`` names is returned (as vLLM
    and transformers find it offline): ``<cache>/models--OWNER--NAME/snapshots/<commit>``,
    where ``<cache>`` is :func:`hf_hub_cache_dir`.

    Raises
    ------
    ValueError
        If ``model`` is neither an existing path nor a hub id whose snapshot (with
        a ``config.json``) is in the cache; the message says that only local
        directories and cached hub ids work, and where the cache was looked for.

    Examples
    --------
    >>> resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")   # doctest: +SKIP
    '/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12fd25f7...'
    """
    if os.path.exists(model):
        return model
    cache = hf_hub_cache_dir()
    if _HUB_ID.fullmatch(model) and not model.startswith((".", "~")):
        snapshot = _cached_snapshot(cache, model, revision)
        if snapshot is not None:
            logger.info("model %s: the local Hugging Face cache's snapshot %s", model, snapshot)
            return snapshot
        why = f"is not a local directory, and hub id '{model}' is not in the local Hugging Face cache ({cache})"
    else:
        why = "does not exist"
    raise ValueError(
        f"model path '{model}' {why}; pagedcore loads local directories and hub ids already in "
        f"the Hugging Face cache (HF_HUB_CACHE / HF_HOME), it never downloads: fetch the model "
        f"first (e.g. `hf download {model}`) or pass its directory"
    )


def _cached_snapshot(cache: str, repo_id: str, revision: str) -> str | None:
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commit = revision
    ref = os.path.join(repo_dir, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    return snapshot if os.path.isfile(os.path.join(snapshot, "config.json")) else None
