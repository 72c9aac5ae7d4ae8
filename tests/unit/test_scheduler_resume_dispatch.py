"""The executor and a woken dispatch (issue 27, part 2): a claimed dispatch that already has a
run is handed to the runner as `runner(agent, prompt, resume=run_id)`, a new one as
`runner(agent, prompt)` (so two-argument runners keep working); the outcome completes the
dispatch as usual (done, failed, or waiting again), and a resume that raises still records the
dispatch's run (real SQLite queue, fake clock, scripted runners)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchDetail,
    DispatchStatus,
    ExecutionStatus,
    RunOutcome,
)
from fsm_kernel.scheduler.executor import DispatchExecutor
from fsm_kernel.scheduler.queue import SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, make_config

K = "k1"


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[SqliteDispatchQueue]:
    q = SqliteDispatchQueue(tmp_path / "runs.db", clock=FakeClock())
    q.ensure_schema()
    yield q
    q.close()


class ResumingRunner:
    """Records how it was called; a resume reports what `resumed` says."""

    def __init__(self, resumed: str = "ok") -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        self.resumed = resumed

    async def __call__(
        self, agent: AgentSpec, prompt: str, /, *, resume: str | None = None
    ) -> RunOutcome:
        self.calls.append((agent.agent_id, prompt, resume))
        if resume is None:
            return RunOutcome(ok=False, run_id="r1", waiting=True)
        if self.resumed == "raise":
            raise RuntimeError("the run is held by another process")
        if self.resumed == "waiting":
            return RunOutcome(ok=False, run_id=resume, waiting=True)
        return RunOutcome(ok=True, run_id=resume, termination_reason="final_answer")


def run_once(
    tmp_path: Path, queue: SqliteDispatchQueue, runner: Any, worker: str
) -> DispatchDetail:
    claimed = queue.claim(K, worker, 60, 3)
    assert claimed is not None
    executor = DispatchExecutor(make_config(tmp_path, ["a"]), queue, runner, worker_id=worker)
    return asyncio.run(executor.execute(claimed))


def suspend_and_wake(tmp_path: Path, queue: SqliteDispatchQueue, runner: ResumingRunner) -> str:
    enqueued = queue.enqueue(K, "a", "do it", 0, "t0")
    assert enqueued is not None
    first = run_once(tmp_path, queue, runner, "w1")
    assert first.status is ExecutionStatus.WAITING
    assert queue.wake_waiting("r1") is not None
    return enqueued.dispatch_id


def test_a_woken_dispatch_resumes_its_run_and_a_new_one_starts_a_run(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    runner = ResumingRunner()
    dispatch_id = suspend_and_wake(tmp_path, queue, runner)

    detail = run_once(tmp_path, queue, runner, "w2")

    assert runner.calls == [("a", "do it", None), ("a", "do it", "r1")]
    assert detail.status is ExecutionStatus.DONE
    row = queue.get(dispatch_id)
    assert row is not None
    assert (row.status, row.run_id, row.termination_reason, row.worker_id, row.attempts) == (
        DispatchStatus.DONE,
        "r1",
        "final_answer",
        "w2",
        1,
    )


def test_a_run_that_waits_again_leaves_its_dispatch_waiting_again(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    runner = ResumingRunner(resumed="waiting")
    dispatch_id = suspend_and_wake(tmp_path, queue, runner)

    run_once(tmp_path, queue, runner, "w2")

    row = queue.get(dispatch_id)
    assert row is not None
    assert (row.status, row.run_id) == (DispatchStatus.WAITING, "r1")
    assert queue.wake_waiting("r1") is not None  # and its next timer wakes it again


def test_a_resume_that_raises_fails_the_dispatch_and_keeps_its_run(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    runner = ResumingRunner(resumed="raise")
    dispatch_id = suspend_and_wake(tmp_path, queue, runner)

    run_once(tmp_path, queue, runner, "w2")

    row = queue.get(dispatch_id)
    assert row is not None
    assert (row.status, row.run_id, row.error) == (
        DispatchStatus.FAILED,
        "r1",
        "RuntimeError: the run is held by another process",
    )


def test_a_two_argument_runner_still_runs_new_dispatches(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    seen: list[tuple[str, str]] = []

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        seen.append((agent.agent_id, prompt))
        return RunOutcome(ok=True, run_id="r9", termination_reason="done")

    enqueued = queue.enqueue(K, "a", "do it", 0, "t0")
    assert enqueued is not None

    run_once(tmp_path, queue, runner, "w1")

    assert seen == [("a", "do it")]
    row = queue.get(enqueued.dispatch_id)
    assert row is not None
    assert (row.status, row.run_id) == (DispatchStatus.DONE, "r9")
