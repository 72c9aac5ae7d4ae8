"""The dispatch queue's SQL written once for SQLite and PostgreSQL: a `Dialect` holds what differs
between them (placeholders, timestamp columns, a few functions, the notifications PostgreSQL
sends), and `SqlDispatchQueue` runs every operation the two adapters do alike through the hooks a
backend supplies: its connection for reads, for single writes and for transactions, each
translating its driver's errors. A backend keeps its connection handling, its locking and its
claim of a batch (SQLite's three statements under BEGIN IMMEDIATE, PostgreSQL's server-side
function); `complete_batch` is written here once (a transaction of fenced updates), and
PostgreSQL replaces it with one statement over arrays.

Imports no database driver; the backends (sqlite_queue.py, pg_queue.py) do.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, Protocol

from fsm_kernel.errors import StoreConflictError, StoreError, StoreSchemaError
from fsm_kernel.protocol import Clock, new_id
from fsm_kernel.scheduler.queue import (
    CANCELLED_EXPIRED,
    CANCELLED_PENDING,
    CANCELLED_WOKEN,
    COLUMNS,
    DEFAULT_MAX_ATTEMPTS,
    LEGACY_COLUMNS,
    LEGACY_TABLE,
    NOTIFY_CHANNEL,
    SCHEMA_VERSION,
    TABLE,
    Completion,
    Dispatch,
    DispatchStatus,
    abandoned_sql,
    already_finished,
    lease_conflict,
    log_reaped,
    require_aware,
    tick_key,
    validate_final_status,
    wake_refused,
)

__all__ = [
    "COLS",
    "ORDER",
    "POSTGRES",
    "RETURNING",
    "SELECT",
    "SQLITE",
    "Dialect",
    "Executor",
    "SqlDispatchQueue",
    "best_claimable",
    "claim_assignments",
    "claim_update",
    "claimable_sql",
    "in_claim_order",
    "live_count",
    "notify_item",
    "reap_assignments",
    "reap_condition",
    "reap_update",
    "reclaimable_sql",
    "sqlite_ts",
    "wake_update",
    "with_notify",
]

COLS: str = ", ".join(COLUMNS)
SELECT: str = f"SELECT {COLS} FROM {TABLE}"
RETURNING: str = f"RETURNING {COLS}"
ORDER: str = "ORDER BY priority DESC, created_at, dispatch_id"


class Rows(Protocol):
    """What executing a statement returns (a DB-API cursor)."""

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    @property
    def rowcount(self) -> int: ...


class Executor(Protocol):
    """A connection of either driver."""

    def execute(self, sql: str, params: Any = ..., /) -> Rows: ...


def in_claim_order(claimed: list[Dispatch]) -> list[Dispatch]:
    """Claimed dispatches best first (an UPDATE returns its rows in no particular order)."""
    return sorted(claimed, key=lambda d: (-d.priority, d.created_at, d.dispatch_id))


def sqlite_ts(moment: datetime) -> str:
    """Fixed-width UTC ISO text, so SQLite's text comparison orders it correctly."""
    return require_aware(moment).astimezone(UTC).isoformat(timespec="microseconds")


def _as_is(moment: datetime) -> datetime:
    return moment


def _no_notify(statement: str, kind: str) -> str:
    return statement


def notify_item(kind: str) -> str:
    """A select-list item that NOTIFYs `<kind> <kernel_id> <dispatch_id>` for each row."""
    return f"pg_notify('{NOTIFY_CHANNEL}', '{kind} ' || kernel_id || ' ' || dispatch_id)"


def with_notify(statement: str, kind: str) -> str:
    """A data-modifying statement (ending in RETURNING) whose rows each send a notification."""
    return f"WITH changed AS ({statement}) SELECT changed.*, {notify_item(kind)} FROM changed"


STATUS_CHECK = "status IN ('pending', 'running', 'done', 'failed', 'cancelled', 'waiting')"


