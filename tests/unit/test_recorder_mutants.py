"""The recorder's behaviours that mutation testing found unpinned: catching up with a log
written by an older fsm-kernel (which lacks a context summary's `iteration.completed`), where a
resume diverges from the log and what it records from there, and the shorthands (`recorder(...)`,
`sync()`) the actions use."""

from __future__ import annotations

import asyncio
import gc
import logging
import types
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel.recorder as recorder_module
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.recorder import RunRecorder
from fsm_kernel.store import SqliteEventStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class FixedClock:
    def now(self) -> datetime:
        return T0

    def monotonic(self) -> float:
        return 0.0


class NotingStore:
    """A store without an idle append: every batch goes to the writer thread, noted with the
    durability it was asked for."""

    def __init__(self) -> None:
        self.written: list[tuple[list[int], bool]] = []

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        self.written.append(([e.seq for e in events], durable))


def logged(seq: int, type_: EventType, **data: Any) -> Event:
    return Event(run_id="r", seq=seq, type=type_, timestamp=T0, data=data)


def catching_up(log: list[Event], store: Any = None) -> RunRecorder:
    return RunRecorder("r", store, clock=FixedClock(), expected=log, next_seq=len(log) + 1)


def summary(step: int) -> dict[str, Any]:
    return {"step": step, "decision": "summarize"}


def test_a_context_summary_an_older_log_lacks_is_skipped_and_catch_up_goes_on() -> None:
    log = [
        logged(1, EventType.STATE_ENTERED),
        logged(2, EventType.ITERATION_COMPLETED, step=1, decision="think"),
    ]
    recorder = catching_up(log)

    assert recorder.record(EventType.STATE_ENTERED, {}) is log[0]
    # written by an older fsm-kernel: no summary's record here; the history stays as written
    assert recorder.record(EventType.ITERATION_COMPLETED, summary(2)) is None
    assert recorder.catching_up
    assert (
        recorder.record(EventType.ITERATION_COMPLETED, {"step": 1, "decision": "think"}) is (log[1])
    )

    assert not recorder.catching_up
    assert recorder.diverged_at is None
    assert recorder.events == log


def test_a_context_summary_the_log_holds_is_matched_like_any_record() -> None:
    log = [
        logged(1, EventType.ITERATION_COMPLETED, step=1, decision="summarize"),
        logged(2, EventType.ITERATION_COMPLETED, step=2, decision="think"),
    ]
    recorder = catching_up(log)

    assert recorder.record(EventType.ITERATION_COMPLETED, summary(1)) is log[0]
    assert (
        recorder.record(EventType.ITERATION_COMPLETED, {"step": 2, "decision": "think"}) is (log[1])
    )
    assert recorder.events == log
    assert recorder.diverged_at is None


def test_an_iteration_record_that_differs_from_the_log_diverges_instead_of_being_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = [logged(1, EventType.ITERATION_COMPLETED, step=1, decision="think")]
    recorder = catching_up(log)

    with caplog.at_level(logging.WARNING, logger="fsm_kernel.recorder"):
        live = recorder.record(EventType.ITERATION_COMPLETED, {"step": 2, "decision": "think"})

    assert live is not None
    assert (live.seq, live.type, live.data) == (
        2,
        EventType.ITERATION_COMPLETED,
        {"step": 2, "decision": "think"},
    )
    assert recorder.diverged_at is log[0]
    assert [r.getMessage() for r in caplog.records] == [
        "resume diverged from the log at seq 1 (iteration.completed); recording live from here"
    ]


