"""The scheduler wakes runs whose timer is due (issue 27, part 2): each cycle resumes the
top-level runs in its store that wait in a waiting state whose `after:` is past due (the timer
fires, recorded), leaves a run whose timer is not due yet waiting, and a failing check never
fails the cycle."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fsm_kernel.cli.timer_wake import due_runs, timer_waker
from fsm_kernel.kernel import Kernel
from fsm_kernel.scheduler import Scheduler, open_queue
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow
from tests.unit.test_scheduler_fakes import ScriptedRunner, make_config

NOW = datetime.now(UTC)

WAIT = """\
name: wait_ci
reasons:
  timed_out: {description: CI never answered}
initial: wait_for_ci
states:
  wait_for_ci: {}
  deploy: {action: agent.think}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


class At:
    """A clock stopped at one instant (a run started in the past)."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return 0.0


def _suspend(store: Path, workflow: Path, started: datetime) -> str:
    with SqliteEventStore(store) as events:
        kernel = Kernel(
            compile_workflow(load_workflow(workflow)),
            model=ScriptedChatModel([]),
            tools=builtin_registry("."),
            store=events,
            clock=At(started),
        )
        result = asyncio.run(kernel.run("ship it"))
    assert result.status == "waiting"
    return result.run_id


def _types(store: Path, run_id: str) -> list[str]:
    with SqliteEventStore(store) as events:
        return [e.type.value for e in events.read(run_id)]


def test_a_cycle_resumes_the_runs_whose_timer_is_due_and_only_those(tmp_path: Path) -> None:
    config = make_config(tmp_path, ["a"])
    store, workflow = Path(config.store), tmp_path / "wait.yaml"
    workflow.write_text(WAIT)
    due = _suspend(store, workflow, NOW - timedelta(hours=2))
    later = _suspend(store, workflow, NOW - timedelta(minutes=5))

    assert [run_id for run_id, _ in due_runs(str(store), NOW)] == [due]
    queue = open_queue(config.store)
    try:
        scheduler = Scheduler(config, queue, ScriptedRunner(), wake=timer_waker(config))
        result = asyncio.run(scheduler.run_cycle())
    finally:
        queue.close()

    assert result.failed == 0
    fired = _types(store, due)
    assert fired.count("timer.fired") == 1
    assert fired[-1] == "run.terminated"
    with SqliteEventStore(store) as events:
        assert events.read(due)[-1].data["reason"] == "timed_out"
    assert "timer.fired" not in _types(store, later)
    assert _types(store, later)[-1] == "run.suspended"
    assert due_runs(str(store), NOW) == []  # nothing left to wake


def test_a_failing_timer_check_does_not_fail_the_cycle(tmp_path: Path) -> None:
    config = make_config(tmp_path, ["a"])
    runner = ScriptedRunner()

    async def broken() -> int:
        raise RuntimeError("the store is down")

    queue = open_queue(config.store)
    try:
        result = asyncio.run(Scheduler(config, queue, runner, wake=broken).run_cycle())
    finally:
        queue.close()

    assert result.failed == 0
    assert runner.agent_ids() == ["a"]  # the cycle's dispatches ran all the same


def test_the_timer_check_is_run_once_per_cycle(tmp_path: Path) -> None:
    config = make_config(tmp_path, ["a"])
    calls: list[Any] = []

    async def count() -> int:
        calls.append(1)
        return 0

    queue = open_queue(config.store)
    try:
        scheduler = Scheduler(config, queue, ScriptedRunner(), wake=count)
        asyncio.run(scheduler.run_cycle())
        asyncio.run(scheduler.run_cycle())
    finally:
        queue.close()

    assert calls == [1, 1]
