"""The dispatch queue: the `DispatchQueue` port, the `Dispatch` row, what both adapters share
(statuses, messages, the schema version) and `open_queue`, which picks the backend from the
`store` setting. The adapters live in sqlite_queue.py (one machine, the default) and pg_queue.py,
the SQL and the operations they share in _queue_sql.py.

Lease semantics, shared by both adapters:
- a claim sets status=running, the worker id, attempts+1 and lease_expires_at = now + lease;
- a running dispatch whose lease has expired does not count against `max_concurrent` and is
  claimable again by anyone (reclaim), unless it was claimed `max_attempts` times already: then
  it is marked failed ("abandoned after 3 attempts: lease expired") and never claimed again;
- heartbeat and complete are fenced: they succeed only while the row is still running under the
  same worker id (and the same attempt, when given), otherwise StoreConflictError;
- cancel: a pending dispatch becomes cancelled at once; a running one gets cancel_requested_at,
  which its worker sees at its next heartbeat (at once on PostgreSQL, through NOTIFY), stops the
  run and completes the dispatch as cancelled; if its lease runs out first it is marked
  cancelled, never reclaimed;
- one active (pending or running) dispatch per (kernel_id, agent_id), enforced by a unique index;
- a dispatch whose run suspended is `waiting` (run_id set); when that run waits for a timer that
  is due, `wake_waiting` makes it pending again (worker and lease cleared, run_id kept, attempts
  restarted at 0 so the woken leg has the whole `max_attempts`, which is unchanged; it keeps its
  priority and creation time, so it is claimed before newer dispatches of its priority), and the
  worker that claims it resumes the run instead of starting one. Refused (it stays waiting) while
  its agent has a newer pending or running dispatch: the one-active index allows one;
- claims read partial indexes over pending and running rows only, so their cost does not grow
  with the finished history;
- time comes from the injected Clock, never from the database.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from fsm_kernel.errors import ConfigError, StoreConflictError, StoreError
from fsm_kernel.protocol import Clock

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "LEGACY_TABLE",
    "NOTIFY_CHANNEL",
    "SCHEMA_VERSION",
    "TABLE",
    "Completion",
    "Dispatch",
    "DispatchListener",
    "DispatchQueue",
    "DispatchStatus",
    "QueueSignal",
    "SqliteDispatchQueue",
    "open_queue",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3
"""1: table dispatch_tasks. 2: renamed kernel_dispatch_tasks (the design's name), with
max_attempts, cancel_requested_at, the cancelled status and partial claim indexes. 3: the
waiting status."""
TABLE = "kernel_dispatch_tasks"
LEGACY_TABLE = "dispatch_tasks"
DEFAULT_MAX_ATTEMPTS = 3
NOTIFY_CHANNEL = "fsm_kernel_dispatch"
"""PostgreSQL channel; payloads are `<kind> <kernel_id> <dispatch_id>` (see QueueSignal)."""


class DispatchStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING = "waiting"
    """Its run waits for a person (approval, input) or an event or timer: the worker and the
    agent are free; a later `fsm-kernel resume` of the run completes it (done or failed), or
    the scheduler wakes it (pending again) once the run's timer is due."""


_STATUSES = {status.value: status for status in DispatchStatus}
ACTIVE_STATUSES = frozenset({DispatchStatus.PENDING, DispatchStatus.RUNNING})
FINAL_STATUSES = frozenset({DispatchStatus.DONE, DispatchStatus.FAILED, DispatchStatus.CANCELLED})
ENDED_STATUSES = FINAL_STATUSES | {DispatchStatus.WAITING}
"""What a worker may record as a dispatch's outcome."""

COLUMNS: tuple[str, ...] = (
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
    "max_attempts",
    "run_id",
    "termination_reason",
    "error",
    "created_at",
    "started_at",
    "finished_at",
    "cancel_requested_at",
)
LEGACY_COLUMNS: tuple[str, ...] = tuple(
    c for c in COLUMNS if c not in ("max_attempts", "cancel_requested_at")
)
"""The columns of schema version 1, copied as they are by the migration."""
_TIME_COLUMNS = ("lease_expires_at", "created_at", "started_at", "finished_at")
_ALL_TIME_COLUMNS = (*_TIME_COLUMNS, "cancel_requested_at")
_INT_COLUMNS = ("priority", "attempts", "max_attempts")

CANCELLED_PENDING = "cancelled while pending: it never ran"
CANCELLED_WOKEN = (
    "cancelled while pending after its run's timer woke it: the run was not resumed and still "
    "waits (fsm-kernel resume fires its timer)"
)
CANCELLED_EXPIRED = "cancelled: its worker's lease expired before it stopped the run"
CANCELLED_RUNNING = "cancelled on request"


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
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Claims allowed before a dispatch whose lease expired is abandoned (marked failed)."""
    cancel_requested_at: datetime | None = None
    """When `dispatches --cancel` asked the worker running it to stop."""

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
        """Build from a database row; times may be datetimes or ISO strings.

        A worker parses two rows per dispatch (claimed, then finished), so this fills the
        frozen instance's fields directly instead of through the generated __init__ (one
        `object.__setattr__` per field): about a third of the cost, the same object."""
        return cls._filled({name: row[name] for name in COLUMNS})

    @classmethod
    def from_tuple(cls, row: Sequence[Any]) -> Dispatch:
        """`from_row` for a row of the COLUMNS in their order (a worker's claims read rows as
        tuples: no dict per row for the driver to build)."""
        return cls._filled(dict(zip(COLUMNS, row, strict=True)))

    @classmethod
    def _filled(cls, values: dict[str, Any]) -> Dispatch:
        """The instance holding these column values, converted (times, status, integers)."""
        for name in _ALL_TIME_COLUMNS:
            if values[name] is not None:
                values[name] = _as_datetime(values[name])
        values["status"] = _STATUSES.get(values["status"]) or DispatchStatus(values["status"])
        for name in _INT_COLUMNS:
            if type(values[name]) is not int:
                values[name] = int(values[name])
        dispatch = object.__new__(cls)
        dispatch.__dict__.update(values)
        return dispatch


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One outcome to record with `complete_batch`: the fields of `complete`, fenced by the
    worker and the attempt (the claim) that produced it."""

    dispatch_id: str
    worker_id: str
    attempt: int
    status: DispatchStatus
    run_id: str | None = None
    termination_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class QueueSignal:
    """A notification from the queue: `enqueued` (a woken dispatch too), `ended` (a slot may be
    free), `cancel` (a running dispatch should stop), or `reconnected` (notifications may have
    been missed)."""

    kind: str
    kernel_id: str
    dispatch_id: str = ""

    @classmethod
    def parse(cls, payload: str) -> QueueSignal | None:
        parts = payload.split(" ")
        if len(parts) != 3:
            return None
        return cls(*parts)


