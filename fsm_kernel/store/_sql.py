"""The SQL event store written once for SQLite and PostgreSQL: a Dialect holds what differs
between them (placeholders, function names, collation, timestamp columns, DDL), and
SqlEventStore runs every EventStore operation through the hooks a backend supplies: its
connection, its transaction and the translation of its driver's errors.

Imports no database driver; the backends (sqlite.py, postgres.py) do.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache, cached_property
from itertools import chain
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self

from fsm_kernel.errors import RunNotFoundError, StoreConflictError, StoreError, StoreSchemaError
from fsm_kernel.protocol import Event, RunFilter, RunSummary
from fsm_kernel.store._schema import (
    AMBIGUOUS_SHOWN,
    COMPONENT,
    EVENT_SEQ,
    INTERRUPTED,
    POSTGRES_MIGRATIONS_TABLE,
    RUN_EVENTS,
    RUN_KEY_SHIFT,
    RUNNING,
    SQLITE_MIGRATIONS_TABLE,
    SUMMARY_STATUSES,
    WAITING,
    Migration,
    RunDelta,
    check_events,
    check_page,
    clean_prefix,
    decode_data,
    encode_data,
    format_ts,
    make_event,
    parse_ts,
    plan_migrations,
    resolve_run,
    summarize_batch,
    unique_prefix,
)

__all__ = [
    "POSTGRES",
    "SQLITE",
    "BatchExecutor",
    "Dialect",
    "Executor",
    "OlderSchemaError",
    "PendingAppend",
    "Rows",
    "SqlEventStore",
    "Statements",
    "event_row",
    "event_rows",
    "keyed_columns",
    "like_escape",
    "only_waiting",
    "progress_params",
    "row_event",
    "row_summary",
    "run_params",
    "runs_query",
    "runs_where",
]


class Rows(Protocol):
    """What executing a statement returns (a DB-API cursor)."""

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Executor(Protocol):
    """A connection, or a cursor, of either driver."""

    def execute(self, sql: str, params: Any = ..., /) -> Rows: ...


class BatchExecutor(Executor, Protocol):
    """What a backend's transaction hands out: an Executor that also takes batches."""

    def executemany(self, sql: str, params: Iterable[Any], /) -> object: ...


@dataclass(frozen=True, kw_only=True)
class Dialect:
    """What the event store's SQL and stored values differ in between SQLite and PostgreSQL."""

    param: str
    """The positional placeholder: `?` or `%s`."""
    named: str
    """A named placeholder, `{}` standing for the name: `:{}` or `%({})s`."""
    json_param: str
    """The placeholder of the JSON `data` column (PostgreSQL casts to jsonb)."""
    greatest: str
    """The two-argument maximum: SQLite's scalar MAX or PostgreSQL's GREATEST."""
    first_chars: str
    """SQL for the first n characters of run_id, `{}` standing for n's placeholder."""
    like: str
    """The pattern match that ignores the case of ASCII letters: SQLite's LIKE, or ILIKE."""
    byte_order: str
    """Appended to `ORDER BY run_id` so an exact id sorts before the ids it is a prefix of."""
    migrations_table: str
    """The DDL of schema_migrations."""
    migration_sql: Callable[[Migration], tuple[str, ...]]
    """A migration's statements for this database."""
    to_db_ts: Callable[[datetime], Any]
    """An aware datetime as a timestamp column's value (text for SQLite)."""
    from_db_ts: Callable[[Any], datetime]
    """A timestamp column's value as an aware UTC datetime."""
    commit_mode: Callable[[bool], str | None]
    """The statement that makes a transaction's commit wait for the disk (True) or not
    (False); None when nothing needs saying."""
    keyed_events: bool
    """Events are keyed by (run_no << RUN_KEY_SHIFT) | seq (SQLite, schema v5) rather than by
    a (run_id, seq) primary key (PostgreSQL): the store numbers each run as it creates its row,
    and puts the key first in each inserted row."""

    @cached_property
    def sql(self) -> Statements:
        """Every statement the store runs, in this dialect."""
        return _statements(self)


@dataclass(frozen=True, kw_only=True)
class Statements:
    """The event store's SQL in one dialect."""

    insert_event: str
    insert_run: str
    """Keeps `runs` in step with `events` for a batch without run.started (creates the row,
    or updates it when the batch changes the iterations or the ending)."""
    upsert_run: str
    """insert_run, also setting workflow, goal and started_at (a batch with run.started)."""
    progress_run: str
    """The update of an existing row by a batch that changes only its iterations, tokens and
    updated_at: no indexed column in its SET list, so SQLite rewrites no index page (an
    upsert that names status and termination_reason rewrites their indexes' entries even
    when their values stay)."""
    select_events: str
    next_seq: str
    select_runs: str
    """The runs' summaries, without WHERE, ORDER BY or LIMIT (see `runs_query`)."""
    select_cursor: str
    """A run's place in the newest-first order: (started_at, run_id)."""
    select_prefix: str
    select_before: str
    """The greatest run id below one, in byte order."""
    select_after: str
    """The least run id above one, in byte order."""
    select_running: str
    """The ids of the runs recorded as running (each is running or interrupted)."""
    event_exists: str
    """1 if the event (run_id, seq) is stored."""
    select_run_no: str
    """A run's number (keyed_events only)."""
    select_migrations: str
    insert_migration: str


