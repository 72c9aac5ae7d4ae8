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
    RUN_SUSPENDED,
    RUNNING,
    WAITING,
    status_after,
    tokens_of,
)
from fsm_kernel.store.jsonl import JsonlEventStore, export_run, import_events
from fsm_kernel.store.postgres import PostgresEventStore
from fsm_kernel.store.sqlite import SqliteEventStore

__all__ = [
    "ACCEPTED_STORE_LOCATIONS",
    "ENDED",
    "RUNNING",
    "RUN_SUSPENDED",
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


def open_store(location: str | Path) -> AnyEventStore:
    """Open (creating if needed) the event store at `location` (see `parse_store_location`).

    Raises:
        StoreLocationError: `location` names no backend; nothing is created.
        StoreError: the store cannot be opened (StoreSchemaError: its schema is too new).
        ImportError: a PostgreSQL URL without psycopg installed.
    """
    where = parse_store_location(location)
    if where.backend == "postgres":
        return PostgresEventStore(where.target)
    if where.backend == "jsonl":
        return JsonlEventStore(where.target)
    return SqliteEventStore(where.target)
