"""The PostgreSQL dispatch queue, for several workers on several hosts sharing one fleet.

Claims: the fleet-wide `max_concurrent` is kept exact by slot rows, without a lock every claim
waits for. A kernel with cap C has C rows in `kernel_dispatch_slots` (slot 0..C-1), each free or
held by one dispatch attempt until its lease (copied into the slot) runs out. A claim is one call
of a server-side function (fsm_kernel_claim_with_slots): it takes up to `limit` free slots `FOR
UPDATE SKIP LOCKED`, as many of the kernel's best claimable dispatches `FOR UPDATE SKIP LOCKED`,
pairs them and marks both, in one statement. Two claimers never take the same slot (a slot one
locks the other skips; one the other just filled is re-checked against its new lease), so at most
C dispatches hold a live slot, and claimers never wait for each other: with 16 processes on 2
cores a descheduled claimer holds only the rows it took, not the whole kernel's claims (the
advisory lock this replaces made every other claimer wait for it). A heartbeat renews its slot's
lease in the statement that renews the dispatch's; the statement that ends a dispatch (complete,
complete_batch) frees its slot; an expired, reaped or cancelled-after-expiry dispatch's slot is
free because its lease ran out. Cap changes resize the rows: a claim creates the missing ones up
to its cap; after the cap is lowered, the dispatches still holding slots above it count against
it until they end (the claims made meanwhile lock all the kernel's slots and count them, and
delete the slots above the cap as they are freed). One window stays, as it did when claims
counted leases: a worker whose heartbeat comes after its lease ran out renews its dispatch even
if the slot went to another dispatch meanwhile, so that run is outside the cap until it ends.
The claim reads partial indexes over pending and running rows, so its cost does not grow with
the finished history. A worker's outcomes travel with its next claim (`complete_and_claim`, a
second function: the outcomes recorded, then the claim, which hands their slots straight on to
the dispatches it claims, one slot write per job, and frees those it cannot fill, in one call);
a worker awaits that call on a connection of its event loop (a psycopg AsyncConnection:
no thread hop per batch); outcomes recorded alone (the Scheduler's, a worker's last ones) go a
batch per statement (`complete_batch`) on a second connection. Both functions plan their statements
generically from the first call: every row they touch is found by its key.

All workers of a kernel use the same cap (its config) and this protocol: opening the store
installs the slots (held ones for the dispatches already running) and drops the previous claim
function, so a worker of an older fsm-kernel still running fails its claims loudly instead of
claiming outside the slots.

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
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.protocol import Clock, SystemClock
from fsm_kernel.scheduler._queue_sql import (
    COLS,
    ORDER,
    POSTGRES,
    Executor,
    SqlDispatchQueue,
    claim_assignments,
    in_claim_order,
    notify_item,
    reap_assignments,
    reap_condition,
    reclaimable_sql,
)
from fsm_kernel.scheduler.queue import (
    CANCELLED_EXPIRED,
    COLUMNS,
    NOTIFY_CHANNEL,
    TABLE,
    Completion,
    Dispatch,
    DispatchStatus,
    QueueSignal,
    lease_conflict,
    log_reaped,
    validate_final_status,
)

try:
    import psycopg
    from psycopg.rows import dict_row, tuple_row
except ImportError as exc:  # pragma: no cover - the test extra always installs psycopg
    raise ImportError(
        "the PostgreSQL dispatch queue needs psycopg: pip install 'fsm-kernel[postgres]'"
    ) from exc

__all__ = ["PostgresDispatchListener", "PostgresDispatchQueue"]

logger = logging.getLogger(__name__)

_SCHEMA_LOCK_KEY = "fsm_kernel.scheduler.schema"
_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
SLOTS = "kernel_dispatch_slots"


def _p(name: str) -> str:
    """A parameter of the claim function."""
    return f"p_{name}"


_FREE_SLOT = "(lease_expires_at IS NULL OR lease_expires_at <= p_now)"
_SLOTS_DDL = (
    f"""CREATE TABLE IF NOT EXISTS {SLOTS} (
        kernel_id TEXT NOT NULL,
        slot INTEGER NOT NULL,
        dispatch_id TEXT,
        lease_expires_at TIMESTAMPTZ,
        PRIMARY KEY (kernel_id, slot))""",
    # The slot a dispatch's current attempt holds, so its heartbeats and end find it by the key
    # (no index on the holder: a slot's updates stay HOT, never touching an index).
    f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS slot INTEGER",
)
# Made anew from the dispatches running when the slots are installed (a store of the
# advisory-lock protocol): they hold slots from 0 up, so the cap counts them.
_SEED_SLOTS = (
    f"DELETE FROM {SLOTS}",
    f"""UPDATE {TABLE} AS t SET slot = numbered.n FROM (
        SELECT dispatch_id,
            (row_number() OVER (PARTITION BY kernel_id ORDER BY dispatch_id) - 1)::integer AS n
        FROM {TABLE} WHERE status = 'running') AS numbered
    WHERE t.dispatch_id = numbered.dispatch_id""",
    f"""INSERT INTO {SLOTS} (kernel_id, slot, dispatch_id, lease_expires_at)
    SELECT kernel_id, slot, dispatch_id, lease_expires_at FROM {TABLE}
    WHERE status = 'running'""",
)
_OLD_CLAIM_FUNCTION = (
    "fsm_kernel_claim_dispatches(text, text, timestamptz, timestamptz, integer, text, integer)"
)
_CLAIM_FUNCTION = "fsm_kernel_claim_with_slots"
_CLAIM_SIGNATURE = (
    f"{_CLAIM_FUNCTION}(text, text, timestamptz, timestamptz, integer, text, integer)"
)


def _claimable(condition: str) -> str:
    """The kernel's best dispatches meeting `condition`, locked, at most one per free slot
    (skipped rows, locked by another claimer, do not count against the limit)."""
    return f"""SELECT dispatch_id, priority, created_at FROM {TABLE}
        WHERE kernel_id = p_kernel AND {condition} {ORDER}
        LIMIT (SELECT count(*) FROM free) FOR UPDATE SKIP LOCKED"""


# A claim of up to p_limit dispatches is one prepared call of this function: one round trip,
# plans cached by the server, no lock held beyond the rows it takes. Being VOLATILE, each
# statement inside takes a fresh snapshot. Reaping skips rows another statement is changing (the
# next claim reaps them); when nothing has expired it is one probe of the running index. Then
# the slots up to p_cap are made if missing (the highest slot found by one index probe). Slots
# at or above p_cap mean the cap was lowered: the dispatches holding them count against it until
# they end, so such a claim frees the slots of the dispatches it just ended, locks every slot of
# the kernel (claims take turns, as they did under the advisory lock, until those slots are
# gone), deletes the free ones above the cap and counts the held ones: the room left bounds the
# batch. The claim itself: the slots of the dispatches this call just ended (`v_slots`, still
# naming them: see fsm_kernel_complete_and_claim) are handed on first, then free slots; both
# kinds and the claimable dispatches are locked SKIP LOCKED (no claimer waits for another), the
# n-th best dispatch goes to the n-th slot, and both rows are written in the same statement. A
# slot another claimer filled after this statement's snapshot is re-read by FOR UPDATE and
# skipped, its lease being live (or, handed on, no longer naming the ended dispatch): no slot is
# ever given twice. Handed-on slots the claim did not fill are freed last. Rows come back as the
# ended ones, the reaped ones (failed, cancelled), then the claimed ones. The planner settings:
# a kernel's slots are made at its first claim, usually after the last ANALYZE saw none, and a
# plan costed for an empty table scans all of them; every row here is meant to be found by its
# key (so the claim that makes slots also ANALYZEs them, and the plans are made anew).
FUNCTIONS_VERSION = 3
"""The version of the server-side functions' bodies, kept as the comment of
fsm_kernel_complete_and_claim: opening a store whose functions carry another (or none) replaces
both (`CREATE OR REPLACE`). Version 3 takes the outcomes as one JSON value instead of six arrays
and returns a recorded outcome as its id alone: version 2's function (another signature) is
dropped, so a worker of that version still running fails its claims (a logged StoreError,
retried) until it is upgraded, instead of misreading the rows."""
_FUNCTIONS_TAG = f"fsm-kernel dispatch functions v{FUNCTIONS_VERSION}"
_HANDED_ON = (  # slots of the dispatches this call ended, while they still name them
    "kernel_id = p_kernel AND slot = ANY(v_slots) AND dispatch_id = ANY(v_ids)"
)


def _claim_ddl(name: str, extra_params: str = "", first: str = "") -> str:
    """The claim function `name` (see above), running `first` (statements that may fill
    v_ids and v_slots with the dispatches they ended) before it claims."""
    return f"""
