"""JsonlEventStore internals the contract tests cannot see: which appends fsync, and the idle
append on the caller's thread."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fsm_kernel.errors import StoreConflictError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def ev(seq: int) -> Event:
    return Event(
        run_id="r",
        seq=seq,
        type=EventType.STATE_ENTERED,
        timestamp=T0 + timedelta(seconds=seq),
        data={"n": seq},
    )


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)  # the store calls os.fsync
    return calls


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JsonlEventStore]:
    with JsonlEventStore(tmp_path / "runs.jsonl") as opened:
        yield opened


def test_only_durable_appends_fsync(store: JsonlEventStore, fsyncs: list[int]) -> None:
    store.append([ev(1)], durable=False)
    assert store.append_if_idle([ev(2)]) is True
    assert fsyncs == []
    store.append([ev(3)])
    assert len(fsyncs) == 1
    assert [e.seq for e in store.read("r")] == [1, 2, 3]


def test_a_durable_idle_append_fsyncs_only_while_fsyncs_are_fast(
    store: JsonlEventStore, fsyncs: list[int]
) -> None:
    assert store.append_if_idle([ev(1)], durable=True) is False  # not measured yet
    assert fsyncs == []
    assert store.read("r") == []
    store.append([ev(1)])
    assert len(fsyncs) == 1
    assert store._sync_cost.average is not None
    store._sync_cost.average = 0.0
    assert store.append_if_idle([ev(2)], durable=True) is True
    assert len(fsyncs) == 2
    store._sync_cost.average = 1.0
    assert store.append_if_idle([ev(3)], durable=True) is False
    assert len(fsyncs) == 2
    assert [e.seq for e in store.read("r")] == [1, 2]


def test_idle_appends_are_seen_by_another_store(store: JsonlEventStore, tmp_path: Path) -> None:
    assert store.append_if_idle([ev(1)]) is True
    with JsonlEventStore(tmp_path / "runs.jsonl") as other:
        assert [e.seq for e in other.read("r")] == [1]


def test_append_if_idle_gives_up_while_another_process_holds_the_file(
    store: JsonlEventStore, tmp_path: Path
) -> None:
    fd = os.open(tmp_path / "runs.jsonl", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as another process's append would
    try:
        assert store.append_if_idle([ev(1)]) is False
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert store.read("r") == []
    assert store.append_if_idle([ev(1)]) is True


def test_append_if_idle_gives_up_while_another_thread_holds_the_store(
    store: JsonlEventStore,
) -> None:
    with store._lock:
        assert store.append_if_idle([ev(1)]) is False
    assert store.read("r") == []


def test_append_if_idle_reports_conflicts_like_append(store: JsonlEventStore) -> None:
    store.append([ev(1)])
    with pytest.raises(StoreConflictError, match="seq 1 already exists"):
        store.append_if_idle([ev(1)])
    assert store.append_if_idle([]) is True
