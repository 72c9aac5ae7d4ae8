"""SqliteEventStore internals the contract tests cannot see: which commits sync the disk, the
idle append on the caller's thread, small pages for new files, checkpoints after commits, and
the runs row left alone by bookkeeping batches."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel.store.sqlite as sqlite_module
from fsm_kernel.errors import StoreConflictError, StoreError, StoreSchemaError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.store._synccost import INLINE_SYNC_MAX, SyncCost

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def ev(
    seq: int,
    type_: EventType = EventType.STATE_ENTERED,
    *,
    iteration: int = 0,
    data: dict[str, Any] | None = None,
) -> Event:
    if data is None:
        data = {"workflow": "w", "goal": "g"} if type_ is EventType.RUN_STARTED else {}
    return Event(
        run_id="r",
        seq=seq,
        type=type_,
        timestamp=T0 + timedelta(seconds=seq),
        iteration=iteration,
        state="think",
        data=data,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteEventStore]:
    with SqliteEventStore(tmp_path / "runs.db") as opened:
        opened.append([ev(1, EventType.RUN_STARTED)])
        yield opened


def traced(store: SqliteEventStore) -> list[str]:
    statements: list[str] = []
    conn = store._conn
    assert conn is not None
    conn.set_trace_callback(statements.append)
    return statements


def syncs_of(store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each sync the store makes, as the name of the file synced, and each
    statement (as "SQL")."""
    log = traced(store)
    real = sqlite_module._datasync

    def datasync(fd: int) -> None:
        synced = os.fstat(fd).st_ino
        names = [p.name for p in store.path.parent.iterdir() if p.stat().st_ino == synced]
        log.append(f"sync {names[0]}")
        real(fd)

    monkeypatch.setattr(sqlite_module, "_datasync", datasync)
    return log


