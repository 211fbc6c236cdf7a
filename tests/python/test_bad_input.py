"""Every bad input raises the right Python exception, names the field and the
value, and leaves the engine exactly as it was: same stats, same sequences,
invariants hold, and the engine still completes every request normally."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pagedcore
import pytest

VOCAB = 1000


def params(**kw) -> pagedcore.RequestParams:
    return pagedcore.RequestParams(**kw)


def toks(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


@dataclass
class State:
    engine: pagedcore.Engine
    live_requests: set[str]
    next_seq_id: int
    batch: pagedcore.StepBatch | None  # the pending step's batch, if any


def make_state(pending: bool = False, policy: str = "fcfs") -> State:
    """An engine with a decoding request 'a' (seq 0), a half-prefilled n=2
    request 'b' (seqs 1, 2, not forked yet) and a waiting request 'c' (seq 3).
    With pending=True a further step is scheduled and not updated."""
    engine = pagedcore.Engine(
        num_blocks=12, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=128, vocab_size=VOCAB, scheduling_policy=policy,
    )
    assert engine.add_request("a", list(range(1, 11)), params(max_tokens=5)) == 0
    assert engine.add_request("b", list(range(100, 140)), params(n=2, max_tokens=4)) == 1
    assert engine.add_request("c", [7, 8, 9], params(max_tokens=3)) == 3
    b = engine.schedule()
    # a: its 10 prompt tokens; b: a 22-token chunk; c does not fit the budget.
    assert b.seq_ids.tolist() == [0, 1] and b.num_tokens == 32 and b.num_samples == 1
    engine.update(toks([11]))
    s = pagedcore.stats_dict(engine.stats())
    assert (s["num_running_seqs"], s["num_waiting_seqs"]) == (2, 1)
    batch = None
    if pending:
        batch = engine.schedule()
        assert engine.has_pending_step
    engine.check_invariants()
    return State(engine, {"a", "b", "c"}, 4, batch)


def snapshot(engine: pagedcore.Engine, batch: pagedcore.StepBatch | None) -> dict:
    seqs = {}
    for seq_id in range(0, 8):
        try:
            seqs[seq_id] = (list(engine.seq_token_ids(seq_id)),
                            list(engine.seq_block_table(seq_id)))
        except KeyError:
            seqs[seq_id] = None
    snap = {
        "stats": pagedcore.stats_dict(engine.stats()),
        "pending": engine.has_pending_step,
        "unfinished": engine.num_unfinished_requests,
        "seqs": seqs,
    }
    if batch is not None:
        snap["batch"] = {
            name: getattr(batch, name).tolist()
            for name in ("input_ids", "positions", "slot_mapping", "seq_ids", "query_start_loc",
                         "num_computed_tokens", "seq_lens", "sample_indices", "sample_seq_ids",
                         "block_copies", "swap_out", "swap_in")
        }
        snap["num_samples"] = batch.num_samples
    return snap


def drain(state: State) -> None:
    """Completes every request; checks a new request still gets the next id."""
    engine = state.engine
    finished: list[str] = []
    if engine.has_pending_step:
        assert state.batch is not None
        r = engine.update(np.full(state.batch.num_samples, 1, dtype=np.int32))
        finished += list(r.finished_request_ids)
    assert engine.add_request("after", [5, 6, 7], params(max_tokens=2)) == state.next_seq_id
    expected = state.live_requests | {"after"}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        b = engine.schedule()
        r = engine.update(np.full(b.num_samples, 1, dtype=np.int32))
        engine.check_invariants()
        finished += list(r.finished_request_ids)
    assert not engine.has_unfinished_requests()
    assert sorted(finished) == sorted(expected)
    s = pagedcore.stats_dict(engine.stats())
    assert s["num_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"] == 12
    assert s["num_running_seqs"] == s["num_waiting_seqs"] == 0
    engine.check_invariants()


@dataclass
class Case:
    name: str
    call: Callable[[State], object]
    exc: type
    words: tuple[str, ...]  # substrings of the message: the field and the value
    pending: bool = False
    policy: str = "fcfs"


def add(request_id, prompt, **kw):
    return lambda st: st.engine.add_request(request_id, prompt, params(**kw))


def update_with(make: Callable[[int], object]):
    return lambda st: st.engine.update(make(st.batch.num_samples))


def bad_last(value):
    def make(n):
        arr = np.full(n, 1, dtype=np.int32)
        arr[-1] = value
        return arr
    return make


CASES = [
    # add_request
    Case("prompt_too_long", add("x", [1] * 129), pagedcore.InvalidArgumentError,
         ("prompt_token_ids", "129", "max_model_len", "128")),
    Case("empty_prompt", add("x", []), pagedcore.InvalidArgumentError,
         ("prompt_token_ids", "empty")),
    Case("empty_request_id", add("", [1, 2]), pagedcore.InvalidArgumentError,
         ("request_id", "empty")),
    Case("duplicate_request_id_running", add("a", [1, 2]), pagedcore.InvalidArgumentError,
         ("request_id", "'a'", "in use")),
    Case("duplicate_request_id_waiting", add("c", [1, 2]), pagedcore.InvalidArgumentError,
         ("request_id", "'c'", "in use")),
    Case("n_zero", add("x", [1, 2], n=0), pagedcore.InvalidArgumentError, ("n must", "0")),
    Case("n_negative", add("x", [1, 2], n=-2), pagedcore.InvalidArgumentError, ("n must", "-2")),
    Case("n_over_max_num_seqs", add("x", [1, 2], n=5), pagedcore.InvalidArgumentError,
         ("n must", "max_num_seqs", "4", "5")),
    Case("max_tokens_zero", add("x", [1, 2], max_tokens=0), pagedcore.InvalidArgumentError,
         ("max_tokens", "0")),
    Case("max_tokens_negative", add("x", [1, 2], max_tokens=-7), pagedcore.InvalidArgumentError,
         ("max_tokens", "-7")),
    Case("min_tokens_over_max_tokens", add("x", [1, 2], max_tokens=4, min_tokens=5),
         pagedcore.InvalidArgumentError, ("min_tokens", "5", "max_tokens", "4")),
    Case("min_tokens_negative", add("x", [1, 2], min_tokens=-1), pagedcore.InvalidArgumentError,
         ("min_tokens", "-1")),
    Case("negative_token", add("x", [1, -1, 3]), pagedcore.InvalidArgumentError,
         ("prompt_token_ids[1]", "-1")),
    Case("token_at_vocab_size", add("x", [1, 2, VOCAB]), pagedcore.InvalidArgumentError,
         ("prompt_token_ids[2]", str(VOCAB))),
    Case("token_over_vocab_size", add("x", [VOCAB + 5]), pagedcore.InvalidArgumentError,
         ("prompt_token_ids[0]", str(VOCAB + 5))),
    Case("negative_eos_token", add("x", [1], eos_token_ids=[2, -5]),
         pagedcore.InvalidArgumentError, ("eos_token_ids[1]", "-5")),
    Case("stop_token_over_vocab", add("x", [1], stop_token_ids=[VOCAB]),
         pagedcore.InvalidArgumentError, ("stop_token_ids[0]", str(VOCAB))),
    Case("priority_under_fcfs", add("x", [1, 2], priority=3), pagedcore.InvalidArgumentError,
         ("priority", "3", "fcfs")),
    Case("priority_negative_under_fcfs", add("x", [1, 2], priority=-1),
         pagedcore.InvalidArgumentError, ("priority", "-1", "fcfs")),
    # 12 blocks of 8 tokens: 60 + 60 tokens need 15 blocks.
    Case("never_fits_in_cache", add("big", [1] * 60, max_tokens=60),
         pagedcore.InvalidArgumentError, ("'big'", "15", "num_blocks", "12")),
    Case("add_while_pending_bad_value", add("x", [], max_tokens=2),
         pagedcore.InvalidArgumentError, ("prompt_token_ids", "empty"), pending=True),
    # abort / finish / fork: unknown ids
    Case("abort_unknown", lambda st: st.engine.abort("nope"), pagedcore.NotFoundError,
         ("request_id", "'nope'")),
    Case("finish_unknown", lambda st: st.engine.finish(99), pagedcore.NotFoundError,
         ("seq_id", "99")),
    Case("finish_unforked_child", lambda st: st.engine.finish(2), pagedcore.NotFoundError,
         ("seq_id", "2")),
    Case("fork_unknown", lambda st: st.engine.fork(42), pagedcore.NotFoundError,
         ("seq_id", "42")),
    Case("fork_negative_id", lambda st: st.engine.fork(-1), pagedcore.NotFoundError,
         ("seq_id", "-1")),
    Case("seq_token_ids_unknown", lambda st: st.engine.seq_token_ids(77), pagedcore.NotFoundError,
         ("seq_id", "77")),
    Case("seq_block_table_unknown", lambda st: st.engine.seq_block_table(78),
         pagedcore.NotFoundError, ("seq_id", "78")),
    # fork / finish: bad values
    Case("fork_waiting_seq", lambda st: st.engine.fork(3), pagedcore.InvalidArgumentError,
         ("seq_id", "3", "not running")),
    Case("fork_unforked_parent", lambda st: st.engine.fork(1), pagedcore.InvalidArgumentError,
         ("seq_id", "1", "n=2")),
    Case("finish_with_length", lambda st: st.engine.finish(0, pagedcore.FinishReason.LENGTH),
         pagedcore.InvalidArgumentError, ("reason", "'length'")),
    Case("finish_with_none", lambda st: st.engine.finish(0, pagedcore.FinishReason.NONE),
         pagedcore.InvalidArgumentError, ("reason", "'none'")),
    # calls at the wrong time
    Case("update_without_schedule", lambda st: st.engine.update(toks([1])),
         pagedcore.InvalidStateError, ("update()", "schedule()")),
    Case("schedule_twice", lambda st: st.engine.schedule(), pagedcore.InvalidStateError,
         ("schedule()", "pending"), pending=True),
    Case("abort_while_pending", lambda st: st.engine.abort("a"), pagedcore.InvalidStateError,
         ("abort()", "pending"), pending=True),
    Case("abort_unknown_while_pending", lambda st: st.engine.abort("nope"),
         pagedcore.InvalidStateError, ("abort()", "pending"), pending=True),
    Case("finish_while_pending", lambda st: st.engine.finish(0), pagedcore.InvalidStateError,
         ("finish()", "pending"), pending=True),
    Case("fork_while_pending", lambda st: st.engine.fork(0), pagedcore.InvalidStateError,
         ("fork()", "pending"), pending=True),
    # update: bad sampled tokens
    Case("update_too_few", update_with(lambda n: np.full(n - 1, 1, dtype=np.int32)),
         pagedcore.InvalidArgumentError, ("sampled_token_ids", "entries", "samples"),
         pending=True),
    Case("update_too_many", update_with(lambda n: np.full(n + 1, 1, dtype=np.int32)),
         pagedcore.InvalidArgumentError, ("sampled_token_ids", "entries", "samples"),
         pending=True),
    Case("update_empty", update_with(lambda n: np.zeros(0, dtype=np.int32)),
         pagedcore.InvalidArgumentError, ("sampled_token_ids has 0",), pending=True),
    Case("update_negative_token", update_with(bad_last(-3)), pagedcore.InvalidArgumentError,
         ("sampled_token_ids[", "-3"), pending=True),
    Case("update_token_at_vocab", update_with(bad_last(VOCAB)), pagedcore.InvalidArgumentError,
         ("sampled_token_ids[", str(VOCAB)), pending=True),
    Case("update_int64_negative", update_with(
        lambda n: np.concatenate([np.ones(n - 1, np.int64), np.array([-9], np.int64)])),
         pagedcore.InvalidArgumentError, ("sampled_token_ids[", "-9"), pending=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_raises_and_changes_nothing(case: Case) -> None:
    state = make_state(pending=case.pending, policy=case.policy)
    engine = state.engine
    before = snapshot(engine, state.batch)
    with pytest.raises(case.exc) as excinfo:
        case.call(state)
    err = excinfo.value
    # The Python hierarchy: bad values are ValueErrors, unknown ids KeyErrors,
    # calls at the wrong time RuntimeErrors.
    if isinstance(err, pagedcore.InvalidArgumentError):
        assert isinstance(err, ValueError)
    elif isinstance(err, pagedcore.NotFoundError):
        assert isinstance(err, KeyError)
    else:
        assert isinstance(err, pagedcore.InvalidStateError) and isinstance(err, RuntimeError)
        assert not isinstance(err, pagedcore.InternalError)
    message = err.args[0]
    assert isinstance(message, str)
    for word in case.words:
        assert word in message, (word, message)
    engine.check_invariants()
    assert snapshot(engine, state.batch) == before
    drain(state)


def test_exception_hierarchy() -> None:
    assert issubclass(pagedcore.InvalidArgumentError, ValueError)
    assert issubclass(pagedcore.NotFoundError, KeyError)
    assert issubclass(pagedcore.InvalidStateError, RuntimeError)
    assert issubclass(pagedcore.InternalError, RuntimeError)
    assert not issubclass(pagedcore.InvalidStateError, pagedcore.InternalError)


def test_priority_is_accepted_under_the_priority_policy() -> None:
    state = make_state(policy="priority")
    assert state.engine.add_request("x", [1, 2], params(priority=-3)) == 4
    state.live_requests.add("x")
    state.next_seq_id = 5
    drain(state)


def test_fork_without_a_free_seat() -> None:
    state = make_state()
    engine = state.engine
    # a (1 seat) + b (2 seats, unforked) = 3 of 4: one fork fits, not two.
    child = engine.fork(0)
    assert child == 4
    state.next_seq_id = 5
    engine.check_invariants()
    before = snapshot(engine, None)
    with pytest.raises(pagedcore.InvalidArgumentError) as excinfo:
        engine.fork(0)
    message = excinfo.value.args[0]
    assert "seq_id 0" in message and "max_num_seqs" in message and "4" in message
    engine.check_invariants()
    assert snapshot(engine, None) == before
    drain(state)


def test_repeated_failures_then_normal_run() -> None:
    """Many failed calls in a row (and of every kind) leave no trace."""
    state = make_state()
    engine = state.engine
    before = snapshot(engine, None)
    for case in CASES:
        if case.pending or case.policy != "fcfs":
            continue
        with pytest.raises(case.exc):
            case.call(state)
    engine.check_invariants()
    assert snapshot(engine, None) == before
    drain(state)


def test_abort_and_finish_twice() -> None:
    state = make_state()
    engine = state.engine
    engine.abort("c")
    state.live_requests.discard("c")
    with pytest.raises(pagedcore.NotFoundError, match="'c'"):
        engine.abort("c")
    assert engine.finish(0) is True
    state.live_requests.discard("a")
    before = snapshot(engine, None)
    with pytest.raises(pagedcore.NotFoundError, match="seq_id 0"):
        engine.finish(0)
    with pytest.raises(pagedcore.NotFoundError, match="seq_id 0"):
        engine.fork(0)
    with pytest.raises(pagedcore.NotFoundError, match="'a'"):
        engine.abort("a")
    assert snapshot(engine, None) == before
    drain(state)


def test_update_rejects_int64_ids_that_do_not_fit_int32() -> None:
    """update() must not silently convert sampled ids: 2**32 + 5 is not a token
    id (nor an int32), yet a forced cast to int32 would turn it into token 5.
    It must raise (ValueError, or TypeError for the wrong type) and change
    nothing."""
    state = make_state(pending=True)
    engine = state.engine
    before = snapshot(engine, state.batch)
    with pytest.raises((ValueError, TypeError)):
        engine.update(np.full(state.batch.num_samples, 2**32 + 5, dtype=np.int64))
    assert snapshot(engine, state.batch) == before
    drain(state)


def test_exception_from_the_log_sink_leaves_the_engine_intact() -> None:
    """schedule() logs a warning for each preemption through the 'pagedcore'
    logger. If that Python code raises (a logging filter that raises, a
    KeyboardInterrupt delivered while it runs, ...), the exception crosses
    schedule(). Either schedule() absorbs it, or it must leave the engine
    exactly as it was: no half-planned step."""
    import logging

    class Boom(Exception):
        pass

    class RaisingFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise Boom("filter failed")

    engine = pagedcore.Engine(num_blocks=3, block_size=8, max_model_len=32,
                              enable_prefix_caching=False)
    engine.add_request("a", list(range(1, 8)), params(max_tokens=9))
    engine.add_request("b", list(range(11, 18)), params(max_tokens=9))
    logger = logging.getLogger("pagedcore")
    flt = RaisingFilter()
    raised = False
    finished: list[str] = []
    logger.addFilter(flt)
    try:
        for _ in range(40):
            if not engine.has_unfinished_requests():
                break
            before = pagedcore.stats_dict(engine.stats())
            try:
                b = engine.schedule()
            except Boom:
                raised = True
                assert not engine.has_pending_step
                engine.check_invariants()
                assert pagedcore.stats_dict(engine.stats()) == before
                break
            r = engine.update(np.full(b.num_samples, 1, dtype=np.int32))
            finished += list(r.finished_request_ids)
    finally:
        logger.removeFilter(flt)
    # Preemption is certain here: two sequences cannot both grow in 3 blocks.
    assert raised or pagedcore.stats_dict(engine.stats())["num_preemptions"] > 0
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        b = engine.schedule()
        r = engine.update(np.full(b.num_samples, 1, dtype=np.int32))
        engine.check_invariants()
        finished += list(r.finished_request_ids)
    assert sorted(finished) == ["a", "b"]
    assert pagedcore.stats_dict(engine.stats())["num_free_blocks"] == 3
