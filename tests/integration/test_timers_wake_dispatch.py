"""Durable timers through the dispatch queue (issue 27, part 2), on SQLite and PostgreSQL, with
the CLI's own runner (DispatchRunner) and kernel runs against a fake OpenAI server over loopback:

- a dispatched run suspends in a waiting state with `after: 30m` (its dispatch `waiting`); once
  the clock has passed its due time a scheduler's timer check makes the dispatch pending again
  without resuming the run itself, and a separate Worker (its own queue connection, another
  worker id) claims it and resumes the run: `timer.fired` once, the run ends `final_answer`
  after one more model call, the dispatch is done with the same run;
- a whole scheduler cycle wakes it and, being a worker too, resumes it itself when no other
  worker is there;
- while the agent has a newer active dispatch the wake is refused (logged, the dispatch stays
  waiting, the run is not resumed) and succeeds at the next check once that dispatch ended;
- a due run that no dispatch started is still resumed in the scheduler's process.

The first leg runs with the system clock set two hours back (the run's `timer.set` records a due
time 90 minutes in the past); everything after it reads the real clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fsm_kernel import Agent
from fsm_kernel.bootstrap import RunOptions
from fsm_kernel.cli.scheduling import DispatchRunner
from fsm_kernel.cli.timer_wake import timer_waker
from fsm_kernel.protocol import SystemClock
from fsm_kernel.scheduler import (
    AgentSpec,
    CycleResult,
    DispatchDetail,
    DispatchQueue,
    DispatchStatus,
    ExecutionStatus,
    Scheduler,
    SchedulerConfig,
    Worker,
    open_queue,
)
from fsm_kernel.store import open_store
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.unit.test_scheduler_fakes import pg_url

K = "k1"
AGENT = "reminder"
PAST = datetime.now(UTC) - timedelta(hours=2)

REMIND = """\
name: remind_later
initial: wait
states:
  wait: {description: "waits half an hour, then writes the reminder"}
  report: {action: agent.think, prompt: Write the reminder.}
  done: {final: true}
transitions:
  - {source: wait, target: report, after: 30m}
  - {source: report, target: done, reason: final_answer}
"""

GIVE_UP = """\
name: give_up_later
reasons:
  timed_out: {description: nobody answered}
initial: wait
states:
  wait: {description: waits for an event or gives up}
  gave_up: {final: true}
  done: {final: true}
transitions:
  - {source: wait, target: done, event: answered, reason: done}
  - {source: wait, target: gave_up, after: 30m, reason: timed_out}