def test_a_relaxed_commit_does_not_sync_and_a_durable_one_syncs_the_wal_after_it(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store._conn is not None
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL, for good
    log = syncs_of(store, monkeypatch)
    store.append([ev(2)], durable=False)
    store.append([ev(3)], durable=False)
    assert not [s for s in log if s.startswith("sync")]
    del log[:]
    store.append([ev(4)])
    assert log[-2:] == ["COMMIT", "sync runs.db-wal"]  # what was committed is on disk
    assert not [s for s in log if "synchronous" in s]  # no mode switched back and forth
    assert [e.seq for e in store.read("r")] == [1, 2, 3, 4]


def test_a_failed_sync_fails_the_append(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sqlite_module, "_datasync", broken)
    store.append([ev(2)], durable=False)  # no sync: fine
    with pytest.raises(StoreError, match=r"runs\.db: append not synced to disk: .*Input/output"):
        store.append([ev(3)])


def test_a_store_without_wal_syncs_every_commit_itself(tmp_path: Path) -> None:
    with SqliteEventStore(":memory:") as store:
        assert store._conn is not None
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        store.append([ev(1, EventType.RUN_STARTED)])
        assert store._wal_fd is None  # nothing of its own to sync
        assert len(store.read("r")) == 1


def test_append_if_idle_commits_on_the_calling_thread(
    store: SqliteEventStore, tmp_path: Path
) -> None:
    statements = traced(store)
    assert store.append_if_idle([ev(2)]) is True
    assert statements[-1] == "COMMIT"
    with SqliteEventStore(tmp_path / "runs.db") as other:  # committed: another reader sees it
        assert [e.seq for e in other.read("r")] == [1, 2]
    assert store.append_if_idle([]) is True


def test_append_if_idle_gives_up_while_another_process_writes(
    store: SqliteEventStore, tmp_path: Path
) -> None:
    writer = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # holds the write lock, as another process's commit would
    try:
        assert store.append_if_idle([ev(2)]) is False  # at once, not after busy_timeout
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert [e.seq for e in store.read("r")] == [1]  # nothing written
    conn = store._conn
    assert conn is not None
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000  # restored
    store.append([ev(2)], durable=False)  # the fallback goes through
    assert [e.seq for e in store.read("r")] == [1, 2]


def test_append_if_idle_gives_up_while_another_thread_holds_the_store(
    store: SqliteEventStore,
) -> None:
    with store._lock:
        assert store.append_if_idle([ev(2)]) is False
    assert [e.seq for e in store.read("r")] == [1]


def test_append_if_idle_gives_up_while_other_appends_wait_for_the_connection(
    store: SqliteEventStore,
) -> None:
    waiting = sqlite_module.PendingAppend(batch=[ev(2)], rows=[], runs=[], durable=True)
    store._queue.append(waiting)  # another thread's append, queued for the lock
    try:
        assert store.append_if_idle([ev(3)]) is False  # it would jump the queue
    finally:
        store._queue.clear()
    assert [e.seq for e in store.read("r")] == [1]


def test_a_failed_checkpoint_is_logged_and_the_commit_stands(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoCheckpoints:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, sql: str, *args: Any) -> Any:
            if "wal_checkpoint" in sql:
                raise sqlite3.OperationalError("disk I/O error")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.conn, name)

    monkeypatch.setattr(sqlite_module, "CHECKPOINT_EVERY", 1)
    real = store._conn
    assert real is not None
    store._conn = NoCheckpoints(real)  # type: ignore[assignment]
    try:
        store.append([ev(2)])
    finally:
        store._conn = real
    assert [e.seq for e in store.read("r")] == [1, 2]
    [record] = [r for r in caplog.records if "checkpoint failed" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert record.getMessage() == f"{store.path}: checkpoint failed: disk I/O error"


def test_append_if_idle_reports_conflicts_like_append(store: SqliteEventStore) -> None:
    with pytest.raises(StoreConflictError, match="seq 1 already exists"):
        store.append_if_idle([ev(1)])


def test_concurrent_appends_share_commits_and_fail_alone(store: SqliteEventStore) -> None:
    threads = 12
    barrier = threading.Barrier(threads)
    outcomes: dict[int, str] = {}

    def work(n: int) -> None:
        barrier.wait()
        events = [ev(1)] if n == 5 else [ev(100 + 2 * n), ev(101 + 2 * n)]
        try:
            store.append(events, durable=n % 2 == 0)
            outcomes[n] = "ok"
        except StoreConflictError:
            outcomes[n] = "conflict"

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert outcomes == {n: "conflict" if n == 5 else "ok" for n in range(threads)}
    written = sorted(s for n in range(threads) if n != 5 for s in (100 + 2 * n, 101 + 2 * n))
    expected = [1, *written]
    assert [e.seq for e in store.read("r")] == expected
    assert store.read("r")[0].type is EventType.RUN_STARTED


def test_a_new_database_gets_small_pages_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "new.db") as new:
        assert new._conn is not None
        assert new._conn.execute("PRAGMA page_size").fetchone()[0] == 1024
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("PRAGMA page_size = 4096")
    old.execute("CREATE TABLE other (x)")
    old.commit()
    old.close()
    with SqliteEventStore(tmp_path / "old.db") as store:
        store.append([ev(1, EventType.RUN_STARTED)])
        assert store._conn is not None
        assert store._conn.execute("PRAGMA page_size").fetchone()[0] == 4096
        assert len(store.read("r")) == 1


def test_checkpoints_follow_durable_commits_never_idle_ones(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "CHECKPOINT_EVERY", 3)
    assert store._conn is not None
    assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    statements = traced(store)
    for seq in range(2, 8):
        assert store.append_if_idle([ev(seq)])
    assert not [s for s in statements if "wal_checkpoint" in s]
    store.append([ev(8)])
    assert [s for s in statements if "wal_checkpoint" in s] == ["PRAGMA wal_checkpoint(PASSIVE)"]


def test_a_durable_idle_append_waits_until_the_disk_is_known_to_be_fast(
    store: SqliteEventStore,
) -> None:
    store._sync_cost = SyncCost()  # nothing measured yet: the loop must not wait on the disk
    statements = traced(store)
    assert store.append_if_idle([ev(2)], durable=True) is False
    assert [e.seq for e in store.read("r")] == [1]  # nothing written
    store.append([ev(2)])  # a durable commit made the usual way measures the disk
    assert store._sync_cost.average is not None
    store._sync_cost.average = INLINE_SYNC_MAX / 2
    del statements[:]
    assert store.append_if_idle([ev(3)], durable=True) is True
    assert statements[-1] == "COMMIT"
    assert store._sync_cost.average != INLINE_SYNC_MAX / 2  # timed too
    store._sync_cost.average = INLINE_SYNC_MAX * 2  # a slow disk: back to a thread
    assert store.append_if_idle([ev(4)], durable=True) is False
    assert store.append_if_idle([ev(4)]) is True  # a relaxed one waits for no disk
    assert [e.seq for e in store.read("r")] == [1, 2, 3, 4]