CREATE OR REPLACE FUNCTION {name}(
    p_kernel text, p_worker text, p_now timestamptz, p_expires timestamptz, p_cap integer,
    p_cancelled text, p_limit integer{extra_params})
RETURNS SETOF {TABLE} LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET enable_bitmapscan = off SET enable_material = off
SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    reaped {TABLE};
    ended {TABLE};
    recorded {TABLE};
    top integer;
    room integer := p_limit;
    v_ids text[] := '{{}}';
    v_slots integer[] := '{{}}';
    filled integer;
    made integer;
BEGIN{first}
    FOR reaped IN
        UPDATE {TABLE} SET {reap_assignments(_p)}
        WHERE {reap_condition(_p)} AND dispatch_id IN (
            SELECT dispatch_id FROM {TABLE} WHERE {reap_condition(_p)} FOR UPDATE SKIP LOCKED)
        RETURNING *
    LOOP
        PERFORM pg_notify('{NOTIFY_CHANNEL}',
                          'ended ' || reaped.kernel_id || ' ' || reaped.dispatch_id);
        RETURN NEXT reaped;
    END LOOP;
    SELECT slot INTO top FROM {SLOTS} WHERE kernel_id = p_kernel ORDER BY slot DESC LIMIT 1;
    IF top IS NULL OR top < p_cap - 1 THEN
        INSERT INTO {SLOTS} (kernel_id, slot)
        SELECT p_kernel, n FROM generate_series(0, p_cap - 1) AS n ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS made = ROW_COUNT;
        IF made > 0 THEN
            ANALYZE {SLOTS};
        END IF;
    ELSIF top >= p_cap THEN
        UPDATE {SLOTS} SET dispatch_id = NULL, lease_expires_at = NULL WHERE {_HANDED_ON};
        v_slots := '{{}}';
        PERFORM 1 FROM {SLOTS} WHERE kernel_id = p_kernel ORDER BY slot FOR UPDATE;
        DELETE FROM {SLOTS} WHERE kernel_id = p_kernel AND slot >= p_cap AND {_FREE_SLOT};
        SELECT least(p_limit, p_cap - count(*)) INTO room FROM {SLOTS}
        WHERE kernel_id = p_kernel AND NOT {_FREE_SLOT};
        IF room <= 0 THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
    WITH handed AS (
        SELECT slot FROM {SLOTS} WHERE {_HANDED_ON} LIMIT room FOR UPDATE SKIP LOCKED),
    spare AS (
        SELECT slot FROM {SLOTS} WHERE kernel_id = p_kernel AND slot < p_cap
        AND {_FREE_SLOT} AND slot <> ALL(v_slots) ORDER BY slot
        LIMIT greatest(room - (SELECT count(*) FROM handed), 0) FOR UPDATE SKIP LOCKED),
    free AS (
        SELECT slot, row_number() OVER () AS n
        FROM (SELECT slot FROM handed UNION ALL SELECT slot FROM spare) AS f),
    pending AS ({_claimable("status = 'pending'")}),
    expired AS ({_claimable(reclaimable_sql("p_now"))}),
    ranked AS MATERIALIZED (
        SELECT dispatch_id, row_number() OVER ({ORDER}) AS n
        FROM (SELECT * FROM pending UNION ALL SELECT * FROM expired) AS c),
    pairs AS (
        SELECT r.dispatch_id, f.slot FROM ranked AS r JOIN free AS f ON f.n = r.n),
    slotted AS (
        UPDATE {SLOTS} AS s SET dispatch_id = pairs.dispatch_id, lease_expires_at = p_expires
        FROM pairs WHERE s.kernel_id = p_kernel AND s.slot = pairs.slot)
    UPDATE {TABLE} AS t SET {claim_assignments(_p)}, slot = pairs.slot
    FROM pairs WHERE t.dispatch_id = pairs.dispatch_id
    RETURNING t.*;
    GET DIAGNOSTICS filled = ROW_COUNT;
    IF filled < cardinality(v_slots) THEN
        UPDATE {SLOTS} SET dispatch_id = NULL, lease_expires_at = NULL WHERE {_HANDED_ON};
    END IF;
