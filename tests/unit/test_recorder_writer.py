"""The recorder's writer thread: a run's batches stay in order when one is written while an
earlier one is still going, and a write that fails as a whole fails each batch it held while
the batches queued meanwhile are still written."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest

import fsm_kernel.recorder as recorder_module
from fsm_kernel.errors import StoreError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.recorder import RunRecorder
from fsm_kernel.store import SqliteEventStore


class GatedStore:
    """A store without an idle append (every batch goes to the writer thread) whose appends
    wait for `gate`, noting each batch's event types in the order written."""

    def __init__(self, path: Path) -> None:
        self.inner = SqliteEventStore(path)
        self.gate = threading.Event()
        self.written: list[tuple[list[str], bool]] = []
        self.refuse: set[str] = set()

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        self.gate.wait(10)
        types = [e.type.value for e in events]
        if self.refuse & set(types):
            raise StoreError("refused")
        self.written.append((types, durable))
        self.inner.append(events, durable=durable)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def flush_waiting_for_the_gate(recorder: RunRecorder, store: GatedStore) -> None:
    """Flush `recorder`, check that the flush still waits while `store`'s gate is shut (for a
    write it must not overtake), then open the gate and let it finish."""
    flushing = asyncio.ensure_future(recorder.flush())
    await asyncio.sleep(0.05)
    assert not flushing.done()
    store.gate.set()
    await flushing


def test_a_flush_while_a_put_off_write_is_going_waits_for_it_and_keeps_the_order(
    tmp_path: Path,
) -> None:
    store = GatedStore(tmp_path / "runs.db")

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.end_step()  # put off: bookkeeping only
        await asyncio.sleep(0)  # the put-off write starts, and waits at the gate
        assert recorder._inflight is not None
        assert not recorder._inflight.done()
        recorder.record(EventType.MODEL_REQUESTED, {"messages": 1})
        await flush_waiting_for_the_gate(recorder, store)  # the write before it

    asyncio.run(main())

    # each with its own durability: the put-off one relaxed, the one before a model call synced
    assert store.written == [(["state.entered"], False), (["model.requested"], True)]
    assert [e.seq for e in store.inner.read("r")] == [1, 2]
    store.inner.close()


def test_a_flush_with_nothing_left_waits_for_the_put_off_write_that_took_it(
    tmp_path: Path,
) -> None:
    # A run that suspends after a wait: the put-off commit takes the suspension along, and the
    # run's last flush (nothing pending) must still return only once it is on disk. It once
    # returned at once, and the caller closed the store under the write: events lost.
    store = GatedStore(tmp_path / "runs.db")

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.end_step()
        recorder.record(EventType.RUN_SUSPENDED, {"question": "q"})
        await asyncio.sleep(0)  # the put-off write takes both, and waits at the gate
        assert recorder._pending == []
        await flush_waiting_for_the_gate(recorder, store)

    asyncio.run(main())

    # synced: it holds the suspension, whoever commits it
    assert store.written == [(["state.entered", "run.suspended"], True)]
    assert [e.seq for e in store.inner.read("r")] == [1, 2]
    store.inner.close()


def test_a_flush_with_nothing_left_raises_the_failure_of_the_put_off_write(
    tmp_path: Path,
) -> None:
    store = GatedStore(tmp_path / "runs.db")
    store.refuse = {"state.entered"}
    store.gate.set()

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.end_step()
        await asyncio.sleep(0)
        assert recorder._pending == []
        with pytest.raises(StoreError, match="refused"):
            await recorder.flush()

    asyncio.run(main())
    assert store.inner.read("r") == []
    store.inner.close()


def test_a_write_that_fails_as_a_whole_fails_its_batches_and_the_next_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqliteEventStore(tmp_path / "runs.db")
    real = recorder_module._Writer._write_all
    calls: list[int] = []

    def first_go_fails(self: Any, items: list[Any]) -> list[Exception | None]:
        calls.append(len(items))
        if len(calls) == 1:
            raise StoreError("the writer failed")
        return real(self, items)

    monkeypatch.setattr(recorder_module._Writer, "_write_all", first_go_fails)

    def event(run_id: str) -> Event:
        return Event(
            run_id=run_id, seq=1, type=EventType.STATE_ENTERED, timestamp=datetime.now(UTC)
        )

    async def main() -> list[BaseException | None]:
        writer = recorder_module._Writer.of(store, asyncio.get_running_loop())
        first = writer.submit([event("a")], True)
        queued = writer.submit([event("b")], True)  # arrives while the first go is going
        outcomes = await asyncio.gather(first, queued, return_exceptions=True)
        return list(outcomes)

    first, queued = asyncio.run(main())

    assert isinstance(first, StoreError)
    assert str(first) == "the writer failed"
    assert queued is None  # written in the next go
    assert calls == [1, 1]
    assert store.read("a") == []
    assert [e.run_id for e in store.read("b")] == ["b"]
    store.close()


