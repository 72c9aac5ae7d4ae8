"""Several worker PROCESSES sharing one dispatch queue: no dispatch runs twice, the fleet never
exceeds max_concurrent, and a SIGKILLed worker's dispatch is reclaimed after its lease and
completed by another worker.

This module is also the workers' entry point:
    python -m tests.integration.test_scheduler_multiworker STORE WORKER_ID RECORD AGENTS ...
Each worker's fake runner appends `monotonic_ns kind agent worker` lines to its RECORD file; the
monotonic clock is system-wide on Linux, so the lines of all workers can be merged in time order.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchQueue,
    DispatchStatus,
    RunOutcome,
    SchedulerConfig,
    Worker,
    open_queue,
)
from fsm_kernel.scheduler.executor import DispatchDetail, ExecutionStatus
from tests.unit.test_scheduler_fakes import pg_url

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "fleet"


def fleet_config(store: str, agents: int, *, max_concurrent: int, lease: float) -> SchedulerConfig:
    return SchedulerConfig(
        kernel_id=KERNEL,
        store=store,
        max_concurrent=max_concurrent,
        lease_seconds=lease,
        timeout_seconds=60,
        agents=tuple(AgentSpec(agent_id=f"agent{i}", prompt="p") for i in range(agents)),
    )


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("store", "worker_id", "record"):
        parser.add_argument(name)
    parser.add_argument("--agents", type=int, required=True)
    parser.add_argument("--max-concurrent", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--run-seconds", type=float, default=0.1)
    parser.add_argument("--hang", action="append", default=[])
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument(
        "--stall-after-calls",
        type=int,
        default=None,
        help="the claims after this many (and any outcome recorded alone) never reach the store",
    )
    args = parser.parse_args(argv)
    config = fleet_config(
        args.store, args.agents, max_concurrent=args.max_concurrent, lease=args.lease
    )
    record = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(kind: str, agent_id: str) -> None:
        os.write(record, f"{time.monotonic_ns()} {kind} {agent_id} {args.worker_id}\n".encode())

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        note("start", agent.agent_id)
        if agent.agent_id in args.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(args.run_seconds)
        note("end", agent.agent_id)
        return RunOutcome(ok=True, run_id=f"{args.worker_id}:{agent.agent_id}")

    def recorded(detail: DispatchDetail) -> None:
        if detail.status is ExecutionStatus.DONE:  # its outcome committed
            note("recorded", detail.agent_id)

    async def serve() -> None:
        queue = open_queue(args.store)
        if args.stall_after_calls is not None:
            stall(queue, args.stall_after_calls)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        worker = Worker(
            config,
            queue,
            runner,
            worker_id=args.worker_id,
            concurrency=args.concurrency,
            poll_seconds=0.05,
            on_result=recorded,
        )
        note("ready", "-")
        try:
            await worker.run(stop)
        finally:
            queue.close()

    asyncio.run(serve())


def stall(queue: Any, calls: int) -> None:
    """Let `calls` claims through, then block every later call that records or claims (in its
    thread or its task, before it reaches the store): a worker frozen with its outcomes
    buffered."""
    left = [calls]
    claim, alone = queue.complete_and_claim, queue.complete_batch
    claim_async = queue.complete_and_claim_async  # PostgreSQL's own: no thread to block

    def gate() -> None:
        if left[0] <= 0:
            time.sleep(3600)
        left[0] -= 1

    def complete_and_claim(*a: Any, **k: Any) -> Any:
        gate()
        return claim(*a, **k)

    def complete_batch(*a: Any, **k: Any) -> Any:
        left[0] = 0
        gate()
        return alone(*a, **k)

    async def complete_and_claim_async(*a: Any, **k: Any) -> Any:
        if left[0] <= 0:
            await asyncio.sleep(3600)
        left[0] -= 1
        return await claim_async(*a, **k)

    queue.complete_and_claim, queue.complete_batch = complete_and_claim, complete_batch
    queue.complete_and_claim_async = complete_and_claim_async


class Fleet:
    """Worker processes started by one test, each recording to its own file."""

    def __init__(self, store: str, tmp_path: Path, agents: int, max_concurrent: int, lease: float):
        self.store, self.tmp_path = store, tmp_path
        self.common = [
            f"--agents={agents}",
            f"--max-concurrent={max_concurrent}",
            f"--lease={lease}",
        ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str, *extra: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "tests.integration.test_scheduler_multiworker"]
        cmd += [self.store, worker_id, str(self.record(worker_id)), *self.common, *extra]
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
        self.procs[worker_id] = proc
        return proc

    def record(self, worker_id: str) -> Path:
        return self.tmp_path / f"{worker_id}.log"

    def events(self) -> list[tuple[int, str, str, str]]:
        lines: list[tuple[int, str, str, str]] = []
        for worker_id in self.procs:
            path = self.record(worker_id)
            if path.exists():
                for line in path.read_text().splitlines():
                    ns, kind, agent, worker = line.split()
                    lines.append((int(ns), kind, agent, worker))
        return sorted(lines)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for worker_id, proc in self.procs.items():
            _, stderr = proc.communicate(timeout=20)
            assert proc.returncode in (0, -signal.SIGKILL), (worker_id, stderr.decode()[-2000:])

    def kill_leftovers(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=20)


def runs(events: list[tuple[int, str, str, str]]) -> list[tuple[int, str, str, str]]:
    return [e for e in events if e[1] in ("start", "end")]


def peak_concurrency(events: list[tuple[int, str, str, str]]) -> int:
    active = peak = 0
    for _, kind, _, _ in runs(events):
        active += 1 if kind == "start" else -1
        peak = max(peak, active)
    return peak


def wait_for(queue: DispatchQueue, what: str, check: Callable[[], bool]) -> None:
    """Poll every 50 ms; fail after 20 s with the queue's rows in the message."""
    for _ in range(400):
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {queue.list(KERNEL)}")


