"""Claims do not read the finished history: with thousands of finished rows in the table, a claim
and the completion after it touch only the partial indexes over pending and running rows. Shown
by the query plans (SQLite) and by PostgreSQL's own counters (no sequential scan of the table),
not by timing (benchmarks/dispatch_queue.py measures the latency).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fsm_kernel.scheduler import open_queue, sqlite_queue
from fsm_kernel.scheduler.queue import TABLE
from tests.unit.test_scheduler_fakes import pg_url

K = "k1"
HISTORY = 20_000


def test_sqlite_claim_and_reap_plans_search_partial_indexes_only(tmp_path: Path) -> None:
    queue = open_queue(str(tmp_path / "runs.db"))
    queue.close()
    params = {
        "worker": "w",
        "expires": "x",
        "now": "y",
        "kernel": K,
        "cancelled": "c",
        "limit": 3,
    }
    with sqlite3.connect(tmp_path / "runs.db") as conn:
        plans = {
            name: [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
            for name, sql in (("claim", sqlite_queue._CLAIM), ("reap", sqlite_queue._REAP))
        }
    conn.close()
    for name, plan in plans.items():
        assert not [step for step in plan if step.startswith(f"SCAN {TABLE}")], (name, plan)
    assert any(f"INDEX {TABLE}_pending" in step for step in plans["claim"])
    assert any(f"INDEX {TABLE}_running" in step for step in plans["claim"])
    assert any(f"INDEX {TABLE}_running" in step for step in plans["reap"])


@pytest.fixture
def pg_store(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.mark.postgres
def test_postgres_claims_and_completions_never_scan_the_history(pg_store: str) -> None:
    import psycopg

    queue = open_queue(pg_store)
    with psycopg.connect(pg_store, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {TABLE} (dispatch_id, kernel_id, agent_id, prompt, status, dedupe_key, "
            "attempts, created_at, finished_at) SELECT 'old-' || g, %s, 'agent' || (g %% 7), 'p', "
            "(ARRAY['done', 'failed', 'cancelled'])[1 + g %% 3], 'old-' || g, 1, "
            "now() - g * interval '1 minute', now() FROM generate_series(1, %s) AS g",
            (K, HISTORY),
        )
        conn.execute(f"ANALYZE {TABLE}")
    try:
        before = _scans(queue)
        for i in range(30):
            dispatch = queue.enqueue(K, f"live{i}", "p", 0, f"live{i}")
            assert dispatch is not None
            claimed = queue.claim(K, "w", 60, 3)
            assert claimed is not None
            assert claimed.dispatch_id == dispatch.dispatch_id
            queue.heartbeat(claimed.dispatch_id, "w", 60, attempt=1)
            queue.complete(claimed.dispatch_id, "w", status="done", max_concurrent=3)
        queue.reap(K)
        after = _scans(queue)
    finally:
        queue.close()
    assert after[0] == before[0], "a sequential scan of the dispatch table"
    rows_read = after[1] - before[1]
    assert rows_read < 30 * 50, f"{rows_read} rows read for 30 claims"  # the history: 20,000


def _scans(queue: object) -> tuple[int, int]:
    """(sequential scans, rows read) of the dispatch table, the queue connection's work
    included."""
    with queue._session() as conn:  # type: ignore[attr-defined]  # the PostgreSQL adapter's
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")  # the flush happens when this backend goes idle
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT seq_scan, seq_tup_read + coalesce(idx_tup_fetch, 0) AS rows_read "
            "FROM pg_stat_user_tables WHERE relname = %s",
            (TABLE,),
        ).fetchone()
    assert row is not None
    return int(row["seq_scan"]), int(row["rows_read"])
