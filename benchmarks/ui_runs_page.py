"""The run viewer's runs page with 100,000 runs in the store: a fresh SQLite store is filled in
bulk (tests/ui/bulk.py: started, one model answer, three in four ended), `fsm-kernel ui`'s app
serves it on a loopback port, and each page is fetched over HTTP like a browser would, the
whole answer timed (query, count, template, transfer).

    python benchmarks/ui_runs_page.py [--runs 100000] [--requests 30] [--json] [--keep DIR]
                                      [--store postgresql://...]   (an empty database)

Exits 1 when the median answer of the first page (`/`) takes 200 ms or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsm_kernel.store import AnyEventStore, SqliteEventStore, open_store
from fsm_kernel.ui import ViewerConfig, open_viewer
from tests.ui.bulk import run_id, write_runs

LIMIT_MS = 200.0


@dataclass(frozen=True)
class Row:
    page: str
    path: str
    median_ms: float
    p95_ms: float
    max_ms: float
    rows: int


def _pages(runs: int) -> list[tuple[str, str]]:
    return [
        ("first page", "/"),
        ("live refresh of it", "/runs/table"),
        ("halfway down (keyset cursor)", f"/?before={run_id(runs // 2)}"),
        ("filtered by workflow", "/?workflow=react"),
        ("filtered by status", "/?status=done"),
        ("workflow and status", "/?workflow=react&status=running"),
        ("text search (scans goals)", "/?q=task+number+4242"),
    ]


def _time(client: httpx.Client, path: str, requests: int) -> Row:
    for _ in range(3):  # warm the page cache and the template
        client.get(path).raise_for_status()
    times = []
    rows = 0
    for _ in range(requests):
        started = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
        rows = answer.text.count("data-run-id=")
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return Row("", path, statistics.median(times), p95, times[-1], rows)


def _fill(events: AnyEventStore, runs: int) -> None:
    started = time.perf_counter()
    with events:
        write_runs(events, runs)
    print(f"wrote {runs:,} runs in {time.perf_counter() - started:.1f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", metavar="DIR", help="write the store here and keep it")
    parser.add_argument("--store", metavar="URL", help="a PostgreSQL database to fill instead")
    args = parser.parse_args(argv)

    if args.store:
        store = args.store
        _fill(open_store(store), args.runs)
    else:
        folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fsmk-ui-bench-"))
        store = str(folder / "runs.db")
        if not Path(store).exists():
            _fill(SqliteEventStore(store), args.runs)

    results = []
    with open_viewer(ViewerConfig(store=store, port=0)) as viewer:
        with httpx.Client(base_url=f"http://127.0.0.1:{viewer.port}", timeout=60) as client:
            for name, path in _pages(args.runs):
                row = _time(client, path, args.requests)
                results.append(Row(name, path, row.median_ms, row.p95_ms, row.max_ms, row.rows))

    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{'page':30} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'rows':>5}  path")
        for r in results:
            print(
                f"{r.page:30} {r.median_ms:10.1f} {r.p95_ms:8.1f} {r.max_ms:8.1f} {r.rows:5}  "
                f"{r.path}"
            )
    first = results[0].median_ms
    if first >= LIMIT_MS:
        print(f"FAIL: the runs page took {first:.1f} ms (median), over {LIMIT_MS:.0f} ms",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"ok: the runs page answers in {first:.1f} ms (median) with {args.runs:,} runs",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