@dataclass(frozen=True, kw_only=True)
class Dialect:
    """What the dispatch queue's SQL and stored values differ in between SQLite and PostgreSQL."""

    param: str
    """The positional placeholder: `?` or `%s`."""
    named: str
    """A named placeholder, `{}` standing for the name: `:{}` or `%({})s`."""
    timestamp: str
    """The type of a timestamp column: TEXT (fixed-width ISO) or TIMESTAMPTZ."""
    first_chars: str
    """SQL for the first n characters of dispatch_id, `{}` standing for n's placeholder."""
    nullable_int: str
    """An integer placeholder tested with IS NULL (PostgreSQL must be told its type)."""
    for_update: str
    """Appended to the SELECT that reads a row before changing it in the same transaction."""
    compound_member: str
    """One `SELECT ... LIMIT 1` of a UNION ALL, `{}` standing for it (SQLite takes no
    parenthesised members)."""
    latest_per_agent: str
    """Each agent's most recent dispatch of the kernel given as the one placeholder."""
    table_exists: str
    """A query that returns a row when the table named by its one placeholder exists."""
    after_migration: tuple[str, ...]
    """Statements run once version 1's rows have been copied."""
    alters_checks: bool
    """Whether a CHECK constraint can be replaced in place (PostgreSQL); SQLite rebuilds the
    table instead."""
    to_db_ts: Callable[[datetime], Any]
    """An aware datetime as a timestamp column's value (text for SQLite)."""
    notify: Callable[[str, str], str]
    """A data-modifying statement made to notify listeners of `kind` for each row it returns
    (unchanged where there are no notifications)."""

    def n(self, name: str) -> str:
        return self.named.format(name)

    @cached_property
    def allow_waiting(self) -> tuple[str, ...]:
        """Version 2 to 3: the status column's CHECK takes 'waiting' too."""
        if self.alters_checks:
            return (
                f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {TABLE}_status_check",
                f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_status_check CHECK ({STATUS_CHECK})",
            )
        return (  # the rows copied into the table made anew; its indexes made anew after
            f"ALTER TABLE {TABLE} RENAME TO {TABLE}_v2",
            self.ddl[0],
            f"INSERT INTO {TABLE} SELECT * FROM {TABLE}_v2",
            f"DROP TABLE {TABLE}_v2",
            *self.ddl[1:],
        )

    @cached_property
    def ddl(self) -> tuple[str, ...]:
        """The tables and indexes, created if missing."""
        ts = self.timestamp
        return (
            f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        dispatch_id TEXT PRIMARY KEY,
        kernel_id TEXT NOT NULL,
        agent_id TEXT NOT NULL,
        prompt TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL
            CHECK ({STATUS_CHECK}),
        dedupe_key TEXT UNIQUE,
        worker_id TEXT,
        lease_expires_at {ts},
        attempts INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL DEFAULT {DEFAULT_MAX_ATTEMPTS} CHECK (max_attempts >= 1),
        run_id TEXT,
        termination_reason TEXT,
        error TEXT,
        created_at {ts} NOT NULL,
        started_at {ts},
        finished_at {ts},
        cancel_requested_at {ts})""",
            f"""CREATE UNIQUE INDEX IF NOT EXISTS {TABLE}_one_active
        ON {TABLE} (kernel_id, agent_id) WHERE status IN ('pending', 'running')""",
            f"""CREATE INDEX IF NOT EXISTS {TABLE}_pending
        ON {TABLE} (kernel_id, priority DESC, created_at, dispatch_id) WHERE status = 'pending'""",
            f"""CREATE INDEX IF NOT EXISTS {TABLE}_running
        ON {TABLE} (kernel_id, lease_expires_at) WHERE status = 'running'""",
            f"""CREATE INDEX IF NOT EXISTS {TABLE}_recent
        ON {TABLE} (kernel_id, created_at DESC, dispatch_id DESC)""",
            f"""CREATE INDEX IF NOT EXISTS {TABLE}_run
        ON {TABLE} (run_id) WHERE run_id IS NOT NULL""",
            f"""CREATE TABLE IF NOT EXISTS scheduler_ticks (
        kernel_id TEXT NOT NULL,
        tick_at {ts} NOT NULL,
        fired_at {ts} NOT NULL,
        PRIMARY KEY (kernel_id, tick_at))""",
        )

    @cached_property
    def enqueue(self) -> str:
        p = self.param
        return (
            f"INSERT INTO {TABLE} (dispatch_id, kernel_id, agent_id, prompt, priority, "
            "status, dedupe_key, attempts, max_attempts, created_at) "
            f"VALUES ({p}, {p}, {p}, {p}, {p}, 'pending', {p}, 0, {p}, {p}) "
            f"ON CONFLICT DO NOTHING {RETURNING}"
        )

    @cached_property
    def reap(self) -> str:
        """Finish the expired dispatches that must not be reclaimed (named parameters now,
        kernel and cancelled)."""
        return f"{reap_update(self.n)}\n{RETURNING}"

    @cached_property
    def wake(self) -> str:
        """Make the waiting dispatch of a run (the one placeholder) pending again."""
        return f"{wake_update(self.param)}\n{RETURNING}"

    def claim(self, name: Callable[[str], str]) -> str:
        """The claim's UPDATE, `name` turning a parameter's name into its placeholder."""
        return claim_update(name, self.compound_member)


def reap_update(name: Callable[[str], str]) -> str:
    """The UPDATE (without RETURNING) that finishes the running dispatches of a kernel whose
    lease expired and that must not be reclaimed: failed after max_attempts claims, cancelled
    when a cancel was requested. `name` gives the placeholders of now, kernel and cancelled."""
    return f"UPDATE {TABLE} SET {reap_assignments(name)}\nWHERE {reap_condition(name)}"


def reap_assignments(name: Callable[[str], str]) -> str:
    """The SET clause of a reap (placeholders now and cancelled)."""
    return f"""status = CASE WHEN cancel_requested_at IS NULL THEN 'failed' ELSE 'cancelled' END,
    error = CASE WHEN cancel_requested_at IS NULL THEN {abandoned_sql()}
        ELSE {name("cancelled")} END,
    finished_at = {name("now")}, lease_expires_at = NULL"""


def reap_condition(name: Callable[[str], str]) -> str:
    """A running row of the kernel whose lease expired and that must not be reclaimed
    (placeholders now and kernel)."""
    now = name("now")
    return f"""kernel_id = {name("kernel")} AND status = 'running' AND lease_expires_at <= {now}
    AND (attempts >= max_attempts OR cancel_requested_at IS NOT NULL)"""


def wake_update(p: str) -> str:
    """The UPDATE (without RETURNING) that makes the waiting dispatch of a run (placeholder `p`)
    pending again, unless its agent has a pending or running dispatch (the one-active index would
    refuse it): worker, lease and outcome cleared, attempts restarted (see queue.py), run_id,
    priority and creation time kept."""
    return f"""UPDATE {TABLE} SET status = 'pending', worker_id = NULL, lease_expires_at = NULL,
    attempts = 0, termination_reason = NULL, error = NULL, finished_at = NULL,
    cancel_requested_at = NULL
