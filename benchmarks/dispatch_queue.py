"""The dispatch queue beside the two maintained PostgreSQL job queues, on one throwaway cluster.

    pip install procrastinate pgqueuer asyncpg   # only for this script, not fsm-kernel's deps
    python benchmarks/dispatch_queue.py          # needs initdb/pg_ctl (apt-get install postgresql)
    python benchmarks/dispatch_queue.py --dispatches 2000 --repetitions 1   # a quick look

It starts its own PostgreSQL clusters in temp dirs (Unix socket only, run as the `postgres` user
when started as root; or point --dsn at a server you own), one per durability mode: `durable`
(PostgreSQL's defaults: fsync=on, synchronous_commit=on, full_page_writes=on, as a production
queue runs) and `fast` (all three off: what the CPU-bound protocol costs). Then it measures:

1. drain: N no-op jobs are enqueued, `ANALYZE` runs (for every system: without it a system's
   claim query plans without statistics until autovacuum first visits its new tables, which
   cost procrastinate 60 s once per cluster), then 1, 4 and 16 worker processes per system
   (fsm-kernel's `Worker`, procrastinate, pgqueuer on asyncpg) start together and take them
   all; the clock runs from the start signal to the moment no job is left unfinished.
   Repetitions interleave the systems. Every job must run exactly once: the workers count what
   they executed.
2. claim latency: fsm-kernel's claim (one pending dispatch, claimed, completed) with 0 and with
   100,000 finished rows of the same kernel in the table, on PostgreSQL and on SQLite.
3. wake-up: an idle fsm-kernel worker polling every 60 s; the time from an enqueue to the start of
   that dispatch's run (LISTEN/NOTIFY).

It reports jobs/s and ratios (absolute figures depend on the machine and its load), and says
which goals are met, per durability mode: fsm-kernel >= 1.0x pgqueuer with 1 and with 4
workers; more fsm-kernel workers never slower than fewer; claim latency at 100,000 finished rows
<= 1.2x that at 0; wake-up within 100 ms. `--json` adds the raw figures. Exits 1 when a goal
is missed.

Settings: every process takes up to --concurrency (10) jobs at a time: procrastinate's
`concurrency`, fsm-kernel's worker `concurrency` (it claims that many in one statement), and
pgqueuer's `batch_size` (its default, 10). The fsm-kernel fleet cap (max_concurrent) is set
high enough never to bind, but is still checked by every claim.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

SYSTEMS = ("fsm", "procrastinate", "pgqueuer")
KERNEL = "bench"
GOAL_CLAIM_RATIO = 1.2
GOAL_VS_PGQUEUER = 1.0
GOAL_MORE_WORKERS = 1.0
MODES = ("durable", "fast")
_FAST = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
GOAL_WAKE_MS = 100.0
DRAIN_TIMEOUT = 300.0
_BIN_DIRS = [Path("/usr/lib/postgresql") / v / "bin" for v in ("17", "16", "15", "14")]


# --- the throwaway cluster ----------------------------------------------------------------------


def _find_bin(name: str) -> str:
    for folder in _BIN_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"error: {name} not found (apt-get install postgresql), or pass --dsn")
    return found


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def throwaway_cluster(mode: str = "durable") -> Iterator[str]:
    """initdb + pg_ctl into a temp dir (no TCP port), stopped and removed afterwards; `fast`
    turns fsync, synchronous_commit and full_page_writes off, `durable` keeps the defaults."""
    root = Path(tempfile.mkdtemp(prefix="fsmk-bench-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", 56000 + os.getpid() % 900
    pg_ctl = _find_bin("pg_ctl")
    run = lambda cmd: subprocess.run(_as_postgres(cmd), check=True, capture_output=True)  # noqa: E731
    try:
        run([_find_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"])
        opts = (
            f"-p {port} -k {root} -c listen_addresses='' {_FAST if mode == 'fast' else ''}"
            "-c max_connections=300"
        )
        run([pg_ctl, "-D", str(data), "-l", str(root / "log"), "-w", "-o", opts, "start"])
        yield f"postgresql:///postgres?host={quote(str(root), safe='')}&port={port}&user=postgres"
    finally:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]),
            capture_output=True,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def fresh_database(server: str) -> Iterator[str]:
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    _, _, query = server.partition("?")
    try:
        yield f"postgresql:///{name}?{query}"
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- the systems: setup, enqueue, count, and the worker process --------------------------------


def _fsm_config(dsn: str, jobs: int, *, concurrency: int, poll: float = 1.0) -> Any:
    from fsm_kernel.scheduler import AgentSpec, SchedulerConfig

    agents = tuple(AgentSpec(agent_id=f"a{i}", prompt="p") for i in range(max(jobs, 1)))
    return SchedulerConfig(
        kernel_id=KERNEL,
        store=dsn,
        max_concurrent=1000,  # never binding: this measures throughput
        lease_seconds=60,
        poll_seconds=poll,
        agents=agents,
    )


def setup_fsm(dsn: str, jobs: int) -> None:
    import psycopg

    from fsm_kernel.scheduler import open_queue

    open_queue(dsn).close()
    with psycopg.connect(dsn, autocommit=True) as conn:  # one statement; the API is per row
        conn.execute(
            "INSERT INTO kernel_dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, "
            "priority, status, dedupe_key, attempts, created_at) "
            "SELECT gen_random_uuid()::text, %s, 'a' || g, 'p', 0, 'pending', 'k' || g, 0, "
            "now() + g * interval '1 microsecond' FROM generate_series(0, %s - 1) AS g",
            (KERNEL, jobs),
        )


def setup_procrastinate(dsn: str, jobs: int) -> None:
    async def go() -> None:
        app = _procrastinate_app(dsn)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            task = app.tasks["noop"]
            for start in range(0, jobs, 1000):
                await task.batch_defer_async(*[{} for _ in range(min(1000, jobs - start))])

    asyncio.run(go())


def setup_pgqueuer(dsn: str, jobs: int) -> None:
    async def go() -> None:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(_asyncpg_dsn(dsn))
        try:
            queries = Queries(AsyncpgDriver(conn))
            await queries.install()
            for start in range(0, jobs, 1000):
                n = min(1000, jobs - start)
                await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
        finally:
            await conn.close()

    asyncio.run(go())


UNFINISHED = {
    "fsm": "SELECT count(*) FROM kernel_dispatch_tasks WHERE status IN ('pending', 'running')",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
    "pgqueuer": "SELECT count(*) FROM pgqueuer",
}
SETUP: dict[str, Callable[[str, int], None]] = {
    "fsm": setup_fsm,
    "procrastinate": setup_procrastinate,
    "pgqueuer": setup_pgqueuer,
}


def _procrastinate_app(dsn: str) -> Any:
    from procrastinate import App, PsycopgConnector

    # It warns that this App lives in a __main__ module, which is true and harmless here.
    logging.getLogger("procrastinate").setLevel(logging.ERROR)

    app = App(connector=PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")
    async def noop() -> None:
        WorkerProcessState.executed += 1

    return app


def _asyncpg_dsn(dsn: str) -> str:
    return dsn.replace("postgresql:///", "postgresql://postgres@/", 1).replace("&user=postgres", "")


class WorkerProcessState:
    executed = 0


def worker_main(system: str, dsn: str, jobs: int, concurrency: int) -> None:
    """One worker process: ready, wait for `go` on stdin, work until SIGTERM, print the count."""
    runners = {"fsm": _fsm_worker, "procrastinate": _procrastinate_worker, "pgqueuer": _pgq_worker}
    asyncio.run(runners[system](dsn, jobs, concurrency))
    print(f"executed {WorkerProcessState.executed}", flush=True)


async def _ready_then_go(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)


async def _fsm_worker(dsn: str, jobs: int, concurrency: int) -> None:
    from fsm_kernel.scheduler import RunOutcome, Worker, open_queue

    config = _fsm_config(dsn, jobs, concurrency=concurrency)
    queue = open_queue(dsn)

    async def noop(agent: Any, prompt: str) -> RunOutcome:
        WorkerProcessState.executed += 1
        return RunOutcome(ok=True)

    worker = Worker(config, queue, noop, concurrency=concurrency)
    await worker.start()  # connected and listening before "ready", as pgqueuer's worker is
    stop = asyncio.Event()
    await _ready_then_go(stop)
    try:
        await worker.run(stop)
    finally:
        queue.close()


async def _procrastinate_worker(dsn: str, jobs: int, concurrency: int) -> None:
    app = _procrastinate_app(dsn)
    stop = asyncio.Event()
    async with app.open_async():
        await _ready_then_go(stop)
        work = asyncio.create_task(
            app.run_worker_async(concurrency=concurrency, install_signal_handlers=False, wait=True)
        )
        await stop.wait()
        if work.done():
            work.result()  # a failing worker must show its error, not count 0
        work.cancel()  # procrastinate's documented way to stop a worker run as a task
        await asyncio.gather(work, return_exceptions=True)


async def _pgq_worker(dsn: str, jobs: int, concurrency: int) -> None:
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(_asyncpg_dsn(dsn))
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        WorkerProcessState.executed += 1

    stop = asyncio.Event()
    await _ready_then_go(stop)
    work = asyncio.create_task(qm.run(batch_size=concurrency))
    await stop.wait()
    qm.shutdown.set()
    await work  # a failing worker must show its error, not count 0
    await conn.close()


# --- drain -------------------------------------------------------------------------------------


@dataclass
class Drain:
    mode: str
    system: str
    workers: int
    repetition: int
    jobs: int
    seconds: float
    executed: int

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds


def _spawn(system: str, dsn: str, jobs: int, concurrency: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--worker", system, dsn, str(jobs), str(concurrency)]
    stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    proc.stderr = stderr  # read back on failure
    return proc


def _stderr(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    proc.stderr.seek(0)
    return proc.stderr.read()[-2000:]


def drain(
    server: str, mode: str, system: str, workers: int, jobs: int, concurrency: int, rep: int
) -> Drain:
    import psycopg

    with fresh_database(server) as dsn:
        SETUP[system](dsn, jobs)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ANALYZE")  # every system's tables, before any worker plans a claim
        procs = [_spawn(system, dsn, jobs, concurrency) for _ in range(workers)]
        try:
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if line.strip() != "ready":
                    proc.wait(30)
                    raise RuntimeError(f"{system} worker failed: {_stderr(proc)}")
            with psycopg.connect(dsn, autocommit=True) as conn:
                start = time.perf_counter()
                for proc in procs:
                    proc.stdin.write("go\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                while conn.execute(UNFINISHED[system]).fetchone()[0]:  # type: ignore[index]
                    _check_alive(procs, system, start)
                    time.sleep(0.01)
                seconds = time.perf_counter() - start
            executed = sum(_stop(proc) for proc in procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return Drain(mode, system, workers, rep, jobs, seconds, executed)


def _check_alive(procs: list[subprocess.Popen[str]], system: str, start: float) -> None:
    for proc in procs:
        if proc.poll() is not None:
            raise RuntimeError(f"a {system} worker exited {proc.returncode}: {_stderr(proc)}")
    if time.perf_counter() - start > DRAIN_TIMEOUT:
        raise RuntimeError(f"{system} did not drain within {DRAIN_TIMEOUT} s")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    for line in out.splitlines():
        if line.startswith("executed "):
            return int(line.split()[1])
    raise RuntimeError(f"worker exited {proc.returncode} without its count: {_stderr(proc)}")


# --- claim latency -----------------------------------------------------------------------------


def _claim_medians_ms(queues: list[Any], samples: int) -> list[float]:
    """Median time of one claim (one pending dispatch waiting, completed after) per queue. The
    queues take turns, so a disk or scheduler hiccup hits them all alike."""
    times: list[list[float]] = [[] for _ in queues]
    for i in range(samples):
        for queue, series in zip(queues, times, strict=True):
            dispatch = queue.enqueue(KERNEL, f"live{i}", "p", 0, f"live-{uuid.uuid4()}")
            start = time.perf_counter()
            claimed = queue.claim(KERNEL, "w", 60, 1000)
            series.append(time.perf_counter() - start)
            if claimed is None or claimed.dispatch_id != dispatch.dispatch_id:
                raise RuntimeError(f"claimed {claimed} instead of {dispatch}")
            queue.complete(claimed.dispatch_id, "w", status="done", attempt=claimed.attempts)
    return [statistics.median(series) * 1000 for series in times]


def _history_pg(dsn: str, rows: int) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO kernel_dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, "
            "priority, status, dedupe_key, worker_id, attempts, run_id, termination_reason, "
            "created_at, started_at, finished_at) "
            "SELECT gen_random_uuid()::text, %s, 'agent' || (g %% 20), 'a prompt of some length',"
            " g %% 3, (ARRAY['done', 'failed', 'cancelled'])[1 + g %% 3], 'h' || g, 'w', 1, "
            "'run' || g, 'final_answer', t, t, t + interval '1 minute' "
            "FROM generate_series(1, %s) AS g, "
            "LATERAL (SELECT now() - (%s - g) * interval '10 minutes' AS t) AS times",
            (KERNEL, rows, rows),
        )
        conn.execute("VACUUM ANALYZE kernel_dispatch_tasks")


def _history_sqlite(path: Path, rows: int) -> None:
    now = datetime.now(UTC)
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO kernel_dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, "
            "priority, status, dedupe_key, worker_id, attempts, run_id, termination_reason, "
            "created_at, started_at, finished_at) VALUES (?, ?, ?, 'a prompt', ?, ?, ?, 'w', 1, "
            "?, 'final_answer', ?, ?, ?)",
            (
                (
                    str(uuid.uuid4()),
                    KERNEL,
                    f"agent{g % 20}",
                    g % 3,
                    ("done", "failed", "cancelled")[g % 3],
                    f"h{g}",
                    f"run{g}",
                    *[(now - timedelta(minutes=10 * (rows - g))).isoformat()] * 3,
                )
                for g in range(rows)
            ),
        )
        conn.execute("ANALYZE")
    conn.close()


def claim_latency(server: str, history: int, samples: int) -> dict[str, dict[str, float]]:
    """Two stores side by side per backend, one empty and one holding `history` finished rows."""
    from fsm_kernel.scheduler import open_queue

    out: dict[str, dict[str, float]] = {}
    with fresh_database(server) as empty_dsn, fresh_database(server) as full_dsn:
        queues = [open_queue(empty_dsn), open_queue(full_dsn)]
        try:
            _history_pg(full_dsn, history)
            _claim_medians_ms(queues, 20)  # warm up
            empty, full = _claim_medians_ms(queues, samples)
        finally:
            for queue in queues:
                queue.close()
        out["postgres"] = {"empty_ms": empty, "history_ms": full, "ratio": full / empty}
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / "empty.db", Path(folder) / "full.db"]
        queues = [open_queue(str(path)) for path in paths]
        try:
            _history_sqlite(paths[1], history)
            _claim_medians_ms(queues, 20)
            empty, full = _claim_medians_ms(queues, samples)
        finally:
            for queue in queues:
                queue.close()
        out["sqlite"] = {"empty_ms": empty, "history_ms": full, "ratio": full / empty}
    return out


# --- wake-up -----------------------------------------------------------------------------------


def wake_main(dsn: str) -> None:
    """An idle worker polling every 60 s; prints `started <monotonic_ns>` for every run."""

    async def go() -> None:
        from fsm_kernel.scheduler import RunOutcome, Worker, open_queue

        config = _fsm_config(dsn, 200, concurrency=1, poll=60.0)
        queue = open_queue(dsn)

        async def noop(agent: Any, prompt: str) -> RunOutcome:
            print(f"started {time.monotonic_ns()}", flush=True)
            return RunOutcome(ok=True)

        worker = Worker(config, queue, noop, concurrency=1)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        task = asyncio.create_task(worker.run(stop))
        await worker.listening.wait()
        await asyncio.sleep(0.3)  # the listener's LISTEN is in place
        print("ready", flush=True)
        await task
        queue.close()

    asyncio.run(go())


def wake_latency(server: str, samples: int) -> dict[str, float]:
    from fsm_kernel.scheduler import open_queue

    latencies = []
    with fresh_database(server) as dsn:
        queue = open_queue(dsn)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--wake-worker", dsn],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"wake-up worker failed: {proc.stderr.read()[-2000:]}")
            for i in range(samples):
                time.sleep(0.2)  # idle: the worker waits for a notification (or 60 s)
                sent = time.monotonic_ns()
                queue.enqueue(KERNEL, f"a{i}", "p", 0, f"wake{i}")
                started = int(proc.stdout.readline().split()[1])
                latencies.append((started - sent) / 1e6)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
            queue.close()
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered),
        "p95_ms": ordered[max(0, round(0.95 * len(ordered)) - 1)],
        "max_ms": ordered[-1],
    }


# --- report ------------------------------------------------------------------------------------


@dataclass
class Report:
    drains: list[Drain] = field(default_factory=list)
    claim: dict[str, dict[str, float]] = field(default_factory=dict)
    wake: dict[str, float] = field(default_factory=dict)

    def rate(self, mode: str, system: str, workers: int) -> float:
        key = (mode, system, workers)
        rates = [d.jobs_per_s for d in self.drains if (d.mode, d.system, d.workers) == key]
        return statistics.median(rates) if rates else float("nan")

    def rates(self, mode: str, system: str, workers: int) -> list[float]:
        key = (mode, system, workers)
        return [d.jobs_per_s for d in self.drains if (d.mode, d.system, d.workers) == key]

    def goals(self, modes: list[str], counts: list[int]) -> list[tuple[str, float, float, bool]]:
        """(goal, measured, bound, met) for every goal the run can judge."""
        out = []
        for backend, figures in self.claim.items():
            ratio = figures["ratio"]
            goal = f"claim at 100k finished / at 0 ({backend})"
            out.append((goal, ratio, GOAL_CLAIM_RATIO, ratio <= GOAL_CLAIM_RATIO))
        peers = {d.system for d in self.drains}
        for mode in modes:
            for n in (1, 4):
                if n in counts and "pgqueuer" in peers:
                    ratio = self.rate(mode, "fsm", n) / self.rate(mode, "pgqueuer", n)
                    goal = f"fsm / pgqueuer, {n} worker(s), {mode}"
                    out.append((goal, ratio, GOAL_VS_PGQUEUER, ratio >= GOAL_VS_PGQUEUER))
            for fewer, more in itertools.pairwise(counts):
                ratio = self.rate(mode, "fsm", more) / self.rate(mode, "fsm", fewer)
                goal = f"fsm {more} workers / {fewer}, {mode}"
                out.append((goal, ratio, GOAL_MORE_WORKERS, ratio >= GOAL_MORE_WORKERS))
        if self.wake:
            p50 = self.wake["p50_ms"]
            out.append(("wake-up p50 (ms)", p50, GOAL_WAKE_MS, p50 <= GOAL_WAKE_MS))
        return out


def print_report(report: Report, args: argparse.Namespace) -> None:
    systems: list[str] = args.systems
    counts: list[int] = args.workers
    others = [s for s in systems if s != "fsm"]
    for mode in args.modes:
        print(f"\n[{mode}] drain throughput, jobs/s (median of repetitions; the runs in brackets)")
        print("workers  " + "  ".join(f"{s:>30}" for s in systems))
        for n in counts:
            cells = []
            for s in systems:
                runs = "/".join(f"{r:.0f}" for r in report.rates(mode, s, n))
                cells.append(f"{report.rate(mode, s, n):8.0f} [{runs}]".rjust(30))
            print(f"{n:7}  " + "  ".join(cells))
        print(f"[{mode}] ratios (>1 means fsm-kernel drains faster)")
        print("workers  " + "  ".join(f"fsm/{s:13}" for s in others))
        for n in counts:
            cells = [report.rate(mode, "fsm", n) / report.rate(mode, s, n) for s in others]
            print(f"{n:7}  " + "  ".join(f"{c:17.2f}" for c in cells))
    lost = [d for d in report.drains if d.executed != d.jobs]
    total = sum(d.jobs for d in report.drains)
    once = "yes" if not lost else "NO"
    print(f"\nexecuted exactly once: {once} ({len(report.drains)} drains, {total:,} jobs)")
    for d in lost:
        print(f"  {d.mode} {d.system} {d.workers}w rep {d.repetition}: {d.executed} of {d.jobs}")
    if report.claim:
        print("\nClaim latency with 100,000 finished rows / with none (fsm-kernel)")
        for backend, figures in report.claim.items():
            print(f"  {backend:9} {figures['ratio']:.2f}x")
    if report.wake:
        w = report.wake
        print(
            f"\nWake-up (enqueue to run start, idle worker polling every 60 s): p50 "
            f"{w['p50_ms']:.1f} ms, p95 {w['p95_ms']:.1f} ms, max {w['max_ms']:.1f} ms"
        )
    print("\nGoals")
    for goal, measured, bound, met in report.goals(args.modes, counts):
        sign = "<=" if "claim" in goal or "wake" in goal else ">="
        print(f"  {'met   ' if met else 'MISSED'} {goal}: {measured:.2f} (goal {sign} {bound:g})")


def run(args: argparse.Namespace) -> Report:
    report = Report()
    for index, mode in enumerate(args.modes):
        with contextmanager_or(args.dsn, mode) as server:
            if index == 0 and args.claim_samples:
                print(f"claim latency: 0 and {args.history:,} finished rows ...", flush=True)
                report.claim = claim_latency(server, args.history, args.claim_samples)
            if index == 0 and args.wake_samples:
                print("wake-up latency ...", flush=True)
                report.wake = wake_latency(server, args.wake_samples)
            _drains(report, server, mode, args)
    return report


def _drains(report: Report, server: str, mode: str, args: argparse.Namespace) -> None:
    systems: list[str] = args.systems
    for rep in range(args.repetitions):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for workers in args.workers:
            for system in order:
                d = drain(server, mode, system, workers, args.dispatches, args.concurrency, rep)
                report.drains.append(d)
                print(
                    f"{mode} rep {rep + 1} {system:13} {workers:2} workers: {d.seconds:6.2f} s "
                    f"= {d.jobs_per_s:7.0f} jobs/s ({d.executed}/{d.jobs} executed)",
                    flush=True,
                )


@contextmanager
def contextmanager_or(dsn: str | None, mode: str) -> Iterator[str]:
    if dsn:
        yield dsn  # the server's own settings: the mode is only a label then
    else:
        with throwaway_cluster(mode) as server:
            yield server


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dispatches", type=int, default=10_000, help="jobs per drain (10000)")
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16],
        help="worker process counts (1,4,16)",
    )
    p.add_argument("--repetitions", type=int, default=3, help="interleaved repetitions (3)")
    p.add_argument("--concurrency", type=int, default=10, help="jobs at once per process (10)")
    p.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=list(MODES),
        help="durable (fsync on, the default), fast (fsync off), or both: durable,fast",
    )
    p.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=list(SYSTEMS),
        help="fsm,procrastinate,pgqueuer",
    )
    p.add_argument("--history", type=int, default=100_000, help="finished rows (100000)")
    p.add_argument("--claim-samples", type=int, default=300, help="claims timed per case (300)")
    p.add_argument("--wake-samples", type=int, default=30, help="wake-ups timed (30)")
    p.add_argument("--dsn", help="use this server (a postgresql:// URL) instead of a new cluster")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    args = p.parse_args(argv)
    if "fsm" not in args.systems:
        p.error("--systems must include fsm")
    if set(args.modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    if argv[:1] == ["--wake-worker"]:
        wake_main(argv[1])
        return 0
    args = parse_args(argv)
    started = time.perf_counter()
    report = run(args)
    print_report(report, args)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if args.json:
        raw = {
            "drains": [{**asdict(d), "jobs_per_s": d.jobs_per_s} for d in report.drains],
            "claim": report.claim,
            "wake": report.wake,
        }
        print(json.dumps(raw, indent=2))
    return 0 if all(met for *_, met in report.goals(args.modes, args.workers)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
