"""The dispatch queue in a SQLite file: one machine, several threads or processes.

SQLite has one writer at a time: every read-then-write runs under BEGIN IMMEDIATE, so a claim's
count of running dispatches and its update cannot interleave with another claim's, and no row is
claimed twice. No notifications: idle workers poll (poll_seconds).
"""

from __future__ import annotations

import builtins
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fsm_kernel.errors import StoreError, StoreSchemaError
from fsm_kernel.protocol import Clock, SystemClock, new_id
from fsm_kernel.scheduler.queue import (
    CANCELLED_EXPIRED,
    CANCELLED_PENDING,
    COLUMNS,
    DEFAULT_MAX_ATTEMPTS,
    LEGACY_COLUMNS,
    LEGACY_TABLE,
    SCHEMA_VERSION,
    TABLE,
    Dispatch,
    DispatchListener,
    DispatchStatus,
    abandoned_sql,
    already_finished,
    lease_conflict,
    log_reaped,
    require_aware,
    tick_key,
    validate_final_status,
)

__all__ = ["SqliteDispatchQueue"]

_DDL = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        dispatch_id TEXT PRIMARY KEY,
        kernel_id TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        prompt TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL
            CHECK (status IN ('pending', 'running', 'done', 'failed', 'cancelled')),
        dedupe_key TEXT UNIQUE,
        worker_id TEXT,
        lease_expires_at TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL DEFAULT {DEFAULT_MAX_ATTEMPTS} CHECK (max_attempts >= 1),
        run_id TEXT,
        termination_reason TEXT,
        error TEXT,
        created_at TEXT NOT NULL,
        started_at TEXT,
        finished_at TEXT,
        cancel_requested_at TEXT)""",
    f"""CREATE UNIQUE INDEX IF NOT EXISTS {TABLE}_one_active
        ON {TABLE} (kernel_id, agent_id) WHERE status IN ('pending', 'running')""",
    f"""CREATE INDEX IF NOT EXISTS {TABLE}_pending
        ON {TABLE} (kernel_id, priority DESC, created_at, dispatch_id) WHERE status = 'pending'""",
    f"""CREATE INDEX IF NOT EXISTS {TABLE}_running
        ON {TABLE} (kernel_id, lease_expires_at) WHERE status = 'running'""",
    f"""CREATE INDEX IF NOT EXISTS {TABLE}_recent
        ON {TABLE} (kernel_id, created_at DESC, dispatch_id DESC)""",
    """CREATE TABLE IF NOT EXISTS scheduler_ticks (
        kernel_id TEXT NOT NULL,
        tick_at TEXT NOT NULL,
        fired_at TEXT NOT NULL,
        PRIMARY KEY (kernel_id, tick_at))""",
)

_SELECT = f"SELECT {', '.join(COLUMNS)} FROM {TABLE}"
_RETURNING = f"RETURNING {', '.join(COLUMNS)}"
_ORDER = "ORDER BY priority DESC, created_at, dispatch_id"
_RECLAIMABLE = (
    "status = 'running' AND lease_expires_at <= :now AND attempts < max_attempts "
    "AND cancel_requested_at IS NULL"
)
# Two index lookups (the best pending row, the best reclaimable one) instead of one scan over
# "pending OR expired": each is served by a partial index that holds no finished rows.
_CLAIM = f"""
UPDATE {TABLE} SET status = 'running', worker_id = :worker, lease_expires_at = :expires,
    attempts = attempts + 1, started_at = :now
WHERE dispatch_id = (
    SELECT dispatch_id FROM (
        SELECT * FROM (SELECT dispatch_id, priority, created_at FROM {TABLE}
            WHERE kernel_id = :kernel AND status = 'pending' {_ORDER} LIMIT 1)
        UNION ALL
        SELECT * FROM (SELECT dispatch_id, priority, created_at FROM {TABLE}
            WHERE kernel_id = :kernel AND {_RECLAIMABLE} {_ORDER} LIMIT 1)
    ) {_ORDER} LIMIT 1)
AND (SELECT count(*) FROM {TABLE} WHERE kernel_id = :kernel AND status = 'running'
     AND lease_expires_at > :now) < :cap
{_RETURNING}"""
_REAP = f"""
UPDATE {TABLE} SET
    status = CASE WHEN cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
    error = CASE WHEN cancel_requested_at IS NULL THEN {abandoned_sql()} ELSE :cancelled END,
    finished_at = :now, lease_expires_at = NULL
