"""The PostgreSQL EventStore (the `postgres` extra): the same logical schema as SQLite, with
TIMESTAMPTZ and JSONB, for several hosts sharing runs.

Owns every use of psycopg in the event store; psycopg is imported lazily and its errors never
escape this module (StoreError). Messages never contain the password.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.protocol import Event, RunSummary
from fsm_kernel.store._runlock import run_lock_key, run_locked_error
from fsm_kernel.store._schema import (
    AMBIGUOUS_SHOWN,
    COMPONENT,
    POSTGRES_MIGRATIONS_TABLE,
    RunDelta,
    check_events,
    clean_prefix,
    decode_data,
    encode_data,
    make_event,
    plan_migrations,
    resolve_run,
    summarize_batch,
)

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresEventStore"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'fsm-kernel[postgres]'"
# Serializes schema set-up between processes opening the same database at once ("fsmk").
_MIGRATION_LOCK_KEY = 0x66736D6B
_RUN_LOCK_BITS = 63  # advisory lock keys are signed bigints: stay non-negative
_CONNECT_TIMEOUT_S = 10

_INSERT_EVENT = (
    "INSERT INTO events (run_id, seq, type, ts, iteration, state, version, data) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s::jsonb)"
)
# Keep `runs` in step with `events` inside the append's transaction; only a batch with
# run.started sets workflow, goal and started_at.
_INSERT_RUN = """
INSERT INTO runs (run_id, workflow, goal, started_at, iterations, termination_reason, updated_at)
VALUES (%(run_id)s, COALESCE(%(workflow)s, ''), COALESCE(%(goal)s, ''),
        COALESCE(%(started_at)s, %(first_ts)s), %(iterations)s, %(reason)s, %(updated_at)s)
