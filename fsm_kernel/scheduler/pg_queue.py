"""The PostgreSQL dispatch queue, for several workers on several hosts sharing one fleet.

Claims use the `FOR UPDATE SKIP LOCKED` lease pattern. The fleet-wide `max_concurrent` cannot be
enforced by SKIP LOCKED alone (a claimer's count does not see rows another claimer is locking),
so each claim first takes a transaction-level advisory lock keyed on the kernel id: claims of one
kernel are serialised, and under READ COMMITTED the count runs on a snapshot taken after the
previous claimer committed.

Clock: lease expiry is computed and compared with the injected Clock (the host's clock by
default), never the database's now(), exactly like the SQLite queue. Hosts sharing a fleet must
therefore keep their clocks in sync (NTP); skew shortens or lengthens leases by that much.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from fsm_kernel.errors import StoreError, StoreSchemaError
from fsm_kernel.protocol import Clock, SystemClock, new_id
from fsm_kernel.scheduler.queue import (
    COLUMNS,
    SCHEMA_VERSION,
    Dispatch,
    DispatchStatus,
    lease_conflict,
    tick_key,
    validate_final_status,
)

try:
    import psycopg
    from psycopg.rows import dict_row
except ImportError as exc:  # pragma: no cover - the test extra always installs psycopg
    raise ImportError(
        "the PostgreSQL dispatch queue needs psycopg: pip install 'fsm-kernel[postgres]'"
    ) from exc

__all__ = ["PostgresDispatchQueue"]

logger = logging.getLogger(__name__)

_SCHEMA_LOCK_KEY = "fsm_kernel.scheduler.schema"
_CLAIM_LOCK_PREFIX = "fsm_kernel.scheduler.claim:"
_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"

_DDL = (
    """CREATE TABLE IF NOT EXISTS scheduler_schema (
        singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
        version INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dispatch_tasks (
        dispatch_id TEXT PRIMARY KEY,
        kernel_id TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        prompt TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
        dedupe_key TEXT UNIQUE,
        worker_id TEXT,
        lease_expires_at TIMESTAMPTZ,
        attempts INTEGER NOT NULL DEFAULT 0,
        run_id TEXT,
        termination_reason TEXT,
        error TEXT,
        created_at TIMESTAMPTZ NOT NULL,
        started_at TIMESTAMPTZ,
        finished_at TIMESTAMPTZ)""",
    """CREATE UNIQUE INDEX IF NOT EXISTS dispatch_tasks_one_active
        ON dispatch_tasks (kernel_id, agent_id) WHERE status IN ('pending', 'running')""",
    """CREATE INDEX IF NOT EXISTS dispatch_tasks_claim
        ON dispatch_tasks (kernel_id, priority DESC, created_at)
        WHERE status IN ('pending', 'running')""",
    """CREATE INDEX IF NOT EXISTS dispatch_tasks_recent
        ON dispatch_tasks (kernel_id, created_at DESC)""",
    """CREATE TABLE IF NOT EXISTS scheduler_ticks (
        kernel_id TEXT NOT NULL,
        tick_at TIMESTAMPTZ NOT NULL,
        fired_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (kernel_id, tick_at))""",
)

_SELECT = f"SELECT {', '.join(COLUMNS)} FROM dispatch_tasks"
_RETURNING = f"RETURNING {', '.join(COLUMNS)}"
_CLAIM = (
    "UPDATE dispatch_tasks SET status = 'running', worker_id = %(worker)s, "
    "lease_expires_at = %(expires)s, attempts = attempts + 1, started_at = %(now)s "
    "WHERE dispatch_id = (SELECT dispatch_id FROM dispatch_tasks "
    "WHERE kernel_id = %(kernel)s AND (status = 'pending' "
    "OR (status = 'running' AND lease_expires_at <= %(now)s)) "
    "ORDER BY priority DESC, created_at, dispatch_id LIMIT 1 FOR UPDATE SKIP LOCKED) "
    f"{_RETURNING}"
)


class PostgresDispatchQueue:
    """The dispatch queue in PostgreSQL (psycopg 3). One connection per instance, guarded by a
    lock so the engine's threads can share it; reconnects after a connection failure."""

    def __init__(self, dsn: str, *, clock: Clock | None = None) -> None:
        self.dsn = dsn
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return "PostgresDispatchQueue(<dsn hidden>)"  # a DSN may carry a password

    def close(self) -> None:
        with self._lock:
            self._drop_connection()

    def ensure_schema(self) -> None:
        with self._transaction() as conn:
            # Concurrent CREATE ... IF NOT EXISTS can still collide in the catalog.
            conn.execute(_ADVISORY_LOCK, (_SCHEMA_LOCK_KEY,))
            for statement in _DDL:
                conn.execute(statement)
            row = conn.execute("SELECT version FROM scheduler_schema").fetchone()
            if row is None:
                conn.execute("INSERT INTO scheduler_schema VALUES (1, %s)", (SCHEMA_VERSION,))
            elif int(row["version"]) > SCHEMA_VERSION:
                raise StoreSchemaError(
                    f"dispatch schema version {row['version']} is newer than this fsm-kernel "
                    f"supports ({SCHEMA_VERSION})"
                )

    def enqueue(
        self, kernel_id: str, agent_id: str, prompt: str, priority: int, dedupe_key: str | None
    ) -> Dispatch | None:
        sql = (
            "INSERT INTO dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, priority, "
            "status, dedupe_key, attempts, created_at) "
            "VALUES (%s, %s, %s, %s, %s, 'pending', %s, 0, %s) "
            f"ON CONFLICT DO NOTHING {_RETURNING}"
        )
        params = (new_id(), kernel_id, agent_id, prompt, priority, dedupe_key, self.clock.now())
        with self._transaction() as conn:
            row = conn.execute(sql, params).fetchone()
        return Dispatch.from_row(row) if row else None

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        now = self.clock.now()
        with self._transaction() as conn:
            conn.execute(_ADVISORY_LOCK, (_CLAIM_LOCK_PREFIX + kernel_id,))
            running = conn.execute(
                "SELECT count(*) AS n FROM dispatch_tasks WHERE kernel_id = %s "
                "AND status = 'running' AND lease_expires_at > %s",
                (kernel_id, now),
            ).fetchone()
            if running is not None and int(running["n"]) >= max_concurrent:
                return None
            params = {
                "worker": worker_id,
                "expires": now + timedelta(seconds=lease_seconds),
                "now": now,
                "kernel": kernel_id,
            }
            row = conn.execute(_CLAIM, params).fetchone()
        return Dispatch.from_row(row) if row else None

    def heartbeat(
        self, dispatch_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
    ) -> Dispatch:
        expires = self.clock.now() + timedelta(seconds=lease_seconds)
        return self._fenced_update(
            "lease_expires_at = %s", (expires,), dispatch_id, worker_id, attempt
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
    ) -> Dispatch:
        final = validate_final_status(status)
        return self._fenced_update(
            "status = %s, run_id = %s, termination_reason = %s, error = %s, finished_at = %s, "
            "lease_expires_at = NULL",
            (final.value, run_id, termination_reason, error, self.clock.now()),
            dispatch_id,
            worker_id,
            attempt,
        )

    def get(self, dispatch_id: str) -> Dispatch | None:
        with self._transaction() as conn:
            row = conn.execute(f"{_SELECT} WHERE dispatch_id = %s", (dispatch_id,)).fetchone()
        return Dispatch.from_row(row) if row else None

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = (
            f"SELECT DISTINCT ON (agent_id) {', '.join(COLUMNS)} FROM dispatch_tasks "
            "WHERE kernel_id = %s ORDER BY agent_id, created_at DESC, dispatch_id DESC"
        )
        with self._transaction() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = %s ORDER BY created_at DESC, dispatch_id DESC LIMIT %s"
        with self._transaction() as conn:
            rows = conn.execute(sql, (kernel_id, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        sql = "INSERT INTO scheduler_ticks VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"
        with self._transaction() as conn:
            cursor = conn.execute(sql, (kernel_id, tick_key(tick_time), self.clock.now()))
            return cursor.rowcount == 1

    def _fenced_update(
        self,
        assignments: str,
        params: tuple[Any, ...],
        dispatch_id: str,
        worker_id: str,
        attempt: int | None,
    ) -> Dispatch:
        sql = (
            f"UPDATE dispatch_tasks SET {assignments} WHERE dispatch_id = %s AND "
            "status = 'running' AND worker_id = %s AND (%s::integer IS NULL OR attempts = %s) "
            f"{_RETURNING}"
        )
        with self._transaction() as conn:
            row = conn.execute(sql, (*params, dispatch_id, worker_id, attempt, attempt)).fetchone()
            if row is None:
                current = conn.execute(
                    f"{_SELECT} WHERE dispatch_id = %s", (dispatch_id,)
                ).fetchone()
                raise lease_conflict(
                    dispatch_id, worker_id, Dispatch.from_row(current) if current else None
                )
        return Dispatch.from_row(row)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def _connect(self) -> psycopg.Connection[dict[str, Any]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with self._lock:
            try:
                conn = self._connect()
                with conn.transaction():
                    yield conn
            except psycopg.OperationalError as exc:
                logger.warning("dispatch store connection failed, reconnecting next call: %s", exc)
                self._drop_connection()
                raise StoreError(f"dispatch store (PostgreSQL) unavailable: {exc}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"dispatch store (PostgreSQL) failed: {exc}") from exc
