"""Event stores: the run's append-only log, keyed (run_id, seq), and `open_store`, which picks
the backend from a location string.

SQLite is the default; psycopg (the `postgres` extra) is imported only when a PostgreSQL store
is opened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

from fsm_kernel.errors import StoreLocationError
from fsm_kernel.redact import redact, register_url_password
from fsm_kernel.store._schema import (
    ENDED,
    INTERRUPTED,
    RUN_SUSPENDED,
    RUNNING,
    SHORT_ID_LENGTH,
    WAITING,
    status_after,
    tokens_of,
)
from fsm_kernel.store._sql import OlderSchemaError
from fsm_kernel.store.jsonl import JsonlEventStore, export_run, import_events
from fsm_kernel.store.postgres import PostgresEventStore
from fsm_kernel.store.sqlite import SqliteEventStore

__all__ = [
    "ACCEPTED_STORE_LOCATIONS",
    "ENDED",
    "INTERRUPTED",
    "RUNNING",
    "RUN_SUSPENDED",
    "SHORT_ID_LENGTH",
    "WAITING",
    "AnyEventStore",
    "JsonlEventStore",
    "PostgresEventStore",
    "SqliteEventStore",
    "StoreLocation",
    "export_run",
    "import_events",
    "is_postgres_dsn",
    "open_store",
    "parse_store_location",
    "status_after",
    "tokens_of",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SQLITE_URL = "sqlite:///"
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_JSONL_SUFFIX = ".jsonl"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:(?://)?")
"""`mysql://`, `s3://`, also `sqlite:` or `user:` (a URL without its scheme); one letter and a
colon is left alone, as a Windows drive is no scheme."""
_KEYWORD_STRING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*=")

ACCEPTED_STORE_LOCATIONS = (
    "a path ending in .db, .sqlite or .sqlite3 (SQLite) or .jsonl (JSON Lines), "
    "sqlite:///relative/path.db or sqlite:////absolute/path.db, "
    "or a postgresql:// URL"
)
"""The forms `parse_store_location` accepts, as every refusal names them."""

AnyEventStore: TypeAlias = SqliteEventStore | JsonlEventStore | PostgresEventStore
"""Every backend: an EventStore plus `next_seq(run_id)` and `with` support."""


@dataclass(frozen=True)
class StoreLocation:
    """Which backend a location names and what to open: a file path or a PostgreSQL URL."""

    backend: Literal["sqlite", "jsonl", "postgres"]
    target: str


def is_postgres_dsn(location: str | Path) -> bool:
    """True for a postgresql:// or postgres:// URL."""
    return isinstance(location, str) and location.strip().lower().startswith(_POSTGRES_SCHEMES)


def parse_store_location(location: str | Path) -> StoreLocation:
    """The backend `location` names. Only explicit forms are accepted, because anything else
    used to become an SQLite file named after it (a mysql:// URL, a libpq keyword string and
    its password) in the working directory.

    Raises:
        StoreLocationError: `location` is none of ACCEPTED_STORE_LOCATIONS; the message shows
            only the scheme of a URL, never the value of a keyword string, and redacts the rest.
    """
    if is_postgres_dsn(location):
        dsn = str(location).strip()
        register_url_password(dsn)  # psycopg's errors may quote it, even mangled
        return StoreLocation("postgres", dsn)
    text = str(location)
    stripped = text.strip()
    if stripped.lower().startswith(_SQLITE_URL):
        path = stripped[len(_SQLITE_URL) :]
        if path:
            return StoreLocation("sqlite", path)
        raise _refused("'sqlite:///' without a path")
    scheme = _SCHEME.match(stripped)
    if scheme:
        raise _refused(f"'{scheme.group()}…'")
    if _KEYWORD_STRING.match(stripped):
        raise _refused("(a keyword string, not shown)")
    suffix = Path(text).suffix.lower()
    if suffix in _SQLITE_SUFFIXES:
        return StoreLocation("sqlite", text)
    if suffix == _JSONL_SUFFIX:
        return StoreLocation("jsonl", text)
    raise _refused(repr(redact(text)) if stripped else "(empty)")


def _refused(shown: str) -> StoreLocationError:
    return StoreLocationError(f"unsupported store location {shown}: use {ACCEPTED_STORE_LOCATIONS}")


def open_store(location: str | Path, *, read_only: bool = False) -> AnyEventStore:
    """Open (creating if needed) the event store at `location` (see `parse_store_location`).

    `read_only`, for commands that only read (`runs list`, `replay`, the viewer): a store file
    must exist, and is opened read-only, so a mistyped location creates neither folders nor
    an empty store. The one write such an open may make is the upgrade of a SQLite store
    written by an older fsm-kernel, which this code could not read otherwise. (A PostgreSQL
    database is opened as for writing: it exists, or connecting fails.)

    Raises:
        StoreLocationError: `location` names no backend, or (`read_only`) no store is there;
            nothing is created.
        StoreError: the store cannot be opened (StoreSchemaError: its schema is too new).
        ImportError: a PostgreSQL URL without psycopg installed.
    """
    where = parse_store_location(location)
    if where.backend == "postgres":
        return PostgresEventStore(where.target)
    if read_only:
        return _open_read_only(where)
    if where.backend == "jsonl":
        return JsonlEventStore(where.target)
    return SqliteEventStore(where.target)


def _open_read_only(where: StoreLocation) -> SqliteEventStore | JsonlEventStore:
    path = Path(where.target).expanduser()
    if str(path) == ":memory:":
        raise StoreLocationError("an in-memory store has nothing to read")
    if not path.exists():
        raise StoreLocationError(
            f"no event store at {redact(str(path))}: no run was recorded there (check "
            "--store or FSM_KERNEL_STORE)"
        )
    if where.backend == "jsonl":
        return JsonlEventStore(path, read_only=True)
    try:
        return SqliteEventStore(path, read_only=True)
    except OlderSchemaError:
        SqliteEventStore(path).close()  # brings it to this code's schema
    return SqliteEventStore(path, read_only=True)
