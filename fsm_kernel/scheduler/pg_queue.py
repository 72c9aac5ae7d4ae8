"""The PostgreSQL dispatch queue, for several workers on several hosts sharing one fleet.

Claims: the fleet-wide `max_concurrent` cannot be enforced by SKIP LOCKED alone (a claimer's
count does not see rows another claimer is locking), so each claim first takes a
transaction-level advisory lock keyed on the kernel id: claims of one kernel are serialised, and
under READ COMMITTED the claim statement's snapshot is taken after the previous claimer
committed. The lock, the claim and the commit run in one server-side function
(fsm_kernel_claim_dispatch, created with the table), so the lock is held for the server's work
only, never across a round trip; the claim reads partial indexes over pending and running rows,
so its cost does not grow with the finished history.

Wake-ups: enqueue, the end of a dispatch and a cancel request NOTIFY channel
`fsm_kernel_dispatch` (sent at commit); a worker's `PostgresDispatchListener` LISTENs on its own
connection. Polling stays the fallback while that connection is down.

Clock: lease expiry is computed and compared with the injected Clock (the host's clock by
default), never the database's now(), exactly like the SQLite queue. Hosts sharing a fleet must
therefore keep their clocks in sync (NTP); skew shortens or lengthens leases by that much.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from types import TracebackType
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
    NOTIFY_CHANNEL,
    SCHEMA_VERSION,
    TABLE,
    Dispatch,
    DispatchStatus,
    QueueSignal,
    abandoned_sql,
    already_finished,
    lease_conflict,
    log_reaped,
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

__all__ = ["PostgresDispatchListener", "PostgresDispatchQueue"]

logger = logging.getLogger(__name__)

_SCHEMA_LOCK_KEY = "fsm_kernel.scheduler.schema"
_CLAIM_LOCK_PREFIX = "fsm_kernel.scheduler.claim:"
_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"

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
        lease_expires_at TIMESTAMPTZ,
        attempts INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL DEFAULT {DEFAULT_MAX_ATTEMPTS} CHECK (max_attempts >= 1),
        run_id TEXT,
        termination_reason TEXT,
        error TEXT,
        created_at TIMESTAMPTZ NOT NULL,
        started_at TIMESTAMPTZ,
        finished_at TIMESTAMPTZ,
        cancel_requested_at TIMESTAMPTZ)""",
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
        tick_at TIMESTAMPTZ NOT NULL,
        fired_at TIMESTAMPTZ NOT NULL,
        PRIMARY KEY (kernel_id, tick_at))""",
)

_COLS = ", ".join(COLUMNS)
_SELECT = f"SELECT {_COLS} FROM {TABLE}"
_RETURNING = f"RETURNING {_COLS}"
_ORDER = "ORDER BY priority DESC, created_at, dispatch_id"


def _notify(kind: str) -> str:
    """A select-list item that NOTIFYs `<kind> <kernel_id> <dispatch_id>` for each row."""
    return f"pg_notify('{NOTIFY_CHANNEL}', '{kind} ' || kernel_id || ' ' || dispatch_id)"


def _with_notify(statement: str, kind: str) -> str:
    """A data-modifying statement (ending in RETURNING) whose rows each send a notification."""
    return f"WITH changed AS ({statement}) SELECT changed.*, {_notify(kind)} FROM changed"


_RECLAIMABLE = (
    "status = 'running' AND lease_expires_at <= p_now AND attempts < max_attempts "
    "AND cancel_requested_at IS NULL"
)
_CLAIM_FUNCTION = "fsm_kernel_claim_dispatch"
_CLAIM_SIGNATURE = f"{_CLAIM_FUNCTION}(text, text, timestamptz, timestamptz, integer, text)"
# A claim is one prepared call of this function: one round trip, plans cached by the server, and
# the advisory lock held only while the server works, never while a message travels or the
# client waits for a CPU (sent as separate statements, 16 workers on 2 cores queued behind a
# descheduled lock holder). Being VOLATILE, each statement inside takes a fresh snapshot, so
# the count sees everything the previous holder of the lock committed. No SKIP LOCKED is needed
# (claims of a kernel take turns); the status test is repeated outside the subquery because
# PostgreSQL re-checks only the outer conditions on a row that changed while the UPDATE waited
# for its row lock. Rows come back as the reaped ones (failed, cancelled), then the claimed one.
_CLAIM_DDL = f"""
CREATE OR REPLACE FUNCTION {_CLAIM_FUNCTION}(
    p_kernel text, p_worker text, p_now timestamptz, p_expires timestamptz, p_cap integer,
    p_cancelled text)