WHERE run_id = {p} AND status = 'waiting' AND NOT EXISTS (
    SELECT 1 FROM {TABLE} AS active WHERE active.kernel_id = {TABLE}.kernel_id
    AND active.agent_id = {TABLE}.agent_id AND active.status IN ('pending', 'running'))"""


def reclaimable_sql(now: str) -> str:
    """A running row whose lease expired and that may be claimed again."""
    return (
        f"status = 'running' AND lease_expires_at <= {now} AND attempts < max_attempts "
        "AND cancel_requested_at IS NULL"
    )


def claimable_sql(now: str) -> str:
    """The claim's condition on a row, repeated outside the subqueries because PostgreSQL
    re-checks only the outer conditions on a row that changed while the statement waited for
    its row lock."""
    return f"(status = 'pending' OR ({reclaimable_sql(now)}))"


def best_claimable(name: Callable[[str], str], member: str = "({})") -> str:
    """The ids of a kernel's best claimable dispatches, at most `limit` of them (placeholders
    now, kernel and limit; `member` wraps each member of the UNION ALL).

    Two index lookups (the best pending rows, the best reclaimable ones) instead of one scan
    over "pending OR expired": each is served by a partial index that holds no finished rows."""
    now, kernel, limit = name("now"), name("kernel"), name("limit")
    pending = member.format(
        f"SELECT dispatch_id, priority, created_at FROM {TABLE}\n"
        f"            WHERE kernel_id = {kernel} AND status = 'pending' {ORDER} LIMIT {limit}"
    )
    expired = member.format(
        f"SELECT dispatch_id, priority, created_at FROM {TABLE}\n"
        f"            WHERE kernel_id = {kernel} AND {reclaimable_sql(now)} {ORDER} "
        f"LIMIT {limit}"
    )
    return f"""SELECT dispatch_id FROM (
        {pending}
        UNION ALL
        {expired}
    ) AS candidates {ORDER} LIMIT {limit}"""


def claim_assignments(name: Callable[[str], str]) -> str:
    """The SET clause of a claim (placeholders worker, expires and now)."""
    return (
        f"status = 'running', worker_id = {name('worker')}, lease_expires_at = "
        f"{name('expires')}, attempts = attempts + 1, started_at = {name('now')}"
    )


def live_count(name: Callable[[str], str]) -> str:
    """How many dispatches of the kernel run under live leases (placeholders kernel, now)."""
    return (
        f"SELECT count(*) AS n FROM {TABLE} WHERE kernel_id = {name('kernel')} "
        f"AND status = 'running' AND lease_expires_at > {name('now')}"
    )


def claim_update(name: Callable[[str], str], member: str = "({})") -> str:
    """The UPDATE (without RETURNING) that claims the `limit` best claimable dispatches of a
    kernel. The caller bounds `limit` by the room the cap leaves, counted (`live_count`) in the
    same transaction while no other claim of the kernel can commit (SQLite's writer lock)."""
    return f"""UPDATE {TABLE} SET {claim_assignments(name)}
WHERE dispatch_id IN ({best_claimable(name, member)})
AND {claimable_sql(name("now"))}"""


SQLITE: Dialect = Dialect(
    param="?",
    named=":{}",
    timestamp="TEXT",
    first_chars="substr(dispatch_id, 1, {})",
    nullable_int="?",
    for_update="",
    compound_member="SELECT * FROM ({})",
    latest_per_agent=(
        f"SELECT {COLS} FROM (SELECT *, row_number() OVER (PARTITION BY "
        f"agent_id ORDER BY created_at DESC, dispatch_id DESC) AS rn FROM {TABLE} "
        "WHERE kernel_id = ?) WHERE rn = 1"
    ),
    table_exists="SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
    after_migration=(),
    alters_checks=False,
    to_db_ts=sqlite_ts,
    notify=_no_notify,
)
POSTGRES: Dialect = Dialect(
    param="%s",
    named="%({})s",
    timestamp="TIMESTAMPTZ",
    first_chars="left(dispatch_id, {})",
    nullable_int="%s::integer",
    for_update=" FOR UPDATE",
    compound_member="({})",
    latest_per_agent=(
        f"SELECT DISTINCT ON (agent_id) {COLS} FROM {TABLE} "
        "WHERE kernel_id = %s ORDER BY agent_id, created_at DESC, dispatch_id DESC"
    ),
    table_exists="SELECT 1 WHERE to_regclass(%s) IS NOT NULL",
    after_migration=(f"ANALYZE {TABLE}",),
    alters_checks=True,
    to_db_ts=_as_is,
    notify=with_notify,
)


class SqlDispatchQueue:
    """Every DispatchQueue operation the two adapters do alike, in the subclass's dialect.

    A subclass sets `dialect` and `clock` and supplies `_read` (a connection for reads),
    `_write` (a connection for one write, atomic on its own) and `_transaction` (a connection
    inside a write transaction), each translating its driver's errors to StoreError; it
    implements `claim`, `listener`, `close` and whatever else is its own."""

    dialect: Dialect
    clock: Clock
    _schema_where = ""
    """Prefixed to the message of a schema that is too new (SQLite names its file)."""
    _unique_violations: tuple[type[Exception], ...] = ()
    """The driver's errors for a row a unique index refuses (caught where that is an answer)."""

    def _read(self) -> AbstractContextManager[Executor]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Executor]:
        raise NotImplementedError

    def _transaction(self) -> AbstractContextManager[Executor]:
        raise NotImplementedError

    def _lock_schema(self, conn: Executor) -> None:
        """Called first in ensure_schema's transaction (PostgreSQL serialises openers)."""

    def _install(self, conn: Executor) -> None:
        """Called in ensure_schema's transaction after the tables (PostgreSQL's function)."""

    def _fenced_sql(
        self, sql: str, params: tuple[Any, ...], notify: tuple[int | None, datetime] | None
    ) -> tuple[str, tuple[Any, ...]]:
        """A fenced update as sent (PostgreSQL wraps a completion in its notification)."""
        return sql, params

    def ensure_schema(self) -> None:
        """Create or migrate, in one write transaction: version 1's dispatch_tasks is copied
        into kernel_dispatch_tasks, row for row, and dropped; a second run finds nothing to do."""
        d = self.dialect
        with self._transaction() as conn:
            self._lock_schema(conn)
            conn.execute(
                "CREATE TABLE IF NOT EXISTS scheduler_schema ("
                "singleton INTEGER PRIMARY KEY CHECK (singleton = 1), version INTEGER NOT NULL)"
            )
            row = conn.execute("SELECT version FROM scheduler_schema").fetchone()
            version = int(row["version"]) if row is not None else None
            if version is not None and version > SCHEMA_VERSION:
                raise StoreSchemaError(
                    f"{self._schema_where}dispatch schema version {version} is newer than "
                    f"this fsm-kernel supports ({SCHEMA_VERSION})"
                )
            for statement in d.ddl:
                conn.execute(statement)
            if version is not None and version < SCHEMA_VERSION:
                if conn.execute(d.table_exists, (LEGACY_TABLE,)).fetchone() is not None:
                    _migrate_v1(conn, d)
                elif version == 2:
                    for statement in d.allow_waiting:
                        conn.execute(statement)
            self._install(conn)
            conn.execute(
                f"INSERT INTO scheduler_schema VALUES (1, {d.param}) "
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
        d = self.dialect
        params = (new_id(), kernel_id, agent_id, prompt, priority, dedupe_key, max_attempts)
        with self._write() as conn:
            row = conn.execute(d.notify(d.enqueue, "enqueued"), (*params, self._now())).fetchone()
        return Dispatch.from_row(row) if row else None

    def reap(self, kernel_id: str) -> builtins.list[Dispatch]:
        d = self.dialect
        params = {"now": self._now(), "kernel": kernel_id, "cancelled": CANCELLED_EXPIRED}
        with self._write() as conn:
            rows = conn.execute(d.notify(d.reap, "ended"), params).fetchall()
        reaped = [Dispatch.from_row(r) for r in rows]
        log_reaped(reaped)
        return reaped

    def claim_batch(
        self,
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> builtins.list[Dispatch]:
        raise NotImplementedError

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        claimed = self.claim_batch(kernel_id, worker_id, lease_seconds, max_concurrent, 1)
        return claimed[0] if claimed else None

    def complete_and_claim(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        raise NotImplementedError

    async def complete_and_claim_async(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """`complete_and_claim` in a thread (a backend whose driver has no asyncio API)."""
        return await asyncio.to_thread(
            self.complete_and_claim,
            completions,
            kernel_id,
            worker_id,
            lease_seconds,
            max_concurrent,
            limit,
        )

    async def connect_async(self) -> None:
        """Nothing to open: `complete_and_claim_async` runs in a thread, on the store's own
        connection."""

    def complete_batch(
        self, completions: builtins.list[Completion], *, max_concurrent: int | None = None
    ) -> builtins.list[Dispatch | StoreConflictError]:
        """Each completion's fenced update, all in one write transaction (one commit)."""
        now = self.clock.now()
        with self._transaction() as conn:
            return self._complete_on(conn, completions, (max_concurrent, now), now)

    def _complete_on(
        self,
        conn: Executor,
        completions: builtins.list[Completion],
        notify: tuple[int | None, datetime] | None,
        now: datetime,
    ) -> builtins.list[Dispatch | StoreConflictError]:
        """`complete_batch` inside the caller's transaction."""
        results: builtins.list[Dispatch | StoreConflictError] = []
        for c in completions:
            assignments, params = self._completion_set(c.status, now, c)
            try:
                results.append(
                    self._fenced_on(
                        conn, assignments, params, c.dispatch_id, c.worker_id, c.attempt, notify
                    )
                )
            except StoreConflictError as exc:
                results.append(exc)
        return results

    def _completion_set(
        self, status: DispatchStatus | str, now: datetime, c: Completion | None = None
    ) -> tuple[str, tuple[Any, ...]]:
        """The SET clause recording an outcome, and its parameters (from `c` when given)."""
        final = validate_final_status(status)
        p = self.dialect.param
        fields = (c.run_id, c.termination_reason, c.error) if c else (None, None, None)
        return (
            f"status = {p}, run_id = {p}, termination_reason = {p}, error = {p}, "
            f"finished_at = {p}, lease_expires_at = NULL",
            (final.value, *fields, self.dialect.to_db_ts(now)),
        )

    def heartbeat(
        self, dispatch_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
    ) -> Dispatch:
        expires = self.clock.now() + timedelta(seconds=lease_seconds)
        return self._fenced_update(
            f"lease_expires_at = {self.dialect.param}",
            (self.dialect.to_db_ts(expires),),
            dispatch_id,
            worker_id,
            attempt,
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
        now = self.clock.now()
        p = self.dialect.param
        return self._fenced_update(
            f"status = {p}, run_id = {p}, termination_reason = {p}, error = {p}, "
            f"finished_at = {p}, lease_expires_at = NULL",
            (final.value, run_id, termination_reason, error, self.dialect.to_db_ts(now)),
            dispatch_id,
            worker_id,
            attempt,
            notify=(max_concurrent, now),
        )

    def settle_waiting(
        self,
        run_id: str,
        *,
        status: DispatchStatus | str,
        termination_reason: str | None = None,
        error: str | None = None,
    ) -> Dispatch | None:
        final = DispatchStatus(status)
        if final not in (DispatchStatus.DONE, DispatchStatus.FAILED):
            raise StoreError(f"a waiting dispatch settles as done or failed, not {final.value}")
        p = self.dialect.param
        finished = self._now()
        with self._write() as conn:
            if conn.execute(self.dialect.table_exists, (TABLE,)).fetchone() is None:
                return None  # an event log without a dispatch queue
            row = conn.execute(
                f"UPDATE {TABLE} SET status = {p}, termination_reason = {p}, error = {p}, "
                f"finished_at = {p} WHERE run_id = {p} AND status IN ('waiting', 'pending') "
                f"{RETURNING}",  # pending with a run: woken, not yet claimed
                (final.value, termination_reason, error, finished, run_id),
            ).fetchone()
        return Dispatch.from_row(row) if row is not None else None

    def wake_waiting(self, run_id: str) -> Dispatch | None:
        d, p = self.dialect, self.dialect.param
        wake = d.notify(d.wake, "enqueued")  # idle workers look at once
        with self._write() as conn:
            if conn.execute(d.table_exists, (TABLE,)).fetchone() is None:
                return None  # an event log without a dispatch queue
            try:
                row = conn.execute(wake, (run_id,)).fetchone()
            except self._unique_violations:  # its agent's dispatch enqueued meanwhile (PG)
                row = None
            if row is not None:
                return Dispatch.from_row(row)
            waiting = conn.execute(
                f"{SELECT} WHERE run_id = {p} AND status = 'waiting'", (run_id,)
            ).fetchone()
            if waiting is None:
                return None
            blocking = conn.execute(
                f"{SELECT} WHERE kernel_id = {p} AND agent_id = {p} "
                "AND status IN ('pending', 'running')",
                (waiting["kernel_id"], waiting["agent_id"]),
            ).fetchone()
        raise wake_refused(
            Dispatch.from_row(waiting), Dispatch.from_row(blocking) if blocking else None
        )

    def dispatch_of_run(self, run_id: str) -> Dispatch | None:
        d, p = self.dialect, self.dialect.param
        with self._read() as conn:
            if conn.execute(d.table_exists, (TABLE,)).fetchone() is None:
                return None
            row = conn.execute(f"{SELECT} WHERE run_id = {p}", (run_id,)).fetchone()
        return Dispatch.from_row(row) if row else None

    def cancel(self, kernel_id: str, dispatch_id: str) -> Dispatch | None:
        d, p = self.dialect, self.dialect.param
        now = self.clock.now()
        with self._transaction() as conn:
            row = conn.execute(
                f"{SELECT} WHERE dispatch_id = {p} AND kernel_id = {p}{d.for_update}",
                (dispatch_id, kernel_id),
            ).fetchone()
            if row is None:
                return None
            current = Dispatch.from_row(row)
            if not current.is_active:
                raise already_finished(current)
            assignments, params, kind = _cancel_update(d, current, now)
            statement = f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = {p} {RETURNING}"
            updated = conn.execute(d.notify(statement, kind), (*params, dispatch_id)).fetchone()
        return Dispatch.from_row(updated) if updated else None

    def get(self, dispatch_id: str) -> Dispatch | None:
        with self._read() as conn:
            row = conn.execute(
                f"{SELECT} WHERE dispatch_id = {self.dialect.param}", (dispatch_id,)
            ).fetchone()
        return Dispatch.from_row(row) if row else None

    def find(self, kernel_id: str, prefix: str, limit: int = 2) -> builtins.list[Dispatch]:
        d, p = self.dialect, self.dialect.param
        sql = f"{SELECT} WHERE kernel_id = {p} AND {d.first_chars.format(p)} = {p} LIMIT {p}"
        with self._read() as conn:
            rows = conn.execute(sql, (kernel_id, len(prefix), prefix, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def active_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        sql = (
            f"{SELECT} WHERE kernel_id = {self.dialect.param} AND status IN ('pending', 'running')"
        )
        return self._per_agent(sql, kernel_id)

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        return self._per_agent(self.dialect.latest_per_agent, kernel_id)

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        p = self.dialect.param
        sql = f"{SELECT} WHERE kernel_id = {p} ORDER BY created_at DESC, dispatch_id DESC LIMIT {p}"
        with self._read() as conn:
            rows = conn.execute(sql, (kernel_id, limit)).fetchall()
        return [Dispatch.from_row(row) for row in rows]

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        d, p = self.dialect, self.dialect.param
        sql = f"INSERT INTO scheduler_ticks VALUES ({p}, {p}, {p}) ON CONFLICT DO NOTHING"
        with self._write() as conn:
            cursor = conn.execute(sql, (kernel_id, d.to_db_ts(tick_key(tick_time)), self._now()))
            return cursor.rowcount == 1

    def _per_agent(self, sql: str, kernel_id: str) -> dict[str, Dispatch]:
        with self._read() as conn:
            rows = conn.execute(sql, (kernel_id,)).fetchall()
        return {row["agent_id"]: Dispatch.from_row(row) for row in rows}

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
        """Change the row only while it is still running under this worker (and attempt);
        StoreConflictError otherwise."""
        with self._write() as conn:
            return self._fenced_on(
                conn, assignments, params, dispatch_id, worker_id, attempt, notify
            )

    def _fenced_on(
        self,
        conn: Executor,
        assignments: str,
        params: tuple[Any, ...],
        dispatch_id: str,
        worker_id: str,
        attempt: int | None,
        notify: tuple[int | None, datetime] | None,
    ) -> Dispatch:
        """`_fenced_update` on a connection the caller holds (a transaction of several)."""
        p = self.dialect.param
        sql, params = self._fenced_sql(
            f"UPDATE {TABLE} SET {assignments} WHERE dispatch_id = {p} AND status = 'running' "
            f"AND worker_id = {p} AND ({self.dialect.nullable_int} IS NULL OR attempts = {p}) "
            f"{RETURNING}",
            (*params, dispatch_id, worker_id, attempt, attempt),
            notify,
        )
        row = conn.execute(sql, params).fetchone()
        if row is None:
            found = conn.execute(f"{SELECT} WHERE dispatch_id = {p}", (dispatch_id,)).fetchone()
            raise lease_conflict(
                dispatch_id, worker_id, Dispatch.from_row(found) if found else None
            )
        return Dispatch.from_row(row)

    def _now(self) -> Any:
        return self.dialect.to_db_ts(self.clock.now())


def _cancel_update(
    d: Dialect, current: Dispatch, now: datetime
) -> tuple[str, tuple[Any, ...], str]:
    """The SET clause that cancels an active dispatch (or requests it, for a live lease), and the
    notification it sends."""
    p, at = d.param, d.to_db_ts(now)
    if current.status is DispatchStatus.PENDING:
        why = CANCELLED_PENDING if current.run_id is None else CANCELLED_WOKEN
        return f"status = 'cancelled', error = {p}, finished_at = {p}", (why, at), "ended"
    if current.lease_expires_at is not None and current.lease_expires_at <= now:
        return (
            f"status = 'cancelled', error = {p}, finished_at = {p}, lease_expires_at = NULL, "
            f"cancel_requested_at = coalesce(cancel_requested_at, {p})",
            (CANCELLED_EXPIRED, at, at),
            "ended",
        )
    return f"cancel_requested_at = coalesce(cancel_requested_at, {p})", (at,), "cancel"


def _migrate_v1(conn: Executor, d: Dialect) -> None:
    """Copy every row of version 1's table (the new columns take their defaults), then drop it
    (its indexes go with it). Runs inside ensure_schema's transaction: all or nothing."""
    columns = ", ".join(LEGACY_COLUMNS)
    conn.execute(
        # WHERE true: without it SQLite reads ON CONFLICT as part of the SELECT's join
        f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {LEGACY_TABLE} WHERE true "
        "ON CONFLICT DO NOTHING"
    )
    conn.execute(f"DROP TABLE {LEGACY_TABLE}")
    for statement in d.after_migration:
        conn.execute(statement)