def _statements(d: Dialect) -> Statements:
    p = d.param

    def n(name: str) -> str:
        return d.named.format(name)

    # Only a batch with run.started sets workflow, goal and started_at: leaving the indexed
    # started_at out of the SET list spares SQLite an index page rewrite. Other batches change
    # the row only when they complete an iteration or end the run: a batch of bookkeeping
    # events (states entered, transitions, a tool started) leaves the row, and its page,
    # alone, so `updated_at` is when the run's summary last changed.
    # keyed_events: a new row takes the next run number (the unique index runs_no finds the
    # highest at once; the write lock held by the transaction makes it this run's alone)
    numbered = (", run_no", ", (SELECT COALESCE(MAX(run_no), 0) + 1 FROM runs)")
    column, number = numbered if d.keyed_events else ("", "")
    conflict = f"""
INSERT INTO runs (run_id, workflow, goal, started_at, iterations, termination_reason, updated_at,
                  tokens, status, parent_run_id{column})
VALUES ({n("run_id")}, COALESCE({n("workflow")}, ''), COALESCE({n("goal")}, ''),
        COALESCE({n("started_at")}, {n("first_ts")}), {n("iterations")}, {n("reason")},
        {n("updated_at")}, {n("tokens")}, COALESCE({n("status")}, 'running'), {n("parent")}{number})
ON CONFLICT (run_id) DO UPDATE SET
    iterations = {d.greatest}(runs.iterations, {n("iterations")}),
    termination_reason = CASE WHEN {n("reopens")} THEN {n("reason")}
        ELSE COALESCE({n("reason")}, runs.termination_reason) END,
    updated_at = {d.greatest}(runs.updated_at, {n("updated_at")}),
    tokens = runs.tokens + {n("tokens")},
    status = COALESCE({n("status")}, runs.status)"""
    insert_run = (
        f"{conflict}\nWHERE excluded.iterations > runs.iterations "
        "OR excluded.termination_reason IS NOT NULL OR excluded.tokens > 0 "
        f"OR {n('status_changed')}"
    )
    upsert_run = (
        f"{conflict}, workflow = {n('workflow')}, goal = {n('goal')}, "
        f"started_at = {n('started_at')}, parent_run_id = {n('parent')}"
    )
    progress_run = (
        f"UPDATE runs SET iterations = {d.greatest}(iterations, {n('iterations')}), "
        f"updated_at = {d.greatest}(updated_at, {n('updated_at')}), "
        f"tokens = tokens + {n('tokens')} WHERE run_id = {n('run_id')}"
    )
    insert_event, select_events, next_seq, event_exists = _event_sql(d)
    return Statements(
        insert_event=insert_event,
        select_events=select_events,
        next_seq=next_seq,
        event_exists=event_exists,
        progress_run=progress_run,
        insert_run=insert_run,
        upsert_run=upsert_run,
        select_run_no=f"SELECT run_no FROM runs WHERE run_id = {p}",
        select_runs=(
            "SELECT run_id, workflow, goal, started_at, iterations, termination_reason, "
            "status, tokens, updated_at, parent_run_id FROM runs"
        ),
        select_cursor=f"SELECT started_at, run_id FROM runs WHERE run_id = {p}",
        select_prefix=(
            f"SELECT run_id FROM runs WHERE {d.first_chars.format(p)} = {p} "
            f"ORDER BY run_id{d.byte_order} LIMIT {p}"
        ),
        select_before=(
            f"SELECT run_id FROM runs WHERE run_id{d.byte_order} < {p} "
            f"ORDER BY run_id{d.byte_order} DESC LIMIT 1"
        ),
        select_after=(
            f"SELECT run_id FROM runs WHERE run_id{d.byte_order} > {p} "
            f"ORDER BY run_id{d.byte_order} LIMIT 1"
        ),
        select_running=f"SELECT run_id FROM runs WHERE status = '{RUNNING}'",
        select_migrations=f"SELECT version, name FROM schema_migrations WHERE component = {p}",
        insert_migration=f"INSERT INTO schema_migrations VALUES ({p}, {p}, {p}, {p})",
    )


def _event_sql(d: Dialect) -> tuple[str, str, str, str]:
    """insert_event, select_events, next_seq and event_exists for the dialect's events table:
    keyed by (run_no << RUN_KEY_SHIFT) | seq and found through the run's number, or by
    (run_id, seq)."""
    p = d.param
    stored = "type, ts, iteration, state, version, data"

    def marks(n: int) -> str:  # n plain parameters, then the JSON one (data)
        return ", ".join([p] * n + [d.json_param])

    if not d.keyed_events:
        columns = f"run_id, seq, {stored}"
        return (
            f"INSERT INTO events ({columns}) VALUES ({marks(7)})",
            f"SELECT {columns} FROM events WHERE run_id = {p} ORDER BY seq",
            f"SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = {p}",
            f"SELECT 1 FROM events WHERE run_id = {p} AND seq = {p}",
        )
    of_run = f"FROM {RUN_EVENTS} WHERE r.run_id = {p}"  # the key holds run and seq (v6)
    return (
        f"INSERT INTO events (key, {stored}) VALUES ({marks(6)})",
        f"SELECT r.run_id, {EVENT_SEQ}, e.{stored.replace(', ', ', e.')} {of_run} ORDER BY e.key",
        f"SELECT COALESCE(MAX({EVENT_SEQ}), 0) + 1 {of_run}",
        "SELECT 1 FROM events WHERE key = "
        f"(SELECT run_no FROM runs WHERE run_id = {p}) * {1 << RUN_KEY_SHIFT} + {p}",
    )


