"""The default EventStore: one SQLite file (stdlib sqlite3), WAL, durable commits.

Owns every use of sqlite3 in the event store; sqlite3 errors never escape it (StoreError).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.protocol import Event, RunSummary
from fsm_kernel.store._runlock import RUN_LOCKS_SUFFIX, RunLockFile
from fsm_kernel.store._schema import (
    AMBIGUOUS_SHOWN,
    COMPONENT,
    SQLITE_MIGRATIONS_TABLE,
    RunDelta,
    check_events,
    clean_prefix,
    decode_data,
    encode_data,
    format_ts,
    make_event,
    parse_ts,
    plan_migrations,
    resolve_run,
    summarize_batch,
)

__all__ = ["SqliteEventStore"]

logger = logging.getLogger(__name__)

_INSERT_EVENT = (
    "INSERT INTO events (run_id, seq, type, ts, iteration, state, version, data) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
# Keep `runs` in step with `events` inside the append's transaction. A batch without
# run.started leaves the indexed started_at out of the SET list, so SQLite does not rewrite the
# index page: one WAL frame less per append.
_INSERT_RUN = """
INSERT INTO runs (run_id, workflow, goal, started_at, iterations, termination_reason, updated_at)
VALUES (:run_id, COALESCE(:workflow, ''), COALESCE(:goal, ''),
        COALESCE(:started_at, :first_ts), :iterations, :reason, :updated_at)
