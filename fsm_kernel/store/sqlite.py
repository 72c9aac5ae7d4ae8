"""The default EventStore: one SQLite file (stdlib sqlite3), WAL, durable commits (synced
before every model or tool call; see SqlEventStore.append).

Owns every use of sqlite3 in the event store; sqlite3 errors never escape it (StoreError).
The SQL and the row mapping it shares with PostgreSQL live in _sql.py.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from urllib.parse import quote

from fsm_kernel.errors import StoreError
from fsm_kernel.protocol import Event
from fsm_kernel.store._runlock import RUN_LOCKS_SUFFIX, RunLockFile
from fsm_kernel.store._sql import SQLITE, PendingAppend, SqlEventStore
from fsm_kernel.store._synccost import SyncCost

__all__ = ["SqliteEventStore"]

logger = logging.getLogger(__name__)

_BUSY_TIMEOUT_S = 30.0
_PAGE_SIZE = 1024
CHECKPOINT_EVERY = 64
"""Commits between two checkpoints. Each checkpoint lets the next commit start the WAL over, so
the WAL stays small and its space is rewritten in place: a sync then writes no file-size
change (on ext4 about 120 of a sync's 300 µs), and readers search a short WAL."""


WAL_PRESIZE = 512 * 1024
"""Bytes of zeros the WAL is extended to before a store's first commit: room for
CHECKPOINT_EVERY commits of a lone run (about 7 KiB each), so no commit grows the file (see
`_presize_wal`)."""


class SqliteEventStore(SqlEventStore):
    """Append-only event log in one SQLite file, safe for threads and for several processes.

    Every append is one `BEGIN IMMEDIATE` transaction whose WAL is synced after it commits, so
    events are on disk when `append` returns, unless it is called with `durable=False`: then
    the commit survives the process dying but reaches the disk with the next durable commit's
    sync. Appends from several threads at once share one transaction and one
    sync (see SqlEventStore.append). `path` may be ":memory:" for a throwaway store.

    With `read_only=True` the file is opened read-only (`mode=ro`) for readers such as the
    run viewer: it must exist with this code's schema, appends fail, and in WAL mode its reads
    never block the processes writing runs to it (nor are they blocked by them).
    """

    _dialect = SQLITE
    _logger = logger
    _driver_error = sqlite3.Error
    _unique_violation = sqlite3.IntegrityError
    _update_from = sqlite3.sqlite_version_info >= (3, 33, 0)

    def __init__(
        self, path: str | Path, *, busy_timeout: float = _BUSY_TIMEOUT_S, read_only: bool = False
    ) -> None:
        self.path = Path(path).expanduser() if str(path) != ":memory:" else Path(":memory:")
        self._where = str(self.path)
        self._lock = threading.Lock()
        in_memory = self.path == Path(":memory:")
        lock_path = None if in_memory else self.path.with_name(self.path.name + RUN_LOCKS_SUFFIX)
        self._run_locks = RunLockFile(lock_path)
        self._busy_ms = int(busy_timeout * 1000)
        self._commits = 0
        self._sync_cost = SyncCost()
        self._impatient = False
        """busy_timeout is 0 (left so by append_if_idle: `_live` restores it for anything else)."""
        self._idle_commit = False
        self._wal_fd: int | None = None
        """The WAL, opened at the first durable commit to sync it (see `_synced`)."""
        self.read_only = read_only
        connect = _connect_read_only if read_only else _connect
        conn = connect(self.path, busy_timeout)
        self._conn: sqlite3.Connection | None = conn
        self._migrate_or_close(read_only=read_only)
        self._presized = read_only or in_memory
        self._wal = not self._presized and self._in_wal_mode(conn)
        """The file is in WAL mode (set by `_configure`, kept while this connection is open):
        the WAL is pre-sized and synced by this store; otherwise each commit syncs itself."""
        """The WAL has had its zeros (at the first commit: a store opened only to be read, by
        `runs list` say, writes nothing)."""

    def __repr__(self) -> str:
        return f"SqliteEventStore({str(self.path)!r})"

    def lock_run(self, run_id: str) -> AbstractContextManager[None]:
        """Hold the run's exclusive lock (see EventStore.lock_run): a record lock in
        `<path>.locks`, not a row, so a killed holder leaves nothing behind to expire.

        Raises:
            RunLockedError: another process, or another holder in this one, has it.
            StoreError: the store is closed or the lock file cannot be opened.
        """
        if self._conn is None:
            raise StoreError(f"{self.path}: event store is closed")
        return self._run_locks.hold(run_id)

    def is_running(self, run_id: str) -> bool:
        """True while a process holds the run's lock (see lock_run); creates no file."""
        if self._conn is None:
            raise StoreError(f"{self.path}: event store is closed")
        return self._run_locks.is_held(run_id)

    def append_if_idle(self, events: Sequence[Event], *, durable: bool = False) -> bool:
        """`append(events, durable=durable)` done at once on the calling thread when it cannot
        wait: no other append of this store holds or waits for the connection and no other
        process holds the database's write lock; False, with nothing written, otherwise.

        A commit with `durable=False` never waits for the disk (no sync, no checkpoint), so it
        is a few tens of microseconds of work, less than handing it to a thread: the run
        recorder makes it on the event loop and falls back to a thread when this returns
        False. A durable one waits for the disk, so it is made only while this store's durable
        commits are fast (see SyncCost) and no checkpoint is due, else False.

        Raises:
            StoreConflictError, StoreError: as `append`.
        """
        if durable and (not self._sync_cost.cheap or self._commits + 1 >= CHECKPOINT_EVERY):
            return False
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with self._queue_lock:
                if self._queue:
                    return False
            job = self._job(events, durable=durable)
            if job is None:
                return True
            self._idle_commit = True
            try:
                if not self._impatient:  # another writer: give up, do not wait
                    self._live().execute("PRAGMA busy_timeout = 0")
                    self._impatient = True
                self._commit([job], checkpoint=False)
            finally:
                self._idle_commit = False
        finally:
            self._lock.release()
        if job.error is not None:
            if _is_busy(job.error.__cause__):
                return False  # rolled back: the caller appends from a thread, waiting its turn
            raise job.error
        return True

    def _commit(self, group: list[PendingAppend], *, checkpoint: bool = True) -> None:
        """Commit (timing the durable ones, see SyncCost), then, every CHECKPOINT_EVERY commits
        and never on the event loop, copy the WAL back into the database (automatic
        checkpoints are off: one would sync the disk inside whichever commit crossed the
        threshold, an idle append's included)."""
        if not self._presized:
            self._presized = True
            self._presize_wal()
        with self._sync_cost.timing(any(job.durable for job in group)):
            super()._commit(group)
        self._commits += 1
        if checkpoint and self._commits >= CHECKPOINT_EVERY and self._conn is not None:
            self._commits = 0
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as exc:  # the commit stands; the next checkpoint retries
                logger.warning("%s: checkpoint failed: %s", self.path, exc)

    def _synced(self) -> None:
        """Sync the WAL after a durable commit: the connection commits without syncing in WAL
        mode (see `_configure`), so this is what puts the commit, and every relaxed one before
        it, on disk, as `synchronous=FULL` would, without switching the connection's mode
        before and after each one. Its own descriptor: SQLite holds no lock on the WAL file
        that closing it could drop (its WAL locks are on the -shm file), and the WAL stays
        the same file while a connection is open (SQLite removes it when the last one
        closes)."""
        fd = self._wal_fd
        if fd is None:
            if not self._wal:
                return  # synchronous=FULL (see _configure): the commit synced itself
            wal = self.path.with_name(self.path.name + "-wal")
            try:
                fd = self._wal_fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot open the WAL to sync it: {exc}") from exc
        try:
            _datasync(fd)
        except OSError as exc:
            raise StoreError(f"{self.path}: append not synced to disk: {exc}") from exc

    def _presize_wal(self) -> None:
        """Extend the WAL file with zeros to WAL_PRESIZE bytes, and sync them, once before the
        store's first commit: until the first checkpoint lets SQLite start the WAL over, each
        commit appends frames to it, and on ext4 a sync that must also record a larger file
        costs about 120 µs more (per commit, for the first 64 of every process: SQLite deletes
        the WAL when the last connection closes). PostgreSQL zero-fills its WAL segments for
        this reason.

        Safe for SQLite, and for any process sharing the file: the zeros go past the WAL's end
        only, while this connection holds the write lock (no frame is being appended), and a
        frame is valid only if its salt and checksum chain from the WAL header, which zeros
        never do, so readers and recovery stop at them. Skipped, never waited for, when
        another connection holds the write lock; an error (a full disk, say) only costs the
        speed-up."""
        conn = self._conn
        if conn is None or not self._wal:
            return
        wal = self.path.with_name(self.path.name + "-wal")
        patient = not self._impatient  # an idle append's first commit left it at 0 already
        try:
            if patient:
                conn.execute("PRAGMA busy_timeout = 0")
            try:
                conn.execute("BEGIN IMMEDIATE")
            finally:
                if patient:
                    conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        except sqlite3.Error as exc:  # busy: another writer is at work, and its WAL grows
            logger.debug("%s: WAL not pre-sized: %s", self.path, exc)
            return
        try:
            _extend_with_zeros(wal, WAL_PRESIZE)
        except OSError as exc:
            logger.debug("%s: WAL not pre-sized: %s", self.path, exc)
        finally:
            conn.execute("COMMIT")  # nothing written: ends the transaction, frees the lock

    @staticmethod
    def _in_wal_mode(conn: sqlite3.Connection) -> bool:
        try:
            return bool(conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal")
        except sqlite3.Error:
            return False

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            conn, self._conn = self._conn, None
            fd, self._wal_fd = self._wal_fd, None
        if conn is not None:
            conn.close()
        if fd is not None:
            os.close(fd)

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"{self.path}: event store is closed")
        if self._impatient and not self._idle_commit:  # anything else waits its turn
            self._conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            self._impatient = False
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves so the write lock is taken
        # up front (waiting busy_timeout) instead of failing mid-transaction on an upgrade.
        conn = self._live()
        if self.read_only:
            raise StoreError(f"{self.path}: the event store is open read-only")
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _only_ours(self) -> bool:
        rows = self._query(
            "SELECT name FROM sqlite_master WHERE type = 'table'", (), what="cannot list tables"
        )
        return all(str(name).startswith(_OUR_TABLES) for (name,) in rows)

    def _error(self, what: str, exc: Exception) -> StoreError:
        message = f"{self.path}: {what}: {exc}"
        if isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
            message = f"{self.path}: not an SQLite database ({exc})"
        return StoreError(message.replace("\n", " "))


_OUR_TABLES = ("scheduler_", "kernel_dispatch_tasks", "dispatch_tasks", "sqlite_")
"""The tables of a database fsm-kernel's scheduler alone has written (and SQLite's own)."""


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


def _connect_read_only(path: Path, busy_timeout: float) -> sqlite3.Connection:
    if not path.is_file():
        raise StoreError(f"{path}: no such event store")
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    try:
        conn = sqlite3.connect(
            uri, uri=True, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        conn.execute("PRAGMA query_only = 1")
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open SQLite database read-only: {exc}") from exc
    return conn


_WAL_TRIES = 200


def enable_wal(conn: sqlite3.Connection) -> str:
    """Switch the file to WAL, waiting out the others doing the same. Changing the journal mode
    takes the file's exclusive lock, and SQLite answers "database is locked" at once, without
    its busy handler, to a connection whose lock upgrade would deadlock with another's: several
    processes opening a new (or pre-WAL) store together, say. Each retry waits a little longer,
    ~4 s in all; an already-WAL file returns at the first try. Returns the mode now in force
    ("wal", or what a filesystem without WAL support left)."""
    for attempt in range(_WAL_TRIES - 1):
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            time.sleep(0.001 * min(attempt + 1, 40))
    return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])  # the last try