def test_a_resume_that_diverges_records_live_from_there_after_the_events_it_matched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = [
        logged(1, EventType.STATE_ENTERED),
        logged(2, EventType.TRANSITION_TAKEN, source="a", target="b", index=0),
        logged(3, EventType.STATE_ENTERED),
    ]
    store = NotingStore()
    recorder = catching_up(log, store)

    with caplog.at_level(logging.WARNING, logger="fsm_kernel.recorder"):
        assert recorder.record(EventType.STATE_ENTERED, {}) is log[0]
        assert recorder.catching_up
        edited = {"source": "a", "target": "c", "index": 0}  # the workflow was edited
        taken = recorder.record(EventType.TRANSITION_TAKEN, edited)
        entered = recorder.record(EventType.STATE_ENTERED, {})

    assert recorder.diverged_at is log[1]
    assert not recorder.catching_up
    assert taken is not None
    assert entered is not None
    assert [(e.seq, e.type, e.data) for e in (taken, entered)] == [
        (4, EventType.TRANSITION_TAKEN, edited),
        (5, EventType.STATE_ENTERED, {}),
    ]
    assert recorder.events == [log[0], taken, entered]
    assert [r.getMessage() for r in caplog.records] == [
        "resume diverged from the log at seq 2 (transition.taken); recording live from here"
    ]

    asyncio.run(recorder.flush())
    assert store.written == [([4, 5], False)]  # only what was recorded live is written


def test_calling_the_recorder_records_the_event() -> None:
    """Actions record through `recorder(type, data)`."""
    recorder = RunRecorder("r", None, clock=FixedClock(), next_seq=7)
    recorder.state = "work"
    recorder.iteration = 3

    recorder(EventType.TOOL_STARTED, {"call": "c1", "name": "search"})

    [event] = recorder.events
    assert event == Event(
        run_id="r",
        seq=7,
        type=EventType.TOOL_STARTED,
        timestamp=T0,
        iteration=3,
        state="work",
        data={"call": "c1", "name": "search"},
    )


def test_sync_commits_even_a_bookkeeping_batch_durably() -> None:
    """`sync()` is a durable flush, whatever the batch holds (before a side effect)."""
    store = NotingStore()

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.sync()
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()

    asyncio.run(main())
    assert store.written == [([1], True), ([2], False)]


def test_a_wrapper_that_intercepts_the_stores_appends_sees_every_batch(tmp_path: Path) -> None:
    """An append replaced on the store object (a wrapper noting what is written, say) is
    not bypassed by the store's own idle append: every batch goes through it."""
    store = SqliteEventStore(tmp_path / "runs.db")
    seen: list[tuple[list[int], bool]] = []
    real = store.append

    def noting(events: Sequence[Event], *, durable: bool = True) -> None:
        seen.append(([e.seq for e in events], durable))
        real(events, durable=durable)

    store.append = noting  # type: ignore[method-assign]

    async def main() -> None:
        recorder = RunRecorder("r", store)
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()
        recorder.record(EventType.MODEL_REQUESTED, {"messages": 1})
        await recorder.flush()

    asyncio.run(main())
    assert seen == [([1], False), ([2], True)]
    assert [e.seq for e in store.read("r")] == [1, 2]
    store.close()


def test_an_idle_append_that_is_not_the_stores_own_method_is_not_used(tmp_path: Path) -> None:
    store = SqliteEventStore(tmp_path / "runs.db")
    offered: list[int] = []

    def foreign_idle_append(events: Sequence[Event], *, durable: bool = False) -> bool:
        offered.append(len(events))
        return False

    store.append_if_idle = foreign_idle_append  # type: ignore[method-assign]

    async def main() -> None:
        recorder = RunRecorder("r", store)
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()

    asyncio.run(main())
    assert offered == []
    assert [e.seq for e in store.read("r")] == [1]
    store.close()


def event_of(run_id: str) -> Event:
    return Event(run_id=run_id, seq=1, type=EventType.STATE_ENTERED, timestamp=T0)


def test_a_batch_whose_waiter_is_gone_leaves_the_batches_written_with_it_settled(
    tmp_path: Path,
) -> None:
    store = SqliteEventStore(tmp_path / "runs.db")

    async def main() -> tuple[bool, list[BaseException | None]]:
        writer = recorder_module._Writer.of(store, asyncio.get_running_loop())
        first = writer.submit([event_of("a")], True)  # starts at once, alone
        gone, last = (writer.submit([event_of(r)], False) for r in "bc")  # together, next
        gone.cancel()  # its waiter went away while they waited
        outcomes = await asyncio.wait_for(asyncio.gather(first, last, return_exceptions=True), 5)
        return gone.cancelled(), list(outcomes)

    gone_cancelled, outcomes = asyncio.run(main())
    assert gone_cancelled
    assert outcomes == [None, None]
    assert [len(store.read(r)) for r in "abc"] == [1, 1, 1]  # written all the same
    store.close()


