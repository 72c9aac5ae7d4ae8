"""Two `fsm-kernel worker` processes on one PostgreSQL dispatch queue, end to end: real
subprocesses running the CLI, kernel runs over real HTTP against an in-process FakeOpenAIServer,
runs recorded in the same database. Counts model requests to show that every dispatch runs
exactly once, that both workers take part, and that the fleet never runs more than
max_concurrent dispatches at once; then stops the workers with SIGTERM and SIGINT.

The order of events is forced, not hoped for: worker Y (one dispatch at a time) claims the first
dispatch and its model request is held until worker X (two at a time) has claimed one too. From
then on X always wants a second slot while Y holds one, so the cap of 2 is binding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from fsm_kernel.cli import main
from fsm_kernel.scheduler import Dispatch, DispatchQueue, DispatchStatus, open_queue
from tests.fakes.openai_server import FakeOpenAIServer, Reply, text_reply

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "pgfleet"
AGENTS = [f"agent{i}" for i in range(6)]
CAP = 2
RUN_SECONDS = 0.3  # how long the model takes to answer; makes the runs overlap
HOLD_LIMIT = 15.0  # the held first request gives up after this, so a bug cannot hang the test
MODEL_X, MODEL_Y = "model-of-worker-x", "model-of-worker-y"


def pg_url(dsn: str) -> str:
    """The pg_dsn fixture's key=value DSN as the postgresql:// URL the `store:` setting needs."""
    from psycopg.conninfo import conninfo_to_dict

    info = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    dbname = info.pop("dbname", "postgres")
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in sorted(info.items()))
    return f"postgresql:///{quote(dbname, safe='')}?{query}"


def prompt_of(agent_id: str) -> str:
    return f"TASK-{agent_id}: answer in one line."