def test_a_batch_the_store_refuses_fails_the_flush_of_its_run(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "runs.db")
    store.gate.set()
    store.refuse = {"model.requested"}

    async def main() -> None:
        recorder = RunRecorder("r", store)  # type: ignore[arg-type]
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush()
        recorder.record(EventType.MODEL_REQUESTED, {"messages": 1})
        with pytest.raises(StoreError, match="refused"):
            await recorder.flush()

    asyncio.run(main())

    assert store.written == [(["state.entered"], False)]
    store.inner.close()


def test_batches_that_arrive_during_a_write_go_together_in_the_next_one(tmp_path: Path) -> None:
    class Grouping(SqliteEventStore):
        groups: ClassVar[list[int]] = []

        def append_batches(
            self, batches: Sequence[tuple[Sequence[Event], bool]]
        ) -> list[Exception | None]:
            self.groups.append(len(batches))
            return super().append_batches(batches)

    store = Grouping(tmp_path / "runs.db")

    def event(run_id: str) -> Event:
        return Event(
            run_id=run_id, seq=1, type=EventType.STATE_ENTERED, timestamp=datetime.now(UTC)
        )

    async def main() -> None:
        writer = recorder_module._Writer.of(store, asyncio.get_running_loop())
        first = writer.submit([event("a")], True)  # starts at once, alone
        later = [writer.submit([event(r)], r == "b") for r in "bc"]  # wait for it, together
        await asyncio.gather(first, *later)

    asyncio.run(main())

    assert store.groups == [2]  # one transaction (and one sync) for the two that waited
    assert [len(store.read(r)) for r in "abc"] == [1, 1, 1]
    store.close()


def test_a_store_whose_idle_append_cannot_sync_gets_its_syncs_from_the_thread(
    tmp_path: Path,
) -> None:
    class RelaxedOnly(SqliteEventStore):
        threads: ClassVar[list[int]] = []

        def append_if_idle(self, events: Sequence[Event]) -> bool:  # type: ignore[override]
            return super().append_if_idle(events)

        def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
            self.threads.append(threading.get_ident())
            super().append(events, durable=durable)

    store = RelaxedOnly(tmp_path / "runs.db")
    store._sync_cost.average = 0.0  # fast, were it asked

    async def main() -> int:
        recorder = RunRecorder("r", store)
        recorder.record(EventType.MODEL_REQUESTED, {"messages": 1})
        await recorder.flush()  # durable: not through append_if_idle, which cannot sync
        return threading.get_ident()

    loop_thread = asyncio.run(main())

    assert len(store.threads) == 1
    assert store.threads[0] != loop_thread
    assert [e.type for e in store.read("r")] == [EventType.MODEL_REQUESTED]
    store.close()


def test_whether_a_store_takes_durable_is_asked_of_its_method_and_kept_per_function(
    tmp_path: Path,
) -> None:
    """Every run's recorder asks whether its store's `append` takes `durable=`: the answer is
    each method's own (kept per function, so another store class, or a plain function as the
    store's append, gets its own), and a relaxed batch reaches only a store that takes it."""

    class Plain:
        def __init__(self) -> None:
            self.calls: list[tuple[int, ...]] = []

        def append(self, events: Sequence[Event]) -> None:
            self.calls.append(tuple(e.seq for e in events))

    class Positional(Plain):
        def append(self, events: Sequence[Event], durable: bool = True) -> None:  # type: ignore[override]
            self.calls.append(tuple(e.seq for e in events))

    sqlite = SqliteEventStore(tmp_path / "runs.db")
    plain, positional = Plain(), Positional()
    function_store = Plain()
    function_store.append = lambda events, *, durable=True: None  # type: ignore[method-assign]
    for _ in range(2):  # the second time from what was kept
        assert recorder_module._takes_durable(sqlite) is True
        assert recorder_module._takes_durable(plain) is False
        assert recorder_module._takes_durable(positional) is False
        assert recorder_module._takes_durable(function_store) is True
        assert recorder_module._takes_durable(None) is False
    assert RunRecorder("r", sqlite)._sync_if_idle is not None
    assert RunRecorder("r", plain)._sync_if_idle is None  # no idle append at all

    async def relaxed_batch() -> None:
        recorder = RunRecorder("r", plain)
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.flush(durable=False)  # a store without durable= syncs every batch

    asyncio.run(relaxed_batch())
    assert plain.calls == [(1,)]
    sqlite.close()