END
$fn$"""


_CLAIM_DDL = _claim_ddl(_CLAIM_FUNCTION)
_CLAIM = f"SELECT {COLS} FROM {_CLAIM_FUNCTION}(%s, %s, %s, %s, %s, %s, %s)"
# The slot of each row a fenced update changed (`changed`, which returns the row's `slot`)
# follows it: a renewed lease renews the slot, an end (no lease left) frees it, while the slot
# still names the dispatch: a slot given to another dispatch after this one's lease ran out is
# left alone.
_SLOT_FOLLOWS = f"""
synced AS (
    UPDATE {SLOTS} AS s SET lease_expires_at = c.lease_expires_at,
        dispatch_id = CASE WHEN c.lease_expires_at IS NULL THEN NULL ELSE s.dispatch_id END
    FROM changed AS c
    WHERE s.kernel_id = c.kernel_id AND s.slot = c.slot AND s.dispatch_id = c.dispatch_id)"""
# After a dispatch ends: the `changed` row still counts as running in this statement's snapshot,
# so "count >= cap" means the kernel was full. Notifying every end would wake every idle worker
# of the fleet for nothing while the cap is not binding. Counted once per kernel of the batch.
_NOTIFY_IF_SLOT_AWAITED = f"""
SELECT changed.*, CASE WHEN kernel.awaited THEN {notify_item("ended")} END AS notified
FROM changed JOIN (
    SELECT k.kernel_id, %s::integer IS NULL OR (
        (SELECT count(*) FROM {TABLE} AS t WHERE t.kernel_id = k.kernel_id
            AND t.status = 'running' AND t.lease_expires_at > %s) >= %s
        AND EXISTS (SELECT 1 FROM {TABLE} AS t WHERE t.kernel_id = k.kernel_id
            AND t.status = 'pending')) AS awaited
    FROM (SELECT DISTINCT kernel_id FROM changed) AS k) AS kernel USING (kernel_id)"""
# Several outcomes in one statement, each fenced like `complete` (status, worker, attempt).
_COMPLETE_BATCH = f"""
WITH outcome AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[], %s::text[], %s::text[],
                         %s::text[], %s::text[])
        AS o(dispatch_id, worker_id, attempt, status, run_id, termination_reason, error)),