def user_prompt(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


@dataclass
class Model:
    """The fake server's reply for every request (called from its handler threads): answers
    after RUN_SECONDS and records when each request was being served, and by which worker.
    The very first request is held until `release` is set."""

    release: threading.Event = field(default_factory=threading.Event)
    served: list[tuple[float, float, str, str]] = field(default_factory=list)
    """(start, end, worker model, prompt) per request, monotonic seconds."""
    arrived: list[str] = field(default_factory=list)
    """The worker model of each request, in arrival order."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> Reply:
        start = time.monotonic()
        with self.lock:
            first = not self.arrived
            self.arrived.append(body["model"])
        if first:
            self.release.wait(HOLD_LIMIT)
        time.sleep(RUN_SECONDS)  # this handler thread only; other requests proceed meanwhile
        with self.lock:
            self.served.append((start, time.monotonic(), body["model"], user_prompt(body)))
        return text_reply(f"done with {user_prompt(body)[:12]}")

    def arrived_from(self, worker_model: str) -> bool:
        with self.lock:
            return worker_model in self.arrived


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start first)."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    active = peak = 0
    for _, step in edges:
        active += step
        peak = max(peak, active)
    return peak


class WorkerProcess:
    """`python -m fsm_kernel worker CONFIG` in a subprocess; stderr collected by a thread."""

    def __init__(self, config: Path, base_url: str, model: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "fsm_kernel", "worker", str(config)]
        cmd += ["--base-url", base_url, "--model", model, *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stderr: list[str] = []
        self.stdout = ""
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            if " ready: connected, listening for new dispatches " in line:  # PostgreSQL
                self.started.set()

    def wait_started(self) -> None:
        assert self.started.wait(20), f"worker did not start: {''.join(self.stderr)}"

    def stop(self, sig: signal.Signals) -> int:
        """Send `sig`, wait for the exit; the exit code."""
        self.proc.send_signal(sig)
        self.stdout, _ = self.proc.communicate(timeout=20)
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=20)
        self._reader.join(5)


def wait_until(what: str, check: Callable[[], bool], detail: Callable[[], object]) -> None:
    """Poll every 20 ms; fail after 20 s, showing `detail()`."""
    for _ in range(1000):
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {detail()}")


@pytest.fixture
def store(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


@pytest.fixture
def config(store: str, tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    document = {
        "kernel_id": KERNEL,
        "state_dir": str(tmp_path / "state"),
        "store": store,
        "max_concurrent": CAP,
        "timeout_seconds": 60,
        "lease_seconds": 60,
        "agents": [{"agent_id": a, "prompt": prompt_of(a)} for a in AGENTS],
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@dataclass
class FleetRun:
    rows: list[Dispatch]
    model: Model
    server: FakeOpenAIServer
    x: WorkerProcess
    y: WorkerProcess
    exit_codes: tuple[int, int]


@pytest.fixture
def fleet_run(config: Path, queue: DispatchQueue) -> Iterator[FleetRun]:
    """Both workers execute the six dispatches, then get SIGTERM (X) and SIGINT (Y)."""
    model = Model()
    with FakeOpenAIServer(*[model] * len(AGENTS)) as server:
        workers: list[WorkerProcess] = []
        try:
            yield _drive(config, queue, model, server, workers)
        finally:
            model.release.set()
            for worker in workers:
                worker.kill()


def _enqueue(queue: DispatchQueue, agents: list[str]) -> None:
    for agent_id in agents:
        assert queue.enqueue(KERNEL, agent_id, prompt_of(agent_id), 0, f"job-{agent_id}")


def _drive(
    config: Path,
    queue: DispatchQueue,
    model: Model,
    server: FakeOpenAIServer,
    workers: list[WorkerProcess],
) -> FleetRun:
    rows = lambda: queue.list(KERNEL)  # noqa: E731
    y = WorkerProcess(config, server.base_url, MODEL_Y, "--concurrency", "1")
    workers.append(y)
    y.wait_started()
    _enqueue(queue, AGENTS[:1])
    wait_until("worker Y's first request", lambda: model.arrived_from(MODEL_Y), rows)
    x = WorkerProcess(config, server.base_url, MODEL_X)  # concurrency: max_concurrent
    workers.append(x)
    x.wait_started()
    _enqueue(queue, AGENTS[1:])
    wait_until("worker X's first request", lambda: model.arrived_from(MODEL_X), rows)
    model.release.set()
    wait_until(
        "every dispatch finished",
        lambda: all(d.status in (DispatchStatus.DONE, DispatchStatus.FAILED) for d in rows()),
        rows,
    )
    codes = (x.stop(signal.SIGTERM), y.stop(signal.SIGINT))
    return FleetRun(rows(), model, server, x, y, codes)


def test_two_worker_processes_share_the_queue_each_dispatch_once_never_over_the_cap(
    fleet_run: FleetRun, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    check_every_dispatch_done_exactly_once(fleet_run)
    check_both_workers_executed_and_each_row_names_its_executor(fleet_run)
    check_the_cap_was_reached_and_never_exceeded(fleet_run)
    check_the_workers_stopped_on_sigterm_and_sigint_with_exit_0(fleet_run)
    check_the_runs_are_in_the_configs_postgres_store(fleet_run, store, capsys)


def check_every_dispatch_done_exactly_once(fleet_run: FleetRun) -> None:
    rows = fleet_run.rows
    assert sorted(d.agent_id for d in rows) == AGENTS
    assert {d.status for d in rows} == {DispatchStatus.DONE}, [d.error for d in rows]
    assert {d.attempts for d in rows} == {1}
    assert {d.termination_reason for d in rows} == {"final_answer"}
    prompts = Counter(prompt for _, _, _, prompt in fleet_run.model.served)
    assert prompts == Counter(prompt_of(a) for a in AGENTS)  # one request each, never twice
    fleet_run.server.assert_complete()


def check_both_workers_executed_and_each_row_names_its_executor(fleet_run: FleetRun) -> None:
    pids = {fleet_run.x.proc.pid: MODEL_X, fleet_run.y.proc.pid: MODEL_Y}
    executor_of = {d.prompt: pids[int(str(d.worker_id).split(":")[-2])] for d in fleet_run.rows}
    requested_by = {prompt: model for _, _, model, prompt in fleet_run.model.served}

    assert executor_of == requested_by  # the process holding the lease is the one that ran it
    assert set(executor_of.values()) == {MODEL_X, MODEL_Y}
    assert executor_of[prompt_of(AGENTS[0])] == MODEL_Y


def check_the_cap_was_reached_and_never_exceeded(fleet_run: FleetRun) -> None:
    intervals = [(start, end) for start, end, _, _ in fleet_run.model.served]

    assert peak_overlap(intervals) == CAP  # X and Y at once, never a third


def check_the_workers_stopped_on_sigterm_and_sigint_with_exit_0(fleet_run: FleetRun) -> None:
    workers = (fleet_run.x, fleet_run.y)
    assert fleet_run.exit_codes == (0, 0), ["".join(w.stderr) for w in workers]
    done_lines = [
        line for w in workers for line in w.stdout.splitlines() if line.startswith("done")
    ]
    assert len(done_lines) == len(AGENTS)
    assert all("final_answer" in line for line in done_lines)
    assert not any("Traceback" in line for w in workers for line in w.stderr)


def check_the_runs_are_in_the_configs_postgres_store(
    fleet_run: FleetRun, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    for row in fleet_run.rows:
        assert row.run_id is not None
        assert main(["runs", "show", row.run_id, "--store", store]) == 0
        assert row.run_id in capsys.readouterr().out