def test_a_writer_whose_store_was_collected_says_so() -> None:
    store = NotingStore()
    writer = recorder_module._Writer(store)  # type: ignore[arg-type]
    del store
    gc.collect()
    with pytest.raises(RuntimeError) as caught:
        writer._write_all([])
    assert str(caught.value) == "the event store was garbage-collected while runs wrote to it"


def test_whether_a_store_takes_durable_is_worked_out_once_per_method() -> None:
    """Every run's recorder asks; the answer for a store class's method is kept, not worked
    out again for each recorder (hundreds of runs started together ask it on the loop)."""
    recorder_module._has_durable_keyword_cached.cache_clear()
    for _ in range(3):
        assert recorder_module._takes_durable(NotingStore()) is True  # type: ignore[arg-type]
    info = recorder_module._has_durable_keyword_cached.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_a_store_method_whose_function_cannot_be_kept_is_still_asked() -> None:
    """A method made of an unhashable callable object: asked each time, not kept."""

    class KeywordDurable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, store: object, events: Sequence[Event], *, durable: bool = True) -> None:
            return None

    class PositionalDurable(KeywordDurable):
        def __call__(self, store: object, events: Sequence[Event], durable: bool = True) -> None:
            return None

    keyword, positional = NotingStore(), NotingStore()
    keyword.append = types.MethodType(KeywordDurable(), keyword)  # type: ignore[method-assign]
    positional.append = types.MethodType(PositionalDurable(), positional)  # type: ignore[method-assign]

    assert recorder_module._takes_durable(keyword) is True  # type: ignore[arg-type]
    assert recorder_module._takes_durable(positional) is False  # type: ignore[arg-type]


def test_a_recorder_moved_to_another_event_loop_writes_through_that_loops_writer(
    tmp_path: Path,
) -> None:
    """Runs that share a store on one event loop share its writer (their batches go
    together); a recorder flushed in a later loop joins that loop's writer."""
    store = SqliteEventStore(tmp_path / "runs.db")
    recorder = RunRecorder("r", store)

    async def flush_one() -> tuple[object, object]:
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()
        assert recorder._writer_of is not None
        return recorder._writer_of[1], recorder_module._Writer.of(store, asyncio.get_running_loop())

    first, first_loops = asyncio.run(flush_one())
    second, second_loops = asyncio.run(flush_one())
    assert first is first_loops
    assert second is second_loops
    assert second is not first
    assert [e.seq for e in store.read("r")] == [1, 2]
    store.close()


class DelegatingStore:
    """A wrapper around a SQLite store that notes the batches its `append` writes and hands
    everything else to the store (its `append_batches` included, as a generic wrapper does)."""

    def __init__(self, inner: SqliteEventStore) -> None:
        self.inner = inner
        self.written: list[str] = []

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        self.written.extend(e.run_id for e in events)
        self.inner.append(events, durable=durable)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def three_runs_writing(store: Any) -> list[BaseException | None]:
    """Three runs' batches on one writer: the first alone, the other two together."""
    writer = recorder_module._Writer.of(store, asyncio.get_running_loop())
    first = writer.submit([event_of("a")], True)
    later = [writer.submit([event_of(r)], r == "b") for r in "bc"]
    return list(await asyncio.gather(first, *later, return_exceptions=True))


def test_a_wrapping_store_sees_every_batch_even_those_written_together(tmp_path: Path) -> None:
    inner = SqliteEventStore(tmp_path / "runs.db")
    store = DelegatingStore(inner)

    assert asyncio.run(three_runs_writing(store)) == [None, None, None]
    assert store.written == ["a", "b", "c"]  # not past it, through the inner append_batches
    inner.close()


def test_a_store_whose_append_is_a_plain_function_gets_batches_written_together(
    tmp_path: Path,
) -> None:
    inner = SqliteEventStore(tmp_path / "runs.db")
    written: list[str] = []

    def append(events: Sequence[Event], *, durable: bool = True) -> None:
        written.extend(e.run_id for e in events)
        inner.append(events, durable=durable)

    class Bare:
        """A store object whose append is the function above; no append_batches at all."""

    store = Bare()
    store.append = append  # type: ignore[attr-defined]

    assert asyncio.run(three_runs_writing(store)) == [None, None, None]
    assert written == ["a", "b", "c"]
    assert [len(inner.read(r)) for r in "abc"] == [1, 1, 1]
    inner.close()


