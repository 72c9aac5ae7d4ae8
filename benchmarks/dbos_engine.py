"""The scheduler's two engines side by side on one PostgreSQL: the own dispatch queue
(`fsm-kernel worker CONFIG`) and DBOS (`fsm-kernel worker CONFIG --engine dbos`).

    pip install -e '.[dbos,postgres]'
    python benchmarks/dbos_engine.py                 # needs initdb/pg_ctl, or --dsn URL
    python benchmarks/dbos_engine.py --jobs 100 --json

Each job is a real dispatch: a kernel run of the stock `single_shot` workflow (one model call to
benchmarks/_fake_llm.py, answering after --latency seconds), recorded in the config's store
(the same database holds DBOS's system tables, in their schema `dbos`). Worker processes are the
real CLI. A fresh database per measurement, on a throwaway cluster with PostgreSQL's durable
defaults (fsync, synchronous_commit and full_page_writes on).

1. drain: 1 and 4 worker processes (each --concurrency 10, the fleet cap not binding) are
   started and ready; then --jobs dispatches are enqueued at once (own queue: one per agent of
   a config with that many agents; DBOS: that many runs of the agent's workflow on its queue)
   and the clock runs until every run's log has ended. jobs/s.
2. recovery: one worker, one dispatch whose model call takes 3 s; the worker is SIGKILLed in
   that call and a new one started at once (DBOS: with the same DBOS__VMID; own queue: any
   worker, lease_seconds 10). Seconds from the kill to the run's end, the 3 s model call made
   again included (on both engines the step in flight at a kill is redone).
3. the fleet cap under contention: 4 workers x --concurrency 3 against max_concurrent 5, 40
   dispatches of 0.2 s: the most runs that overlapped (from the logs' run.started and
   run.terminated), never above 5.
4. exactly once, in every measurement: every dispatch has exactly one run that ended, which
   ended once (a killed attempt's run, left interrupted, does not count as a second one).

Prints a table, `--json` the raw figures. Exits 1 when a job was lost or ran twice, or the cap
was exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dispatch_queue import fresh_database, throwaway_cluster  # noqa: E402

from fsm_kernel.protocol import EventType  # noqa: E402
from fsm_kernel.store import open_store  # noqa: E402

ENGINES = ("local", "dbos")
KERNEL = "bench"
CAP = 5


# --- the pieces ----------------------------------------------------------------------------------


@contextmanager
def fake_llm(latency: float) -> Iterator[str]:
    """The fake model server, answering every request after `latency` seconds."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks/_fake_llm.py"), "--latency", str(latency),
         "--iterations", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    try:
        yield line[1]
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def write_config(folder: Path, store: str, agents: int, *, cap: int, lease: float) -> Path:
    """A scheduler config: `agents` agents (a0, a1, ...) running single_shot."""
    lines = [
        f"kernel_id: {KERNEL}", f"store: '{store}'", f"state_dir: {folder / 'state'}",
        f"max_concurrent: {cap}", f"lease_seconds: {lease}", "poll_seconds: 0.2",
        "timeout_seconds: 120", "agents:",
    ]  # fmt: skip
    lines += [
        f"  - {{agent_id: a{i}, workflow: single_shot, prompt: 'job {i}'}}" for i in range(agents)
    ]
    path = folder / f"bench-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Workers:
    """`fsm-kernel worker` processes of one engine."""

    def __init__(self, engine: str, config: Path, url: str, concurrency: int) -> None:
        self.engine, self.config, self.url, self.concurrency = engine, config, url, concurrency
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "fsm_kernel", "worker", str(self.config), "--engine",
               self.engine, "--base-url", self.url, "--model", "m",
               "--concurrency", str(self.concurrency)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "DBOS__VMID": name}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        assert proc.stderr is not None
        line = proc.stderr.readline()
        if "started" not in line and "Ctrl-C" not in line:
            raise RuntimeError(f"{self.engine} worker did not start: {line}{proc.stderr.read()}")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def enqueue(engine: str, config: Path, store: str, jobs: int) -> None:
    """`jobs` dispatches, at once."""
    if engine == "local":
        from fsm_kernel.scheduler import open_queue

        queue = open_queue(store)
        try:
            for i in range(jobs):
                queue.enqueue(KERNEL, f"a{i}", f"job {i}", 0, None)
        finally:
            queue.close()
        return
    from dbos import DBOSClient

    from fsm_kernel.integrations.dbos_scheduler import _version

    client = DBOSClient(system_database_url=store)
    try:
        for i in range(jobs):
            run_id = str(uuid.uuid4())
            client.enqueue(
                {"queue_name": f"fsm-kernel.{KERNEL}", "workflow_name": f"fsm-kernel.{KERNEL}.a0",
                 "workflow_id": run_id, "app_version": _version(),
                 "application_name": "fsm-kernel"},
                run_id, f"job {i}",
            )  # fmt: skip
    finally:
        client.destroy()


def logs(store: str) -> dict[str, list[Any]]:
    """Every run's events."""
    opened = open_store(store)
    try:
        return {s.run_id: opened.read(s.run_id) for s in opened.list_runs(limit=100_000)}
    finally:
        opened.close()


def ended(store: str) -> int:
    opened = open_store(store)
    try:
        return sum(s.status == "ended" for s in opened.list_runs(limit=100_000))
    finally:
        opened.close()