@pytest.fixture
def store(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


@pytest.mark.postgres
def test_workers_share_the_queue_without_duplicates_or_exceeding_the_cap(
    store: str, queue: DispatchQueue, tmp_path: Path
) -> None:
    jobs, cap, workers = 8, 2, 3
    fleet = Fleet(store, tmp_path, agents=jobs, max_concurrent=cap, lease=30)
    try:
        # One run at a time per process: reaching the cap of 2 then takes two processes.
        for n in range(workers):
            fleet.start(f"w{n}", "--run-seconds=0.1", "--concurrency=1")
        wait_for(queue, "the workers to start", lambda: len(fleet.events()) == workers)
        for i in range(jobs):
            assert queue.enqueue(KERNEL, f"agent{i}", "p", 0, f"job{i}") is not None
        wait_for(
            queue,
            "every dispatch done",
            lambda: all(d.status is DispatchStatus.DONE for d in queue.list(KERNEL)),
        )
        fleet.stop_all()
    finally:
        fleet.kill_leftovers()

    events = fleet.events()
    starts = sorted(agent for _, kind, agent, _ in events if kind == "start")
    assert starts == sorted(f"agent{i}" for i in range(jobs))  # each ran exactly once
    assert peak_concurrency(events) == cap  # so two processes ran at once, never three
    rows = queue.list(KERNEL)
    assert {d.attempts for d in rows} == {1}
    assert all(d.run_id == f"{d.worker_id}:{d.agent_id}" for d in rows)


@pytest.mark.postgres
def test_a_killed_workers_dispatch_is_reclaimed_after_its_lease(
    pg_dsn: str, tmp_path: Path
) -> None:
    store = pg_url(pg_dsn)
    queue = open_queue(store)
    fleet = Fleet(store, tmp_path, agents=1, max_concurrent=1, lease=1.0)
    try:
        victim = queue.enqueue(KERNEL, "agent0", "p", 0, "victim")
        assert victim is not None
        doomed = fleet.start("doomed", "--hang=agent0")
        wait_for(queue, "the doomed worker to start the run", lambda: bool(runs(fleet.events())))
        lease_at_kill = queue.get(victim.dispatch_id).lease_expires_at  # type: ignore[union-attr]
        doomed.kill()  # SIGKILL: no cleanup, no completion, no more heartbeats
        doomed.wait(10)
        fleet.start("rescuer")
        wait_for(
            queue,
            "the rescuer to complete it",
            lambda: queue.get(victim.dispatch_id).status is DispatchStatus.DONE,  # type: ignore[union-attr]
        )
        fleet.stop_all()
        row = queue.get(victim.dispatch_id)
    finally:
        fleet.kill_leftovers()
        queue.close()

    assert row is not None
    assert (row.worker_id, row.attempts, row.run_id) == ("rescuer", 2, "rescuer:agent0")
    assert lease_at_kill is not None
    assert row.started_at is not None
    assert row.started_at >= lease_at_kill  # not reclaimed while the lease was live
    assert [(kind, worker) for _, kind, _, worker in runs(fleet.events())] == [
        ("start", "doomed"),
        ("start", "rescuer"),
        ("end", "rescuer"),
    ]


if __name__ == "__main__":
    worker_main(sys.argv[1:])