def _sqlite_statements(migration: Migration) -> tuple[str, ...]:
    return migration.sqlite


def _postgres_statements(migration: Migration) -> tuple[str, ...]:
    return migration.postgres


def _as_is(ts: datetime) -> datetime:
    return ts


def _as_utc(ts: datetime) -> datetime:
    return ts.astimezone(UTC)


def _sqlite_commit_mode(durable: bool) -> None:
    # The connection stays at one safety level (see sqlite.py's _configure): in WAL mode
    # NORMAL, a commit written to the log without a sync, and a durable commit then syncs the
    # log itself (SqliteEventStore._synced), sparing a PRAGMA before each change of mode.
    return None


def _postgres_commit_mode(durable: bool) -> str | None:
    # Without synchronous_commit the server acknowledges before its WAL is flushed (a client
    # dying changes nothing; a server crash may lose the last commits, never half of one).
    return None if durable else "SET LOCAL synchronous_commit TO OFF"


SQLITE = Dialect(
    param="?",
    named=":{}",
    json_param="?",
    greatest="MAX",
    first_chars="substr(run_id, 1, {})",
    like="LIKE",
    byte_order="",  # SQLite compares TEXT bytewise (BINARY) unless told otherwise
    migrations_table=SQLITE_MIGRATIONS_TABLE,
    migration_sql=_sqlite_statements,
    to_db_ts=format_ts,
    from_db_ts=parse_ts,
    commit_mode=_sqlite_commit_mode,
    keyed_events=True,
)

POSTGRES = Dialect(
    param="%s",
    named="%({})s",
    json_param="%s::jsonb",
    greatest="GREATEST",
    first_chars="left(run_id, {})",
    like="ILIKE",
    byte_order=' COLLATE "C"',  # the database's collation may not be byte order
    migrations_table=POSTGRES_MIGRATIONS_TABLE,
    migration_sql=_postgres_statements,
    to_db_ts=_as_is,
    from_db_ts=_as_utc,
    commit_mode=_postgres_commit_mode,
    keyed_events=False,
)


def event_row(d: Dialect, event: Event) -> tuple[Any, ...]:
    """The `events` columns of `event`, in insert_event's order."""
    return event_rows(d, (event,))[0]


def event_rows(d: Dialect, events: Iterable[Event]) -> list[tuple[Any, ...]]:
    """`event_row` of each event: the rows of a batch, built in one loop (the store's thread
    builds tens of thousands a second when hundreds of runs share it, holding the GIL)."""
    to_db_ts = d.to_db_ts
    return [
        (
            e.run_id,
            e.seq,
            e.type._value_,  # the plain str: Enum.value is a descriptor call
            to_db_ts(e.timestamp),
            e.iteration,
            e.state,
            e.version,
            encode_data(e),
        )
        for e in events
    ]


KEYED_WIDTH = 7
"""The columns of an event's row in a keyed dialect's events table: key, type, ts, iteration,
state, version, data."""


def keyed_columns(d: Dialect, events: Iterable[Event]) -> list[Any]:
    """The rows of `events` for a keyed dialect (SQLite), their columns one after another,
    KEYED_WIDTH each, with the seq where the key goes until the run's number is known (see
    SqlEventStore._keyed_columns). One flat list rather than a tuple per row, rebuilt with
    its key and then flattened for a multi-row INSERT: the store's thread builds tens of
    thousands of rows a second when hundreds of runs share it, holding the GIL (with 500
    runs its samples holding the GIL fell by a third, keying the rows from 24% of them to
    2%)."""
    to_db_ts = d.to_db_ts
    columns: list[Any] = []
    for e in events:
        columns += (
            e.seq,
            e.type._value_,  # the plain str: Enum.value is a descriptor call
            to_db_ts(e.timestamp),
            e.iteration,
            e.state,
            e.version,
            encode_data(e),
        )
    return columns


def row_event(d: Dialect, row: Sequence[Any]) -> Event:
    """The Event of a select_events row."""
    run_id, seq, type_, ts, iteration, state, version, data = row
    return make_event(
        run_id=run_id,
        seq=seq,
        type_=type_,
        ts=d.from_db_ts(ts),
        iteration=iteration,
        state=state,
        version=version,
        data=decode_data(data),
    )


