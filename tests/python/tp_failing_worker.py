"""Tensor-parallel workers that fail at start-up, for test_tensor_parallel.py (a
spawned process imports this module: it must stay light)."""

from __future__ import annotations

import os
from typing import Any


def fail_at_rendezvous(launch: Any, rank: int, conn: Any, wake: Any = None) -> None:
    """Says hello, then dies before it joins the group, as a worker whose
    process-group set-up fails would."""
    conn.send(("hello",))
    conn.send(("error", "RuntimeError: injected failure before the rendezvous"))
    os._exit(3)