def test_a_durable_idle_commit_syncs(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.append([ev(2)], durable=False)
    store._sync_cost.average = 0.0
    log = syncs_of(store, monkeypatch)
    assert store.append_if_idle([ev(3)], durable=True) is True
    assert log[-2:] == ["COMMIT", "sync runs.db-wal"]


def test_a_durable_idle_append_leaves_a_due_checkpoint_to_a_thread(
    store: SqliteEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "CHECKPOINT_EVERY", 3)
    store._sync_cost.average = 0.0
    # The disk stays fast whatever the syncs take here (a busy machine's slow one would rightly
    # send the next durable commit to a thread): only the checkpoint decides.
    monkeypatch.setattr(store._sync_cost, "add", lambda seconds: None)
    store._commits = 0
    assert store.append_if_idle([ev(2)], durable=True) is True
    assert store.append_if_idle([ev(3)], durable=True) is True
    assert store.append_if_idle([ev(4)], durable=True) is False  # the 3rd: a checkpoint is due
    assert store.append_if_idle([ev(4)]) is True  # relaxed: never checkpoints
    statements = traced(store)
    store.append([ev(5)])
    assert "PRAGMA wal_checkpoint(PASSIVE)" in statements
    assert store._commits == 0
    del statements[:]
    assert store.append_if_idle([ev(6)]) is True
    store.append([ev(7)])
    assert "PRAGMA wal_checkpoint(PASSIVE)" not in statements  # 2 commits: not yet
    store.append([ev(8)])
    assert "PRAGMA wal_checkpoint(PASSIVE)" in statements  # the 3rd


def test_the_wal_is_rewritten_in_place_not_grown(store: SqliteEventStore) -> None:
    wal = store.path.with_name(store.path.name + "-wal")
    sizes = []
    for seq in range(2, 1202):
        store.append([ev(seq, data={"text": "x" * 300})], durable=seq % 2 == 0)
        if seq % 300 == 0:
            sizes.append(wal.stat().st_size)
    # a checkpoint every CHECKPOINT_EVERY (64) commits lets the next commit start the WAL
    # over: about 64 commits of a few 1 KiB pages, which fit in the zeros it was given when
    # the store opened, so it never grows, whatever the number of commits
    assert sizes == [sqlite_module.WAL_PRESIZE] * 4, sizes


def test_bookkeeping_batches_leave_the_runs_row_alone(store: SqliteEventStore) -> None:
    statements = traced(store)
    store.append([ev(2), ev(3)], durable=False)  # states entered: nothing for `runs`
    assert not [s for s in statements if "INSERT INTO runs" in s]
    store.append([ev(4, EventType.ITERATION_COMPLETED, iteration=1)])
    assert [s for s in statements if s.startswith("UPDATE runs")]
    [summary] = store.list_runs()
    assert (summary.workflow, summary.iterations, summary.termination_reason) == ("w", 1, None)
    store.append([ev(5, EventType.RUN_TERMINATED, iteration=1, data={"reason": "done"})])
    assert store.list_runs()[0].termination_reason == "done"


def test_an_iterations_progress_updates_the_runs_row_without_touching_its_indexes(
    store: SqliteEventStore,
) -> None:
    statements = traced(store)
    responded = {"completion": {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}}
    store.append([ev(2, EventType.MODEL_RESPONDED, data=responded)])
    store.append([ev(3, EventType.ITERATION_COMPLETED, iteration=1)], durable=False)
    runs_writes = [s.split()[0] for s in statements if "runs" in s and "SELECT" not in s]
    assert runs_writes == ["UPDATE", "UPDATE"]  # not the upsert that names status, reason
    [summary] = store.list_runs()
    assert (summary.iterations, summary.tokens, summary.status) == (1, 7, "interrupted")
    assert summary.updated_at == T0 + timedelta(seconds=3)
    statements.clear()
    store.append([ev(4, EventType.RUN_TERMINATED, iteration=1, data={"reason": "done"})])
    assert [s.split()[0] for s in statements if "INTO runs" in s] == ["INSERT"]  # the ending
    [summary] = store.list_runs()
    assert (summary.iterations, summary.tokens, summary.termination_reason) == (1, 7, "done")
    assert summary.status == "ended"


def test_progress_of_a_run_this_store_has_not_written_goes_through_the_upsert(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    with SqliteEventStore(path) as first:
        first.append([ev(1, EventType.RUN_STARTED)])
    with SqliteEventStore(path) as second:  # another process: it does not know the row
        statements = traced(second)
        second.append([ev(2, EventType.ITERATION_COMPLETED, iteration=1)])
        assert [s.split()[0] for s in statements if "INTO runs" in s] == ["INSERT"]
        assert second.list_runs()[0].iterations == 1


def test_a_reopened_store_creates_the_runs_row_of_a_bookkeeping_batch(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "runs.db") as store:
        store.append([ev(2)], durable=False)  # a run seen before its start: the row is made
        assert [r.run_id for r in store.list_runs()] == ["r"]


# --- read-only (the run viewer) ---------------------------------------------------------------


def test_a_read_only_store_reads_while_a_writer_holds_the_write_lock(
    store: SqliteEventStore,
) -> None:
    store.append([ev(2, EventType.ITERATION_COMPLETED, iteration=1)])
    writer = sqlite3.connect(store.path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # a run in the middle of a commit
        writer.execute("UPDATE runs SET goal = 'changing'")
        with SqliteEventStore(store.path, read_only=True, busy_timeout=0) as reader:
            assert [e.seq for e in reader.read("r")] == [1, 2]
            assert reader.list_runs()[0].goal == "g"  # the last committed state
            assert reader.count_runs() == 1
        writer.execute("COMMIT")
    finally:
        writer.close()
    store.append([ev(3)])  # and the reader never held up the writer


def test_a_read_only_store_refuses_appends_and_sees_later_commits(
    store: SqliteEventStore,
) -> None:
    with SqliteEventStore(store.path, read_only=True) as reader:
        with pytest.raises(StoreError, match="read-only"):
            reader.append([ev(2)])
        store.append([ev(2, EventType.ITERATION_COMPLETED, iteration=1)])
        assert reader.next_seq("r") == 3
        assert reader.list_runs()[0].iterations == 1
    assert [e.seq for e in store.read("r")] == [1, 2]


def test_a_read_only_store_must_exist_with_the_current_schema(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such event store"):
        SqliteEventStore(tmp_path / "missing.db", read_only=True)
    assert not (tmp_path / "missing.db").exists()
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(StoreSchemaError, match="not an fsm-kernel event store"):
        SqliteEventStore(other, read_only=True)
    old = tmp_path / "old.db"
    with SqliteEventStore(old) as current:
        current.append([ev(1, EventType.RUN_STARTED)])
    conn = sqlite3.connect(old)
    conn.execute("DELETE FROM schema_migrations WHERE version > 1")
    conn.commit()
    conn.close()
    with pytest.raises(StoreSchemaError, match="older fsm-kernel"):
        SqliteEventStore(old, read_only=True)


# --- the WAL pre-sized with zeros before a store's first commit ------------------------------


def wal_of(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def test_a_store_extends_its_wal_with_zeros_that_readers_and_recovery_ignore(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    store = SqliteEventStore(path)
    store.append([ev(1, EventType.RUN_STARTED), ev(2)])
    assert wal_of(path).stat().st_size == sqlite_module.WAL_PRESIZE
    store.append([ev(3)], durable=False)
    data = wal_of(path).read_bytes()
    assert len(data) == sqlite_module.WAL_PRESIZE  # the frames went into the zeros
    assert data[:4] in (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")  # SQLite's WAL header
    assert data[-4096:] == bytes(4096)
    other = sqlite3.connect(path)  # another process's connection reads the frames
    assert [r[0] for r in other.execute("SELECT seq FROM run_events ORDER BY seq")] == [1, 2, 3]
    other.close()
    store.close()
    assert not wal_of(path).exists()  # checkpointed and removed at the last close, as always
    reopened = SqliteEventStore(path)
    assert [e.seq for e in reopened.read("r")] == [1, 2, 3]
    assert reopened._conn is not None
    assert reopened._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    reopened.close()


def test_zeros_go_past_the_frames_of_a_wal_in_use_and_nothing_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    monkeypatch.setattr(sqlite_module, "WAL_PRESIZE", 2048)
    first = SqliteEventStore(path)
    first.append([ev(1, EventType.RUN_STARTED)] + [ev(s, data={"x": "y" * 300}) for s in (2, 3)])
    in_use = wal_of(path).stat().st_size
    assert in_use > 2048  # frames past the first store's zeros
    monkeypatch.setattr(sqlite_module, "WAL_PRESIZE", in_use + 64 * 1024)
    second = SqliteEventStore(path)  # another process opening the store while the first writes
    second.append([ev(4)])
    assert wal_of(path).stat().st_size == in_use + 64 * 1024
    first.append([ev(5)], durable=False)
    assert [e.seq for e in second.read("r")] == [1, 2, 3, 4, 5]
    first.close()
    second.close()
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert [r[0] for r in check.execute("SELECT seq FROM run_events ORDER BY seq")] == [
        1,
        2,
        3,
        4,
        5,
    ]
    check.close()


def test_the_zeros_are_written_a_page_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One big write would give the page cache big folios, and every later commit would then
    # dirty, and its sync write, a whole folio (hundreds of KiB) instead of a few pages.
    sizes: list[int] = []
    real = sqlite_module.os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        sizes.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(sqlite_module.os, "pwrite", pwrite)
    store = SqliteEventStore(tmp_path / "runs.db")
    store.append([ev(1, EventType.RUN_STARTED)])
    store.close()
    assert sizes
    assert max(sizes) <= 4096
    assert len(sizes) == -(-sum(sizes) // 4096)  # each write a whole page (the last: the rest)
    assert sum(sizes) >= sqlite_module.WAL_PRESIZE - 64 * 1024  # (SQLite's own WAL bytes: few)


def test_the_zeros_wait_for_no_other_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "runs.db"
    store = SqliteEventStore(path, busy_timeout=30)
    before = wal_of(path).stat().st_size
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with caplog.at_level("DEBUG", logger="fsm_kernel.store.sqlite"):
            store._presize_wal()  # at once: SQLITE_BUSY, not a 30 s wait
        assert f"{path}: WAL not pre-sized: database is locked" in caplog.text
        assert wal_of(path).stat().st_size == before < sqlite_module.WAL_PRESIZE
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert store._conn is not None
    assert store._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000  # restored
    assert not store._conn.in_transaction
    store._presize_wal()  # free again: done
    assert wal_of(path).stat().st_size == sqlite_module.WAL_PRESIZE
    store.append([ev(1, EventType.RUN_STARTED)])
    assert [e.seq for e in store.read("r")] == [1]
    store.close()


def test_a_wal_that_cannot_be_extended_only_costs_the_speed_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sqlite_module.os, "pwrite", full)
    store = SqliteEventStore(tmp_path / "runs.db")
    with caplog.at_level("DEBUG", logger="fsm_kernel.store.sqlite"):
        store.append([ev(1, EventType.RUN_STARTED)])
    assert f"{tmp_path / 'runs.db'}: WAL not pre-sized: [Errno 28] No space left on device" in (
        caplog.text
    )
    assert [e.seq for e in store.read("r")] == [1]
    assert store._conn is not None
    assert not store._conn.in_transaction  # the lock taken for it is given back
    store.close()


def test_a_store_not_in_wal_mode_is_not_given_zeros(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    store = SqliteEventStore(path)
    assert store._conn is not None
    store._conn.execute("PRAGMA journal_mode = DELETE")  # as on a filesystem without WAL
    assert not wal_of(path).exists()
    store._presize_wal()
    assert not wal_of(path).exists()
    store.close()
    closed = sqlite3.connect(":memory:")
    closed.close()
    assert SqliteEventStore._in_wal_mode(closed) is False  # unreadable: not WAL


def test_read_only_and_in_memory_stores_leave_the_wal_alone(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    store = SqliteEventStore(path)
    store.append([ev(1, EventType.RUN_STARTED)])
    store.close()
    viewer = SqliteEventStore(path, read_only=True)
    assert not wal_of(path).exists() or wal_of(path).stat().st_size == 0
    viewer.close()
    before = sorted(p.name for p in tmp_path.iterdir())
    SqliteEventStore(":memory:").close()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --- events keyed by run number and seq (schema v5) -----------------------------------------


def test_events_are_keyed_by_run_number_and_seq_and_read_through_the_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    with SqliteEventStore(path) as store:
        for seq in (1, 2, 3):  # two runs written turn about
            for run in ("a", "b"):
                kind = EventType.RUN_STARTED if seq == 1 else EventType.STATE_ENTERED
                store.append([Event(**{**ev(seq, kind).__dict__, "run_id": run})])
        assert [(e.run_id, e.seq) for e in store.read("b")] == [("b", 1), ("b", 2), ("b", 3)]
        conn = store._conn
        assert conn is not None
        assert (
            conn.execute(  # no index of (run_id, seq) to write beside the table
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events'"
            ).fetchall()
            == []
        )
        numbers = dict(conn.execute("SELECT run_id, run_no FROM runs").fetchall())
        assert sorted(numbers.values()) == [1, 2]
        keys = [
            k
            for (k,) in conn.execute("SELECT key FROM events WHERE key >> 32 = ?", (numbers["b"],))
        ]
        assert keys == [(numbers["b"] << 32) | s for s in (1, 2, 3)]
        from fsm_kernel.store._sql import SQLITE

        for sql, params in [
            (SQLITE.sql.select_events, ("b",)),
            (SQLITE.sql.next_seq, ("b",)),
            (SQLITE.sql.event_exists, ("b", 2)),
        ]:
            plan = " ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))
            assert "USING INTEGER PRIMARY KEY" in plan, plan
            assert "SCAN" not in plan, plan
    with SqliteEventStore(path) as other:  # another process numbers the next run after them
        other.append([Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": "c"})])
        assert other.next_seq("a") == 4
        assert other._conn is not None
        assert other._conn.execute("SELECT run_no FROM runs WHERE run_id = 'c'").fetchone() == (3,)


def test_an_event_row_holds_its_run_and_seq_only_in_its_key_and_the_view_shows_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    with SqliteEventStore(path) as store:
        for run in ("a", "b"):
            store.append(
                [
                    Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": run}),
                    Event(**{**ev(2).__dict__, "run_id": run}),
                ]
            )
        read = store.read("a") + store.read("b")
    conn = sqlite3.connect(path)
    columns = [row[1] for row in conn.execute("PRAGMA table_info(events)")]
    assert columns == ["key", "type", "ts", "iteration", "state", "version", "data"]
    shown = conn.execute(
        "SELECT run_id, seq, type, iteration, state FROM run_events ORDER BY run_id, seq"
    ).fetchall()
    assert shown == [(e.run_id, e.seq, e.type.value, e.iteration, e.state) for e in read]
    assert [(e.run_id, e.seq) for e in read] == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    conn.close()


def test_a_seq_past_the_key_range_is_refused_and_nothing_is_written(
    store: SqliteEventStore,
) -> None:
    with pytest.raises(StoreError, match=r"r#4294967296: seq must be < 2\*\*32"):
        store.append([ev(2), ev(1 << 32)])
    assert [e.seq for e in store.read("r")] == [1]


def test_a_batch_that_fails_does_not_leave_its_run_number_behind(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "runs.db") as store:
        store.append([ev(1, EventType.RUN_STARTED)])
        new = Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": "n"})
        errors = store.append_batches([([new, new], True), ([ev(2)], True)])
        assert isinstance(errors[0], StoreConflictError)  # the same seq twice: rolled back
        assert errors[1] is None
        assert "n" not in store._run_nos
        assert store.list_runs()[0].run_id == "r"
        store.append([new])  # numbered now, after the runs that exist
        assert store._run_nos["n"] == 2
        assert [e.seq for e in store.read("n")] == [1]


def test_a_runs_events_end_where_the_next_runs_begin(tmp_path: Path) -> None:
    last = (1 << 32) - 1  # the highest seq a key holds
    with SqliteEventStore(tmp_path / "runs.db") as store:
        store.append([Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": "a"})])
        store.append([Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": "b"})])
        store.append([Event(**{**ev(last).__dict__, "run_id": "a"})])
        assert [(e.run_id, e.seq) for e in store.read("a")] == [("a", 1), ("a", last)]
        assert [(e.run_id, e.seq) for e in store.read("b")] == [("b", 1)]
        assert store.next_seq("a") == last + 1
        assert store.next_seq("b") == 2
        with pytest.raises(StoreConflictError, match=f"run a: seq {last} already exists"):
            store.append([Event(**{**ev(last).__dict__, "run_id": "a"})])


def test_a_batch_looks_a_runs_number_up_once_and_a_known_run_never(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "runs.db") as first:
        first.append([ev(1, EventType.RUN_STARTED)])
    with SqliteEventStore(tmp_path / "runs.db") as store:  # knows no number yet
        statements = traced(store)
        store.append([ev(2), ev(3), ev(4)])
        store.append([ev(5)])
        lookups = [s for s in statements if s.startswith("SELECT run_no FROM runs")]
        assert len(lookups) == 1
        assert [e.seq for e in store.read("r")] == [1, 2, 3, 4, 5]


def test_a_batch_of_several_runs_numbers_each_and_keeps_a_known_ones_row(
    store: SqliteEventStore,
) -> None:
    other = Event(**{**ev(1, EventType.RUN_STARTED).__dict__, "run_id": "n"})
    store.append([ev(2), other])  # the known run's bookkeeping first, then a new run
    assert [e.seq for e in store.read("n")] == [1]
    assert sorted(r.run_id for r in store.list_runs()) == ["n", "r"]


def test_a_batchs_tokens_add_up_and_an_ending_without_a_reason_has_none(
    store: SqliteEventStore,
) -> None:
    def responded(seq: int, used: int) -> Event:
        usage = {"prompt_tokens": used, "completion_tokens": 1}
        return ev(seq, EventType.MODEL_RESPONDED, data={"completion": {"usage": usage}})

    store.append([responded(2, 10), responded(3, 20)])
    assert store.list_runs()[0].tokens == 32
    store.append([ev(4, EventType.RUN_TERMINATED, data={})])
    [summary] = store.list_runs()
    assert (summary.status, summary.termination_reason) == ("ended", None)


def test_a_store_opened_to_be_read_writes_nothing_and_its_first_commit_gives_the_zeros(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    with SqliteEventStore(path) as store:
        store.append([ev(1, EventType.RUN_STARTED)])
    writes: list[int] = []
    real = sqlite_module.os.pwrite
    monkeypatch.setattr(
        sqlite_module.os,
        "pwrite",
        lambda fd, data, at: writes.append(len(data)) or real(fd, data, at),
    )
    with SqliteEventStore(path) as reader:  # as `runs list` opens it
        assert [r.run_id for r in reader.list_runs()] == ["r"]
        assert writes == []
        assert wal_of(path).stat().st_size < sqlite_module.WAL_PRESIZE
        assert reader.append_if_idle([ev(2)]) is True  # the first commit: on the event loop
        assert sum(writes) >= sqlite_module.WAL_PRESIZE - 64 * 1024
        assert reader._conn is not None
        assert reader._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0  # left impatient
        reader.append([ev(3)])  # no second round of zeros
        assert sum(writes) < sqlite_module.WAL_PRESIZE + 4096
        assert [e.seq for e in reader.read("r")] == [1, 2, 3]


def test_a_read_only_open_gives_only_a_scheduler_database_the_event_schema(
    tmp_path: Path,
) -> None:
    from fsm_kernel.store import open_store

    scheduler = tmp_path / "scheduler.db"
    sqlite3.connect(scheduler).execute("CREATE TABLE scheduler_ticks (x)").connection.close()
    with open_store(scheduler, read_only=True) as store:
        assert store.list_runs() == []
    foreign = tmp_path / "app.db"
    sqlite3.connect(foreign).execute("CREATE TABLE scheduler_ticks (x)").execute(
        "CREATE TABLE users (name)"
    ).connection.close()
    with pytest.raises(StoreSchemaError, match="not an fsm-kernel event store"):
        open_store(foreign, read_only=True)
    tables = sqlite3.connect(foreign).execute("SELECT name FROM sqlite_master").fetchall()
    assert sorted(tables) == [("scheduler_ticks",), ("users",)]


def test_data_shared_by_events_is_encoded_once_and_stored_like_any_other(
    store: SqliteEventStore,
) -> None:
    from fsm_kernel.redact import Redacted, SharedData, register_secret
    from fsm_kernel.store._schema import encode_data

    shared = Redacted({"target": "act", "key": "tok-5521-secret", "n": [1, 2]})
    first = shared.get()
    store.append([ev(2, data=first), ev(3, data=first)])
    assert isinstance(first, SharedData)
    assert first.encoded == '{"key":"tok-5521-secret","n":[1,2],"target":"act"}'
    first.encoded = '{"cached":true}'  # what a second encoding of it would now write
    assert encode_data(ev(4, data=first)) == '{"cached":true}'

    register_secret("tok-5521-secret")  # a new value, encoded anew: the secret never leaks
    store.append([ev(5, data=shared.get())])
    stored = {e.seq: e.data for e in store.read("r")}
    assert stored[2] == stored[3] == {"key": "tok-5521-secret", "n": [1, 2], "target": "act"}
    assert stored[5] == {"key": "[REDACTED]", "n": [1, 2], "target": "act"}


def test_timestamps_are_stored_as_utc_text_whatever_their_offset() -> None:
    from datetime import timezone

    from fsm_kernel.store._schema import format_ts

    plus_two = timezone(timedelta(hours=2))
    assert (
        format_ts(datetime(2026, 1, 1, 12, 0, tzinfo=plus_two))
        == "2026-01-01T10:00:00.000000+00:00"
    )
    assert (
        format_ts(datetime(2026, 1, 1, 12, 0, 5, 7, tzinfo=UTC))
        == "2026-01-01T12:00:05.000007+00:00"
    )


def test_timestamps_format_as_isoformat_does_across_seconds_days_and_going_back() -> None:
    """format_ts keeps the text of the last second it formatted: each timestamp, whichever
    came before it (the same second, the next, a day or a year later, an earlier one, another
    offset, a zone other than `UTC` at offset 0), is still exactly its isoformat in UTC."""
    from datetime import timezone
    from zoneinfo import ZoneInfo

    from fsm_kernel.store._schema import format_ts

    def iso(ts: datetime) -> str:
        return ts.astimezone(UTC).isoformat(timespec="microseconds")

    base = datetime(2026, 12, 31, 23, 59, 58, 999_998, tzinfo=UTC)
    steps = [0, 1, 1, 999_998, 1, 1_000_000, 86_400_000_000, -1, -86_400_000_001, 5]
    stamps = [base]
    for micros in steps:
        stamps.append(stamps[-1] + timedelta(microseconds=micros))
    stamps += [
        datetime(2026, 1, 1, 0, 0, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=ZoneInfo("UTC")),
        datetime(2026, 3, 29, 3, 30, 0, 250_000, tzinfo=ZoneInfo("Europe/Berlin")),
        datetime(2026, 3, 29, 1, 30, 0, 250_000, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(1, 1, 1, 0, 0, 0, 42, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
    ]
    formatted = [format_ts(ts) for ts in stamps]
    assert formatted == [iso(ts) for ts in stamps]
    assert formatted[:7] == [
        "2026-12-31T23:59:58.999998+00:00",
        "2026-12-31T23:59:58.999998+00:00",
        "2026-12-31T23:59:58.999999+00:00",
        "2026-12-31T23:59:59.000000+00:00",
        "2026-12-31T23:59:59.999998+00:00",
        "2026-12-31T23:59:59.999999+00:00",
        "2027-01-01T00:00:00.999999+00:00",
    ]
    assert formatted[9:11] == [  # back a day, then into the next second
        "2027-01-01T00:00:00.999997+00:00",
        "2027-01-01T00:00:01.000002+00:00",
    ]
    assert formatted[-6] == "2026-03-29T01:30:00.250000+00:00"  # Berlin's summer time, +02:00
    assert formatted[-3] == "0001-01-01T00:00:00.000042+00:00"