"""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


def make_config(store: str, tmp_path: Path) -> SchedulerConfig:
    workflow = tmp_path / "remind.yaml"
    workflow.write_text(REMIND)
    return SchedulerConfig(
        kernel_id=K,
        store=store,
        state_dir=str(tmp_path / "state"),
        poll_seconds=0.05,
        lease_seconds=60,
        agents=(AgentSpec(agent_id=AGENT, workflow=str(workflow), prompt="Remind me to ship."),),
    )


def runner(config: SchedulerConfig, tmp_path: Path, server: FakeOpenAIServer) -> DispatchRunner:
    options = RunOptions(model="m", base_url=server.base_url, max_retries=0)
    return DispatchRunner(config, tmp_path / "scheduler.yaml", options)


def first_leg(
    config: SchedulerConfig,
    queue: DispatchQueue,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """A scheduler cycle two hours ago: the dispatched run suspends on its 30 minute timer."""
    with monkeypatch.context() as patched:
        patched.setattr(SystemClock, "now", lambda self: PAST)
        result = asyncio.run(_cycle(config, queue, runner(config, tmp_path, server)))
    assert (result.dispatched, result.waiting) == (1, 1)
    run_id = result.details[0].run_id
    assert run_id is not None
    row = queue.dispatch_of_run(run_id)
    assert row is not None
    assert row.status is DispatchStatus.WAITING
    assert server.requests == []  # it went straight to waiting
    return run_id


async def _cycle(config: SchedulerConfig, queue: DispatchQueue, run: DispatchRunner) -> CycleResult:
    try:
        return await Scheduler(config, queue, run).run_cycle()
    finally:
        await run.aclose()


def wake_once(config: SchedulerConfig, queue: DispatchQueue) -> int:
    """What each scheduler tick runs first: the timer check."""
    return asyncio.run(_call(timer_waker(config, queue=queue)))


async def _call(wake: Callable[[], Awaitable[int]]) -> int:
    return await wake()


def events(store: str, run_id: str) -> list[tuple[str, dict[str, object]]]:
    with open_store(store, read_only=True) as log:
        return [(e.type.value, e.data) for e in log.read(run_id)]


def types(store: str, run_id: str) -> list[str]:
    return [t for t, _ in events(store, run_id)]


def test_a_woken_dispatch_is_resumed_by_a_separate_worker(
    store: str,
    queue: DispatchQueue,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(store, tmp_path)
    run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
    (due,) = [d["due"] for t, d in events(store, run_id) if t == "timer.set"]
    assert datetime.fromisoformat(str(due)) < datetime.now(UTC)
    server.enqueue(text_reply("Reminder: ship v2 today."))

    woken = wake_once(config, queue)  # what each scheduler tick runs

    assert woken == 1
    row = queue.dispatch_of_run(run_id)
    assert row is not None
    assert (row.status, row.worker_id, row.attempts) == (DispatchStatus.PENDING, None, 0)
    assert "timer.fired" not in types(store, run_id)  # not resumed in the scheduler's process

    results = asyncio.run(_work(config, tmp_path, server))

    assert [(d.status, d.run_id, d.termination_reason) for d in results] == [
        (ExecutionStatus.DONE, run_id, "final_answer")
    ]
    done = queue.dispatch_of_run(run_id)
    assert done is not None
    assert (done.dispatch_id, done.status, done.worker_id, done.termination_reason) == (
        row.dispatch_id,
        DispatchStatus.DONE,
        "host-b",
        "final_answer",
    )
    log = events(store, run_id)
    kinds = [t for t, _ in log]
    assert kinds.count("timer.fired") == 1
    assert kinds.count("run.resumed") == 1
    assert kinds.count("run.started") == 1  # the same run, not a new one
    assert log[-1] == ("run.terminated", {**log[-1][1], "reason": "final_answer"})
    assert len(server.requests) == 1  # the report, after the timer fired
    assert wake_once(config, queue) == 0  # nothing left to wake


async def _work(
    config: SchedulerConfig, tmp_path: Path, server: FakeOpenAIServer
) -> list[DispatchDetail]:
    """A worker on "another host": its own queue connection and runner; stops after one."""
    results: list[DispatchDetail] = []
    own_queue = open_queue(config.store)
    run = runner(config, tmp_path, server)
    worker = Worker(config, own_queue, run, worker_id="host-b", on_result=results.append)
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(600):
            if results:
                break
            await asyncio.sleep(0.05)
        worker.stop()
        await asyncio.wait_for(task, 30)
    finally:
        await run.aclose()
        own_queue.close()
    return results


def test_a_scheduler_cycle_wakes_the_run_and_resumes_it_itself_without_workers(
    store: str,
    queue: DispatchQueue,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(store, tmp_path)
    run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
    server.enqueue(text_reply("Reminder: ship v2 today."))
    run = runner(config, tmp_path, server)

    async def cycle() -> CycleResult:
        try:
            wake = timer_waker(config, queue=queue)
            return await Scheduler(config, queue, run, wake=wake).run_cycle()
        finally:
            await run.aclose()

    result = asyncio.run(cycle())

    details = result.details
    assert [(d.status, d.run_id) for d in details] == [(ExecutionStatus.DONE, run_id)]
    assert [(s.agent_id, s.reason) for s in result.skipped_agents] == [
        (AGENT, "pending")  # its woken dispatch is its active one: no new dispatch this tick
    ]
    assert result.dispatched == 0
    assert types(store, run_id).count("timer.fired") == 1
    row = queue.dispatch_of_run(run_id)
    assert row is not None
    assert (row.status, row.termination_reason) == (DispatchStatus.DONE, "final_answer")


def test_a_wake_refused_by_the_agents_newer_dispatch_is_tried_again_next_tick(
    store: str,
    queue: DispatchQueue,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = make_config(store, tmp_path)
    run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
    newer = queue.enqueue(K, AGENT, "the next tick's task", 0, "next-tick")
    assert newer is not None
    wake = timer_waker(config, queue=queue)

    with caplog.at_level(logging.WARNING, logger="fsm_kernel.cli.timer_wake"):
        assert asyncio.run(_call(wake)) == 0

    (line,) = [r.getMessage() for r in caplog.records if "stays waiting" in r.getMessage()]
    assert f"run {run_id}: its timer is due;" in line
    assert f"dispatch {newer.dispatch_id} is pending; tried again next tick" in line
    row = queue.dispatch_of_run(run_id)
    assert row is not None
    assert row.status is DispatchStatus.WAITING
    assert "timer.fired" not in types(store, run_id)  # nor resumed in process instead

    claimed = queue.claim(K, "w", 60, 3)
    assert claimed is not None
    assert claimed.dispatch_id == newer.dispatch_id
    queue.complete(newer.dispatch_id, "w", status="done", attempt=1)
    assert asyncio.run(_call(wake)) == 1  # the next tick
    woken = queue.dispatch_of_run(run_id)
    assert woken is not None
    assert woken.status is DispatchStatus.PENDING


def test_a_due_run_no_dispatch_started_is_resumed_in_the_schedulers_process(
    store: str,
    queue: DispatchQueue,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(store, tmp_path)
    dispatched = first_leg(config, queue, tmp_path, server, monkeypatch)
    give_up = tmp_path / "give_up.yaml"
    give_up.write_text(GIVE_UP)

    async def by_hand() -> str:  # `fsm-kernel run` into the same store, two hours ago
        async with Agent(str(give_up), store=store) as agent:
            result = await agent.run("wait for an answer")
        assert result.status == "waiting"
        return result.run_id

    with monkeypatch.context() as patched:
        patched.setattr(SystemClock, "now", lambda self: PAST)
        alone = asyncio.run(by_hand())

    assert wake_once(config, queue) == 2

    log = events(store, alone)
    assert [t for t, _ in log].count("timer.fired") == 1
    assert log[-1][0] == "run.terminated"
    assert log[-1][1]["reason"] == "timed_out"
    assert queue.dispatch_of_run(alone) is None
    assert "timer.fired" not in types(store, dispatched)  # left to the queue
    row = queue.dispatch_of_run(dispatched)
    assert row is not None
    assert row.status is DispatchStatus.PENDING
