"""Event stores: the run's append-only log, keyed (run_id, seq), and `open_store`, which picks
the backend from a location string.

SQLite is the default; psycopg (the `postgres` extra) is imported only when a PostgreSQL store
is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

from fsm_kernel.store.jsonl import JsonlEventStore, export_run, import_events
from fsm_kernel.store.postgres import PostgresEventStore
from fsm_kernel.store.sqlite import SqliteEventStore

__all__ = [
    "AnyEventStore",
    "JsonlEventStore",
    "PostgresEventStore",
    "SqliteEventStore",
    "export_run",
    "import_events",
    "is_postgres_dsn",
    "open_store",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")

AnyEventStore: TypeAlias = SqliteEventStore | JsonlEventStore | PostgresEventStore
"""Every backend: an EventStore plus `next_seq(run_id)` and `with` support."""


def is_postgres_dsn(location: str | Path) -> bool:
    """True for a postgresql:// or postgres:// URL."""
    return isinstance(location, str) and location.strip().lower().startswith(_POSTGRES_SCHEMES)


def open_store(location: str | Path) -> AnyEventStore:
    """Open (creating if needed) the event store at `location`.

    `postgresql://...` or `postgres://...` opens PostgreSQL, a path ending in `.jsonl` a JSON
    Lines file, anything else an SQLite file.

    Raises:
        StoreError: the store cannot be opened (StoreSchemaError: its schema is too new).
        ImportError: a PostgreSQL URL without psycopg installed.
    """
    if is_postgres_dsn(location):
        return PostgresEventStore(str(location).strip())
    path = Path(location).expanduser()
    if path.suffix.lower() == ".jsonl":
        return JsonlEventStore(path)
    return SqliteEventStore(path)
