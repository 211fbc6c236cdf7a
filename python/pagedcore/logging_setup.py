"""pagedcore's log format, one for the Python API (``LLM``) and the command line
(``pagedcore generate``, ``pagedcore serve``, uvicorn's own lines included)::

    INFO 16:41:07 pagedcore: # KV cache blocks: 1456
"""

from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("pagedcore")


def format_bytes(n: float) -> str:
    """A size for a log line: ``1.25 GiB`` from 1 GiB up, ``25.3 MiB`` below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_rate(n: float, seconds: float) -> str:
    """Bytes moved in ``seconds`` as a rate for a log line: ``310.5 MiB/s``."""
    return f"{format_bytes(n / max(seconds, 1e-9))}/s"


def make_formatter() -> logging.Formatter:
    return logging.Formatter(LOG_FORMAT, DATE_FORMAT)


def configure_default_logging() -> None:
    """The Python API's logging: like vLLM, show INFO start-up lines (# KV cache
    blocks ...) on stderr, unless the application set up logging itself (a
    handler on the root or the pagedcore logger) or PAGEDCORE_CONFIGURE_LOGGING=0."""
    if os.environ.get("PAGEDCORE_CONFIGURE_LOGGING", "1") == "0":
        return
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter())
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def configure_cli_logging(level: str) -> None:
    """The command line's logging: every logger (uvicorn's too) through one
    stderr handler on the root at ``level`` (one of LOG_LEVELS); the pagedcore
    logger at INFO or more verbose, so that the start-up lines the README shows
    (# KV cache blocks, the cache size, the weights loaded, "serving ... on")
    are there whatever ``level`` is (DEBUG adds the time of each start-up phase)."""
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    logger.setLevel(min(logging.INFO, root.level))