def run_params(d: Dialect, delta: RunDelta) -> dict[str, Any]:
    """The named parameters of insert_run and upsert_run for one run's delta."""
    return {
        "run_id": delta.run_id,
        "workflow": delta.workflow,
        "goal": delta.goal,
        "parent": delta.parent_run_id,
        "started_at": None if delta.started_at is None else d.to_db_ts(delta.started_at),
        "first_ts": d.to_db_ts(delta.first_ts),
        "iterations": delta.iterations,
        "reason": delta.termination_reason,
        "updated_at": d.to_db_ts(delta.last_ts),
        "tokens": delta.tokens,
        "status": delta.status,
        "status_changed": delta.status is not None,
        "reopens": delta.reopens,
    }


def progress_params(run_id: str, iterations: int, updated_at: Any, tokens: int) -> dict[str, Any]:
    """The named parameters of progress_run."""
    return {"run_id": run_id, "iterations": iterations, "updated_at": updated_at, "tokens": tokens}


def _add_progress(d: Dialect, progress: dict[str, list[Any]], delta: RunDelta) -> None:
    """Fold a progress delta into `progress`, by run: [iterations, updated_at, tokens], the
    greatest, the latest and the sum, as progress_run would leave the row after each."""
    updated_at = d.to_db_ts(delta.last_ts)
    change = progress.get(delta.run_id)
    if change is None:
        progress[delta.run_id] = [delta.iterations, updated_at, delta.tokens]
    else:
        change[0] = max(change[0], delta.iterations)
        change[1] = max(change[1], updated_at)
        change[2] += delta.tokens


_PROGRESS_HEAD = (
    "UPDATE runs SET iterations = MAX(runs.iterations, v.column2), "
    "updated_at = MAX(runs.updated_at, v.column3), tokens = runs.tokens + v.column4 "
    "FROM (VALUES "
)
_PROGRESS_TAIL = ") AS v WHERE runs.run_id = v.column1"
"""progress_run for many runs at once (SQLite 3.33 on: UPDATE ... FROM), one row per run."""


def row_summary(d: Dialect, row: Sequence[Any]) -> RunSummary:
    """The RunSummary of a select_runs row."""
    run_id, workflow, goal, started_at, iterations, reason, status, tokens, updated_at, parent = row
    return RunSummary(
        run_id=run_id,
        workflow=workflow,
        goal=goal,
        started_at=d.from_db_ts(started_at),
        iterations=int(iterations),
        termination_reason=reason,
        tokens=int(tokens),
        status=status,
        updated_at=d.from_db_ts(updated_at),
        parent_run_id=parent,
    )


def runs_where(
    d: Dialect, where: RunFilter | None, live: Sequence[str] = ()
) -> tuple[str, list[Any]]:
    """The WHERE clause (with a leading space; "" for none) and parameters of a filter.
    `live`: the runs recorded as running whose lock is held, which a status of `running` keeps
    and one of `interrupted` leaves out (see is_running)."""
    if where is None:
        return "", []
    p = d.param
    clauses: list[str] = []
    params: list[Any] = []
    if where.top_level:
        clauses.append("parent_run_id IS NULL")
    if where.workflow:
        clauses.append(f"workflow = {p}")
        params.append(where.workflow)
    if where.status in (RUNNING, INTERRUPTED):
        clauses.append(f"status = '{RUNNING}'")
        marks = ", ".join(p for _ in live)
        if where.status == RUNNING:
            clauses.append(f"run_id IN ({marks})" if live else "1 = 0")
        elif live:
            clauses.append(f"run_id NOT IN ({marks})")
        params += list(live)
    elif where.status in SUMMARY_STATUSES:
        clauses.append(f"status = {p}")
        params.append(where.status)
    elif where.status:  # a termination reason: only an ended run has one (a resume clears it)
        clauses.append(f"termination_reason = {p}")
        params.append(where.status)
    if where.text:
        pattern = "%" + like_escape(where.text) + "%"
        clauses.append(f"(run_id {d.like} {p} ESCAPE '\\' OR goal {d.like} {p} ESCAPE '\\')")
        params += [pattern, pattern]
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def runs_query(
    d: Dialect,
    where: RunFilter | None,
    *,
    cursor: tuple[Any, str] | None,
    older: bool,
    limit: int,
    live: Sequence[str] = (),
) -> tuple[str, list[Any]]:
    """A page of runs: newest first, or, for the page before `cursor` (`older` False), oldest
    first from it (the caller turns it round). Keyset paging on runs_started_at and its
    siblings per filter, so a page deep in 100,000 runs costs what the first one does."""
    sql, params = runs_where(d, where, live)
    if cursor is not None:
        op = "<" if older else ">"
        keyset = f"(started_at, run_id) {op} ({d.param}, {d.param})"
        sql += (" AND " if sql else " WHERE ") + keyset
        params += list(cursor)
    order = "DESC" if older else "ASC"
    sql = f"{d.sql.select_runs}{sql} ORDER BY started_at {order}, run_id {order} LIMIT {d.param}"
    return sql, [*params, limit]


def only_waiting(where: RunFilter | None) -> RunFilter:
    """`where`, narrowed to the runs waiting for a person."""
    return replace(where or RunFilter(), status=WAITING)