class DispatchListener(Protocol):
    """Wake-ups for one kernel's workers; an async context manager."""

    async def __aenter__(self) -> DispatchListener: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def get(self) -> QueueSignal:
        """The next signal for this kernel (waits for it)."""
        ...


@runtime_checkable
class DispatchQueue(Protocol):
    """Where ticks put dispatches and workers take them. Every method but `listener` and
    `complete_and_claim_async` is synchronous and safe to call from several threads; the async
    engine calls them through asyncio.to_thread."""

    def ensure_schema(self) -> None:
        """Create the tables if missing and migrate older ones (idempotent, nothing lost).
        StoreSchemaError if they are newer than this code."""
        ...

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
        """Add a pending dispatch. None when the dedupe key is taken or the agent already has
        an active (pending or running) dispatch."""
        ...

    def claim(
        self, kernel_id: str, worker_id: str, lease_seconds: float, max_concurrent: int
    ) -> Dispatch | None:
        """Abandon the dispatches whose leases expired too often (see `reap`), then take the
        best claimable one (highest priority, then oldest; expired leases included) unless
        `max_concurrent` dispatches of the kernel already run under live leases. None when
        there is nothing to take or no free slot."""
        ...

    def claim_batch(
        self,
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> builtins.list[Dispatch]:
        """`claim` for up to `limit` dispatches at once, in one statement (PostgreSQL: one
        round trip): as many as `limit` and the room `max_concurrent` leaves allow, best
        first. Empty when there is nothing to take or no free slot."""
        ...

    def heartbeat(
        self, dispatch_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
    ) -> Dispatch:
        """Extend the lease to now + lease_seconds; the row tells whether a cancel was
        requested. StoreConflictError if the lease was lost."""
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
        max_concurrent: int | None = None,
    ) -> Dispatch:
        """Record the outcome (done, failed, cancelled, or waiting for a person).
        StoreConflictError if the lease was lost. `max_concurrent` (the kernel's cap) lets a
        notifying backend wake waiting workers only when this end frees a slot they wait for."""
        ...

    def complete_batch(
        self, completions: builtins.list[Completion], *, max_concurrent: int | None = None
    ) -> builtins.list[Dispatch | StoreConflictError]:
        """`complete` for several dispatches in one transaction (PostgreSQL: one statement);
        each result, in order, is the finished row or the StoreConflictError of a lease that
        was lost (that outcome is not recorded). StoreError if the store failed: nothing was
        recorded."""
        ...

    def complete_and_claim(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """`complete_batch` of a worker's outcomes (each fenced; all by `worker_id`), then
        `claim_batch`, in one transaction (PostgreSQL: one statement, one round trip): the
        slots the outcomes free are offered to the claim, so no end needs to wake anyone.
        Returns the outcomes' results, in order (None: recorded; the StoreConflictError of a
        lost lease: not recorded; not the finished rows, which the worker never reads), and
        the claimed dispatches, best first.
        StoreError if the store failed: nothing was recorded or claimed."""
        ...

    async def complete_and_claim_async(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """`complete_and_claim` awaited in the caller's event loop (the worker's claim): SQLite
        runs it in a thread; PostgreSQL sends it on a connection of that loop, so no thread
        hop per batch."""
        ...

    async def connect_async(self) -> None:
        """Open now what `complete_and_claim_async` uses in the caller's event loop
        (PostgreSQL: its connection), so that a worker's first claim pays no connection; a
        no-op where there is nothing to open (SQLite). Worker.start calls it.
        StoreError if the store cannot be reached."""
        ...

    def settle_waiting(
        self,
        run_id: str,
        *,
        status: DispatchStatus | str,
        termination_reason: str | None = None,
        error: str | None = None,
    ) -> Dispatch | None:
        """Record how the run of a `waiting` dispatch ended after a resume (done or failed);
        also of a woken one still pending (a person resumed the run before any worker claimed
        it). None when no dispatch waits on that run."""
        ...

    def wake_waiting(self, run_id: str) -> Dispatch | None:
        """Make the `waiting` dispatch of run `run_id` pending again (its timer is due), for any
        worker to claim and resume the run; notifies idle workers like an enqueue. Returns the
        pending row; None when no dispatch waits on that run (already woken, finished, or the run
        was not started by a dispatch). StoreConflictError when its agent has another pending or
        running dispatch (one active dispatch per agent): it stays waiting, to be woken later."""
        ...

    def dispatch_of_run(self, run_id: str) -> Dispatch | None:
        """The dispatch whose run is `run_id`, whatever its status; None if none is."""
        ...

    def cancel(self, kernel_id: str, dispatch_id: str) -> Dispatch | None:
        """Cancel a pending dispatch, or ask the worker of a running one to stop it (a running
        one whose lease already expired is cancelled at once). None if there is no such
        dispatch in the kernel; StoreConflictError if it has already finished."""
        ...

    def reap(self, kernel_id: str) -> builtins.list[Dispatch]:
        """Finish the running dispatches whose lease expired and that must not be reclaimed:
        failed after max_attempts claims, cancelled when a cancel was requested."""
        ...

    def get(self, dispatch_id: str) -> Dispatch | None: ...

    def find(self, kernel_id: str, prefix: str, limit: int = 2) -> builtins.list[Dispatch]:
        """Dispatches of the kernel whose id starts with `prefix`."""
        ...

    def active_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        """Each agent's pending or running dispatch (there is at most one), keyed by agent_id."""
        ...

    def latest_per_agent(self, kernel_id: str) -> dict[str, Dispatch]:
        """Each agent's most recent dispatch, keyed by agent_id (reads the whole history)."""
        ...

    def list(self, kernel_id: str, limit: int = 50) -> builtins.list[Dispatch]:
        """Most recent dispatches first."""
        ...

    def try_acquire_tick(self, kernel_id: str, tick_time: datetime) -> bool:
        """Record that the tick scheduled at `tick_time` fires; False if it already did."""
        ...

    def listener(self, kernel_id: str) -> DispatchListener | None:
        """Instant wake-ups for idle workers, or None when the backend only polls."""
        ...

    def close(self) -> None: ...


def open_queue(store: str, *, clock: Clock | None = None) -> DispatchQueue:
    """The dispatch queue for a `store` setting, schema ready (migrated if it was older).

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


def settle_waiting_dispatch(
    store: str, run_id: str, *, ok: bool, termination_reason: str | None, error: str | None
) -> Dispatch | None:
    """After `fsm-kernel resume` ended a run: complete the dispatch that waited on it (done or
    failed), if the store holds a dispatch queue with one; None otherwise (nothing created)."""
    from fsm_kernel.store import parse_store_location

    where = parse_store_location(store)
    if where.backend == "jsonl":
        return None
    if where.backend == "postgres":
        from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

        queue: DispatchQueue = PostgresDispatchQueue(where.target)
    else:
        queue = SqliteDispatchQueue(where.target)
    try:
        return queue.settle_waiting(
            run_id,
            status=DispatchStatus.DONE if ok else DispatchStatus.FAILED,
            termination_reason=termination_reason,
            error=error,
        )
    finally:
        queue.close()


def validate_final_status(status: DispatchStatus | str) -> DispatchStatus:
    try:
        value = DispatchStatus(status)
    except ValueError:
        raise StoreError(f"unknown dispatch status {status!r}") from None
    if value not in ENDED_STATUSES:
        raise StoreError(
            "a dispatch completes with status done, failed, cancelled or waiting, not "
            f"{value.value}"
        )
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


def already_finished(dispatch: Dispatch) -> StoreConflictError:
    return StoreConflictError(
        f"dispatch {dispatch.dispatch_id} ({dispatch.agent_id}) has already finished: "
        f"{dispatch.status.value}"
    )


def wake_refused(waiting: Dispatch, active: Dispatch | None) -> StoreConflictError:
    """The error for a waiting dispatch not woken because its agent has an active dispatch."""
    other = (
        f"dispatch {active.dispatch_id} is {active.status.value}"
        if active is not None
        else "another dispatch is active"
    )
    return StoreConflictError(
        f"dispatch {waiting.dispatch_id} (run {waiting.run_id}) stays waiting: its agent "
        f"{waiting.agent_id} has one active dispatch at a time and {other}"
    )


def abandoned_sql(concat: str = "||") -> str:
    """SQL for the error of a dispatch abandoned after its attempts (`attempts` column)."""
    return (
        f"'abandoned after ' {concat} attempts {concat} "
        f"CASE WHEN attempts = 1 THEN ' attempt' ELSE ' attempts' END {concat} ': lease expired'"
    )


def log_reaped(reaped: builtins.list[Dispatch]) -> None:
    for dispatch in reaped:
        logger.warning(
            "dispatch %s (%s) %s: %s",
            dispatch.dispatch_id,
            dispatch.agent_id,
            dispatch.status.value,
            dispatch.error,
        )


def tick_key(tick_time: datetime) -> datetime:
    """Tick times are compared at whole-second precision in UTC."""
    return require_aware(tick_time).astimezone(UTC).replace(microsecond=0)


def require_aware(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise StoreError(f"naive datetime {moment.isoformat()} (expected timezone-aware UTC)")
    return moment


def _as_datetime(value: Any) -> datetime | None:
    if value is None:
        return None
    if type(value) is datetime and value.tzinfo is UTC:
        return value
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment.astimezone(UTC)


# The default adapter, re-exported here where it always lived; imported last because it builds on
# the names above.
from fsm_kernel.scheduler.sqlite_queue import SqliteDispatchQueue  # noqa: E402
