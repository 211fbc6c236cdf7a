"""Faults injected into a real engine, for the server tests (test_server_api.py).

A spawned engine process (``pagedcore serve --engine-process``) imports this
module to build its faulty engine: it must stay light (no pytest, no server).

NOTE: no real failure of the engine can be triggered on demand, so it is
injected at the model's output, and everything after it is the real path: NaN
logits are what a numerical blow-up gives, and the sampler, the failed-step
handling of LLMEngine, the engine loop and the server react to them as they
would in production.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class FaultInjector:
    """Wraps a model runner's ``execute``: once armed, the forward pass after
    ``healthy`` more good ones fails the way the test asks."""

    def __init__(self, runner) -> None:
        self._execute = runner.execute
        self._healthy: int | None = None
        self._fault = None
        runner.execute = self

    def arm(self, healthy: int, fault: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._healthy, self._fault = healthy, fault

    def __call__(self, batch, *args, **kwargs) -> torch.Tensor:
        # (with async scheduling the engine also passes the previous step's sampled ids)
        logits = self._execute(batch, *args, **kwargs)
        if self._healthy is None:
            return logits
        if self._healthy > 0:
            self._healthy -= 1
            return logits
        fault, self._healthy, self._fault = self._fault, None, None
        return fault(logits)


def nan_logits(logits: torch.Tensor) -> torch.Tensor:
    return torch.full_like(logits, float("nan"))


class EngineThreadKilled(BaseException):
    """Not an Exception: what no handler of the engine loop catches."""


def kill_thread(logits: torch.Tensor) -> torch.Tensor:
    raise EngineThreadKilled("injected")


def stall(logits: torch.Tensor) -> torch.Tensor:
    """The engine loop hangs in this step (until its process is killed)."""
    time.sleep(3600)
    return logits


@dataclass(frozen=True)
class FaultyEngine:
    """An ``engine_factory`` for :class:`pagedcore.server.engine_process.EngineProcess`:
    the real LLMEngine of the engine args, armed at once with ``fault`` (a
    function of this module) after ``healthy`` good forward passes."""

    healthy: int
    fault: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, engine_args):
        from pagedcore.llm_engine import LLMEngine

        engine = LLMEngine(engine_args)
        FaultInjector(engine.runner).arm(self.healthy, self.fault)
        return engine