RETURNS SETOF {TABLE} LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    reaped {TABLE};
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('{_CLAIM_LOCK_PREFIX}' || p_kernel, 0));
    FOR reaped IN
        UPDATE {TABLE} SET
            status = CASE WHEN cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
            error = CASE WHEN cancel_requested_at IS NULL THEN {abandoned_sql()}
                ELSE p_cancelled END,
            finished_at = p_now, lease_expires_at = NULL
        WHERE kernel_id = p_kernel AND status = 'running' AND lease_expires_at <= p_now
            AND (attempts >= max_attempts OR cancel_requested_at IS NOT NULL)
        RETURNING *
    LOOP
        PERFORM pg_notify('{NOTIFY_CHANNEL}',
                          'ended ' || reaped.kernel_id || ' ' || reaped.dispatch_id);
        RETURN NEXT reaped;
    END LOOP;
    RETURN QUERY
    UPDATE {TABLE} SET status = 'running', worker_id = p_worker, lease_expires_at = p_expires,
        attempts = attempts + 1, started_at = p_now
    WHERE dispatch_id = (
        SELECT dispatch_id FROM (
            (SELECT dispatch_id, priority, created_at FROM {TABLE}
                WHERE kernel_id = p_kernel AND status = 'pending' {_ORDER} LIMIT 1)
            UNION ALL
            (SELECT dispatch_id, priority, created_at FROM {TABLE}
                WHERE kernel_id = p_kernel AND {_RECLAIMABLE} {_ORDER} LIMIT 1)
        ) AS candidates {_ORDER} LIMIT 1)
    AND (status = 'pending' OR ({_RECLAIMABLE}))
    AND (SELECT count(*) FROM {TABLE} WHERE kernel_id = p_kernel AND status = 'running'
         AND lease_expires_at > p_now) < p_cap
    RETURNING *;
END
$fn$"""
_CLAIM = f"SELECT {_COLS} FROM {_CLAIM_FUNCTION}(%s, %s, %s, %s, %s, %s)"
_REAP = _with_notify(
    f"""UPDATE {TABLE} SET
        status = CASE WHEN cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
        error = CASE WHEN cancel_requested_at IS NULL THEN {abandoned_sql()}
            ELSE %(cancelled)s END,
        finished_at = %(now)s, lease_expires_at = NULL
    WHERE kernel_id = %(kernel)s AND status = 'running' AND lease_expires_at <= %(now)s
        AND (attempts >= max_attempts OR cancel_requested_at IS NOT NULL)
    {_RETURNING}""",
    "ended",
)
# After a dispatch ends: the `changed` row still counts as running in this statement's snapshot,
# so "count >= cap" means the kernel was full. Notifying every end would wake every idle worker
# of the fleet for nothing while the cap is not binding.
_NOTIFY_IF_SLOT_AWAITED = f"""
SELECT changed.*, CASE WHEN %s::integer IS NULL OR (
    (SELECT count(*) FROM {TABLE} AS t WHERE t.kernel_id = changed.kernel_id
        AND t.status = 'running' AND t.lease_expires_at > %s) >= %s
    AND EXISTS (SELECT 1 FROM {TABLE} AS t WHERE t.kernel_id = changed.kernel_id
        AND t.status = 'pending'))