ON CONFLICT (run_id) DO UPDATE SET
    iterations = GREATEST(runs.iterations, %(iterations)s),
    termination_reason = COALESCE(%(reason)s, runs.termination_reason),
    updated_at = GREATEST(runs.updated_at, %(updated_at)s)"""
_UPSERT_RUN = (
    _INSERT_RUN + ", workflow = %(workflow)s, goal = %(goal)s, started_at = %(started_at)s"
)
_SELECT_EVENTS = (
    "SELECT run_id, seq, type, ts, iteration, state, version, data "
    "FROM events WHERE run_id = %s ORDER BY seq"
)
_SELECT_RUNS = (
    "SELECT run_id, workflow, goal, started_at, iterations, termination_reason "
    "FROM runs ORDER BY started_at DESC, run_id DESC LIMIT %s"
)
# COLLATE "C": byte order, so an exact id sorts before the longer ids it is a prefix of.
_SELECT_PREFIX = (
    'SELECT run_id FROM runs WHERE left(run_id, %s) = %s ORDER BY run_id COLLATE "C" LIMIT %s'
)
_PASSWORD_IN_URL = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_PASSWORD_IN_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def _import_psycopg() -> ModuleType:
    try:
        import psycopg
    except ImportError as exc:
        raise ImportError(
            f"PostgresEventStore needs psycopg 3, which is not installed: {_INSTALL_HINT}"
        ) from exc
    return psycopg


class PostgresEventStore:
    """Append-only event log in a PostgreSQL database; one connection guarded by a lock.

    Each append is one transaction, committed before `append` returns. A broken connection
    (server restart) is replaced on the next call.
    """

    def __init__(self, dsn: str, *, connect_timeout: int = _CONNECT_TIMEOUT_S) -> None:
        self._psycopg = _import_psycopg()
        self._dsn = dsn
        self._info = _parse_dsn(self._psycopg, dsn)
        if "connect_timeout" not in self._info:
            self._info["connect_timeout"] = str(connect_timeout)
        self._where = _describe(self._info)
        self._lock = threading.Lock()
        self._closed = False
        self._conn: psycopg.Connection[Any] | None = None
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresEventStore({self._where!r})"

    def __enter__(self) -> PostgresEventStore:
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
                with self._transaction() as conn, conn.cursor() as cur:
                    cur.executemany(_INSERT_EVENT, rows)
                    for delta in deltas:
                        sql = _INSERT_RUN if delta.started_at is None else _UPSERT_RUN
                        cur.execute(sql, _run_params(delta))
            except self._psycopg.errors.UniqueViolation as exc:
                raise self._conflict(batch) from exc
            except self._psycopg.Error as exc:
                raise self._error("append failed", exc) from exc

    def read(self, run_id: str) -> list[Event]:
        """Every event of the run in seq order; [] for an unknown run."""
        rows = self._query(_SELECT_EVENTS, (run_id,), what="read failed")
        return [_row_event(row) for row in rows]

    def next_seq(self, run_id: str) -> int:
        """1 + the run's last seq; 1 for a run with no events."""
        sql = "SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = %s"
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

    @contextmanager
    def lock_run(self, run_id: str) -> Iterator[None]:
        """Hold the run's exclusive lock (see EventStore.lock_run): a session advisory lock on
        a connection of its own, held for the block, so the server releases it when the
        holder's process or connection dies. (A connection broken mid-block, by a server
        restart, loses the lock; the unlock at the end then only logs.)

        Raises:
            RunLockedError: another session (process, host or holder in this process) has it.
            StoreError: the store is closed or the database failed.
        """
        if self._closed:
            raise StoreError(f"{self._where}: event store is closed")
        key = run_lock_key(run_id, bits=_RUN_LOCK_BITS)
        conn = self._connect()
        try:
            self._try_advisory_lock(conn, run_id, key)
            try:
                yield
            finally:
                self._advisory_unlock(conn, run_id, key)
        finally:
            conn.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            conn, self._conn, self._closed = self._conn, None, True
        if conn is not None:
            conn.close()

    def _try_advisory_lock(self, conn: psycopg.Connection[Any], run_id: str, key: int) -> None:
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        except self._psycopg.Error as exc:
            raise self._error(f"cannot lock run {run_id}", exc) from exc
        if not (row and row[0]):
            raise run_locked_error(run_id)

    def _advisory_unlock(self, conn: psycopg.Connection[Any], run_id: str, key: int) -> None:
        try:
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        except self._psycopg.Error as exc:  # closing the connection releases it anyway
            logger.warning("%s: run %s: unlock failed: %s", self._where, run_id, exc)

    def _live(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError(f"{self._where}: event store is closed")
        if self._conn is None or self._conn.broken:
            self._conn = self._connect()
        return self._conn

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn: psycopg.Connection[Any] = self._psycopg.connect(**self._info, autocommit=True)
        except self._psycopg.Error as exc:
            raise self._error("cannot connect", exc) from exc
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._live()
        with conn.transaction():
            yield conn

    def _query(self, sql: str, params: Sequence[Any], *, what: str) -> list[Any]:
        with self._lock:
            try:
                return self._live().execute(sql, params).fetchall()
            except self._psycopg.Error as exc:
                raise self._error(what, exc) from exc

    def _migrate(self) -> None:
        with self._lock:
            try:
                with self._transaction() as conn:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))
                    conn.execute(POSTGRES_MIGRATIONS_TABLE)
                    rows = conn.execute(
                        "SELECT version, name FROM schema_migrations WHERE component = %s",
                        (COMPONENT,),
                    ).fetchall()
                    for migration in plan_migrations(dict(rows), where=self._where):
                        for statement in migration.postgres:
                            conn.execute(statement)
                        conn.execute(
                            "INSERT INTO schema_migrations VALUES (%s, %s, %s, %s)",
                            (COMPONENT, migration.version, migration.name, datetime.now(UTC)),
                        )
                        logger.info("%s: applied migration %s", self._where, migration.name)
            except self._psycopg.Error as exc:
                raise self._error("cannot set up the event store schema", exc) from exc

    def _conflict(self, batch: Sequence[Event]) -> StoreConflictError:
        """Name the first (run_id, seq) that made the batch fail (called with the lock held)."""
        counts = Counter((e.run_id, e.seq) for e in batch)
        twice = [key for key, n in counts.items() if n > 1]
        if twice:
            run_id, seq = twice[0]
            return StoreConflictError(f"run {run_id}: seq {seq} appears twice in one batch")
        try:
            conn = self._live()
            for event in batch:
                sql = "SELECT 1 FROM events WHERE run_id = %s AND seq = %s"
                if conn.execute(sql, (event.run_id, event.seq)).fetchone():
                    return StoreConflictError(f"run {event.run_id}: seq {event.seq} already exists")
        except self._psycopg.Error as exc:
            logger.warning("%s: could not name the conflicting event: %s", self._where, exc)
        return StoreConflictError("an event of the batch already exists")

    def _error(self, what: str, exc: Exception) -> StoreError:
        detail = " ".join(str(exc).split())
        password = self._info.get("password")
        if password:
            detail = detail.replace(password, "***")
        return StoreError(_scrub(f"PostgreSQL {self._where}: {what}: {detail}"))


def _parse_dsn(psycopg_module: ModuleType, dsn: str) -> dict[str, str]:
    try:
        info = psycopg_module.conninfo.conninfo_to_dict(dsn)
    except psycopg_module.Error as exc:
        detail = _scrub(" ".join(str(exc).split()))
        raise StoreError(f"invalid PostgreSQL DSN: {detail}") from exc
    return {key: str(value) for key, value in info.items() if value is not None}


def _describe(info: dict[str, str]) -> str:
    """Where the store is, without secrets: "host=... port=... dbname=... user=..."."""
    parts = [f"{key}={info[key]}" for key in ("host", "port", "dbname", "user") if key in info]
    return " ".join(parts) or "(libpq defaults)"


def _scrub(text: str) -> str:
    text = _PASSWORD_IN_URL.sub(r"\1***@", text)
    return _PASSWORD_IN_KV.sub(r"\1***", text)


def _event_row(event: Event) -> tuple[Any, ...]:
    return (
        event.run_id,
        event.seq,
        event.type.value,
        event.timestamp,
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
        ts=ts,
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
        "started_at": delta.started_at,
        "first_ts": delta.first_ts,
        "iterations": delta.iterations,
        "reason": delta.termination_reason,
        "updated_at": delta.last_ts,
    }


def _row_summary(row: Sequence[Any]) -> RunSummary:
    run_id, workflow, goal, started_at, iterations, reason = row
    return RunSummary(
        run_id=run_id,
        workflow=workflow,
        goal=goal,
        started_at=started_at.astimezone(UTC),
        iterations=int(iterations),
        termination_reason=reason,
    )