WHERE kernel_id = :kernel AND status = 'running' AND lease_expires_at <= :now
    AND (attempts >= max_attempts OR cancel_requested_at IS NOT NULL)
{_RETURNING}"""


class SqliteDispatchQueue:
    """The dispatch queue in a SQLite file (WAL). Safe across threads and across processes on
    one host."""

    def __init__(self, path: str | Path, *, clock: Clock | None = None) -> None:
        self.path = Path(path).expanduser()
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"SqliteDispatchQueue({str(self.path)!r})"

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def ensure_schema(self) -> None:
        """Create or migrate, in one write transaction: version 1's dispatch_tasks is copied
        into kernel_dispatch_tasks, row for row, and dropped; a second run finds nothing to do."""
        with self._transaction() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS scheduler_schema ("
                "singleton INTEGER PRIMARY KEY CHECK (singleton = 1), version INTEGER NOT NULL)"
            )
            row = conn.execute("SELECT version FROM scheduler_schema").fetchone()
            version = int(row["version"]) if row is not None else None
            if version is not None and version > SCHEMA_VERSION:
                raise StoreSchemaError(
                    f"{self.path}: dispatch schema version {version} is newer than "
                    f"this fsm-kernel supports ({SCHEMA_VERSION})"
                )
            for statement in _DDL:
                conn.execute(statement)
            if version is not None and version < SCHEMA_VERSION and _has_table(conn):
                _migrate_v1(conn)
            conn.execute(
                "INSERT INTO scheduler_schema VALUES (1, ?) "
                "ON CONFLICT (singleton) DO UPDATE SET version = excluded.version",
                (SCHEMA_VERSION,),
            )

    def enqueue(
        self,
        kernel_id: str,
        agent_id: str,
        prompt: str,
        priority: int,
        dedupe_key: str | None,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> Dispatch | None:
        sql = (
            f"INSERT INTO {TABLE} (dispatch_id, kernel_id, agent_id, prompt, priority, "
            "status, dedupe_key, attempts, max_attempts, created_at) "
            f"VALUES (?, ?, ?, ?, ?, 'pending', ?, 0, ?, ?) ON CONFLICT DO NOTHING {_RETURNING}"
        )
        params = (new_id(), kernel_id, agent_id, prompt, priority, dedupe_key, max_attempts)
        with self._transaction() as conn:
            row = conn.execute(sql, (*params, self._now())).fetchone()
        return Dispatch.from_row(row) if row else None

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        now = self.clock.now()
        params = {
            "worker": worker_id,
            "expires": _ts(now + timedelta(seconds=lease_seconds)),
            "now": _ts(now),
            "kernel": kernel_id,
            "cap": max_concurrent,
            "cancelled": CANCELLED_EXPIRED,
        }
        with self._transaction() as conn:
            reaped = [Dispatch.from_row(r) for r in conn.execute(_REAP, params).fetchall()]
            row = conn.execute(_CLAIM, params).fetchone()
        log_reaped(reaped)
        return Dispatch.from_row(row) if row else None

    def reap(self, kernel_id: str) -> builtins.list[Dispatch]:
        params = {"now": self._now(), "kernel": kernel_id, "cancelled": CANCELLED_EXPIRED}
        with self._transaction() as conn:
            reaped = [Dispatch.from_row(r) for r in conn.execute(_REAP, params).fetchall()]
        log_reaped(reaped)
        return reaped

    def heartbeat(
        self, dispatch_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
    ) -> Dispatch:
        expires = self.clock.now() + timedelta(seconds=lease_seconds)
        return self._fenced_update(
            "lease_expires_at = ?", (_ts(expires),), dispatch_id, worker_id, attempt
        )

    def complete(
        self,
        dispatch_id: str,
        worker_id: str,
        *,
        status: DispatchStatus | str,
        run_id: str | None = None,
        termination_reason: str | None = None,
        error: str | None = None,
        attempt: int | None = None,
        max_concurrent: int | None = None,
    ) -> Dispatch:
        final = validate_final_status(status)
        return self._fenced_update(
            "status = ?, run_id = ?, termination_reason = ?, error = ?, finished_at = ?, "
            "lease_expires_at = NULL",
            (final.value, run_id, termination_reason, error, self._now()),
            dispatch_id,
            worker_id,
            attempt,
        )

    def cancel(self, kernel_id: str, dispatch_id: str) -> Dispatch | None:
        now = self.clock.now()
        with self._transaction() as conn:
            row = conn.execute(
                f"{_SELECT} WHERE dispatch_id = ? AND kernel_id = ?", (dispatch_id, kernel_id)
            ).fetchone()
            if row is None:
                return None
            current = Dispatch.from_row(row)
            if not current.is_active:
                raise already_finished(current)
            assignments, params = _cancel_update(current, now)
            updated = conn.execute(
                f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = ? {_RETURNING}",
                (*params, dispatch_id),
            ).fetchone()
        return Dispatch.from_row(updated)

    def get(self, dispatch_id: str) -> Dispatch | None:
        with self._connection() as conn:
            row = conn.execute(f"{_SELECT} WHERE dispatch_id = ?", (dispatch_id,)).fetchone()
        return Dispatch.from_row(row) if row else None

    def find(self, kernel_id: str, prefix: str, limit: int = 2) -> builtins.list[Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = ? AND substr(dispatch_id, 1, ?) = ? LIMIT ?"
        with self._connection() as conn:
            rows = conn.execute(sql, (kernel_id, len(prefix), prefix, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def active_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = ? AND status IN ('pending', 'running')"
        with self._connection() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = (
            f"SELECT {', '.join(COLUMNS)} FROM (SELECT *, row_number() OVER (PARTITION BY "
            f"agent_id ORDER BY created_at DESC, dispatch_id DESC) AS rn FROM {TABLE} "
            "WHERE kernel_id = ?) WHERE rn = 1"
        )
        with self._connection() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = ? ORDER BY created_at DESC, dispatch_id DESC LIMIT ?"
        with self._connection() as conn:
            rows = conn.execute(sql, (kernel_id, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        sql = "INSERT INTO scheduler_ticks VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
        with self._transaction() as conn:
            cursor = conn.execute(sql, (kernel_id, _ts(tick_key(tick_time)), self._now()))
            return cursor.rowcount == 1

    def listener(self, kernel_id: str) -> DispatchListener | None:
        return None  # SQLite has no notifications: workers poll

    def _fenced_update(
        self,
        assignments: str,
        params: tuple[Any, ...],
        dispatch_id: str,
        worker_id: str,
        attempt: int | None,
    ) -> Dispatch:
        sql = (
            f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = ? AND "
            f"status = 'running' AND worker_id = ? AND (? IS NULL OR attempts = ?) {_RETURNING}"
        )
        with self._transaction() as conn:
            row = conn.execute(sql, (*params, dispatch_id, worker_id, attempt, attempt)).fetchone()
            if row is None:
                current = conn.execute(
                    f"{_SELECT} WHERE dispatch_id = ?", (dispatch_id,)
                ).fetchone()
                raise lease_conflict(
                    dispatch_id, worker_id, Dispatch.from_row(current) if current else None
                )
        return Dispatch.from_row(row)

    def _now(self) -> str:
        return _ts(self.clock.now())

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._conn = conn
        return self._conn

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._connect()
            except (sqlite3.Error, OSError) as exc:
                raise StoreError(f"{self.path}: dispatch store failed: {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction taken with BEGIN IMMEDIATE (the writer lock up front)."""
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")