class SlottedStore:
    """A store that cannot be weakly referenced (`__slots__` without `__weakref__`)."""

    __slots__ = ("written",)

    def __init__(self) -> None:
        self.written: list[tuple[str, list[int], bool]] = []

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        self.written.append((events[0].run_id, [e.seq for e in events], durable))


def test_runs_record_to_a_store_that_cannot_be_weakly_referenced() -> None:
    """Such a store's writer is not shared (there is no weak key to share it by), and the
    runs write to it all the same: each batch in order, with its durability."""
    store = SlottedStore()

    async def run(run_id: str) -> None:
        recorder = RunRecorder(run_id, store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()
        recorder.record(EventType.MODEL_REQUESTED, {"messages": 1})
        await recorder.flush()

    async def main() -> None:
        await asyncio.gather(run("a"), run("b"))

    asyncio.run(main())
    assert sorted(store.written) == [
        ("a", [1], False),
        ("a", [2], True),
        ("b", [1], False),
        ("b", [2], True),
    ]
    assert [w[1] for w in store.written if w[0] == "a"] == [[1], [2]]


def test_a_new_recorder_stamps_its_events_with_iteration_zero_and_no_state() -> None:
    """What a run records before its first step (run.started, say) belongs to no state."""
    recorder = RunRecorder("r", None, clock=FixedClock())

    event = recorder.record(EventType.RUN_STARTED, {})

    assert event is not None
    assert (event.seq, event.iteration, event.state) == (1, 0, None)
    assert recorder.diverged_at is None
    assert not recorder.catching_up


def test_a_store_whose_append_cannot_be_inspected_gets_every_batch_without_durable() -> None:
    """Whether such an append takes `durable=` is unknown: it is never passed (the store
    syncs every batch, as stores without the option do)."""

    class Uninspectable:
        __signature__ = "not a signature"  # inspect.signature raises TypeError

        def __init__(self) -> None:
            self.calls: list[tuple[list[int], dict[str, Any]]] = []

        def __call__(self, events: Sequence[Event], **options: Any) -> None:
            self.calls.append(([e.seq for e in events], options))

    append = Uninspectable()
    store = NotingStore()
    store.append = append  # type: ignore[method-assign]

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush(durable=False)

    asyncio.run(main())
    assert append.calls == [([1], {})]


def test_each_event_recorded_is_logged_at_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    recorder = RunRecorder("r", None, clock=FixedClock())

    with caplog.at_level(logging.DEBUG, logger="fsm_kernel.recorder"):
        recorder.record(EventType.RUN_STARTED, {})
        recorder.state = "work"
        recorder.record(EventType.STATE_ENTERED, {})

    assert [r.getMessage() for r in caplog.records] == [
        "event 1 run.started ",
        "event 2 state.entered work",
    ]


def test_a_store_answering_for_fewer_batches_than_it_was_given_is_reported(
    tmp_path: Path,
) -> None:
    """`append_batches` owes one outcome per batch; a store that breaks that is an error the
    event loop reports, not silence."""

    class Short(SqliteEventStore):
        def append_batches(
            self, batches: Sequence[tuple[Sequence[Event], bool]]
        ) -> list[Exception | None]:
            return super().append_batches(batches)[:-1]

    store = Short(tmp_path / "runs.db")

    async def main() -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        reported: list[BaseException | None] = []
        loop.set_exception_handler(lambda _, context: reported.append(context.get("exception")))
        writer = recorder_module._Writer.of(store, loop)
        first = writer.submit([event_of("a")], True)  # starts at once, alone
        together = [writer.submit([event_of(r)], True) for r in "bc"]  # go together, next
        await first
        await wait_for_the_writer(writer)
        assert together[0].done()  # the outcome it did answer for
        return reported

    reported = asyncio.run(main())
    assert len(reported) == 1
    assert isinstance(reported[0], ValueError)
    assert "shorter" in str(reported[0])
    store.close()


async def wait_for_the_writer(writer: Any) -> None:
    for _ in range(500):
        if not writer._busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the writer did not finish")