changed AS (
    UPDATE {TABLE} AS t SET status = o.status, run_id = o.run_id,
        termination_reason = o.termination_reason, error = o.error, finished_at = %s,
        lease_expires_at = NULL
    FROM outcome AS o
    WHERE t.dispatch_id = o.dispatch_id AND t.status = 'running'
        AND t.worker_id = o.worker_id AND t.attempts = o.attempt
    RETURNING t.*),{_SLOT_FOLLOWS}
{_NOTIFY_IF_SLOT_AWAITED}"""

_COMPLETE_AND_CLAIM_FUNCTION = "fsm_kernel_complete_and_claim"
_COMPLETE_AND_CLAIM_SIGNATURE = (
    f"{_COMPLETE_AND_CLAIM_FUNCTION}(text, text, timestamptz, timestamptz, integer, text, "
    "integer, json)"
)
_ARRAYS_SIGNATURE = (  # FUNCTIONS_VERSION 2 and before: the outcomes as six arrays
    f"{_COMPLETE_AND_CLAIM_FUNCTION}(text, text, timestamptz, timestamptz, integer, text, "
    "integer, text[], integer[], text[], text[], text[], text[])"
)
# A worker's outcomes and its next claim in one call: each outcome fenced like `complete` (the
# row still running under p_worker at that attempt), its slot left as it is and remembered
# (v_ids, v_slots), then, in a statement that sees those ends, the claim, which hands those
# slots on to the dispatches it claims (one write of a slot per job instead of a free and a
# take) and frees the ones it cannot fill. So an end wakes no one: the worker that ended the
# dispatches takes their slots, and leaves them free only when nothing is left to claim. Rows
# come back as the recorded outcomes, then the claim's (reaped, claimed). A recorded outcome
# comes back as its id alone (every other column NULL, status too): the worker only needs to
# know it was recorded, and ten full rows a batch cost it ~0.1 ms to receive and parse.
_COMPLETE_AND_CLAIM_DDL = _claim_ddl(
    _COMPLETE_AND_CLAIM_FUNCTION,
    ", p_outcomes json",
    f"""
    IF p_outcomes IS NOT NULL THEN
        FOR ended IN
            WITH outcome AS MATERIALIZED (
                SELECT o->>0 AS dispatch_id, (o->>1)::integer AS attempt, o->>2 AS status,
                    o->>3 AS run_id, o->>4 AS termination_reason, o->>5 AS error
                FROM json_array_elements(p_outcomes) AS o)
            UPDATE {TABLE} AS t SET status = o.status, run_id = o.run_id,
                termination_reason = o.termination_reason, error = o.error,
                finished_at = p_now, lease_expires_at = NULL
            FROM outcome AS o
            WHERE t.dispatch_id = o.dispatch_id
                AND CASE WHEN t.status = 'running' THEN t.worker_id END = p_worker
                AND t.attempts = o.attempt
            RETURNING t.*
        LOOP
            IF ended.slot IS NOT NULL THEN  -- a NULL would make `slot <> ALL(v_slots)` NULL
                v_ids := v_ids || ended.dispatch_id;
                v_slots := v_slots || ended.slot;
            END IF;
            recorded.dispatch_id := ended.dispatch_id;  -- the id alone: the rest stays NULL
            RETURN NEXT recorded;
        END LOOP;
    END IF;""",
)
_COMPLETE_AND_CLAIM = (
    f"SELECT {COLS} FROM {_COMPLETE_AND_CLAIM_FUNCTION}(%s, %s, %s, %s, %s, %s, %s, %s)"
)

_CURRENT = f"SELECT {COLS} FROM {TABLE} WHERE dispatch_id = ANY(%s)"
"""The rows of some dispatches as they are now (for a lost lease's conflict message)."""


class PostgresDispatchQueue(SqlDispatchQueue):
    """The dispatch queue in PostgreSQL (psycopg 3). One connection per instance, guarded by a
    lock so the engine's threads can share it; reconnects after a connection failure.

    Enqueues, ends and cancel requests NOTIFY (see the module's docstring); `complete` and
    `complete_batch` NOTIFY `ended` only when the end frees a slot someone may be waiting for:
    the kernel was at `max_concurrent` with dispatches pending (always, when it is not given).
    `complete_and_claim` never does: its own claim is offered the slots its ends free."""

    dialect = POSTGRES
    _unique_violations = (psycopg.errors.UniqueViolation,)

    def __init__(self, dsn: str, *, clock: Clock | None = None) -> None:
        self.dsn = dsn
        self.clock: Clock = clock or SystemClock()
        self._main = _Link(dsn)
        self._outcomes = _Link(dsn)
        """complete_batch's own connection: a worker's outcomes are recorded while its next
        claim is under way, not behind it."""
        self._claims = _AsyncLink(dsn)
        """complete_and_claim_async's connection, of the event loop that awaits it (a worker's
        claims), opened by its first claim."""

    def __repr__(self) -> str:
        return "PostgresDispatchQueue(<dsn hidden>)"  # a DSN may carry a password

    def close(self) -> None:
        self._main.close()
        self._outcomes.close()
        self._claims.close()

    def claim_batch(
        self,
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> builtins.list[Dispatch]:
        now = self.clock.now()
        expires = now + timedelta(seconds=lease_seconds)
        params = (kernel_id, worker_id, now, expires, max_concurrent, CANCELLED_EXPIRED, limit)
        with self._session() as conn:
            rows = [
                Dispatch.from_row(r) for r in conn.execute(_CLAIM, params, prepare=True).fetchall()
            ]
        log_reaped([d for d in rows if d.status is not DispatchStatus.RUNNING])
        return in_claim_order([d for d in rows if d.status is DispatchStatus.RUNNING])

    def complete_and_claim(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """One call of the server-side function: the outcomes travel as one JSON value and come
        back as the ids recorded; one it did not record (a lost lease) is read back for its
        conflict."""
        params = self._claim_params(
            completions, kernel_id, worker_id, lease_seconds, max_concurrent, limit
        )
        with self._session() as conn:
            rows = (  # prepared at once: a worker calls it every batch
                conn.cursor(row_factory=tuple_row)
                .execute(_COMPLETE_AND_CLAIM, params, prepare=True)
                .fetchall()
            )
            recorded, reaped, claimed = _sorted_rows(rows)
            lost = [c.dispatch_id for c in completions if c.dispatch_id not in recorded]
            current = self._current(conn, lost) if lost else {}
        return _claim_results(completions, worker_id, recorded, reaped, claimed, current)

    async def complete_and_claim_async(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """`complete_and_claim` on the claim connection of the running event loop (an
        AsyncConnection): the worker awaits the round trip itself, no thread hop per batch."""
        params = self._claim_params(
            completions, kernel_id, worker_id, lease_seconds, max_concurrent, limit
        )
        async with self._claims.session() as conn:
            cursor = conn.cursor(row_factory=tuple_row)
            await cursor.execute(_COMPLETE_AND_CLAIM, params, prepare=True)
            recorded, reaped, claimed = _sorted_rows(await cursor.fetchall())
            lost = [c.dispatch_id for c in completions if c.dispatch_id not in recorded]
            current = await _current_async(conn, lost) if lost else {}
        return _claim_results(completions, worker_id, recorded, reaped, claimed, current)

    async def connect_async(self) -> None:
        """Open the claim connection of the running event loop (see complete_and_claim_async).
        StoreError if the server cannot be reached."""
        async with self._claims.session():
            pass

    def _claim_params(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[Any, ...]:
        """The parameters of the server function's call, in its order."""
        now = self.clock.now()
        expires = now + timedelta(seconds=lease_seconds)
        outcomes = _outcomes_json(completions)
        return (
            kernel_id,
            worker_id,
            now,
            expires,
            max_concurrent,
            CANCELLED_EXPIRED,
            limit,
            outcomes,
        )

    def complete_batch(
        self, completions: builtins.list[Completion], *, max_concurrent: int | None = None
    ) -> builtins.list[Dispatch | StoreConflictError]:
        """One statement for the whole batch: the outcomes travel as arrays, each row fenced
        by its worker and attempt; a row it did not change is read back for its conflict."""
        if not completions:
            return []
        statuses = [validate_final_status(c.status).value for c in completions]
        now = self.clock.now()
        columns = [
            [getattr(c, name) for c in completions]
            for name in ("dispatch_id", "worker_id", "attempt")
        ]
        outcomes = [
            [getattr(c, name) for c in completions]
            for name in ("run_id", "termination_reason", "error")
        ]
        params = (*columns, statuses, *outcomes, now, max_concurrent, now, max_concurrent)
        with self._outcomes.session() as conn:
            rows = conn.execute(_COMPLETE_BATCH, params).fetchall()
            done = {row["dispatch_id"]: Dispatch.from_row(row) for row in rows}
            lost = [c.dispatch_id for c in completions if c.dispatch_id not in done]
            current = self._current(conn, lost) if lost else {}
        return [
            done.get(c.dispatch_id)
            or lease_conflict(c.dispatch_id, c.worker_id, current.get(c.dispatch_id))
            for c in completions
        ]

    @staticmethod
    def _current(conn: Executor, ids: builtins.list[str]) -> dict[str, Dispatch]:
        """The rows of these dispatches as they are now, keyed by id (for conflict messages)."""
        found = conn.execute(_CURRENT, (ids,))
        return {row["dispatch_id"]: Dispatch.from_row(row) for row in found.fetchall()}

    def listener(self, kernel_id: str) -> PostgresDispatchListener:
        return PostgresDispatchListener(self.dsn, kernel_id)

    def _lock_schema(self, conn: Executor) -> None:
        """Concurrent openers wait for each other instead of colliding."""
        conn.execute(_ADVISORY_LOCK, (_SCHEMA_LOCK_KEY,))

    def _install(self, conn: Executor) -> None:
        """The slots and the claim functions: the slots once (again after the dispatch table,
        and the functions with it, was dropped), made anew from the running dispatches, when
        the advisory-lock claim function goes; the functions whenever theirs are missing or of
        another FUNCTIONS_VERSION (a store opened by an older fsm-kernel gets the new bodies)."""
        found = conn.execute(
            "SELECT to_regprocedure(%s) AS claim, obj_description(to_regprocedure(%s), "
            "'pg_proc') AS tag",
            (_CLAIM_SIGNATURE, _COMPLETE_AND_CLAIM_SIGNATURE),
        ).fetchone()
        if found is None or found["claim"] is None:
            for statement in (*_SLOTS_DDL, *_SEED_SLOTS):
                conn.execute(statement)
            conn.execute(f"DROP FUNCTION IF EXISTS {_OLD_CLAIM_FUNCTION}")
        if found is None or found["claim"] is None or found["tag"] != _FUNCTIONS_TAG:
            conn.execute(f"DROP FUNCTION IF EXISTS {_ARRAYS_SIGNATURE}")
            conn.execute(_CLAIM_DDL)
            conn.execute(_COMPLETE_AND_CLAIM_DDL)
            conn.execute(
                f"COMMENT ON FUNCTION {_COMPLETE_AND_CLAIM_SIGNATURE} IS '{_FUNCTIONS_TAG}'"
            )

    def _fenced_sql(
        self, sql: str, params: tuple[Any, ...], notify: tuple[int | None, datetime] | None
    ) -> tuple[str, tuple[Any, ...]]:
        """The update with its slot following it (and, for an end, its notification)."""
        synced = f"WITH changed AS ({sql}, slot),{_SLOT_FOLLOWS}"  # sql ends with RETURNING
        if notify is None:
            return f"{synced} SELECT * FROM changed", params
        cap, now = notify
        return f"{synced} {_NOTIFY_IF_SLOT_AWAITED}", (*params, cap, now, cap)

    def _session(self) -> AbstractContextManager[psycopg.Connection[dict[str, Any]]]:
        """The main connection (autocommit), psycopg's errors translated to StoreError."""
        return self._main.session()

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with self._session() as conn, conn.transaction():
            yield conn

    _read = _session
    """Autocommit: each statement is its own (implicit) transaction, a single round trip."""
    _write = _session


def _outcomes_json(completions: builtins.list[Completion]) -> str | None:
    """The outcomes as one JSON value, an array per outcome (id, attempt, status, run id,
    reason, error): one parameter is cheaper to send than six arrays. None when there are none."""
    if not completions:
        return None
    return json.dumps(
        [
            (
                c.dispatch_id,
                c.attempt,
                validate_final_status(c.status).value,
                c.run_id,
                c.termination_reason,
                c.error,
            )
            for c in completions
        ],
        separators=(",", ":"),
    )


_ID, _STATUS = COLUMNS.index("dispatch_id"), COLUMNS.index("status")


def _sorted_rows(
    rows: builtins.list[tuple[Any, ...]],
) -> tuple[set[str], builtins.list[Dispatch], builtins.list[Dispatch]]:
    """complete_and_claim's rows (tuples of COLUMNS) as the ids of the outcomes recorded (a row
    with no status: the function returns the id alone), the reaped dispatches and the claimed
    ones."""
    recorded: set[str] = set()
    reaped: builtins.list[Dispatch] = []
    claimed: builtins.list[Dispatch] = []
    for row in rows:
        if row[_STATUS] is None:
            recorded.add(row[_ID])
            continue
        d = Dispatch.from_tuple(row)
        (claimed if d.status is DispatchStatus.RUNNING else reaped).append(d)
    return recorded, reaped, claimed


class _Link:
    """One connection, opened on first use, shared by threads under a lock, dropped after a
    connection failure (the next call reconnects)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    @contextmanager
    def session(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """The connection (autocommit), psycopg's errors translated to StoreError."""
        with self._lock:
            was_open = self._conn is not None
            try:
                yield self._connect()
            except psycopg.OperationalError as exc:
                if was_open:  # the caller hears of a failure to connect at all from its error
                    logger.warning("dispatch store connection lost, reconnecting: %s", _line(exc))
                self._drop()
                raise StoreError(f"dispatch store (PostgreSQL) unavailable: {_line(exc)}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"dispatch store (PostgreSQL) failed: {_line(exc)}") from exc

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def _connect(self) -> psycopg.Connection[dict[str, Any]]:
        """The connection, its session in UTC: psycopg then gives timestamps Python's own
        `datetime.UTC`, which `Dispatch.from_row` keeps as they are, instead of the server's
        zone (often `Etc/UTC`, a ZoneInfo) that every row's times would be converted from."""
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)
            conn.execute("SET TIME ZONE 'UTC'")
            self._conn = conn
        return self._conn


def _line(exc: BaseException) -> str:
    """A driver error on one line (libpq's messages carry a hint on a line of their own)."""
    return " ".join(str(exc).split())


def _claim_results(
    completions: builtins.list[Completion],
    worker_id: str,
    recorded: set[str],
    reaped: builtins.list[Dispatch],
    claimed: builtins.list[Dispatch],
    current: dict[str, Dispatch],
) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
    """What complete_and_claim returns from its rows: per outcome None (recorded) or the lease
    conflict that kept it out; the claimed dispatches in claim order."""
    log_reaped(reaped)
    results = [
        None
        if c.dispatch_id in recorded
        else lease_conflict(c.dispatch_id, worker_id, current.get(c.dispatch_id))
        for c in completions
    ]
    return results, in_claim_order(claimed)


async def _current_async(
    conn: psycopg.AsyncConnection[Any], ids: builtins.list[str]
) -> dict[str, Dispatch]:
    """`PostgresDispatchQueue._current` on an AsyncConnection."""
    cursor = conn.cursor(row_factory=dict_row)
    await cursor.execute(_CURRENT, (ids,))
    return {row["dispatch_id"]: Dispatch.from_row(row) for row in await cursor.fetchall()}


class _AsyncLink:
    """One AsyncConnection for the event loop that uses it, opened on first use, shared by
    that loop's tasks under a lock, dropped after a connection failure or a cancelled call
    (the next call reconnects) and when another loop asks (a connection belongs to the loop it
    was made in)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._conn: psycopg.AsyncConnection[Any] | None = None

    def close(self) -> None:
        self._drop()

    @asynccontextmanager
    async def session(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The connection (autocommit, UTC), psycopg's errors translated to StoreError."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._drop()
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            was_open = self._conn is not None
            try:
                yield await self._connect()
            except psycopg.OperationalError as exc:
                if was_open:  # see _Link.session
                    logger.warning("dispatch store connection lost, reconnecting: %s", _line(exc))
                self._drop()
                raise StoreError(f"dispatch store (PostgreSQL) unavailable: {_line(exc)}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"dispatch store (PostgreSQL) failed: {_line(exc)}") from exc
            except asyncio.CancelledError:
                self._drop()  # a statement may still be under way on it
                raise

    def _drop(self) -> None:
        """Closed at once (libpq's own close needs no event loop)."""
        if self._conn is not None:
            try:
                self._conn.pgconn.finish()
            finally:
                self._conn = None

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            await conn.execute("SET TIME ZONE 'UTC'")  # see _Link._connect
            self._conn = conn
        return self._conn


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