def _cancel_update(current: Dispatch, now: datetime) -> tuple[str, tuple[Any, ...]]:
    """The SET clause that cancels an active dispatch (or requests it, for a live lease)."""
    if current.status is DispatchStatus.PENDING:
        return "status = 'cancelled', error = ?, finished_at = ?", (CANCELLED_PENDING, _ts(now))
    if current.lease_expires_at is not None and current.lease_expires_at <= now:
        return (
            "status = 'cancelled', error = ?, finished_at = ?, lease_expires_at = NULL, "
            "cancel_requested_at = coalesce(cancel_requested_at, ?)",
            (CANCELLED_EXPIRED, _ts(now), _ts(now)),
        )
    return "cancel_requested_at = coalesce(cancel_requested_at, ?)", (_ts(now),)


def _has_table(conn: sqlite3.Connection) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (LEGACY_TABLE,)
    ).fetchone()
    return row is not None


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Copy every row of version 1's table (the new columns take their defaults), then drop it
    (its indexes go with it). Runs inside ensure_schema's transaction: all or nothing."""
    columns = ", ".join(LEGACY_COLUMNS)
    conn.execute(
        # WHERE true: without it SQLite reads ON CONFLICT as part of the SELECT's join
        f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {LEGACY_TABLE} WHERE true "
        "ON CONFLICT DO NOTHING"
    )
    conn.execute(f"DROP TABLE {LEGACY_TABLE}")


def _ts(moment: datetime) -> str:
    """Fixed-width UTC ISO text, so SQLite's text comparison orders it correctly."""
    return require_aware(moment).astimezone(UTC).isoformat(timespec="microseconds")
