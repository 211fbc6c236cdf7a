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

Each spec compiles once per lane (one per thread of the mask pool): the
compiled matchers are kept in an LRU keyed by the spec, and every sequence
starts from a ``deep_copy`` of one of them (see StructuredOutputManager for why
one is not enough). A step's masks are computed on the pool in the background,
as soon as the matchers have the previous step's tokens, while the engine's
thread finishes the outputs and queues the sampler; on CUDA the sampler's work
is queued behind a device-side wait for the masks (see BitmaskStaging), so that
the engine's thread waits for them only once the sampler is queued, if at all.
Or in line, on the pool from the engine's thread, when that costs the engine's
thread less: each way is timed over a few steps, and the cheaper one stays (see
StructuredOutputManager._choose_mask_way).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: How many compiled grammars :class:`StructuredOutputManager` keeps.
GRAMMAR_CACHE_SIZE = 128
#: Threads of the pool that computes a step's masks in the background: an integer, 0
#: for none (every mask on the engine's thread, before the sampler). Unset: llguidance's
#: default (80% of the CPUs, up to 32) on hosts of 4 CPUs or more, none on fewer, where
#: the pool's threads only compete with the engine's (measured on 2 loaded cores, 64
#: rows: 2.4 ms a step on the engine's thread, 8.7 ms on the pool before lanes; with
#: lanes, handing a step over to threads that wait for a core still costs ~2 ms there).
MASK_THREADS_ENV = "PAGEDCORE_MASK_THREADS"
#: From this many rows on, a step's tokens may be fed to the matchers on the pool (see
#: StructuredOutputManager.consume), which tries both ways over its first CONSUME_TRIALS calls.
CONSUME_POOL_MIN_ROWS = 16
CONSUME_TRIALS = 16
#: With a pool, a step's masks are computed either in the background (the engine's
#: thread hands them to the mask thread and joins them later) or in line (the engine's
#: thread calls the pool and waits): whichever costs the engine's thread less per row,
#: measured over MASK_TRIALS steps taking turns (see StructuredOutputManager._choose_mask_way);
#: the trials run again every MASK_TRIAL_PERIOD steps (the grammars' states change); each
#: power-of-two bucket of batch sizes has its own trials and choice.
MASK_TRIALS = 16
MASK_TRIAL_PERIOD = 1024
#: "0": on CUDA, the host waits for a step's masks before it queues the sampler,
#: instead of queuing it behind a device-side wait for them (see BitmaskStaging).
DEVICE_WAIT_ENV = "PAGEDCORE_MASK_DEVICE_WAIT"
#: "cpp": the grammar work goes through the C++ worker (pagedcore._C.LlgWorker over
#: llguidance's C API: a step's masks computed without the GIL, the ready flag stored
#: from C++); "pyo3": llguidance's PyO3 matchers; unset: the C++ worker where
#: llguidance's wheel has its shared library, else PyO3 (see grammar_worker_way). Read
#: when a StructuredOutputManager is made.
GRAMMAR_WORKER_ENV = "PAGEDCORE_GRAMMAR_WORKER"

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