def _configure(conn: sqlite3.Connection, path: Path, busy_timeout: float) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    # A new database gets small pages: a commit writes every page it changes to the WAL, and
    # most appends are a few hundred bytes (a step's bookkeeping), so 4 KiB pages would write
    # ~10x what they store. Ignored for an existing database (its page size stays).
    conn.execute(f"PRAGMA page_size = {_PAGE_SIZE}")
    mode = enable_wal(conn)
    if mode != "wal" and str(path) != ":memory:":
        logger.warning("%s: journal_mode is %s, not wal (unsupported filesystem?)", path, mode)
    # In WAL mode NORMAL: a commit goes to the WAL without a sync (it survives the process
    # dying, and SQLite keeps the file consistent whatever happens), and a durable append
    # then syncs the WAL itself (SqliteEventStore._synced), as FULL would at every commit, so
    # a crash or power loss right after it cannot lose the events. Elsewhere (a filesystem
    # without WAL, an in-memory database) FULL: every commit syncs.
    conn.execute("PRAGMA synchronous = NORMAL" if mode == "wal" else "PRAGMA synchronous = FULL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")  # SqliteEventStore._commit checkpoints


_OS_PAGE = 4096
"""The zeros go to the WAL one page per write: the page cache sizes a folio by the write that
creates it, and a commit later dirties (and a sync writes) the whole folio it writes into, so
one big write would make every commit write up to hundreds of KiB."""


def _extend_with_zeros(path: Path, size: int) -> None:
    """Write zeros from the end of the existing file `path` up to `size` bytes, then sync
    them (no-op when it is that large already, or missing). The descriptor is this
    function's own: SQLite holds no POSIX lock on a WAL file that closing it could drop
    (its WAL locks are on the -shm file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        end = os.fstat(fd).st_size
        if end >= size:
            return
        page = bytes(_OS_PAGE)
        for offset in range(end, size, _OS_PAGE):  # a page a write: see _OS_PAGE
            os.pwrite(fd, page[: size - offset], offset)
        os.fsync(fd)  # the new size too (fdatasync would as well, but macOS lacks it)
    finally:
        os.close(fd)


_datasync = getattr(os, "fdatasync", os.fsync)
"""Data (and the size) to disk; macOS has no fdatasync."""


def _is_busy(exc: BaseException | None) -> bool:
    """SQLITE_BUSY (another connection holds the write lock), extended codes included."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY
