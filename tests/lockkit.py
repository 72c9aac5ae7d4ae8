"""What the run-lock tests share: every backend's store class by kind, a store location per
backend (a parametrised fixture), and a script that holds a run's lock in another process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fsm_kernel.store import AnyEventStore, JsonlEventStore, PostgresEventStore, SqliteEventStore

REPO = Path(__file__).resolve().parents[1]
STORES: dict[str, Callable[[str], AnyEventStore]] = {
    "sqlite": SqliteEventStore,
    "jsonl": JsonlEventStore,
    "postgres": PostgresEventStore,
}
HOLDER = """
import sys, time
from fsm_kernel.store import JsonlEventStore, PostgresEventStore, SqliteEventStore

kind, location, run_id = sys.argv[1:4]
cls = {"sqlite": SqliteEventStore, "jsonl": JsonlEventStore, "postgres": PostgresEventStore}[kind]
with cls(location) as store, store.lock_run(run_id):
    print("locked", flush=True)
    time.sleep(120)
"""
"""Run with `python -c HOLDER KIND LOCATION RUN_ID` from REPO: prints `locked`, then holds."""


@pytest.fixture(params=["sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(backend kind, store location)."""
    kind: str = request.param
    if kind == "postgres":
        return kind, request.getfixturevalue("pg_dsn")
    return kind, str(tmp_path / ("events.db" if kind == "sqlite" else "events.jsonl"))
