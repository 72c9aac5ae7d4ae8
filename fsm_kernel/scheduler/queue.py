"""The dispatch queue: the `DispatchQueue` port, the `Dispatch` row, the SQLite adapter (one
machine, the default) and `open_queue`, which picks the backend from the `store` setting.

Lease semantics, shared by both adapters:
- a claim sets status=running, the worker id, attempts+1 and lease_expires_at = now + lease;
- a running dispatch whose lease has expired is claimable again by anyone (reclaim), and does not
  count against `max_concurrent`;
- heartbeat and complete are fenced: they succeed only while the row is still running under the
  same worker id (and the same attempt, when given), otherwise StoreConflictError;
- one active (pending or running) dispatch per (kernel_id, agent_id), enforced by a unique index;
- time comes from the injected Clock, never from the database.
"""

from __future__ import annotations

import builtins
import logging
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fsm_kernel.errors import ConfigError, StoreConflictError, StoreError, StoreSchemaError
from fsm_kernel.protocol import Clock, SystemClock, new_id

__all__ = [
    "SCHEMA_VERSION",
    "Dispatch",
    "DispatchQueue",
    "DispatchStatus",
    "SqliteDispatchQueue",
    "open_queue",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class DispatchStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


ACTIVE_STATUSES = frozenset({DispatchStatus.PENDING, DispatchStatus.RUNNING})
FINAL_STATUSES = frozenset({DispatchStatus.DONE, DispatchStatus.FAILED})

COLUMNS = (
    "dispatch_id",
    "kernel_id",
    "agent_id",
    "prompt",
    "priority",
    "status",
    "dedupe_key",
    "worker_id",
    "lease_expires_at",
    "attempts",
    "run_id",
    "termination_reason",
    "error",
    "created_at",
    "started_at",
    "finished_at",
)
_TIME_COLUMNS = ("lease_expires_at", "created_at", "started_at", "finished_at")


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    """One queued agent task and what became of it."""

    dispatch_id: str
    kernel_id: str
    agent_id: str
    prompt: str
    """The final prompt, STATE.md already injected."""
    priority: int
    status: DispatchStatus
    dedupe_key: str | None
    worker_id: str | None
    """The worker holding (or last holding) the lease."""
    lease_expires_at: datetime | None
    attempts: int
    """How many times it was claimed; also the fencing token of the current claim."""
    run_id: str | None
    termination_reason: str | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (ISO-8601 times, status as its string)."""
        out: dict[str, Any] = {}
        for name in COLUMNS:
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, DispatchStatus):
                value = value.value
            out[name] = value
        return out

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Dispatch:
        """Build from a database row; times may be datetimes or ISO strings."""
        values = {name: row[name] for name in COLUMNS}
        for name in _TIME_COLUMNS:
            values[name] = _as_datetime(values[name])
        values["status"] = DispatchStatus(values["status"])
        values["priority"] = int(values["priority"])
        values["attempts"] = int(values["attempts"])
        return cls(**values)


@runtime_checkable
class DispatchQueue(Protocol):
    """Where ticks put dispatches and workers take them. Every method is synchronous and safe to
    call from several threads; the async engine calls them through asyncio.to_thread."""

    def ensure_schema(self) -> None:
        """Create the tables if missing (idempotent). StoreSchemaError if they are newer."""
        ...

    def enqueue(
        self, kernel_id: str, agent_id: str, prompt: str, priority: int, dedupe_key: str | None
    ) -> Dispatch | None:
        """Add a pending dispatch. None when the dedupe key is taken or the agent already has
        an active (pending or running) dispatch."""
        ...

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        """Take the best claimable dispatch (highest priority, then oldest; expired leases
        included) unless `max_concurrent` dispatches of the kernel already run under live
        leases. None when there is nothing to take or no free slot."""
        ...

    def heartbeat(
        self, dispatch_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
    ) -> Dispatch:
        """Extend the lease to now + lease_seconds. StoreConflictError if the lease was lost."""
        ...

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
        """Record the outcome (done or failed). StoreConflictError if the lease was lost."""
        ...

    def get(self, dispatch_id: str) -> Dispatch | None: ...

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        """Each agent's most recent dispatch, keyed by agent_id."""
        ...

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        """Most recent dispatches first."""
        ...

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        """Record that the tick scheduled at `tick_time` fires; False if it already did."""
        ...

    def close(self) -> None: ...


def open_queue(store: str, *, clock: Clock | None = None) -> DispatchQueue:
    """The dispatch queue for a `store` setting, schema ready.

    A postgresql:// DSN selects PostgreSQL (needs `pip install 'fsm-kernel[postgres]'`); a SQLite
    location (see `fsm_kernel.store.parse_store_location`) may be the event log's own file.

    Raises:
        ConfigError: `store` names a JSON Lines event log (StoreLocationError: no backend).
        StoreError: the store cannot be opened (StoreSchemaError: its schema is too new).
    """
    from fsm_kernel.store import parse_store_location

    where = parse_store_location(store)  # the event log's rules: both land in the same place
    if where.backend == "postgres":
        from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

        queue: DispatchQueue = PostgresDispatchQueue(where.target, clock=clock)
    elif where.backend == "jsonl":
        raise ConfigError(
            f"store {store!r} is a JSON Lines file, which cannot hold the dispatch queue: set "
            "`store:` in the scheduler config to a SQLite file or a postgresql:// URL"
        )
    else:
        queue = SqliteDispatchQueue(where.target, clock=clock)
    try:
        queue.ensure_schema()
    except BaseException:
        queue.close()
        raise
    logger.debug("dispatch queue ready: %r", queue)
    return queue


def validate_final_status(status: DispatchStatus | str) -> DispatchStatus:
    try:
        value = DispatchStatus(status)
    except ValueError:
        raise StoreError(f"unknown dispatch status {status!r}") from None
    if value not in FINAL_STATUSES:
        raise StoreError(f"a dispatch completes with status done or failed, not {value.value}")
    return value


def lease_conflict(
    dispatch_id: str, worker_id: str, current: Dispatch | None
) -> StoreConflictError:
    """The error for a heartbeat or completion from a worker that no longer holds the lease."""
    if current is None:
        return StoreConflictError(f"dispatch {dispatch_id} does not exist")
    return StoreConflictError(
        f"worker {worker_id} no longer holds dispatch {dispatch_id} "
        f"(status {current.status.value}, worker {current.worker_id}, "
        f"attempt {current.attempts})"
    )


def tick_key(tick_time: datetime) -> datetime:
    """Tick times are compared at whole-second precision in UTC."""
    return _require_aware(tick_time).astimezone(UTC).replace(microsecond=0)


def _require_aware(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise StoreError(f"naive datetime {moment.isoformat()} (expected timezone-aware UTC)")
    return moment


def _as_datetime(value: Any) -> datetime | None:
    if value is None:
        return None
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment.astimezone(UTC)


def _ts(moment: datetime) -> str:
    """Fixed-width UTC ISO text, so SQLite's text comparison orders it correctly."""
    return _require_aware(moment).astimezone(UTC).isoformat(timespec="microseconds")


_SQLITE_DDL = (
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
        lease_expires_at TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        run_id TEXT,
        termination_reason TEXT,
        error TEXT,
        created_at TEXT NOT NULL,
        started_at TEXT,
        finished_at TEXT)""",
    """CREATE UNIQUE INDEX IF NOT EXISTS dispatch_tasks_one_active
        ON dispatch_tasks (kernel_id, agent_id) WHERE status IN ('pending', 'running')""",
    """CREATE INDEX IF NOT EXISTS dispatch_tasks_claim
        ON dispatch_tasks (kernel_id, status, priority DESC, created_at)""",
    """CREATE INDEX IF NOT EXISTS dispatch_tasks_recent
        ON dispatch_tasks (kernel_id, created_at DESC)""",
    """CREATE TABLE IF NOT EXISTS scheduler_ticks (
        kernel_id TEXT NOT NULL,
        tick_at TEXT NOT NULL,
        fired_at TEXT NOT NULL,
        PRIMARY KEY (kernel_id, tick_at))""",
)

_SELECT = f"SELECT {', '.join(COLUMNS)} FROM dispatch_tasks"
_RETURNING = f"RETURNING {', '.join(COLUMNS)}"
_CLAIMABLE = (
    "kernel_id = ? AND (status = 'pending' OR (status = 'running' AND lease_expires_at <= ?))"
)


class SqliteDispatchQueue:
    """The dispatch queue in a SQLite file (WAL). Safe across threads and across processes on
    one host: every read-then-write runs under BEGIN IMMEDIATE, so SQLite's single writer lock
    serialises claims and no row can be claimed twice."""

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
        with self._transaction() as conn:
            for statement in _SQLITE_DDL:
                conn.execute(statement)
            row = conn.execute("SELECT version FROM scheduler_schema").fetchone()
            if row is None:
                conn.execute("INSERT INTO scheduler_schema VALUES (1, ?)", (SCHEMA_VERSION,))
            elif int(row["version"]) > SCHEMA_VERSION:
                raise StoreSchemaError(
                    f"{self.path}: dispatch schema version {row['version']} is newer than "
                    f"this fsm-kernel supports ({SCHEMA_VERSION})"
                )

    def enqueue(
        self, kernel_id: str, agent_id: str, prompt: str, priority: int, dedupe_key: str | None
    ) -> Dispatch | None:
        sql = (
            "INSERT INTO dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, priority, "
            "status, dedupe_key, attempts, created_at) VALUES (?, ?, ?, ?, ?, 'pending', ?, 0, ?) "
            f"ON CONFLICT DO NOTHING {_RETURNING}"
        )
        params = (new_id(), kernel_id, agent_id, prompt, priority, dedupe_key, self._now())
        with self._transaction() as conn:
            row = conn.execute(sql, params).fetchone()
        return Dispatch.from_row(row) if row else None

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        now = self.clock.now()
        with self._transaction() as conn:
            running = conn.execute(
                "SELECT count(*) FROM dispatch_tasks WHERE kernel_id = ? AND status = 'running' "
                "AND lease_expires_at > ?",
                (kernel_id, _ts(now)),
            ).fetchone()[0]
            if running >= max_concurrent:
                return None
            row = conn.execute(
                f"UPDATE dispatch_tasks SET status = 'running', worker_id = ?, "
                f"lease_expires_at = ?, attempts = attempts + 1, started_at = ? "
                f"WHERE dispatch_id = (SELECT dispatch_id FROM dispatch_tasks WHERE {_CLAIMABLE} "
                f"ORDER BY priority DESC, created_at, dispatch_id LIMIT 1) {_RETURNING}",
                (
                    worker_id,
                    _ts(now + timedelta(seconds=lease_seconds)),
                    _ts(now),
                    kernel_id,
                    _ts(now),
                ),
            ).fetchone()
        return Dispatch.from_row(row) if row else None

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

    def get(self, dispatch_id: str) -> Dispatch | None:
        with self._connection() as conn:
            row = conn.execute(f"{_SELECT} WHERE dispatch_id = ?", (dispatch_id,)).fetchone()
        return Dispatch.from_row(row) if row else None

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = (
            f"SELECT {', '.join(COLUMNS)} FROM (SELECT *, row_number() OVER (PARTITION BY "
            "agent_id ORDER BY created_at DESC, dispatch_id DESC) AS rn FROM dispatch_tasks "
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

    def _fenced_update(
        self,
        assignments: str,
        params: tuple[Any, ...],
        dispatch_id: str,
        worker_id: str,
        attempt: int | None,
    ) -> Dispatch:
        sql = (
            f"UPDATE dispatch_tasks SET {assignments} WHERE dispatch_id = ? AND "
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