def wait_ended(store: str, count: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while ended(store) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {ended(store)} of {count} runs ended in {timeout:g} s")
        time.sleep(0.1)
    return time.monotonic()


def exactly_once(store: str, jobs: int) -> dict[str, int]:
    """Per dispatch: lost (no run of it ended), twice (two runs of it ended, or one run ended
    twice); and how many runs were started in all (the own queue starts a dispatch whose worker
    was killed afresh, in a second run; DBOS goes on with the same run)."""
    runs = logs(store)
    ended_by_goal: dict[str, int] = {}
    twice = 0
    for events in runs.values():
        ends = sum(e.type == EventType.RUN_TERMINATED for e in events)
        twice += ends > 1
        if ends:
            goal = str(events[0].data.get("goal"))
            ended_by_goal[goal] = ended_by_goal.get(goal, 0) + 1
    twice += sum(n > 1 for n in ended_by_goal.values())
    return {"lost": jobs - len(ended_by_goal), "twice": twice, "runs_started": len(runs)}


def most_at_once(store: str) -> int:
    edges: list[tuple[datetime, int]] = []
    for events in logs(store).values():
        for e in events:
            if e.type == EventType.RUN_STARTED:
                edges.append((e.timestamp, 1))
            elif e.type == EventType.RUN_TERMINATED:
                edges.append((e.timestamp, -1))
    running = most = 0
    for _, step in sorted(edges):
        running += step
        most = max(most, running)
    return most


# --- the measurements ----------------------------------------------------------------------------


def drain(
    engine: str, server: str, folder: Path, url: str, jobs: int, workers: int
) -> dict[str, Any]:
    with fresh_database(server) as store:
        agents = jobs if engine == "local" else 1
        config = write_config(folder, store, agents, cap=1000, lease=60)
        fleet = Workers(engine, config, url, concurrency=10)
        try:
            for n in range(workers):
                fleet.start(f"w{n}")
            start = time.monotonic()
            enqueue(engine, config, store, jobs)
            seconds = wait_ended(store, jobs) - start
        finally:
            fleet.stop()
        return {"engine": engine, "workers": workers, "jobs": jobs, "seconds": round(seconds, 2),
                "jobs_per_s": round(jobs / seconds, 1), **exactly_once(store, jobs)}  # fmt: skip


def recovery(engine: str, server: str, folder: Path, url: str) -> dict[str, Any]:
    with fresh_database(server) as store:
        config = write_config(folder, store, 1, cap=10, lease=10)
        fleet = Workers(engine, config, url, concurrency=1)
        try:
            first = fleet.start("w0")
            enqueue(engine, config, store, 1)
            while not logs(store) or not any(
                e.type == EventType.MODEL_REQUESTED for e in next(iter(logs(store).values()))
            ):
                time.sleep(0.05)
            first.send_signal(signal.SIGKILL)
            first.communicate()
            killed = time.monotonic()
            fleet.start("w0")  # the same DBOS__VMID: DBOS recovers its runs
            seconds = wait_ended(store, 1, timeout=120) - killed
        finally:
            fleet.stop()
        return {"engine": engine, "recovery_s": round(seconds, 2), **exactly_once(store, 1)}


def contention(engine: str, server: str, folder: Path, url: str) -> dict[str, Any]:
    jobs = 40
    with fresh_database(server) as store:
        agents = jobs if engine == "local" else 1
        config = write_config(folder, store, agents, cap=CAP, lease=60)
        fleet = Workers(engine, config, url, concurrency=3)
        try:
            for n in range(4):
                fleet.start(f"w{n}")
            enqueue(engine, config, store, jobs)
            wait_ended(store, jobs)
        finally:
            fleet.stop()
        return {"engine": engine, "cap": CAP, "most_at_once": most_at_once(store),
                **exactly_once(store, jobs)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"drain": [], "recovery": [], "contention": []}
    with _server(args.dsn) as server, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with fake_llm(args.latency) as url:
            for workers in (1, 4):
                for engine in ENGINES:
                    report["drain"].append(drain(engine, server, folder, url, args.jobs, workers))
        with fake_llm(3.0) as url:
            for engine in ENGINES:
                report["recovery"].append(recovery(engine, server, folder, url))
        with fake_llm(0.2) as url:
            for engine in ENGINES:
                report["contention"].append(contention(engine, server, folder, url))
    return report


@contextmanager
def _server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    with throwaway_cluster("durable") as server:
        yield server


def print_report(report: dict[str, Any]) -> None:
    print(f"{'drain':10} {'engine':6} {'workers':>7} {'jobs':>5} {'jobs/s':>8}  lost twice")
    for r in report["drain"]:
        print(f"{'':10} {r['engine']:6} {r['workers']:>7} {r['jobs']:>5} {r['jobs_per_s']:>8}  "
              f"{r['lost']:>4} {r['twice']:>5}")  # fmt: skip
    for r in report["recovery"]:
        print(f"recovery   {r['engine']:6} {r['recovery_s']:>6} s after SIGKILL  lost {r['lost']} "
              f"twice {r['twice']}  runs started {r['runs_started']}")  # fmt: skip
    for r in report["contention"]:
        print(f"contention {r['engine']:6} at most {r['most_at_once']} at once (cap {r['cap']})  "
              f"lost {r['lost']} twice {r['twice']}")  # fmt: skip


def failed(report: dict[str, Any]) -> bool:
    rows = [r for part in report.values() for r in part]
    over = any(r["most_at_once"] > r["cap"] for r in report["contention"])
    return over or any(r["lost"] or r["twice"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="dispatches per drain (200)")
    parser.add_argument("--latency", type=float, default=0.02, help="model latency, s (0.02)")
    parser.add_argument("--dsn", help="a PostgreSQL server to use instead of a throwaway one")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
