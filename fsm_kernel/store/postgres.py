"""The PostgreSQL EventStore (the `postgres` extra): the same logical schema as SQLite, with
TIMESTAMPTZ and JSONB, for several hosts sharing runs.

Owns every use of psycopg in the event store; psycopg is imported lazily and its errors never
escape this module (StoreError). Messages never contain the password.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fsm_kernel.errors import StoreError
from fsm_kernel.store._runlock import run_lock_key, run_locked_error
from fsm_kernel.store._sql import POSTGRES, Executor, SqlEventStore

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresEventStore"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'fsm-kernel[postgres]'"
# Serializes schema set-up between processes opening the same database at once ("fsmk").
_MIGRATION_LOCK_KEY = 0x66736D6B
_RUN_LOCK_BITS = 63  # advisory lock keys are signed bigints: stay non-negative
_CONNECT_TIMEOUT_S = 10
_HELD_SQL = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid::text::bigint = %s AND objid::text::bigint = %s AND objsubid = 1)"
)
"""Whether a bigint advisory lock is held: pg_locks splits its key into classid (the high 32
bits) and objid (the low ones), objsubid 1."""

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


class PostgresEventStore(SqlEventStore):
    """Append-only event log in a PostgreSQL database; one connection guarded by a lock.

    Each append is one transaction, committed before `append` returns. A broken connection
    (server restart) is replaced on the next call.
    """

    _dialect = POSTGRES
    _logger = logger

    def __init__(self, dsn: str, *, connect_timeout: int = _CONNECT_TIMEOUT_S) -> None:
        self._psycopg = _import_psycopg()
        self._dsn = dsn
        self._info = _parse_dsn(self._psycopg, dsn)
        if "connect_timeout" not in self._info:
            self._info["connect_timeout"] = str(connect_timeout)
        self._where = _describe(self._info)
        self._driver_error = self._psycopg.Error
        self._unique_violation = self._psycopg.errors.UniqueViolation
        self._lock = threading.Lock()
        self._closed = False
        self._conn: psycopg.Connection[Any] | None = None
        self._migrate_or_close()

    def __repr__(self) -> str:
        return f"PostgresEventStore({self._where!r})"

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

    def is_running(self, run_id: str) -> bool:
        """True while some session holds the run's advisory lock (see lock_run), as pg_locks
        shows it: asking takes no lock, so it never makes a resume fail."""
        key = run_lock_key(run_id, bits=_RUN_LOCK_BITS)
        rows = self._query(_HELD_SQL, (key >> 32, key & 0xFFFFFFFF), what="is_running failed")
        return bool(rows and rows[0][0])

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
    def _transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        conn = self._live()
        with conn.transaction(), conn.cursor() as cur:
            yield cur

    def _lock_schema(self, cur: Executor) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))

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