ON CONFLICT (run_id) DO UPDATE SET
    iterations = MAX(runs.iterations, :iterations),
    termination_reason = COALESCE(:reason, runs.termination_reason),
    updated_at = MAX(runs.updated_at, :updated_at)"""
_UPSERT_RUN = _INSERT_RUN + ", workflow = :workflow, goal = :goal, started_at = :started_at"
_SELECT_EVENTS = (
    "SELECT run_id, seq, type, ts, iteration, state, version, data "
    "FROM events WHERE run_id = ? ORDER BY seq"
)
_SELECT_RUNS = (
    "SELECT run_id, workflow, goal, started_at, iterations, termination_reason "
    "FROM runs ORDER BY started_at DESC, run_id DESC LIMIT ?"
)
_SELECT_PREFIX = "SELECT run_id FROM runs WHERE substr(run_id, 1, ?) = ? ORDER BY run_id LIMIT ?"
_BUSY_TIMEOUT_S = 30.0


class SqliteEventStore:
    """Append-only event log in one SQLite file, safe for threads and for several processes.

    Every append is one `BEGIN IMMEDIATE` transaction committed with `synchronous=FULL`, so
    events are on disk when `append` returns. `path` may be ":memory:" for a throwaway store.
    """

    def __init__(self, path: str | Path, *, busy_timeout: float = _BUSY_TIMEOUT_S) -> None:
        self.path = Path(path).expanduser() if str(path) != ":memory:" else Path(":memory:")
        self._lock = threading.Lock()
        in_memory = self.path == Path(":memory:")
        lock_path = None if in_memory else self.path.with_name(self.path.name + RUN_LOCKS_SUFFIX)
        self._run_locks = RunLockFile(lock_path)
        self._conn: sqlite3.Connection | None = _connect(self.path, busy_timeout)
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"SqliteEventStore({str(self.path)!r})"

    def __enter__(self) -> SqliteEventStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def append(self, events: Sequence[Event]) -> None:
        """Append a batch atomically and durably.

        Raises:
            StoreConflictError: a (run_id, seq) of the batch exists already (or twice in it);
                nothing of the batch is written.
            StoreError: the database failed.
        """
        batch = list(events)
        if not batch:
            return
        check_events(batch)
        rows = [_event_row(e) for e in batch]
        deltas = summarize_batch(batch)
        with self._lock:
            try:
                with self._transaction() as conn:
                    conn.executemany(_INSERT_EVENT, rows)
                    for delta in deltas:
                        sql = _INSERT_RUN if delta.started_at is None else _UPSERT_RUN
                        conn.execute(sql, _run_params(delta))
            except sqlite3.IntegrityError as exc:
                raise self._conflict(batch) from exc
            except sqlite3.Error as exc:
                raise self._error("append failed", exc) from exc

    def read(self, run_id: str) -> list[Event]:
        """Every event of the run in seq order; [] for an unknown run."""
        rows = self._query(_SELECT_EVENTS, (run_id,), what="read failed")
        return [_row_event(row) for row in rows]

    def next_seq(self, run_id: str) -> int:
        """1 + the run's last seq; 1 for a run with no events."""
        sql = "SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = ?"
        return int(self._query(sql, (run_id,), what="next_seq failed")[0][0])

    def list_runs(self, *, limit: int = 50) -> list[RunSummary]:
        """The `limit` most recently started runs, newest first."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        rows = self._query(_SELECT_RUNS, (limit,), what="list_runs failed")
        return [_row_summary(row) for row in rows]

    def find_run(self, prefix: str) -> str:
        """The full id of the run `prefix` names (a full id or a unique prefix of one).

        Raises:
            RunNotFoundError: no run matches, or several do (the message lists them).
        """
        cleaned = clean_prefix(prefix)
        params = (len(cleaned), cleaned, AMBIGUOUS_SHOWN + 1)
        rows = self._query(_SELECT_PREFIX, params, what="find_run failed")
        return resolve_run(cleaned, [row[0] for row in rows])

    def lock_run(self, run_id: str) -> AbstractContextManager[None]:
        """Hold the run's exclusive lock (see EventStore.lock_run): a record lock in
        `<path>.locks`, not a row, so a killed holder leaves nothing behind to expire.

        Raises:
            RunLockedError: another process, or another holder in this one, has it.
            StoreError: the store is closed or the lock file cannot be opened.
        """
        self._live()
        return self._run_locks.hold(run_id)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"{self.path}: event store is closed")
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves so the write lock is taken
        # up front (waiting busy_timeout) instead of failing mid-transaction on an upgrade.
        conn = self._live()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _query(self, sql: str, params: Sequence[Any], *, what: str) -> list[Any]:
        with self._lock:
            try:
                return self._live().execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise self._error(what, exc) from exc

    def _migrate(self) -> None:
        with self._lock:
            try:
                with self._transaction() as conn:
                    conn.execute(SQLITE_MIGRATIONS_TABLE)
                    rows = conn.execute(
                        "SELECT version, name FROM schema_migrations WHERE component = ?",
                        (COMPONENT,),
                    ).fetchall()
                    pending = plan_migrations(dict(rows), where=str(self.path))
                    for migration in pending:
                        for statement in migration.sqlite:
                            conn.execute(statement)
                        conn.execute(
                            "INSERT INTO schema_migrations VALUES (?, ?, ?, ?)",
                            (COMPONENT, migration.version, migration.name, _now()),
                        )
                        logger.info("%s: applied migration %s", self.path, migration.name)
            except sqlite3.Error as exc:
                raise self._error("cannot set up the event store schema", exc) from exc

    def _conflict(self, batch: Sequence[Event]) -> StoreConflictError:
        """Name the first (run_id, seq) that made the batch fail (called with the lock held)."""
        counts = Counter((e.run_id, e.seq) for e in batch)
        twice = [key for key, n in counts.items() if n > 1]
        if twice:
            run_id, seq = twice[0]
            return StoreConflictError(f"run {run_id}: seq {seq} appears twice in one batch")
        conn = self._live()
        for event in batch:
            sql = "SELECT 1 FROM events WHERE run_id = ? AND seq = ?"
            if conn.execute(sql, (event.run_id, event.seq)).fetchone():
                return StoreConflictError(f"run {event.run_id}: seq {event.seq} already exists")
        return StoreConflictError("an event of the batch already exists")

    def _error(self, what: str, exc: sqlite3.Error) -> StoreError:
        message = f"{self.path}: {what}: {exc}"
        if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
            message = f"{self.path}: not an SQLite database ({exc})"
        return StoreError(message.replace("\n", " "))


def _connect(path: Path, busy_timeout: float) -> sqlite3.Connection:
    if str(path) != ":memory:":
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{path}: cannot create its directory: {exc}") from exc
    try:
        conn = sqlite3.connect(
            str(path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open SQLite database: {exc}") from exc
    try:
        _configure(conn, path, busy_timeout)
    except sqlite3.Error as exc:
        conn.close()
        if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
            raise StoreError(f"{path}: not an SQLite database ({exc})") from exc
        raise StoreError(f"{path}: cannot configure SQLite database: {exc}") from exc
    return conn


def _configure(conn: sqlite3.Connection, path: Path, busy_timeout: float) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode != "wal" and str(path) != ":memory:":
        logger.warning("%s: journal_mode is %s, not wal (unsupported filesystem?)", path, mode)
    # FULL: a commit is fsynced to the WAL before COMMIT returns, so a crash or power loss
    # right after append() cannot lose the events (NORMAL only survives process crashes).
    conn.execute("PRAGMA synchronous = FULL")


def _now() -> str:
    return format_ts(datetime.now(UTC))


def _event_row(event: Event) -> tuple[Any, ...]:
    return (
        event.run_id,
        event.seq,
        event.type.value,
        format_ts(event.timestamp),
        event.iteration,
        event.state,
        event.version,
        encode_data(event),
    )


def _row_event(row: Sequence[Any]) -> Event:
    run_id, seq, type_, ts, iteration, state, version, data = row
    return make_event(
        run_id=run_id,
        seq=seq,
        type_=type_,
        ts=parse_ts(ts),
        iteration=iteration,
        state=state,
        version=version,
        data=decode_data(data),
    )


def _run_params(delta: RunDelta) -> dict[str, Any]:
    return {
        "run_id": delta.run_id,
        "workflow": delta.workflow,
        "goal": delta.goal,
        "started_at": None if delta.started_at is None else format_ts(delta.started_at),
        "first_ts": format_ts(delta.first_ts),
        "iterations": delta.iterations,
        "reason": delta.termination_reason,
        "updated_at": format_ts(delta.last_ts),
    }


def _row_summary(row: Sequence[Any]) -> RunSummary:
    run_id, workflow, goal, started_at, iterations, reason = row
    return RunSummary(
        run_id=run_id,
        workflow=workflow,
        goal=goal,
        started_at=parse_ts(started_at),
        iterations=int(iterations),
        termination_reason=reason,
    )
