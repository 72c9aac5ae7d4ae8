"""The dispatch queue in a SQLite file: one machine, several threads or processes.

SQLite has one writer at a time: every read-then-write runs under BEGIN IMMEDIATE, so a claim's
count of running dispatches and its update cannot interleave with another claim's, and no row is
claimed twice. No notifications: idle workers poll (poll_seconds).

The operations both adapters do alike, and the SQL, are in _queue_sql.py.
"""

from __future__ import annotations

import builtins
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.protocol import Clock, SystemClock
from fsm_kernel.scheduler._queue_sql import (
    RETURNING,
    SQLITE,
    SqlDispatchQueue,
    in_claim_order,
    live_count,
    sqlite_ts,
)
from fsm_kernel.scheduler.queue import (
    CANCELLED_EXPIRED,
    Completion,
    Dispatch,
    DispatchListener,
    log_reaped,
)
from fsm_kernel.store.sqlite import enable_wal

__all__ = ["SqliteDispatchQueue"]

_REAP: str = SQLITE.reap
_CLAIM: str = f"{SQLITE.claim(SQLITE.n)}\n{RETURNING}"
_LIVE: str = live_count(SQLITE.n)
_ts = sqlite_ts


class SqliteDispatchQueue(SqlDispatchQueue):
    """The dispatch queue in a SQLite file (WAL). Safe across threads and across processes on
    one host."""

    dialect = SQLITE
    _unique_violations = (sqlite3.IntegrityError,)

    def __init__(self, path: str | Path, *, clock: Clock | None = None) -> None:
        self.path = Path(path).expanduser()
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._schema_where = f"{self.path}: "

    def __repr__(self) -> str:
        return f"SqliteDispatchQueue({str(self.path)!r})"

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def claim_batch(
        self,
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> builtins.list[Dispatch]:
        """Reap, count the live leases, claim what the room allows: one transaction under the
        writer lock, so no other claim interleaves."""
        now = self.clock.now()
        with self._transaction() as conn:
            reaped, claimed = self._claim_on(
                conn, now, kernel_id, worker_id, lease_seconds, max_concurrent, limit
            )
        log_reaped(reaped)
        return claimed

    def complete_and_claim(
        self,
        completions: builtins.list[Completion],
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[StoreConflictError | None], builtins.list[Dispatch]]:
        """The outcomes' fenced updates, then the claim, in one transaction (one commit)."""
        now = self.clock.now()
        with self._transaction() as conn:
            results = self._complete_on(conn, completions, None, now)
            reaped, claimed = self._claim_on(
                conn, now, kernel_id, worker_id, lease_seconds, max_concurrent, limit
            )
        log_reaped(reaped)
        return [r if isinstance(r, StoreConflictError) else None for r in results], claimed

    def _claim_on(
        self,
        conn: sqlite3.Connection,
        now: datetime,
        kernel_id: str,
        worker_id: str,
        lease_seconds: float,
        max_concurrent: int,
        limit: int,
    ) -> tuple[builtins.list[Dispatch], builtins.list[Dispatch]]:
        """The reaped and the claimed dispatches, inside the caller's write transaction."""
        params: dict[str, object] = {
            "worker": worker_id,
            "expires": _ts(now + timedelta(seconds=lease_seconds)),
            "now": _ts(now),
            "kernel": kernel_id,
            "cancelled": CANCELLED_EXPIRED,
        }
        reaped = [Dispatch.from_row(r) for r in conn.execute(_REAP, params).fetchall()]
        running = int(conn.execute(_LIVE, params).fetchone()["n"])
        room = min(limit, max_concurrent - running)
        rows = conn.execute(_CLAIM, {**params, "limit": room}).fetchall() if room > 0 else []
        return reaped, in_claim_order([Dispatch.from_row(row) for row in rows])

    def listener(self, kernel_id: str) -> DispatchListener | None:
        return None  # SQLite has no notifications: workers poll

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
            conn.row_factory = sqlite3.Row
            enable_wal(conn)
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

    _read = _connection
    """Reads need no transaction."""
    _write = _transaction
    """Every write, even of one statement, takes the writer lock up front."""