def _mask_threads() -> int:
    """The mask pool's threads from ``$PAGEDCORE_MASK_THREADS`` (see MASK_THREADS_ENV),
    as a count (0: no pool)."""
    raw = os.environ.get(MASK_THREADS_ENV)
    if raw is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # (llguidance's own default for its pool: 80% of the CPUs, up to 32)
        return min(max(cpus * 8 // 10, 1), 32) if cpus >= 4 else 0
    try:
        threads = int(raw)
    except ValueError:
        threads = -1
    if threads < 0:
        raise ValueError(f"${MASK_THREADS_ENV} must be a non-negative integer (threads), got {raw!r}")
    return threads


def grammar_worker_way() -> str:
    """``$PAGEDCORE_GRAMMAR_WORKER`` (see GRAMMAR_WORKER_ENV): "cpp" or "pyo3"; unset,
    "cpp" where llguidance's shared library is there (_llg_library_path), else "pyo3".

    Why the C++ worker is the default (H200, 16-core host, 64 requests x 256 tokens, one
    call each way, ``bench_structured.py``): the PyO3 way's mask thread waits for the GIL
    to store the device's ready flag, so the device waits for masks that were done; the
    Llama-3-8B shape with its own tokenizer, strings of at most 8 characters: 0.919 of
    the unconstrained throughput with the worker, 0.875-0.880 without (bench/RESULTS.md).
    """
    raw = os.environ.get(GRAMMAR_WORKER_ENV)
    if raw is None:
        return "cpp" if os.path.exists(_llg_library_path(_llguidance())) else "pyo3"
    if raw not in ("cpp", "pyo3"):
        raise ValueError(f"${GRAMMAR_WORKER_ENV} must be cpp or pyo3, got {raw!r}")
    return raw


def _llg_library_path(llg: Any) -> str:
    """llguidance's shared library (its C API, which the C++ worker loads), in its wheel."""
    return os.path.join(os.path.dirname(llg.__file__), "_lib.abi3.so")


def device_wait_enabled() -> bool:
    """Whether ``$PAGEDCORE_MASK_DEVICE_WAIT`` leaves the device-side wait on (the default)."""
    raw = os.environ.get(DEVICE_WAIT_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"${DEVICE_WAIT_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


@dataclass(slots=True, eq=False)
class GrammarMatcher:
    """One sequence's llguidance matcher and the lane (compiled copy of its grammar) it
    was copied from: matchers of one lane share that copy's lexer, behind one lock."""

    ll: Any
    lane: int


@dataclass(slots=True, eq=False)
class WorkerMatcher:
    """One sequence's matcher in the C++ worker (``PAGEDCORE_GRAMMAR_WORKER=cpp``): its
    handle, its lane, and the verdict of the last token fed to it (consume)."""

    handle: int
    lane: int
    stopped: bool = False
    error: str | None = None


class _Lanes:
    """The compiled copies of one spec's grammar (see StructuredOutputManager)."""

    __slots__ = ("grammar", "templates", "handed_out")

    def __init__(self, grammar: str, template: Any) -> None:
        self.grammar = grammar
        self.templates = [template]
        self.handed_out = 0


class MaskJob:
    """A step's grammar bitmasks being computed (see StructuredOutputManager.start_masks)."""

    __slots__ = ("_started", "_done", "_error", "_release", "compute_seconds", "background", "host_seconds",
                 "__weakref__")

    def __init__(self, release: Callable[[], None] | None, background: bool = False) -> None:
        self._started = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._release = release
        #: Wall time of the computation (of llguidance's call), for benchmarks.
        self.compute_seconds = 0.0
        #: Whether the masks are computed on the mask thread (else on the caller's, in line).
        self.background = background
        #: The caller's time in start_masks and in wait() for this job: what the job cost
        #: the engine's thread (the manager compares the two ways by it).
        self.host_seconds = 0.0

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Returns True once every mask is in the buffer (and the release has run),
        False if ``timeout`` seconds passed first; raises RuntimeError if the
        computation failed. While it waits, this thread lets the mask thread have the
        GIL, which it needs to finish."""
        if not self._done.is_set():
            t0 = time.perf_counter()
            done = self._done.wait(timeout)
            self.host_seconds += time.perf_counter() - t0
            if not done:
                return False
        if self._error is not None:
            raise RuntimeError(f"computing the grammar bitmasks failed: {self._error!r}") from self._error
        return True

    def _run(self, compute: Callable[[], None]) -> None:
        try:
            self._started.set()
            t0 = time.perf_counter()
            compute()
            self.compute_seconds = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e
        finally:
            try:
                if self._release is not None:
                    self._release()
            except BaseException as e:  # noqa: BLE001
                self._error = self._error or e
            finally:
                self._done.set()


class WorkerMaskJob:
    """A step's masks being computed by the C++ worker (LlgWorker.start_step): done()
    and wait() as MaskJob's, over step_done() / wait_step(). The worker stores the
    ready flag itself (no release to run).

    NOTE: a row whose mask fails (a matcher in error: its sequence's token was refused,
    and the sequence is being aborted) gets a mask of the end-of-sequence tokens only,
    as the PyO3 matcher's; the job does not fail for it.
    """

    __slots__ = ("_worker", "compute_seconds", "background", "host_seconds", "__weakref__")

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        #: (not measured apart: the worker's step runs on its own thread)
        self.compute_seconds = 0.0
        self.background = True
        self.host_seconds = 0.0

    def done(self) -> bool:
        return self._worker.step_done()

    def wait(self, timeout: float | None = None) -> bool:
        """As MaskJob.wait."""
        t0 = time.perf_counter()
        if timeout is None:
            self._worker.wait_step()
        else:
            deadline = t0 + timeout
            while not self._worker.step_done():
                if time.perf_counter() >= deadline:
                    self.host_seconds += time.perf_counter() - t0
                    return False
                time.sleep(0)  # (a yield of the GIL; the worker's thread needs it only to tokenize)
        self.host_seconds += time.perf_counter() - t0
        return True


def _mask_worker(jobs: queue.SimpleQueue) -> None:
    """The thread that computes a step's masks behind the engine's back."""
    while True:
        item = jobs.get()
        if item is None:
            return
        job, compute = item
        job._run(compute)
        del job, compute, item  # (nothing kept alive between jobs)


class _MaskWay:
    """The mask ways' trials and choice for one bucket of batch sizes (see
    StructuredOutputManager._choose_mask_way)."""

    __slots__ = ("trials", "background", "jobs_until_trials", "medians")

    def __init__(self) -> None:
        #: Engine-thread seconds per row of each way's trial jobs (None once chosen).
        self.trials: dict[bool, list[float]] | None = {True: [], False: []}
        self.background = True
        self.jobs_until_trials = 0
        #: The last trials' medians, seconds per row (background, in line); None before.
        self.medians: tuple[float, float] | None = None

    def next(self) -> bool:
        if self.trials is None:
            if self.jobs_until_trials > 0:
                self.jobs_until_trials -= 1
                return self.background
            self.trials = {True: [], False: []}
        return len(self.trials[True]) <= len(self.trials[False])

    def record(self, background: bool, seconds_per_row: float) -> None:
        trials = self.trials
        if trials is None:
            return
        trials[background].append(seconds_per_row)
        if min(len(trials[True]), len(trials[False])) >= MASK_TRIALS // 2:
            self.medians = (statistics.median(trials[True]), statistics.median(trials[False]))
            self.background = self.medians[0] <= self.medians[1]
            self.trials = None
            self.jobs_until_trials = MASK_TRIAL_PERIOD


class StructuredOutputManager:
    """Compiles specs against the model's tokenizer (cached) and hands out matchers;
    computes a step's masks on a pool of threads, in the background or in line (the
    engine's thread waiting on the pool), whichever the trials of ``_choose_mask_way``
    measured cheaper for the engine's thread.

    NOTE: llguidance's matchers copied from one compiled grammar (``deep_copy``) share
    its lexer behind a lock, which a mask's computation holds throughout: masks of one
    compiled grammar cannot be computed in parallel (measured: two threads over 16
    masks inside a bounded string, 10.8 ms wall for 10.8 ms of CPU time, as on one
    thread). So each spec is compiled once per pool thread (its lanes, ~0.5 ms each,
    compiled as matchers are handed out), matchers are handed out over the lanes in
    turn, and a step's rows go to the pool grouped by lane.

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
        worker_way = grammar_worker_way()  # (a bad value refused before anything is built)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured_outputs needs a fast (Rust) Hugging Face tokenizer")
        self.vocab_size = vocab_size
        self._llg = llg
        self._tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[tuple[str, str], _Lanes] = OrderedDict()
        #: Threads of the mask pool (0: none, masks on the caller's thread).
        self.mask_threads = _mask_threads()
        #: Compiled copies per spec: one per pool thread.
        self.num_lanes = max(self.mask_threads, 1)
        self._executor: Any = None  # llguidance's thread pool, built on first use
        self._jobs: queue.SimpleQueue | None = None  # the background thread's queue
        # consume(): per-token times of each way while they take turns (None once chosen)
        self._consume_trials: dict[bool, list[float]] | None = {True: [], False: []}
        self._consume_on_pool = False
        #: The mask ways' trials and choices, per batch size (a power-of-two bucket of
        #: constrained rows: rows.bit_length()).
        self.mask_ways: dict[int, _MaskWay] = {}
        # start_masks(): the last job with a pool and its rows (its cost is read once it
        # was waited for: at the next call)
        self._last_job: tuple[MaskJob, int] | None = None
        self.num_words = (vocab_size + 31) // 32
        #: The C++ grammar worker ($PAGEDCORE_GRAMMAR_WORKER=cpp; see GRAMMAR_WORKER_ENV),
        #: else None: llguidance's PyO3 matchers. With it, the lanes' templates and the
        #: matchers are the worker's handles.
        self.worker: Any = None
        # Handles whose sequences are done, freed at the next consume / start_masks:
        # the worker frees a matcher only once no step is in flight, which this thread
        # would otherwise wait for in the middle of a step's processing.
        self._to_free: list[int] = []
        if worker_way == "cpp":
            from . import _C

            lib_path = _llg_library_path(llg)
            if not os.path.exists(lib_path):
                raise ValueError(f"${GRAMMAR_WORKER_ENV}=cpp needs llguidance's shared library, "
                                 f"not found at {lib_path}")
            self.worker = _C.LlgWorker(_C.LlgLibrary.open(lib_path), backend.to_str(), vocab_size,
                                       list(eos_token_ids), self.num_lanes, self._tokenizer.tokenize_bytes)

    @property
    def background(self) -> bool:
        """Whether start_masks may return before the masks are computed (with a pool:
        see _choose_mask_way; with the C++ worker, always)."""
        return self.mask_threads > 0 or self.worker is not None

    def _choose_mask_way(self, rows: int) -> bool:
        """Whether the next job (of ``rows`` masks) runs in the background. Per bucket of
        batch sizes (rows from 2**k to 2**(k+1) - 1), the two ways take turns over
        MASK_TRIALS jobs (background first), then the one that cost the engine's thread
        less per row (median) stays for MASK_TRIAL_PERIOD jobs of that bucket, then
        they take turns again.

        NOTE: in the background the engine's thread pays the hand-over, the copy's wait
        and the join (a mask thread needs the GIL to start and to finish, which the
        engine's thread holds while it runs Python): roughly fixed per step, hence the
        buckets; in line it pays the computation on the pool. Cheap masks (outside
        strings) favour in line, expensive ones (inside bounded strings, ~0.5 ms each)
        the background, where the engine's thread queues the sampler meanwhile; which
        holds depends on the grammars, the batch and the host.
        """
        last, self._last_job = self._last_job, None
        if last is not None and last[0].done():
            job, job_rows = last
            self.mask_ways[job_rows.bit_length()].record(job.background, job.host_seconds / job_rows)
        way = self.mask_ways.get(rows.bit_length())
        if way is None:
            way = self.mask_ways[rows.bit_length()] = _MaskWay()
        return way.next()

    def new_matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``spec``; raises ValueError naming the field if it does not compile."""
        key = spec.key
        lanes = self._compiled.get(key)
        if lanes is None:
            grammar = _grammar_text(key)
            lanes = _Lanes(grammar, self._compile(grammar, spec))
            self._compiled[key] = lanes
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                _, evicted = self._compiled.popitem(last=False)
                if self.worker is not None:
                    self._to_free += evicted.templates
        else:
            self._compiled.move_to_end(key)
        lane = lanes.handed_out % self.num_lanes
        lanes.handed_out += 1
        if lane == len(lanes.templates):
            lanes.templates.append(self._compile(lanes.grammar, spec, lane))
        if self.worker is not None:
            return WorkerMatcher(self.worker.clone_matcher(lanes.templates[lane]), lane)
        return GrammarMatcher(lanes.templates[lane].deep_copy(), lane)

    def free(self, matcher: GrammarMatcher | WorkerMatcher) -> None:
        """Lets a done sequence's matcher go (its handle with the C++ worker: freed at the
        next consume or start_masks; a PyO3 matcher goes with its last reference)."""
        if self.worker is not None and matcher.handle >= 0:
            self._to_free.append(matcher.handle)
            matcher.handle = -1

    def _free_pending(self) -> None:
        to_free, self._to_free = self._to_free, []
        for handle in to_free:
            self.worker.free_matcher(handle)

    def live_matchers(self) -> int:
        """With the C++ worker: its matchers not yet freed, templates aside (for leak
        checks; frees the pending ones first, waiting for a step in flight)."""
        if self.worker is None:
            raise RuntimeError("live_matchers needs the C++ grammar worker")
        self._free_pending()
        return self.worker.num_matchers() - sum(len(lanes.templates) for lanes in self._compiled.values())

    def _compile(self, grammar: str, spec: StructuredOutputsParams, lane: int = 0) -> Any:
        if self.worker is not None:
            try:
                return self.worker.new_matcher("llguidance", grammar, lane)
            except ValueError as e:
                raise ValueError(f"structured_outputs.{spec.kind} is invalid: {str(e).strip()}") from None
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {template.get_error().strip()}")
        return template

    def consume(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """Feeds ``tokens[i]`` to ``matchers[i]``; returns whether each was accepted.

        From CONSUME_POOL_MIN_ROWS rows on, with a pool, the tokens go one by one or on
        the pool, whichever proves faster per token on this host: the two take turns
        over the first CONSUME_TRIALS such calls, then the faster one (by median) stays.
        A token costs ~3 us on one thread outside strings; waking the pool's threads
        costs tens of us on an idle host and milliseconds on a loaded one (measured on 2
        loaded cores: 64 tokens 0.39 ms one by one, 0.48-3.7 ms on a pool of 2).
        With the C++ worker the tokens go to it in one call (on its threads), which also
        records each matcher's verdict in it (``stopped``, ``error``).
        """
        if self.worker is not None:
            return self._consume_worker(matchers, tokens)
        if self.mask_threads == 0 or len(matchers) < CONSUME_POOL_MIN_ROWS:
            return [m.ll.consume_token(t) for m, t in zip(matchers, tokens)]
        trials = self._consume_trials
        on_pool = self._consume_on_pool if trials is None else len(trials[True]) < len(trials[False])
        t0 = time.perf_counter()
        if on_pool:
            order = sorted(range(len(matchers)), key=lambda i: matchers[i].lane)  # (see start_masks)
            accepted = self._pool().consume_token_par([(matchers[i].ll, tokens[i]) for i in order])
            out = [False] * len(matchers)
            for i, ok in zip(order, accepted):
                out[i] = ok
        else:
            out = [m.ll.consume_token(t) for m, t in zip(matchers, tokens)]
        if trials is not None:
            trials[on_pool].append((time.perf_counter() - t0) / len(matchers))
            if min(len(trials[True]), len(trials[False])) >= CONSUME_TRIALS // 2:
                self._consume_on_pool = statistics.median(trials[True]) < statistics.median(trials[False])
                self._consume_trials = None
        return out

    def _consume_worker(self, matchers: list[WorkerMatcher], tokens: list[int]) -> list[bool]:
        import numpy as np

        self._free_pending()
        n = len(matchers)
        status = np.zeros(n, dtype=np.uint8)
        stopped = np.zeros(n, dtype=np.uint8)
        self.worker.consume(np.fromiter((m.handle for m in matchers), dtype=np.int64, count=n),
                            np.asarray(tokens, dtype=np.int32), status, stopped)
        out = (status == 0).tolist()
        for m, ok, done in zip(matchers, out, stopped.tolist()):
            m.stopped = bool(done)
            m.error = None if ok else self.worker.error(m.handle)
        return out

    def start_masks(self, matchers: list[GrammarMatcher], out: torch.Tensor,
                    release: Callable[[], None] | None = None,
                    ready: tuple[Any, int] | None = None) -> MaskJob | WorkerMaskJob:
        """Starts computing the matchers' masks into ``out``: ``[len(matchers),
        ceil(V / 32)]`` int32, contiguous, on the host. Bit ``t % 32`` of word ``t // 32``
        of row ``i`` is set iff ``matchers[i]`` allows token ``t`` next.

        With a pool (``background``) the masks are computed on it, behind the caller's
        back or in line, whichever costs the caller less (``job.background`` says
        which; see _choose_mask_way): until the job's ``wait()`` returns, ``out`` may
        be being written and the matchers must not be used (llguidance refuses a
        matcher in use elsewhere). ``release`` runs once every mask is written (or the
        computation failed), before ``wait()`` returns. Without a pool the masks are
        computed on the caller's thread before this returns.

        With the C++ worker the masks are computed on its threads (LlgWorker.start_step),
        which store ``ready`` (a 1-word uint32 numpy array and the value to store in it,
        BitmaskStaging.ready) once every mask is written, in place of ``release``.
        """
        import torch

        if out.dtype != torch.int32 or not out.is_contiguous() or out.device.type != "cpu" \
                or tuple(out.shape) != (len(matchers), self.num_words):
            raise RuntimeError(f"internal error: a bitmask buffer must be contiguous int32 "
                               f"[{len(matchers)}, {self.num_words}] on the host, got {out.dtype} "
                               f"{tuple(out.shape)} on {out.device}")
        t0 = time.perf_counter()
        if self.worker is not None and matchers:
            return self._start_worker_masks(matchers, out, release, ready, t0)
        nbytes, base = self.num_words * 4, out.data_ptr()
        if not matchers:
            job = MaskJob(release)
            job._run(lambda: None)
        elif self.mask_threads == 0:
            job = MaskJob(release)
            lls = [m.ll for m in matchers]
            job._run(lambda: [m.unsafe_compute_mask_ptr(base + row * nbytes, nbytes) for row, m in enumerate(lls)])
        else:
            job = MaskJob(release, background=self._choose_mask_way(len(matchers)))
            self._last_job = (job, len(matchers))
            # NOTE: rows grouped by lane: the pool splits the list into contiguous runs,
            # so that its threads mostly take different lanes (different locks).
            pairs = [(matchers[row].ll, row) for row in sorted(range(len(matchers)), key=lambda i: matchers[i].lane)]
            executor, rows = self._pool(), len(matchers)
            if not job.background:
                job._run(lambda: executor.unsafe_compute_mask_ptr(pairs, base, nbytes, rows))
                job.host_seconds += time.perf_counter() - t0
                return job
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_mask_worker, args=(self._jobs,), name="pagedcore-masks",
                                 daemon=True).start()
                weakref.finalize(self, self._jobs.put, None)  # (the thread ends with the manager)
            self._jobs.put((job, lambda: executor.unsafe_compute_mask_ptr(pairs, base, nbytes, rows)))
            # NOTE: wait until the thread has the job in hand: it needs the GIL to start
            # the computation, which this thread, running Python, would otherwise hold
            # for up to sys.getswitchinterval() (5 ms) at a time.
            job._started.wait()
            job.host_seconds += time.perf_counter() - t0
        return job

    def _start_worker_masks(self, matchers: list[WorkerMatcher], out: torch.Tensor,
                            release: Callable[[], None] | None, ready: tuple[Any, int] | None,
                            t0: float) -> WorkerMaskJob:
        import numpy as np

        self._free_pending()
        n = len(matchers)
        handles = np.fromiter((m.handle for m in matchers), dtype=np.int64, count=n)
        status = np.zeros(n, dtype=np.uint8)
        flag, value = ready if ready is not None else (None, 0)
        # (tokens -1: consume fed this step's tokens already)
        self.worker.start_step(handles, np.full(n, -1, dtype=np.int32), out.numpy(), status,
                               np.zeros(n, dtype=np.uint8), flag, value)
        job = WorkerMaskJob(self.worker)
        job.host_seconds += time.perf_counter() - t0
        if release is not None and ready is None:  # (a release in Python: once the masks are in)
            job.wait()
            release()
        return job

    def fill_bitmask(self, matchers: list[GrammarMatcher], out: torch.Tensor) -> None:
        """start_masks, waited for."""
        self.start_masks(matchers, out).wait()

    def _pool(self) -> Any:
        if self._executor is None:
            self._executor = self._llg.LLExecutor(self.mask_threads)
        return self._executor


class BitmaskStaging:
    """A step's grammar bitmasks on their way to the sampler's device.

    The masks are computed straight into preallocated host buffers (pinned on
    CUDA) that also hold the rows, so that one asynchronous copy takes both to
    the device; no allocation, no pinning per step. On the CPU the sampler
    reads the buffer where it is.

    With ``device_wait`` (CUDA, masks computed in the background) the copy and
    the sampler are queued before the masks are done: the stream first waits
    (:func:`pagedcore.ops.bitmask.wait_host_flag`) for the step's ticket, which
    the mask job writes into a pinned flag once every mask is in the buffer. The
    host then never waits for the masks before it launches the sampler.

    Parameters
    ----------
    num_words : int
        Words per mask (``ceil(V / 32)``).
    device : torch.device
        Where the sampler runs.
    device_wait : bool
        See above (CUDA only).
    """

    #: Buffers used in turn: a buffer is written again only once the copy queued
    #: from it has run (each has its event), so three keep the host from ever
    #: waiting on a copy that a step in flight still has queued.
    DEPTH = 3
    #: Seconds the device waits for a step's masks before it gives up on them (the
    #: step's constrained rows then sample nothing, and the step fails).
    WAIT_TIMEOUT_S = 10.0

    def __init__(self, num_words: int, device: torch.device, device_wait: bool = False) -> None:
        import numpy as np
        import torch

        self.num_words = num_words
        self.device = device
        self._cuda = device.type == "cuda"
        self.device_wait = device_wait and self._cuda
        self._buffers: list[torch.Tensor | None] = [None] * self.DEPTH
        self._events = [torch.cuda.Event() for _ in range(self.DEPTH)] if self._cuda else []
        self._recorded = [False] * self.DEPTH
        self._next = 0
        self._staged: tuple[torch.Tensor, int, int] | None = None  # (host buffer, rows, ticket)
        self._ticket = 0
        #: With ``device_wait``, after begin: (the pinned flag's word, the step's ticket),
        #: for a mask job that stores the ticket itself (the C++ worker); else None.
        self.ready: tuple[Any, int] | None = None
        if self.device_wait:
            self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._flag_word = self._flag.numpy().view(np.uint32)
            self._status = torch.zeros(1, dtype=torch.int32, device=device)

    def begin(self, rows: list[int]) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Writes ``rows`` into the next host buffer; returns its ``[len(rows),
        num_words]`` int32 view for the masks, and (with ``device_wait``) what the
        mask job must call once they are in it."""
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
        release = None
        if self.device_wait:
            self._ticket = (self._ticket + 1) % 2**32
            ticket, word = self._ticket, self._flag_word
            release = lambda: word.__setitem__(0, ticket)  # noqa: E731 - (a plain 4-byte store)
            self.ready = (word, ticket)
        self._staged = (host, i, self._ticket)
        return host[n:].view(n, words), release

    def finish(self, job: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The staged rows and masks on the device: ``[B]`` rows (int64 on the CPU,
        int32 on CUDA), ``[B, num_words]`` int32 masks, and the device wait's status
        (None without it). Waits for ``job`` first, unless the device waits for it
        (then the stream does, if the job is not done yet: see the class).

        On the CPU ``masks`` is a view of the buffer: valid until the buffer's turn
        comes again, ``DEPTH`` calls later.
        """
        from .ops import bitmask as bitmask_ops

        if self._staged is None:
            raise RuntimeError("internal error: BitmaskStaging.finish without begin")
        (host, i, ticket), self._staged = self._staged, None
        n = host.numel() // (self.num_words + 1)
        # NOTE: masks already in (computed in line, or a background job done by now)
        # need no device-side wait: it would cost the host a launch and its checks.
        device_wait = self.device_wait and not job.done()
        if not device_wait:
            job.wait()
        if not self._cuda:
            return host[:n].long(), host[n:].view(n, self.num_words), None
        status = None
        if device_wait:
            t0 = time.perf_counter()
            bitmask_ops.wait_host_flag(self._flag, ticket, self._status, self.WAIT_TIMEOUT_S)
            job.host_seconds += time.perf_counter() - t0  # (the background way's cost too)
            status = self._status
        staged = host.to(self.device, non_blocking=True)
        self._events[i].record()
        self._recorded[i] = True
        return staged[:n], staged[n:].view(n, self.num_words), status
