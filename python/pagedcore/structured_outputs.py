"""Structured outputs (vLLM's ``StructuredOutputsParams``) on llguidance.

A request constrained by a JSON schema, a regex, a list of choices or a
grammar gets, per sampled sequence, an ``llguidance.LLMatcher``: before each
sampling step the matcher's token bitmask (one bit per vocabulary entry, 1 =
allowed) marks what may come next, the sampler sets the other logits to -inf
(:func:`pagedcore.sampler.apply_token_bitmask`), and the sampled token
advances the matcher. When the grammar is complete and admits nothing more
(``is_stopped``) the sequence finishes with ``stop``; if ``max_tokens`` ends it
first, it finishes with ``length``.

llguidance was picked over xgrammar for its footprint on CPU installs: one
3 MB wheel with no dependencies, where xgrammar requires torch (unpinned),
triton and apache-tvm-ffi. It is imported only when a request uses
structured outputs.

Each spec compiles once: the compiled matcher is kept in an LRU keyed by the
spec, and every sequence starts from a ``deep_copy`` of it.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: How many compiled grammars :class:`StructuredOutputManager` keeps.
GRAMMAR_CACHE_SIZE = 128
#: From this many rows on, a step's masks are computed on llguidance's thread pool.
EXECUTOR_MIN_ROWS = 4
#: Threads of that pool: an integer, 0 for none (every mask on the engine's thread).
#: Unset: llguidance's default (80% of the CPUs, up to 32) on hosts of 4 CPUs or more,
#: none on fewer, where the pool's threads only compete with the engine's (measured
#: on 2 loaded cores, 64 rows: 2.4 ms a step on the engine's thread, 8.7 ms on the pool).
MASK_THREADS_ENV = "PAGEDCORE_MASK_THREADS"

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("structured_outputs needs the llguidance package "
                         "(pip install llguidance==1.9.1)") from e
    return llguidance


@dataclass(kw_only=True, slots=True)
class StructuredOutputsParams:
    """Constrains a request's output, as vLLM's ``StructuredOutputsParams``.

    Exactly one of:

    json : dict or str
        A JSON schema (a dict, or its JSON text); the output is a JSON value
        that validates against it.
    regex : str
        The output fully matches this regular expression (Rust ``regex`` syntax).
    choice : list of str
        The output is one of these strings.
    grammar : str
        A Lark grammar, or a GBNF (llama.cpp) grammar.
    json_object : bool
        True: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).

    and optionally

    disable_any_whitespace : bool
        JSON only: no whitespace between tokens of the JSON value (compact
        separators). By default any whitespace is allowed, as in vLLM; a model
        that has not learnt the format may then fill its output with it.

    Raises ValueError naming the field for an invalid schema, regex or grammar,
    or when none or several are given.

    >>> StructuredOutputsParams(regex="[0-9]+").kind
    'regex'
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(parsed).__name__}")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        elif self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        error = _validate(self.key)
        if error:
            raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
        if self.disable_any_whitespace and kind not in ("json", "json_object"):
            raise ValueError(f"structured_outputs.disable_any_whitespace applies to json and json_object only, "
                             f"not to {kind}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """Hashable: (kind, text); equal specs (same key order) give equal keys."""
        kind = self.kind
        if kind in ("json", "json_object"):
            if kind == "json_object":
                value = '{"type": "object"}'
            else:
                value = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json_compact" if self.disable_any_whitespace else "json",
                    json.dumps(json.loads(value)))  # (key order kept: it orders the output)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)


def _grammar_text(key: tuple[str, str]) -> str:
    """The llguidance grammar for a spec key."""
    llg = _llguidance()
    kind, text = key
    if kind in ("json", "json_compact"):
        return llg.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": kind == "json"})
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # Each choice a JSON string literal, which Lark's string syntax reads.
        alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    from llguidance.gbnf_to_lark import any_to_lark  # Lark passes through unchanged

    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - the converter raises assorted errors for bad input
        raise ValueError(f"structured_outputs.grammar is invalid: {e}") from None
    return llg.LLMatcher.grammar_from_lark(lark)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _validate(key: tuple[str, str]) -> str:
    """'' for a valid spec, else llguidance's error (cached: the server validates every request)."""
    try:
        grammar = _grammar_text(key)
    except ValueError as e:
        return str(e)
    return _llguidance().LLMatcher.validate_grammar(grammar, None)


def _mask_threads() -> int | None:
    """The mask pool's threads from ``$PAGEDCORE_MASK_THREADS`` (see MASK_THREADS_ENV)."""
    raw = os.environ.get(MASK_THREADS_ENV)
    if raw is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return None if cpus >= 4 else 0
    try:
        threads = int(raw)
    except ValueError:
        threads = -1
    if threads < 0:
        raise ValueError(f"${MASK_THREADS_ENV} must be a non-negative integer (threads), got {raw!r}")
    return threads


class StructuredOutputManager:
    """Compiles specs against the model's tokenizer (cached) and hands out matchers.

    Parameters
    ----------
    tokenizer
        A fast Hugging Face tokenizer (its ``backend_tokenizer`` is what llguidance reads).
    vocab_size : int
        The model's vocabulary (logits columns); may exceed the tokenizer's.
    eos_token_ids : list of int
        Tokens that end a sequence; the grammar allows them once it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        llg = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured_outputs needs a fast (Rust) Hugging Face tokenizer")
        self.vocab_size = vocab_size
        self._llg = llg
        self._tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._executor: Any = None  # llguidance's thread pool, for batches of masks
        self._mask_threads = _mask_threads()  # (None: llguidance's default, 0: no pool)
        self.num_words = (vocab_size + 31) // 32

    def new_matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for ``spec``; raises ValueError naming the field if it does not compile."""
        key = spec.key
        template = self._compiled.get(key)
        if template is None:
            template = self._llg.LLMatcher(self._tokenizer, _grammar_text(key), log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{spec.kind} is invalid: {template.get_error().strip()}")
            self._compiled[key] = template
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def fill_bitmask(self, matchers: list[Any], out: torch.Tensor) -> None:
        """Computes the matchers' masks into ``out``: ``[len(matchers), ceil(V / 32)]``
        int32, contiguous, on the host. Bit ``t % 32`` of word ``t // 32`` of row
        ``i`` is set iff ``matchers[i]`` allows token ``t`` next."""
        import torch

        if out.dtype != torch.int32 or not out.is_contiguous() or out.device.type != "cpu" \
                or tuple(out.shape) != (len(matchers), self.num_words):
            raise RuntimeError(f"internal error: a bitmask buffer must be contiguous int32 "
                             f"[{len(matchers)}, {self.num_words}] on the host, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        nbytes, base = self.num_words * 4, out.data_ptr()
        if self._mask_threads == 0 or len(matchers) < EXECUTOR_MIN_ROWS:
            for row, matcher in enumerate(matchers):
                matcher.unsafe_compute_mask_ptr(base + row * nbytes, nbytes)
            return
        # Larger batches: llguidance computes the rows on its own threads (without the GIL).
        if self._executor is None:
            self._executor = self._llg.LLExecutor(self._mask_threads)
        self._executor.unsafe_compute_mask_ptr([(m, row) for row, m in enumerate(matchers)],
                                               base, nbytes, len(matchers))


class BitmaskStaging:
    """A step's grammar bitmasks on their way to the sampler's device.

    The masks are computed straight into preallocated host buffers (pinned on
    CUDA) that also hold the rows, so that one asynchronous copy takes both to
    the device; no allocation, no pinning per step. On the CPU the sampler
    reads the buffer where it is.

    Parameters
    ----------
    num_words : int
        Words per mask (``ceil(V / 32)``).
    device : torch.device
        Where the sampler runs.
    """

    #: Buffers used in turn: a buffer is written again only once the copy queued
    #: from it has run (each has its event), so three keep the host from ever
    #: waiting on a copy that a step in flight still has queued.
    DEPTH = 3

    def __init__(self, num_words: int, device: torch.device) -> None:
        import torch

        self.num_words = num_words
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * self.DEPTH
        self._events = [torch.cuda.Event() for _ in range(self.DEPTH)] if self._cuda else []
        self._recorded = [False] * self.DEPTH
        self._next = 0

    def stage(self, rows: list[int], fill: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Puts ``rows`` and their masks (written by ``fill(masks)`` into a host
        ``[len(rows), num_words]`` int32 view) on the device.

        Returns ``(rows, masks)`` on the device: ``[B]`` int64, ``[B, num_words]``
        int32 (on the CPU ``masks`` is a view of the buffer: valid until the
        buffer's turn comes again, ``DEPTH`` calls later).
        """
        import torch

        n, words = len(rows), self.num_words
        i, self._next = self._next, (self._next + 1) % self.DEPTH
        if self._recorded[i]:
            # NOTE: the copy queued from this buffer DEPTH calls ago must have read
            # it before the host overwrites it; it has (the host waited for that
            # step's sampled ids since), so this returns at once.
            self._events[i].synchronize()
            self._recorded[i] = False
        size = n * (words + 1)
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < size:  # grown rarely (more constrained rows), then reused
            buffer = self._buffers[i] = torch.empty(max(size, 2 * (0 if buffer is None else buffer.numel())),
                                                    dtype=torch.int32, pin_memory=self._cuda)
        host = buffer[:size]
        host[:n] = torch.as_tensor(rows, dtype=torch.int32)
        masks = host[n:].view(n, words)
        fill(masks)
        if not self._cuda:
            return host[:n].long(), masks
        staged = host.to(self.device, non_blocking=True)
        self._events[i].record()
        self._recorded[i] = True
        return staged[:n].long(), staged[n:].view(n, words)
