"""The C++ grammar worker (pagedcore._C.LlgWorker over llguidance's C API) against
llguidance's PyO3 LLMatcher, the engine's path (StructuredOutputManager's tokenizer and
grammar text), on SmolLM2's tokenizer: masks, verdicts and stops over seeded random
walks of 64 rows on 4 threads; bad input refused before any matcher moves; clean
create/clone/free cycles."""

from __future__ import annotations

import numpy as np
import pytest

llg = pytest.importorskip("llguidance")
transformers = pytest.importorskip("transformers")

from pagedcore import _C, default_model_path  # noqa: E402
from pagedcore.structured_outputs import (  # noqa: E402
    StructuredOutputManager, StructuredOutputsParams, _grammar_text, _llg_library_path)

VOCAB = 49152  # SmolLM2's config.json vocab_size
EOS = [2]
THREADS = 4
ROWS = 64
STEPS = 14
LIB_PATH = _llg_library_path(llg)

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 3, "items": {"type": "string", "maxLength": 8}},
                   "n": {"type": "integer"}},
    "required": ["items", "n"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputsParams(json=BOUNDED_SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[a-c]{1,3}-[0-9]{2,4}(x|yz)?"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not", "y"]),
}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    """The PyO3 way's manager (its LLMatchers are the reference), whatever the default."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDCORE_GRAMMAR_WORKER", "pyo3")
        return StructuredOutputManager(tokenizer, VOCAB, EOS)


@pytest.fixture(scope="module")
def worker(tokenizer, manager):
    lib = _C.LlgLibrary.open(LIB_PATH)
    # (the engine's llguidance tokenizer tokenizes forced strings, as in the PyO3 path)
    return _C.LlgWorker(lib, tokenizer.backend_tokenizer.to_str(), VOCAB, EOS, THREADS,
                        manager._tokenizer.tokenize_bytes)


def reference_mask(ll) -> np.ndarray:
    mask = np.zeros(VOCAB // 32, dtype=np.int32)
    ll.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return mask


def allowed(mask: np.ndarray) -> np.ndarray:
    bits = (mask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1))


def step(worker, handles, tokens, start: bool = False):
    """worker.step, or (start) worker.start_step then wait_step."""
    n = len(handles)
    masks = np.full((n, worker.num_words), -1, dtype=np.int32)
    status = np.full(n, 9, dtype=np.uint8)
    stopped = np.full(n, 9, dtype=np.uint8)
    flag = np.zeros(1, dtype=np.uint32)
    args = (np.asarray(handles, dtype=np.int64), np.asarray(tokens, dtype=np.int32), masks, status, stopped, flag, 77)
    if start:
        worker.start_step(*args)
        worker.wait_step()
        assert worker.step_done()
    else:
        worker.step(*args)
    assert flag[0] == 77
    return masks, status, stopped


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_walks_match_pyo3_matchers(worker, manager, kind) -> None:
    """64 rows (clones over 4 lanes) walk seeded random tokens: each step (step, and
    start_step + wait_step in turn) the worker's masks, verdicts and stops equal the
    PyO3 matchers' fed the same tokens. Every 5th row
    is fed a token its mask refuses at step 1 (verdict 1, then the EOS-only mask)."""
    spec = SPECS[kind]
    grammar = _grammar_text(spec.key)
    lanes = [worker.new_matcher("llguidance", grammar, lane) for lane in range(THREADS)]
    handles = [worker.clone_matcher(lanes[row % THREADS]) for row in range(ROWS)]
    refs = [manager.new_matcher(spec).ll for _ in range(ROWS)]
    rng = np.random.default_rng(sum(map(ord, kind)))
    tokens = [-1] * ROWS
    live = list(range(ROWS))
    compared = refused = stops = fed_refused = 0
    try:
        for t in range(STEPS):
            masks, status, stopped = step(worker, [handles[r] for r in live], [tokens[r] for r in live], t % 2 == 1)
            next_live = []
            for i, r in enumerate(live):
                ok = True if tokens[r] < 0 else refs[r].consume_token(tokens[r])
                assert status[i] == (0 if ok else 1), (kind, t, r, worker.error(handles[r]))
                np.testing.assert_array_equal(masks[i], reference_mask(refs[r]), err_msg=f"{kind} step {t} row {r}")
                assert bool(stopped[i]) == refs[r].is_stopped() == worker.is_stopped(handles[r])
                compared += 1
                if not ok:
                    refused += 1
                    assert "doesn't satisfy the grammar" in worker.error(handles[r])
                    continue
                if stopped[i]:
                    stops += 1
                    continue
                ids = allowed(masks[i])
                if t == 1 and r % 5 == 0:
                    tokens[r] = int(rng.choice(np.setdiff1d(np.arange(VOCAB), ids)))
                    fed_refused += 1
                else:
                    tokens[r] = int(rng.choice(ids))
                next_live.append(r)
            live = next_live
        assert refused == fed_refused > 0 and compared > 3 * ROWS, (refused, fed_refused, compared)
        if kind == "choice":
            assert stops > 0  # (the short choices complete within the walk)
    finally:
        for h in handles + lanes:
            worker.free_matcher(h)
    assert worker.num_matchers() == 0


def test_consume_then_masks_equal_one_step(worker, manager, tokenizer) -> None:
    """consume (tokens, verdicts, no masks) then a step with no tokens: the PyO3 matcher's
    verdicts and mask after the same tokens; a refused token reads 1."""
    spec = SPECS["regex"]
    a = worker.new_matcher("llguidance", _grammar_text(spec.key))
    b = worker.clone_matcher(a)
    ids = tokenizer.encode("ab-12", add_special_tokens=False)
    ref = manager.new_matcher(spec).ll
    status, stopped = np.full(2, 9, np.uint8), np.full(2, 9, np.uint8)
    for token in ids:
        worker.consume(np.array([a, b]), np.array([token, ids[0]], dtype=np.int32), status, stopped)
        assert ref.consume_token(token)
        assert status[0] == 0 and stopped[0] == ref.is_stopped()
        b_refused = status[1]
    assert b_refused == 1  # (b was fed "a"-tokens after "ab": refused by then)
    masks, status, stopped = step(worker, [a], [-1])
    np.testing.assert_array_equal(masks[0], reference_mask(ref))
    assert status[0] == 0
    worker.free_matcher(a)
    worker.free_matcher(b)


def test_grammar_error_is_reported_by_name(worker) -> None:
    before = worker.num_matchers()
    grammar = llg.LLMatcher.grammar_from_lark("start: item_undefined_rule")
    with pytest.raises(ValueError, match="item_undefined_rule"):
        worker.new_matcher("llguidance", grammar)
    with pytest.raises(ValueError, match="refused by llguidance"):
        worker.new_matcher("regex", "[a-")
    assert worker.num_matchers() == before


def test_bad_steps_leave_the_matchers_as_they_were(worker, manager, tokenizer) -> None:
    """Refused before any row moves: an unknown handle, a handle twice, a wrong dtype or
    shape. The matchers' state is then the same as never stepped (checked against a
    PyO3 matcher fed the same tokens)."""
    spec = SPECS["regex"]
    grammar = _grammar_text(spec.key)
    a = worker.new_matcher("llguidance", grammar)
    b = worker.clone_matcher(a)
    token = tokenizer.encode("b", add_special_tokens=False)[0]
    ok = (np.array([a, b]), np.array([token, token], dtype=np.int32))
    n, words = 2, worker.num_words
    out = lambda: (np.zeros((n, words), np.int32), np.zeros(n, np.uint8), np.zeros(n, np.uint8))  # noqa: E731
    with pytest.raises(ValueError, match="no live matcher has handle 999"):
        worker.step(np.array([a, 999]), ok[1], *out())
    with pytest.raises(ValueError, match=f"handle {a} appears twice"):
        worker.step(np.array([a, a]), ok[1], *out())
    with pytest.raises(TypeError, match="tokens must be of dtype int32"):
        worker.step(ok[0], ok[1].astype(np.int64), *out())
    with pytest.raises(ValueError, match=r"masks must have shape \(2,1536,\)"):
        worker.step(ok[0], ok[1], np.zeros((n, words - 1), np.int32), *out()[1:])
    with pytest.raises(ValueError, match="ready_flag must have shape"):
        worker.step(*ok, *out(), np.zeros(2, np.uint32), 1)
    masks, status, stopped = step(worker, [a, b], [token, token])
    ref = manager.new_matcher(spec).ll
    assert ref.consume_token(token)
    assert list(status) == [0, 0]
    np.testing.assert_array_equal(masks[0], reference_mask(ref))
    np.testing.assert_array_equal(masks[1], reference_mask(ref))
    worker.free_matcher(a)
    worker.free_matcher(b)
    with pytest.raises(ValueError, match=f"no live matcher has handle {a}"):
        worker.free_matcher(a)


def test_create_clone_free_cycles_are_clean(worker) -> None:
    """A few hundred cycles: every matcher freed, the handles reused (no growth)."""
    grammar = _grammar_text(SPECS["choice"].key)
    base = worker.num_matchers()
    seen = set()
    for _ in range(300):
        template = worker.new_matcher("llguidance", grammar)
        clone = worker.clone_matcher(template)
        seen.update((template, clone))
        worker.free_matcher(template)
        worker.free_matcher(clone)
    assert worker.num_matchers() == base
    assert len(seen) == 2  # (freed handles are handed out again)


def test_library_lacking_a_symbol_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lacks the symbol llg_new_tokenizer_v2"):
        _C.LlgLibrary.open("libm.so.6")
    with pytest.raises(ValueError, match="cannot load the llguidance library /nonexistent/x.so"):
        _C.LlgLibrary.open("/nonexistent/x.so")


def test_matcher_calls_wait_for_the_step_in_flight(worker, manager) -> None:
    """Freeing a step's matchers right after start_step waits for the step: the masks
    are complete and equal the PyO3 matchers' (no matcher freed under the threads)."""
    spec = SPECS["json"]
    lane = worker.new_matcher("llguidance", _grammar_text(spec.key))
    handles = np.array([worker.clone_matcher(lane) for _ in range(ROWS)], dtype=np.int64)
    masks = np.full((ROWS, worker.num_words), -1, dtype=np.int32)
    status, stopped = np.full(ROWS, 9, np.uint8), np.full(ROWS, 9, np.uint8)
    flag = np.zeros(1, dtype=np.int32)
    worker.start_step(handles, np.full(ROWS, -1, np.int32), masks, status, stopped, flag, 5)
    for h in handles:
        worker.free_matcher(int(h))
    worker.free_matcher(lane)
    assert flag[0] == 5 and worker.step_done()
    expected = reference_mask(manager.new_matcher(spec).ll)
    np.testing.assert_array_equal(masks, np.broadcast_to(expected, masks.shape))
    assert not status.any() and not stopped.any()


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 0}, "vocab_size must be positive, got 0"),
    ({"eos_token_ids": [VOCAB]}, f"eos_token_ids holds {VOCAB}, outside the vocabulary"),
    ({"eos_token_ids": []}, "eos_token_ids must not be empty"),
    ({"num_threads": 0}, r"num_threads must be in \[1, 256\], got 0"),
    ({"tokenizer_json": "{"}, "llguidance refused the tokenizer"),
])
def test_worker_arguments_are_checked_by_name(change, message) -> None:
    kwargs = {"lib": _C.LlgLibrary.open(LIB_PATH), "tokenizer_json": "{}", "vocab_size": VOCAB,
              "eos_token_ids": EOS, "num_threads": 1, **change}
    with pytest.raises(ValueError, match=message):
        _C.LlgWorker(**kwargs)


def test_tokenize_must_be_callable() -> None:
    with pytest.raises(TypeError, match="tokenize must be callable"):
        _C.LlgWorker(_C.LlgLibrary.open(LIB_PATH), "{}", VOCAB, EOS, 1, 42)