def like_escape(text: str) -> str:
    """`text` matched literally by LIKE ... ESCAPE '\\' (no wildcards of its own)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


@dataclass(eq=False, kw_only=True, slots=True)
class PendingAppend:
    """One append waiting to be committed, and how it went."""

    batch: list[Event]
    runs: list[tuple[str, RunDelta]]
    durable: bool
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    """The batch's rows in insert_event's column order (none for a keyed dialect)."""
    columns: list[Any] = field(default_factory=list)
    """The batch's rows for a keyed dialect, one after another (see keyed_columns); their
    keys are set when the batch is inserted."""
    done: bool = False
    error: Exception | None = None
    run_nos: dict[str, int] = field(default_factory=dict)
    """The numbers of the runs this append created or looked up (keyed_events), kept by the
    store once committed."""


ROWS_PER_INSERT = 128
"""The most rows one INSERT of events carries: 6 columns x 128 = 768 parameters, within the
999 of SQLite before 3.32."""


def _execute_rows(
    cur: Executor, head: str, values: str, tail: str, columns: list[Any], width: int
) -> None:
    """Execute `head` + `values` once per row + `tail` for the rows of `width` columns each
    that `columns` holds one after another, ROWS_PER_INSERT rows a statement at most and a
    power of two (so a handful of statements serve every count)."""
    done, size, rows = 0, ROWS_PER_INSERT, len(columns) // width
    while done < rows:
        while size > rows - done:
            size //= 2
        chunk = columns if size == rows else columns[done * width : (done + size) * width]
        done += size
        cur.execute(_many_rows(head, values, tail, size), chunk)


@cache
def _many_rows(head: str, values: str, tail: str, rows: int) -> str:
    """The statement of `_execute_rows` for `rows` rows."""
    return f"{head}{', '.join([values] * rows)}{tail}"


class OlderSchemaError(StoreSchemaError):
    """A store opened read-only was written by an older fsm-kernel: it needs its migrations
    (which only a read-write open applies) before this code can read it."""


class SqlEventStore:
    """The EventStore operations both SQL backends share. A backend sets the class attributes
    and the attributes below, and implements the hooks that raise NotImplementedError.
    """

    _dialect: ClassVar[Dialect]
    _logger: ClassVar[logging.Logger]
    """The backend module's logger, so records keep their origin."""
    _lock: threading.Lock
    """Guards the shared connection."""
    _where: str
    """The store's location for messages (never a password)."""
    _driver_error: type[Exception]
    """The base class of the driver's errors."""
    _unique_violation: type[Exception]
    """The driver's error for a duplicate (run_id, seq)."""
    _queue_lock: threading.Lock
    _queue: list[PendingAppend]
    """Appends waiting for the lock; whoever gets it commits them all."""
    _run_nos: dict[str, int | None]
    """The runs whose `runs` row this store has written (it exists: rows are never deleted),
    each with its number (keyed_events; None otherwise), which never changes."""
    _update_from: ClassVar[bool] = False
    """The database takes UPDATE ... FROM (VALUES ...) with SQLite's column names (SQLite
    3.33 on): the progress of many runs in one statement."""

    def _live(self) -> Executor:
        """The open shared connection (called with the lock held); StoreError when closed."""
        raise NotImplementedError

    def _transaction(self) -> AbstractContextManager[BatchExecutor]:
        """One committed-or-rolled-back transaction on the shared connection."""
        raise NotImplementedError

    def _error(self, what: str, exc: Exception) -> StoreError:
        """The StoreError for a driver error."""
        raise NotImplementedError

    def _lock_schema(self, cur: Executor) -> None:
        """Serialize schema set-up with other processes, inside its transaction."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        """Append a batch atomically; durably unless `durable` is False.

        A durable append is on disk when it returns. One with `durable=False` is committed
        (every reader sees it, and it survives this process dying, by SIGKILL too) but may wait
        for the next durable commit, of any batch, to reach the disk: a machine crash or power
        loss can take it. The recorder passes True before every model or tool call, with a
        person's answer and at the end or suspension of a run, and False for the commits in
        between (a tool's result, the steps after it).

        Appends from several threads at once are committed together (group commit): one
        transaction, each batch in a savepoint of its own, so each still succeeds or fails
        alone, and one sync for all of them.

        Raises:
            StoreConflictError: a (run_id, seq) of the batch exists already (or twice in it);
                nothing of the batch is written.
            StoreError: the database failed.
        """
        job = self._job(events, durable=durable)
        if job is None:
            return
        self._commit_queued([job])
        if job.error is not None:
            raise job.error

    def append_batches(
        self, batches: Sequence[tuple[Sequence[Event], bool]]
    ) -> list[Exception | None]:
        """Several appends, given as (events, durable), made together: each atomic and
        succeeding or failing on its own (its error, or None, at its index), all in one
        transaction with at most one sync. How the run recorder writes the batches of many
        concurrent runs that share this store."""
        errors: list[Exception | None] = [None] * len(batches)
        jobs: list[tuple[int, PendingAppend]] = []
        for i, (events, durable) in enumerate(batches):
            try:
                job = self._job(events, durable=durable)
            except StoreError as exc:
                errors[i] = exc
                continue
            if job is not None:
                jobs.append((i, job))
        self._commit_queued([job for _, job in jobs])
        for i, job in jobs:
            errors[i] = job.error
        return errors

    def _commit_queued(self, jobs: list[PendingAppend]) -> None:
        """Queue `jobs`; whoever holds the lock next commits everything queued."""
        if not jobs:
            return
        with self._queue_lock:
            self._queue.extend(jobs)
        with self._lock:
            if not all(job.done for job in jobs):  # else a holder before took them along
                with self._queue_lock:
                    group, self._queue = self._queue, []
                self._commit(group)

    def _job(self, events: Sequence[Event], *, durable: bool) -> PendingAppend | None:
        """The rows of an append, checked; None for an empty batch."""
        batch = list(events)
        if not batch:
            return None
        check_events(batch)
        d = self._dialect
        if d.keyed_events:
            for event in batch:
                if event.seq >= 1 << RUN_KEY_SHIFT:
                    raise StoreError(
                        f"event {event.run_id}#{event.seq}: seq must be < 2**{RUN_KEY_SHIFT}"
                    )
        keyed = d.keyed_events
        return PendingAppend(
            batch=batch,
            rows=[] if keyed else event_rows(d, batch),
            columns=keyed_columns(d, batch) if keyed else [],
            runs=[
                (d.sql.insert_run if delta.started_at is None else d.sql.upsert_run, delta)
                for delta in summarize_batch(batch)
            ],
            durable=durable,
        )

    def _commit(self, group: list[PendingAppend]) -> None:
        """Write the queued batches in one transaction (called with the lock held); each
        batch's outcome goes to its `error` and `done`."""
        try:
            self._write(group)
        except self._unique_violation as exc:  # a lone batch (several have savepoints)
            group[0].error = self._conflict(group[0].batch)
            group[0].error.__cause__ = exc
        except self._driver_error as exc:
            for job in group:
                job.error = self._error("append failed", exc)
                job.error.__cause__ = exc
        except Exception as exc:  # StoreError: the store is closed
            for job in group:
                job.error = exc if len(group) == 1 else StoreError(str(exc))
        except BaseException as exc:  # KeyboardInterrupt in this thread: nothing committed
            for job in group:
                job.error = StoreError(f"{self._where}: append interrupted ({exc!r})")
            raise
        finally:
            for job in group:
                job.done = True

    def _write(self, group: list[PendingAppend]) -> None:
        d = self._dialect
        durable = any(job.durable for job in group)
        mode = d.commit_mode(durable)
        with self._transaction() as cur:
            if mode is not None:  # SET LOCAL: this transaction only
                cur.execute(mode)
            if len(group) == 1:
                self._insert(cur, group)
            elif not self._insert_together(cur, group):
                for job in group:
                    cur.execute("SAVEPOINT batch")
                    try:
                        self._insert(cur, [job])
                    except self._unique_violation as exc:
                        cur.execute("ROLLBACK TO SAVEPOINT batch")
                        job.error = self._conflict(job.batch)
                        job.error.__cause__ = exc
                    cur.execute("RELEASE SAVEPOINT batch")
        if durable:
            self._synced()
        for job in group:
            if job.error is None:
                for _, delta in job.runs:
                    self._run_nos.setdefault(delta.run_id, None)
                self._run_nos.update(job.run_nos)

    def _synced(self) -> None:
        """After a durable commit: whatever else it takes for the commit to be on disk (the
        commit itself did, when commit_mode says so)."""

    def _insert_together(self, cur: BatchExecutor, group: list[PendingAppend]) -> bool:
        """Insert the batches of `group` as one (one statement for all their events, one for
        all the runs they only advance), in a savepoint; False, with nothing of them written,
        when one of them conflicts: then each goes in a savepoint of its own, so the others
        still succeed (a conflict is a bug or a second writer of a run: rare)."""
        cur.execute("SAVEPOINT together")
        try:
            self._insert(cur, group)
        except self._unique_violation:
            cur.execute("ROLLBACK TO SAVEPOINT together")
            cur.execute("RELEASE SAVEPOINT together")
            for job in group:  # numbers looked up in what was rolled back: look again
                job.run_nos.clear()
            return False
        cur.execute("RELEASE SAVEPOINT together")
        return True

    def _insert(self, cur: BatchExecutor, jobs: list[PendingAppend]) -> None:
        """Write the events and run rows of `jobs`, in the order given."""
        d = self._dialect
        if d.keyed_events:  # the runs' rows first: they number the runs the keys are made of
            self._update_runs(cur, jobs)
            self._insert_events(cur, self._keyed_columns(cur, jobs), together=len(jobs) > 1)
        else:
            rows = jobs[0].rows if len(jobs) == 1 else [r for job in jobs for r in job.rows]
            cur.executemany(d.sql.insert_event, rows)
            self._update_runs(cur, jobs)

    def _insert_events(self, cur: BatchExecutor, columns: list[Any], *, together: bool) -> None:
        """Insert the rows `columns` holds (see keyed_columns): the rows of several batches
        `together` with as few statements as it takes, ROWS_PER_INSERT rows each at most (and
        a power of two, so a handful of statements serve every count). SQLite lets go of the
        GIL while it runs a statement, and the store's thread must take it back after each,
        so one statement for many rows, rather than one step per row, spares the event loop's
        thread a wait for the GIL per row (the rows of hundreds of runs at once). A lone
        batch's few rows go one step each, which costs it less than preparing several
        statements."""
        sql = self._dialect.sql.insert_event
        if not together:
            cur.executemany(sql, zip(*[iter(columns)] * KEYED_WIDTH, strict=True))
            return
        head, values = sql.split(" VALUES ")
        _execute_rows(cur, f"{head} VALUES ", values, "", columns, KEYED_WIDTH)

    def _keyed_columns(self, cur: BatchExecutor, jobs: list[PendingAppend]) -> list[Any]:
        """The rows of `jobs` (see keyed_columns), one after another, each keyed by
        (run_no << RUN_KEY_SHIFT) | seq, which stands for its run_id and seq columns."""
        known = self._run_nos
        for job in jobs:
            numbers, columns = job.run_nos, job.columns
            at = 0
            for event in job.batch:  # set again after a rollback: the same key, or a new one
                run_id = event.run_id
                number = known.get(run_id) or numbers.get(run_id)
                if number is None:
                    number = numbers[run_id] = self._run_no(cur, run_id)
                columns[at] = (number << RUN_KEY_SHIFT) | event.seq
                at += KEYED_WIDTH
        if len(jobs) == 1:
            return jobs[0].columns
        return list(chain.from_iterable(job.columns for job in jobs))

    def _run_no(self, cur: BatchExecutor, run_id: str) -> int:
        """The number of a run whose row this transaction has written."""
        found = cur.execute(self._dialect.sql.select_run_no, (run_id,)).fetchone()
        if found is None or found[0] is None:  # pragma: no cover - written just before
            raise StoreError(f"{self._where}: run {run_id} has no number")
        return int(found[0])

    def _update_runs(self, cur: BatchExecutor, jobs: list[PendingAppend]) -> None:
        """Keep the `runs` rows of `jobs` in step. The updates that only advance a row's
        iterations, tokens and time go last, in one statement: each takes the maximum or adds,
        so their order among themselves and against the others' changes of the same row does
        not matter (and the others of a row this store has written set its status, so
        insert_run's WHERE holds whatever they follow)."""
        d = self._dialect
        progress: dict[str, list[Any]] = {}
        for job in jobs:
            for sql, delta in job.runs:
                if sql is d.sql.insert_run and delta.run_id in self._run_nos:  # the row exists
                    if delta.is_quiet:
                        continue  # and would stay as it is (see insert_run)
                    if delta.is_progress:
                        _add_progress(d, progress, delta)
                        continue
                cur.execute(sql, run_params(d, delta))
        if not progress:
            return
        if self._update_from and len(jobs) > 1:
            columns: list[Any] = []
            for run_id, change in progress.items():
                columns.append(run_id)
                columns += change
            _execute_rows(cur, _PROGRESS_HEAD, "(?, ?, ?, ?)", _PROGRESS_TAIL, columns, 4)
        else:
            params = [progress_params(run_id, *change) for run_id, change in progress.items()]
            cur.executemany(d.sql.progress_run, params)

    def read(self, run_id: str) -> list[Event]:
        """Every event of the run in seq order; [] for an unknown run."""
        rows = self._query(self._dialect.sql.select_events, (run_id,), what="read failed")
        return [row_event(self._dialect, row) for row in rows]

    def next_seq(self, run_id: str) -> int:
        """1 + the run's last seq; 1 for a run with no events."""
        sql = self._dialect.sql.next_seq
        return int(self._query(sql, (run_id,), what="next_seq failed")[0][0])

    def list_runs(
        self,
        *,
        limit: int = 50,
        waiting: bool = False,
        where: RunFilter | None = None,
        before: str | None = None,
        after: str | None = None,
    ) -> list[RunSummary]:
        """The `limit` most recently started runs that `where` keeps (only the ones waiting for
        a person when `waiting`), newest first; with `before` (a run id) only those that come
        after that run in this order (the next page), with `after` only those before it (the
        previous page; still newest first).

        Raises:
            RunNotFoundError: `before` or `after` names no run.
        """
        check_page(limit, before, after)
        where = only_waiting(where) if waiting else where
        cursor = None
        if before is not None or after is not None:
            cursor = self._cursor(str(before if before is not None else after))
        sql, params = runs_query(
            self._dialect,
            where,
            cursor=cursor,
            older=after is None,
            limit=limit,
            live=self._live_runs(where),
        )
        rows = self._query(sql, params, what="list_runs failed")
        runs = [self._shown(row_summary(self._dialect, row)) for row in rows]
        return runs if after is None else runs[::-1]

    def count_runs(self, *, where: RunFilter | None = None) -> int:
        """How many runs `where` keeps."""
        sql, params = runs_where(self._dialect, where, self._live_runs(where))
        rows = self._query(f"SELECT COUNT(*) FROM runs{sql}", params, what="count_runs failed")
        return int(rows[0][0])

    def is_running(self, run_id: str) -> bool:
        """True while a process holds the run's lock, i.e. drives it (see lock_run). A run
        recorded as running whose lock is free is `interrupted`: its process died."""
        raise NotImplementedError

    def _shown(self, run: RunSummary) -> RunSummary:
        """The summary with `interrupted` for a run recorded as running that nothing drives."""
        if run.status == RUNNING and not self.is_running(run.run_id):
            return replace(run, status=INTERRUPTED)
        return run

    def _live_runs(self, where: RunFilter | None) -> list[str]:
        """The runs recorded as running that are running now, when `where` tells running
        ones from interrupted ones (else none are looked up)."""
        if where is None or where.status not in (RUNNING, INTERRUPTED):
            return []
        sql = self._dialect.sql.select_running
        rows = self._query(sql, (), what="list_runs failed")
        return [row[0] for row in rows if self.is_running(row[0])]

    def short_id(self, run_id: str) -> str:
        """The shortest prefix of `run_id` (8 characters at least) that names it alone among
        the stored runs (see unique_prefix): what to show where the full id does not fit."""
        before = self._query(self._dialect.sql.select_before, (run_id,), what="short_id failed")
        after = self._query(self._dialect.sql.select_after, (run_id,), what="short_id failed")
        return unique_prefix(
            run_id, before[0][0] if before else None, after[0][0] if after else None
        )

    def _cursor(self, run_id: str) -> tuple[Any, str]:
        rows = self._query(self._dialect.sql.select_cursor, (run_id,), what="list_runs failed")
        if not rows:
            raise RunNotFoundError(f"no run with id {run_id!r}", run_id=run_id)
        return rows[0][0], rows[0][1]

    def find_run(self, prefix: str) -> str:
        """The full id of the run `prefix` names (a full id or a unique prefix of one).

        Raises:
            RunNotFoundError: no run matches, or several do (the message lists them).
        """
        cleaned = clean_prefix(prefix)
        params = (len(cleaned), cleaned, AMBIGUOUS_SHOWN + 1)
        rows = self._query(self._dialect.sql.select_prefix, params, what="find_run failed")
        return resolve_run(cleaned, [row[0] for row in rows])

    def _query(self, sql: str, params: Sequence[Any], *, what: str) -> list[Any]:
        with self._lock:
            try:
                return self._live().execute(sql, params).fetchall()
            except self._driver_error as exc:
                raise self._error(what, exc) from exc

    def _migrate_or_close(self, *, read_only: bool = False) -> None:
        """Set up the append queue and the schema when the store opens (only check the schema
        when it is opened read-only); close the store if that fails."""
        self._queue_lock = threading.Lock()
        self._queue: list[PendingAppend] = []
        self._run_nos: dict[str, int | None] = {}
        try:
            self._check_schema() if read_only else self._migrate()
        except BaseException:
            self.close()
            raise

    def _check_schema(self) -> None:
        """StoreSchemaError unless the schema is this code's, migrations and all."""
        sql = self._dialect.sql.select_migrations
        try:
            rows = self._query(sql, (COMPONENT,), what="cannot read the event store schema")
        except StoreError as exc:
            if "no such table" in str(exc) and self._only_ours():  # no event schema yet
                raise OlderSchemaError(f"{self._where}: no event store schema yet") from exc
            raise StoreSchemaError(f"{self._where}: not an fsm-kernel event store ({exc})") from exc
        if plan_migrations(dict(rows), where=self._where):
            raise OlderSchemaError(
                f"{self._where}: the event store was written by an older fsm-kernel; open it "
                "once read-write (any fsm-kernel command that runs, resumes or lists runs) to "
                "upgrade it"
            )

    def _only_ours(self) -> bool:
        """Whether every table of the database is fsm-kernel's (none at all, or the
        scheduler's): only such a database may be given the event schema by a read-only open;
        another program's database is refused, never written."""
        return False

    def _migrate(self) -> None:
        """Apply the pending migrations in one transaction (StoreSchemaError for a schema this
        code does not know)."""
        d = self._dialect
        with self._lock:
            try:
                with self._transaction() as cur:
                    self._lock_schema(cur)
                    cur.execute(d.migrations_table)
                    rows = cur.execute(d.sql.select_migrations, (COMPONENT,)).fetchall()
                    for migration in plan_migrations(dict(rows), where=self._where):
                        for statement in d.migration_sql(migration):
                            cur.execute(statement)
                        now = d.to_db_ts(datetime.now(UTC))
                        params = (COMPONENT, migration.version, migration.name, now)
                        cur.execute(d.sql.insert_migration, params)
                        self._logger.info("%s: applied migration %s", self._where, migration.name)
            except self._driver_error as exc:
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
                params = (event.run_id, event.seq)
                if conn.execute(self._dialect.sql.event_exists, params).fetchone():
                    return StoreConflictError(f"run {event.run_id}: seq {event.seq} already exists")
        except self._driver_error as exc:
            self._logger.warning("%s: could not name the conflicting event: %s", self._where, exc)
        return StoreConflictError("an event of the batch already exists")