THEN {_notify("ended")} END AS notified FROM changed"""
_ENQUEUE = _with_notify(
    f"INSERT INTO {TABLE} (dispatch_id, kernel_id, agent_id, prompt, priority, status, "
    "dedupe_key, attempts, max_attempts, created_at) "
    "VALUES (%s, %s, %s, %s, %s, 'pending', %s, 0, %s, %s) "
    f"ON CONFLICT DO NOTHING {_RETURNING}",
    "enqueued",
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
        """Create or migrate, in one transaction under an advisory lock (so concurrent openers
        wait instead of colliding): version 1's dispatch_tasks is copied into
        kernel_dispatch_tasks, row for row, and dropped; a second run finds nothing to do."""
        with self._transaction() as conn:
            conn.execute(_ADVISORY_LOCK, (_SCHEMA_LOCK_KEY,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS scheduler_schema ("
                "singleton INTEGER PRIMARY KEY CHECK (singleton = 1), version INTEGER NOT NULL)"
            )
            row = conn.execute("SELECT version FROM scheduler_schema").fetchone()
            version = int(row["version"]) if row is not None else None
            if version is not None and version > SCHEMA_VERSION:
                raise StoreSchemaError(
                    f"dispatch schema version {version} is newer than this fsm-kernel "
                    f"supports ({SCHEMA_VERSION})"
                )
            for statement in _DDL:
                conn.execute(statement)
            if version is not None and version < SCHEMA_VERSION:
                _migrate_v1(conn)
            found = conn.execute("SELECT to_regprocedure(%s) AS f", (_CLAIM_SIGNATURE,))
            if (row := found.fetchone()) is None or row["f"] is None:
                conn.execute(_CLAIM_DDL)
            conn.execute(
                "INSERT INTO scheduler_schema VALUES (1, %s) "
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
        params = (new_id(), kernel_id, agent_id, prompt, priority, dedupe_key, max_attempts)
        row = self._one(_ENQUEUE, (*params, self.clock.now()))
        return Dispatch.from_row(row) if row else None

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        now = self.clock.now()
        expires = now + timedelta(seconds=lease_seconds)
        params = (kernel_id, worker_id, now, expires, max_concurrent, CANCELLED_EXPIRED)
        with self._session() as conn:
            rows = [Dispatch.from_row(r) for r in conn.execute(_CLAIM, params).fetchall()]
        claimed = [d for d in rows if d.status is DispatchStatus.RUNNING]
        log_reaped([d for d in rows if d.status is not DispatchStatus.RUNNING])
        return claimed[0] if claimed else None

    def reap(self, kernel_id: str) -> builtins.list[Dispatch]:
        params = {"now": self.clock.now(), "kernel": kernel_id, "cancelled": CANCELLED_EXPIRED}
        with self._session() as conn:
            rows = conn.execute(_REAP, params).fetchall()
        reaped = [Dispatch.from_row(r) for r in rows]
        log_reaped(reaped)
        return reaped

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
        max_concurrent: int | None = None,
    ) -> Dispatch:
        """Also NOTIFYs `ended` when the end frees a slot someone may be waiting for: the kernel
        was at `max_concurrent` with dispatches pending (always, when it is not given)."""
        final = validate_final_status(status)
        now = self.clock.now()
        return self._fenced_update(
            "status = %s, run_id = %s, termination_reason = %s, error = %s, finished_at = %s, "
            "lease_expires_at = NULL",
            (final.value, run_id, termination_reason, error, now),
            dispatch_id,
            worker_id,
            attempt,
            notify=(max_concurrent, now),
        )

    def cancel(self, kernel_id: str, dispatch_id: str) -> Dispatch | None:
        now = self.clock.now()
        with self._transaction() as conn:
            row = conn.execute(
                f"{_SELECT} WHERE dispatch_id = %s AND kernel_id = %s FOR UPDATE",
                (dispatch_id, kernel_id),
            ).fetchone()
            if row is None:
                return None
            current = Dispatch.from_row(row)
            if not current.is_active:
                raise already_finished(current)
            assignments, params, kind = _cancel_update(current, now)
            statement = f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = %s {_RETURNING}"
            updated = conn.execute(_with_notify(statement, kind), (*params, dispatch_id)).fetchone()
        return Dispatch.from_row(updated) if updated else None

    def get(self, dispatch_id: str) -> Dispatch | None:
        row = self._one(f"{_SELECT} WHERE dispatch_id = %s", (dispatch_id,))
        return Dispatch.from_row(row) if row else None

    def find(self, kernel_id: str, prefix: str, limit: int = 2) -> builtins.list[Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = %s AND left(dispatch_id, %s) = %s LIMIT %s"
        with self._session() as conn:
            rows = conn.execute(sql, (kernel_id, len(prefix), prefix, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def active_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = %s AND status IN ('pending', 'running')"
        with self._session() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = (
            f"SELECT DISTINCT ON (agent_id) {_COLS} FROM {TABLE} "
            "WHERE kernel_id = %s ORDER BY agent_id, created_at DESC, dispatch_id DESC"
        )
        with self._session() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        sql = f"{_SELECT} WHERE kernel_id = %s ORDER BY created_at DESC, dispatch_id DESC LIMIT %s"
        with self._session() as conn:
            rows = conn.execute(sql, (kernel_id, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        sql = "INSERT INTO scheduler_ticks VALUES (%s, %s, %s) ON CONFLICT DO NOTHING"
        with self._session() as conn:
            cursor = conn.execute(sql, (kernel_id, tick_key(tick_time), self.clock.now()))
            return cursor.rowcount == 1

    def listener(self, kernel_id: str) -> PostgresDispatchListener:
        return PostgresDispatchListener(self.dsn, kernel_id)

    def _fenced_update(
        self,
        assignments: str,
        params: tuple[Any, ...],
        dispatch_id: str,
        worker_id: str,
        attempt: int | None,
        *,
        notify: tuple[int | None, datetime] | None = None,
    ) -> Dispatch:
        sql = (
            f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = %s AND "
            "status = 'running' AND worker_id = %s AND (%s::integer IS NULL OR attempts = %s) "
            f"{_RETURNING}"
        )
        params = (*params, dispatch_id, worker_id, attempt, attempt)
        if notify is not None:
            sql = f"WITH changed AS ({sql}) {_NOTIFY_IF_SLOT_AWAITED}"
            cap, now = notify
            params = (*params, cap, now, cap)
        row = self._one(sql, params)
        if row is None:
            current = self.get(dispatch_id)
            raise lease_conflict(dispatch_id, worker_id, current)
        return Dispatch.from_row(row)

    def _one(self, sql: str, params: Any) -> dict[str, Any] | None:
        """One statement in its own (implicit) transaction: a single round trip."""
        with self._session() as conn:
            return conn.execute(sql, params).fetchone()

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
    def _session(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """The connection (autocommit), psycopg's errors translated to StoreError."""
        with self._lock:
            try:
                yield self._connect()
            except psycopg.OperationalError as exc:
                logger.warning("dispatch store connection failed, reconnecting next call: %s", exc)
                self._drop_connection()
                raise StoreError(f"dispatch store (PostgreSQL) unavailable: {exc}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"dispatch store (PostgreSQL) failed: {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with self._session() as conn, conn.transaction():
            yield conn


class PostgresDispatchListener:
    """LISTENs on its own connection and hands the signals of one kernel to a worker.

    When the connection drops it logs one warning, reconnects every `retry_seconds`, and after
    every (re)connection emits a `reconnected` signal: notifications sent meanwhile are lost, so
    the worker should look at the queue once. Meanwhile the worker's polling carries on.
    """

    def __init__(self, dsn: str, kernel_id: str, *, retry_seconds: float = 1.0) -> None:
        self.dsn = dsn
        self.kernel_id = kernel_id
        self.retry_seconds = retry_seconds
        self.connected = asyncio.Event()
        """Set while LISTEN is active (tests wait on it)."""
        self._signals: asyncio.Queue[QueueSignal] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PostgresDispatchListener:
        self._task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def get(self) -> QueueSignal:
        return await self._signals.get()

    async def _listen(self) -> None:
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            except (psycopg.Error, OSError) as exc:
                logger.warning("dispatch listener cannot connect, polling meanwhile: %s", exc)
                await asyncio.sleep(self.retry_seconds)
                continue
            try:
                await self._relay(conn)
            except (psycopg.Error, OSError) as exc:
                logger.warning("dispatch listener lost its connection, polling meanwhile: %s", exc)
            finally:
                self.connected.clear()
                await conn.close()
            await asyncio.sleep(self.retry_seconds)

    async def _relay(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        self.connected.set()
        self._signals.put_nowait(QueueSignal("reconnected", self.kernel_id))
        async for note in conn.notifies():
            signal = QueueSignal.parse(note.payload)
            if signal is not None and signal.kernel_id == self.kernel_id:
                self._signals.put_nowait(signal)


def _cancel_update(current: Dispatch, now: datetime) -> tuple[str, tuple[Any, ...], str]:
    """The SET clause that cancels an active dispatch (or requests it, for a live lease), and the
    notification it sends."""
    if current.status is DispatchStatus.PENDING:
        return (
            "status = 'cancelled', error = %s, finished_at = %s",
            (CANCELLED_PENDING, now),
            "ended",
        )
    if current.lease_expires_at is not None and current.lease_expires_at <= now:
        return (
            "status = 'cancelled', error = %s, finished_at = %s, lease_expires_at = NULL, "
            "cancel_requested_at = coalesce(cancel_requested_at, %s)",
            (CANCELLED_EXPIRED, now, now),
            "ended",
        )
    return "cancel_requested_at = coalesce(cancel_requested_at, %s)", (now,), "cancel"


def _migrate_v1(conn: psycopg.Connection[dict[str, Any]]) -> None:
    """Copy every row of version 1's table (the new columns take their defaults), then drop it
    (its indexes go with it). Runs inside ensure_schema's transaction: all or nothing."""
    legacy = conn.execute("SELECT to_regclass(%s) AS t", (LEGACY_TABLE,)).fetchone()
    if legacy is None or legacy["t"] is None:
        return
    columns = ", ".join(LEGACY_COLUMNS)
    conn.execute(
        f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {LEGACY_TABLE} "
        "ON CONFLICT DO NOTHING"
    )
    conn.execute(f"DROP TABLE {LEGACY_TABLE}")
    conn.execute(f"ANALYZE {TABLE}")
