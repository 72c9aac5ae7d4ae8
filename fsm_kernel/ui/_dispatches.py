"""The scheduler's dispatches as the viewer reads them: the recent ones grouped by the cycle
(tick) that enqueued them, and the dispatch a run came from. Reads only: SQLite is opened
read-only (WAL, so workers and schedulers writing the queue are never held up); PostgreSQL
through the queue's own reads.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import Dispatch, SchedulerConfig, open_queue
from fsm_kernel.scheduler.queue import COLUMNS, TABLE, DispatchQueue
from fsm_kernel.store import parse_store_location

__all__ = ["Cycle", "DispatchReader", "group_cycles"]

_RECENT = 200
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM {TABLE}"


@dataclass
class Cycle:
    """The dispatches one tick enqueued (`--once` cycles are ticks of their own)."""

    stamp: str
    """The tick's time (ISO-8601), or `manual:<id>` for a `--once` cycle."""
    dispatches: list[Dispatch] = field(default_factory=list)

    @property
    def is_manual(self) -> bool:
        return self.stamp.startswith("manual:")


def _stamp(dispatch: Dispatch) -> str:
    """The cycle of a dispatch, from its dedupe key `<kernel>:<agent>:<stamp>`."""
    prefix = f"{dispatch.kernel_id}:{dispatch.agent_id}:"
    key = dispatch.dedupe_key or ""
    return key[len(prefix) :] if key.startswith(prefix) else "(no cycle recorded)"


def group_cycles(dispatches: list[Dispatch]) -> list[Cycle]:
    """Dispatches (newest first) grouped by cycle, the newest cycle first."""
    cycles: dict[str, Cycle] = {}
    for dispatch in dispatches:
        stamp = _stamp(dispatch)
        cycles.setdefault(stamp, Cycle(stamp)).dispatches.append(dispatch)
    return list(cycles.values())


class DispatchReader:
    """Reads one scheduler config's dispatches."""

    def __init__(self, config: SchedulerConfig, config_path: Path) -> None:
        self.config = config
        self.config_path = config_path
        self._where = parse_store_location(config.store)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._queue: DispatchQueue | None = None

    def recent(self, limit: int = _RECENT) -> list[Dispatch]:
        """The most recent dispatches of the config's kernel, newest first."""
        kernel = self.config.kernel_id
        if self._where.backend != "sqlite":
            return self._pg().list(kernel, limit)
        sql = f"{_SELECT} WHERE kernel_id = ? ORDER BY created_at DESC, dispatch_id DESC LIMIT ?"
        return self._sqlite(sql, (kernel, limit))

    def for_run(self, run_id: str) -> Dispatch | None:
        """The dispatch whose run this is (known once the dispatch finished)."""
        if self._where.backend != "sqlite":
            return next((d for d in self.recent(1000) if d.run_id == run_id), None)
        sql = f"{_SELECT} WHERE kernel_id = ? AND run_id = ? LIMIT 1"
        found = self._sqlite(sql, (self.config.kernel_id, run_id))
        return found[0] if found else None

    def get(self, dispatch_id: str) -> Dispatch | None:
        if self._where.backend != "sqlite":
            return self._pg().get(dispatch_id)
        found = self._sqlite(f"{_SELECT} WHERE dispatch_id = ?", (dispatch_id,))
        return found[0] if found else None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._queue is not None:
                self._queue.close()
                self._queue = None

    def _pg(self) -> DispatchQueue:
        with self._lock:
            if self._queue is None:
                from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

                self._queue = PostgresDispatchQueue(self._where.target)
            return self._queue

    def _sqlite(self, sql: str, params: tuple[str | int, ...]) -> list[Dispatch]:
        path = Path(self._where.target).expanduser()
        with self._lock:
            try:
                if self._conn is None:
                    if not path.is_file():
                        return []  # no cycle has run yet
                    self._conn = _connect_read_only(path)
                rows = self._conn.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return []  # the store holds runs, but no scheduler has used it yet
                raise StoreError(f"{path}: cannot read dispatches: {exc}") from exc
            except sqlite3.Error as exc:
                raise StoreError(f"{path}: cannot read dispatches: {exc}") from exc
        return [Dispatch.from_row(row) for row in rows]

    def cancel(self, dispatch_id: str) -> Dispatch | None:
        """What `fsm-kernel dispatches CONFIG --cancel ID` does (the one write the viewer
        makes, on a person's POST): a pending dispatch is cancelled, a running one asked to
        stop. None for an unknown id; StoreConflictError when it already finished."""
        queue = open_queue(self.config.store)
        try:
            return queue.cancel(self.config.kernel_id, dispatch_id)
        finally:
            queue.close()


def _connect_read_only(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(
        f"file:{quote(str(path.resolve()))}?mode=ro",
        uri=True,
        isolation_level=None,
        check_same_thread=False,
        timeout=5.0,
    )
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA query_only = 1")
    return conn
