"""JsonlEventStore internals the contract tests cannot see: which appends fsync, the idle
append on the caller's thread, the space reserved past the end of the file, and appended
events kept as their lines until read."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from fsm_kernel.errors import StoreConflictError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore, jsonl

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


# --- space reserved past the end of the file -----------------------------------------------

RESERVES = sys.platform.startswith("linux")


def reserved_bytes(path: Path) -> int:
    """Bytes allocated to the file beyond its size (what a reservation adds)."""
    st = os.stat(path)
    return st.st_blocks * 512 - st.st_size


def exact_lines(path: Path, count: int) -> list[bytes]:
    """The file's lines, after checking it holds `count` complete lines and nothing else."""
    data = path.read_bytes()
    assert b"\0" not in data
    assert data.endswith(b"\n")
    lines = data.split(b"\n")[:-1]
    assert len(lines) == count
    assert all(line.startswith(b"{") and line.endswith(b"}") for line in lines)
    return lines


def reservation_supported(directory: Path) -> bool:
    probe = directory / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        jsonl._fallocate_keep_size(fd, 0, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
    return True


@pytest.fixture
def reserving(tmp_path: Path) -> Path:
    """A directory on a file system where fallocate(FALLOC_FL_KEEP_SIZE) works."""
    if not RESERVES or not reservation_supported(tmp_path):
        pytest.skip("no fallocate(FALLOC_FL_KEEP_SIZE) here")
    return tmp_path


def test_space_is_reserved_past_the_end_and_never_read(reserving: Path) -> None:
    path = reserving / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev(1), ev(2)])
        store.append([ev(3)], durable=False)
        assert os.stat(path).st_size == store._offset  # the size is the lines' bytes
        assert reserved_bytes(path) >= jsonl._RESERVE_MIN - os.stat(path).st_size
        exact_lines(path, 3)
        with JsonlEventStore(path, read_only=True) as reader:
            assert [e.seq for e in reader.read("r")] == [1, 2, 3]


def test_close_gives_the_reserved_space_back(reserving: Path) -> None:
    path = reserving / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev(1), ev(2), ev(3)])
        written = store.read("r")
        assert reserved_bytes(path) > 1 << 20
    assert reserved_bytes(path) < 8192  # the last block's slack at most
    exact_lines(path, 3)
    with JsonlEventStore(path) as reopened:
        assert reopened.read("r") == written


def test_a_store_closed_without_appending_changes_nothing(reserving: Path) -> None:
    path = reserving / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev(1)])
    before = os.stat(path)
    with JsonlEventStore(path) as store:
        assert [e.seq for e in store.read("r")] == [1]
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_blocks) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_blocks,
    )


_DIES_WITHOUT_CLOSING = """
import os, sys
from datetime import UTC, datetime, timedelta
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore

store = JsonlEventStore(sys.argv[1])
t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
for seq in range(1, 51):
    store.append([Event(run_id="r", seq=seq, type=EventType.STATE_ENTERED,
                        timestamp=t0 + timedelta(seconds=seq), data={"n": seq})])
os.write(store._fd, b'{"run_id": "r", "seq": 51, "ty')  # killed in the middle of a line
os._exit(0)  # no close: the reservation stays, as after a crash
"""


def test_a_store_that_dies_without_closing_keeps_every_synced_event(reserving: Path) -> None:
    path = reserving / "runs.jsonl"
    subprocess.run(
        [sys.executable, "-c", _DIES_WITHOUT_CLOSING, str(path)],
        check=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert reserved_bytes(path) > 1 << 20  # reserved space, not data: the size is the bytes
    assert path.read_bytes().endswith(b'"seq": 51, "ty')
    with JsonlEventStore(path) as store:
        assert [e.seq for e in store.read("r")] == list(range(1, 51))
        assert [e.data for e in store.read("r")] == [{"n": n} for n in range(1, 51)]
        store.append([ev(51)])  # cuts the torn line off first
    exact_lines(path, 51)
    assert reserved_bytes(path) < 8192  # the next writer's close gave the space back
    with JsonlEventStore(path) as reopened:
        assert [e.seq for e in reopened.read("r")] == list(range(1, 52))


def test_stores_sharing_a_file_keep_every_line_when_one_closes(reserving: Path) -> None:
    path = reserving / "runs.jsonl"
    first, second = JsonlEventStore(path), JsonlEventStore(path)
    try:
        first.append([ev(1)])
        second.append([ev(2)])
        first.close()  # gives back the space past the end, the second store's too
        second.append([ev(3)])
        second.append([ev(4)], durable=False)
        exact_lines(path, 4)
        with JsonlEventStore(path) as reader:
            assert [e.seq for e in reader.read("r")] == [1, 2, 3, 4]
    finally:
        first.close()
        second.close()
    exact_lines(path, 4)


def test_a_file_system_without_fallocate_is_appended_to_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []

    def unsupported(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(jsonl, "_fallocate_keep_size", unsupported)
    path = tmp_path / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev(1)])
        store.append([ev(2)])
        assert len(calls) == (1 if RESERVES else 0)  # tried once, then never again
        assert store._reservation.end == 0
    exact_lines(path, 2)
    with JsonlEventStore(path) as reopened:
        assert [e.seq for e in reopened.read("r")] == [1, 2]


def test_each_reservation_is_as_large_as_the_file_within_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(jsonl, "_fallocate_keep_size", lambda fd, o, n: calls.append((o, n)))
    reservation = jsonl._Reservation()
    reservation.enabled = True
    mib = 1 << 20
    reservation.cover(-1, 0, 100)
    reservation.cover(-1, 100, 200)  # within what is reserved: no call
    reservation.cover(-1, 4 * mib - 10, 100)  # past it: at least _RESERVE_MIN again
    reservation.cover(-1, 20 * mib, 100)  # then as much again as the file holds
    reservation.cover(-1, 500 * mib, 100)  # a large file: at most _RESERVE_MAX
    reservation.cover(-1, 600 * mib, 80 * mib)  # a batch larger than that: all of it
    assert calls == [
        (0, 4 * mib),
        (4 * mib - 10, 4 * mib),
        (20 * mib, 20 * mib),
        (500 * mib, 64 * mib),
        (600 * mib, 80 * mib),
    ]
    assert reservation.end == 680 * mib


# --- appended events kept as their lines ----------------------------------------------------


def test_appended_events_read_back_as_a_reopened_store_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    paris = timezone(timedelta(hours=2))
    data = {"workflow": "w", "goal": "g", "nested": {"k": [1, 2]}}
    started = Event(
        run_id="r",
        seq=1,
        type=EventType.RUN_STARTED,
        timestamp=datetime(2026, 3, 1, 14, 0, 0, 123456, tzinfo=paris),
        data=data,
    )
    with JsonlEventStore(path) as store:
        store.append([started, ev(2)])
        assert type(store._events["r"][1]) is bytes  # not decoded until read
        data["nested"]["k"].append(3)  # the caller's dict changes after the append
        summary = store.list_runs()
        events = store.read("r")
        assert type(store._events["r"][1]) is Event  # decoded once, then kept
        assert store.read("r") == events
        with JsonlEventStore(path) as reopened:
            assert reopened.read("r") == events
            assert reopened.list_runs() == summary
    assert events[0].timestamp == datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    assert events[0].timestamp.tzinfo is UTC
    assert events[0].data == {"workflow": "w", "goal": "g", "nested": {"k": [1, 2]}}
    assert summary[0].started_at == events[0].timestamp
    assert summary[0].started_at.tzinfo is UTC
    assert (summary[0].workflow, summary[0].goal) == ("w", "g")
