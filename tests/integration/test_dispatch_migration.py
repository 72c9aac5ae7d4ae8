"""Schema version 1 (table dispatch_tasks) becomes version 2 (kernel_dispatch_tasks, the design's
name) when a queue opens the store: every row and every tick kept, value for value; the old table
gone; a second opening, or several at once, changes nothing. On SQLite and on PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreSchemaError
from fsm_kernel.scheduler import Dispatch, DispatchQueue, DispatchStatus, open_queue
from fsm_kernel.scheduler._queue_sql import POSTGRES, SQLITE
from fsm_kernel.scheduler.queue import (
    LEGACY_COLUMNS,
    SCHEMA_VERSION,
    settle_waiting_dispatch,
)
from tests.unit.test_scheduler_fakes import FakeClock, pg_url

K = "k1"
T0 = datetime(2026, 2, 11, 10, 0, tzinfo=UTC)

# The DDL of schema version 1, as fsm-kernel created it (SQLite, then PostgreSQL).
V1_TABLE = """CREATE TABLE dispatch_tasks (
    dispatch_id TEXT PRIMARY KEY, kernel_id TEXT NOT NULL, agent_id TEXT NOT NULL,
    prompt TEXT NOT NULL, priority INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
    dedupe_key TEXT UNIQUE, worker_id TEXT, lease_expires_at {ts}, attempts INTEGER NOT NULL
    DEFAULT 0, run_id TEXT, termination_reason TEXT, error TEXT, created_at {ts} NOT NULL,
    started_at {ts}, finished_at {ts})"""
V1_REST = (
    """CREATE TABLE scheduler_schema (singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
        version INTEGER NOT NULL)""",
    """CREATE UNIQUE INDEX dispatch_tasks_one_active ON dispatch_tasks (kernel_id, agent_id)
        WHERE status IN ('pending', 'running')""",
    "CREATE INDEX dispatch_tasks_recent ON dispatch_tasks (kernel_id, created_at DESC)",
    """CREATE TABLE scheduler_ticks (kernel_id TEXT NOT NULL, tick_at {ts} NOT NULL,
        fired_at {ts} NOT NULL, PRIMARY KEY (kernel_id, tick_at))""",
    "INSERT INTO scheduler_schema VALUES (1, 1)",
)


def v1_rows() -> list[dict[str, Any]]:
    """One row per status, with every column set where it can be."""

    def row(agent: str, status: str, **values: Any) -> dict[str, Any]:
        base = dict.fromkeys(LEGACY_COLUMNS)
        base.update(
            dispatch_id=str(uuid.uuid4()),
            kernel_id=K,
            agent_id=agent,
            prompt=f"prompt of {agent} with 'quotes' and\nnewlines",
            priority=len(agent),
            status=status,
            dedupe_key=f"{K}:{agent}:t0",
            attempts=0,
            created_at=T0,
        )
        base.update(values)
        return base

    lease = T0 + timedelta(hours=1)
    return [
        row("waiting", "pending"),
        row(
            "busy", "running", worker_id="h:1:ab", lease_expires_at=lease, attempts=7, started_at=T0
        ),
        row(
            "ok",
            "done",
            worker_id="h:2:cd",
            attempts=1,
            run_id="r-ok",
            termination_reason="final_answer",
            started_at=T0,
            finished_at=lease,
        ),
        row(
            "broke",
            "failed",
            worker_id="h:3:ef",
            attempts=2,
            run_id="r-broke",
            termination_reason="timeout",
            error="timed out after 900 s",
            started_at=T0,
            finished_at=lease,
        ),
        row("other", "pending", kernel_id="k2", dedupe_key="k2:other:t0"),
    ]


class Backend:
    """Creates a version 1 store and reads it back, for one backend."""

    def __init__(self, store: str, execute: Callable[[str, Any], list[dict[str, Any]]]) -> None:
        self.store = store
        self.execute = execute

    def tables(self) -> set[str]:
        raise NotImplementedError


class SqliteBackend(Backend):
    def __init__(self, path: Path) -> None:
        def execute(sql: str, params: Any = ()) -> list[dict[str, Any]]:
            conn = sqlite3.connect(path)
            conn.row_factory = sqlite3.Row
            try:
                with conn:
                    return [dict(r) for r in conn.execute(sql.replace("%s", "?"), params)]
            finally:
                conn.close()

        super().__init__(str(path), execute)
        self.ts = "TEXT"

    def value(self, v: Any) -> Any:
        return v.isoformat(timespec="microseconds") if isinstance(v, datetime) else v

    def tables(self) -> set[str]:
        return {
            r["name"] for r in self.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }


class PostgresBackend(Backend):
    def __init__(self, url: str) -> None:
        import psycopg
        from psycopg.rows import dict_row

        def execute(sql: str, params: Any = ()) -> list[dict[str, Any]]:
            with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
                cursor = conn.execute(sql, params or None)
                return list(cursor.fetchall()) if cursor.description else []

        super().__init__(url, execute)
        self.ts = "TIMESTAMPTZ"

    def value(self, v: Any) -> Any:
        return v

    def tables(self) -> set[str]:
        rows = self.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        yield SqliteBackend(tmp_path / "runs.db")
    else:
        yield PostgresBackend(pg_url(request.getfixturevalue("pg_dsn")))


def make_v1(backend: Any, rows: list[dict[str, Any]]) -> None:
    backend.execute(V1_TABLE.format(ts=backend.ts))
    for statement in V1_REST:
        backend.execute(statement.format(ts=backend.ts))
    columns = ", ".join(LEGACY_COLUMNS)
    marks = ", ".join(["%s"] * len(LEGACY_COLUMNS))
    for row in rows:
        values = tuple(backend.value(row[c]) for c in LEGACY_COLUMNS)
        backend.execute(f"INSERT INTO dispatch_tasks ({columns}) VALUES ({marks})", values)
    backend.execute(
        "INSERT INTO scheduler_ticks VALUES (%s, %s, %s)",
        (K, backend.value(T0), backend.value(T0 + timedelta(seconds=1))),
    )


def all_rows(queue: DispatchQueue) -> dict[str, Dispatch]:
    return {d.dispatch_id: d for kernel in (K, "k2") for d in queue.list(kernel, limit=100)}


def test_a_version_1_store_is_migrated_row_for_row(backend: Any) -> None:
    rows = v1_rows()
    make_v1(backend, rows)
    clock = FakeClock(T0 + timedelta(minutes=5))
    queue = open_queue(backend.store, clock=clock)
    try:
        migrated = all_rows(queue)
        assert backend.tables() >= {"kernel_dispatch_tasks", "scheduler_ticks", "scheduler_schema"}
        assert "dispatch_tasks" not in backend.tables()
        assert backend.execute("SELECT version FROM scheduler_schema") == [
            {"version": SCHEMA_VERSION}
        ]
        assert len(migrated) == len(rows)
        for row in rows:
            got = migrated[row["dispatch_id"]]
            assert {c: _plain(getattr(got, c)) for c in LEGACY_COLUMNS} == row
            assert (got.max_attempts, got.cancel_requested_at) == (3, None)
        # the constraints came along: the tick, the dedupe key, one active dispatch per agent
        assert queue.try_acquire_tick(K, T0) is False
        assert queue.enqueue(K, "fresh", "p", 0, f"{K}:ok:t0") is None
        assert queue.enqueue(K, "waiting", "p", 0, "another-key") is None
        assert queue.enqueue(K, "busy", "p", 0, "another-key") is None
        # and it works as a version 2 queue: the pending row is claimed, the lease still holds
        claimed = queue.claim(K, "w-new", 60, 5)
        assert claimed is not None
        assert claimed.agent_id == "waiting"
        assert queue.claim(K, "w-new", 60, 5) is None
    finally:
        queue.close()


def test_migration_is_idempotent_and_safe_to_run_from_several_processes(backend: Any) -> None:
    rows = v1_rows()
    make_v1(backend, rows)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def open_and_close() -> None:
        try:
            barrier.wait()
            open_queue(backend.store).close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_and_close) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    queue = open_queue(backend.store)  # once more, after the migration
    try:
        assert sorted(all_rows(queue)) == sorted(r["dispatch_id"] for r in rows)
    finally:
        queue.close()
    count = backend.execute("SELECT count(*) AS n FROM kernel_dispatch_tasks")
    assert count == [{"n": len(rows)}]


def test_a_new_store_starts_at_version_2_without_the_old_table(backend: Any) -> None:
    open_queue(backend.store).close()
    assert "dispatch_tasks" not in backend.tables()
    assert backend.execute("SELECT version FROM scheduler_schema") == [{"version": SCHEMA_VERSION}]


def test_someone_elses_dispatch_tasks_table_is_left_alone(backend: Any) -> None:
    backend.execute("CREATE TABLE dispatch_tasks (id INTEGER PRIMARY KEY, payload TEXT)")
    backend.execute("INSERT INTO dispatch_tasks VALUES (1, 'theirs')")
    open_queue(backend.store).close()
    assert backend.execute("SELECT payload FROM dispatch_tasks") == [{"payload": "theirs"}]


def test_a_store_newer_than_this_code_is_refused_untouched(backend: Any) -> None:
    rows = v1_rows()
    make_v1(backend, rows)
    backend.execute(f"UPDATE scheduler_schema SET version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreSchemaError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        open_queue(backend.store)
    assert "dispatch_tasks" in backend.tables()
    assert "kernel_dispatch_tasks" not in backend.tables()


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, DispatchStatus) else value


def test_a_version_2_store_learns_the_waiting_status_keeping_its_rows(backend: Any) -> None:
    """Version 2's status CHECK had no 'waiting': version 3 replaces it (SQLite copies the rows
    into a table made anew), every row and index kept."""
    dialect = SQLITE if isinstance(backend, SqliteBackend) else POSTGRES
    for statement in dialect.ddl:
        backend.execute(statement.replace(", 'waiting')", ")"))
    backend.execute(
        "CREATE TABLE scheduler_schema (singleton INTEGER PRIMARY KEY CHECK (singleton = 1), "
        "version INTEGER NOT NULL)"
    )
    backend.execute("INSERT INTO scheduler_schema VALUES (1, 2)")
    insert = (
        "INSERT INTO kernel_dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, status, "
        "created_at) VALUES (%s, %s, %s, %s, %s, %s)"
    )
    backend.execute(insert, ("d1", K, "a1", "p", "done", backend.value(T0)))
    with pytest.raises(Exception, match=r"(?i)check"):  # version 2 refuses 'waiting'
        backend.execute(insert, ("d2", K, "a2", "p", "waiting", backend.value(T0)))

    open_queue(backend.store).close()
    backend.execute(insert, ("d2", K, "a2", "p", "waiting", backend.value(T0)))
    backend.execute("UPDATE kernel_dispatch_tasks SET run_id = 'r2' WHERE dispatch_id = 'd2'")

    assert backend.execute("SELECT version FROM scheduler_schema") == [{"version": SCHEMA_VERSION}]
    rows = backend.execute("SELECT dispatch_id, status FROM kernel_dispatch_tasks ORDER BY 1")
    assert rows == [
        {"dispatch_id": "d1", "status": "done"},
        {"dispatch_id": "d2", "status": "waiting"},
    ]
    indexes = backend.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'kernel_dispatch%'"
        if isinstance(backend, SqliteBackend)
        else "SELECT indexname AS name FROM pg_indexes WHERE indexname LIKE 'kernel_dispatch%%'"
    )
    assert {
        "kernel_dispatch_tasks_one_active",
        "kernel_dispatch_tasks_pending",
        "kernel_dispatch_tasks_running",
        "kernel_dispatch_tasks_recent",
    } <= {r["name"] for r in indexes}
    settled = settle_waiting_dispatch(
        backend.store, "r2", ok=False, termination_reason="tool_failures", error="boom"
    )
    assert settled is not None
    assert (settled.dispatch_id, settled.status, settled.termination_reason, settled.error) == (
        "d2",
        DispatchStatus.FAILED,
        "tool_failures",
        "boom",
    )
    assert settled.finished_at is not None
    again = settle_waiting_dispatch(
        backend.store, "r2", ok=True, termination_reason=None, error=None
    )
    assert again is None  # settled once
