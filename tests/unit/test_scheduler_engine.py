"""The engine's cycle: plan, enqueue, run in parallel, record outcomes (real SQLite queue, fake
clock, scripted runners)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchStatus,
    ExecutionStatus,
    RunOutcome,
    Scheduler,
    SchedulerConfig,
    StateFile,
    open_queue,
)
from fsm_kernel.scheduler.queue import DispatchQueue, SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, ScriptedRunner, make_config, wait_until


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteDispatchQueue]:
    q = open_queue(str(tmp_path / "runs.db"), clock=clock)
    assert isinstance(q, SqliteDispatchQueue)
    yield q
    q.close()


def scheduler(
    config: SchedulerConfig, queue: DispatchQueue, runner: Any, clock: FakeClock
) -> Scheduler:
    return Scheduler(config, queue, runner, clock=clock, worker_id="sched-1")


def statuses(queue: DispatchQueue) -> dict[str, str]:
    return {d.agent_id: d.status.value for d in queue.list("k1")}


def test_empty_plan(tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock) -> None:
    runner = ScriptedRunner()
    result = asyncio.run(scheduler(make_config(tmp_path), queue, runner, clock).run_cycle())
    assert (result.dispatched, result.succeeded, result.failed, result.skipped) == (0, 0, 0, 0)
    assert result.details == ()
    assert result.tick == clock.now()
    assert runner.calls == []


def test_all_succeed(tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock) -> None:
    config = make_config(tmp_path, ["a", "b", "c"])
    StateFile(config.state_file).write("# the state")
    runner = ScriptedRunner()
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    assert (result.dispatched, result.succeeded, result.failed, result.skipped) == (3, 3, 0, 0)
    assert sorted(runner.calls) == [
        ("a", "a: # the state"),
        ("b", "b: # the state"),
        ("c", "c: # the state"),
    ]
    assert statuses(queue) == {"a": "done", "b": "done", "c": "done"}
    for row in queue.list("k1"):
        assert (row.run_id, row.termination_reason, row.worker_id) == (
            f"run-{row.agent_id}",
            "done",
            "sched-1",
        )
        # a cycle for "now" (--once) is never deduplicated against an earlier one
        assert row.dedupe_key.startswith(f"k1:{row.agent_id}:manual:")
    assert {d.status for d in result.details} == {ExecutionStatus.DONE}
    assert set(result.enqueued_ids) == {d.dispatch_id for d in result.details}
    json.dumps(result.to_dict())


def test_partial_failure(tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock) -> None:
    config = make_config(tmp_path, ["ok", "fails", "raises", "ok2"])
    runner = ScriptedRunner({"fails": "fail", "raises": "raise"})
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    assert (result.dispatched, result.succeeded, result.failed) == (4, 2, 2)
    assert statuses(queue) == {"ok": "done", "fails": "failed", "raises": "failed", "ok2": "done"}
    rows = {d.agent_id: d for d in queue.list("k1")}
    assert rows["raises"].error == "RuntimeError: boom in raises"  # one line
    assert rows["fails"].termination_reason == "no_progress"
    by_agent = {d.agent_id: d for d in result.details}
    assert by_agent["raises"].status is ExecutionStatus.FAILED
    assert by_agent["raises"].error == "RuntimeError: boom in raises"


def test_all_fail(tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock) -> None:
    config = make_config(tmp_path, ["a", "b"])
    runner = ScriptedRunner({"a": "raise", "b": "fail"})
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert (result.dispatched, result.succeeded, result.failed) == (2, 0, 2)
    assert statuses(queue) == {"a": "failed", "b": "failed"}


def test_seed_state_is_written_once_and_injected(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"], seed_state="# seeded {braces}\n")
    runner = ScriptedRunner()
    sched = scheduler(config, queue, runner, clock)
    asyncio.run(sched.run_cycle())
    assert runner.calls == [("a", "a: # seeded {braces}\n")]
    assert StateFile(config.state_file).read() == "# seeded {braces}\n"

    StateFile(config.state_file).write("# the agent changed it")
    clock.advance(600)
    asyncio.run(sched.run_cycle())
    assert runner.calls[-1] == ("a", "a: # the agent changed it")
    assert StateFile(config.state_file).read() == "# the agent changed it"


def test_running_agent_not_redispatched(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["busy", "free"])
    queue.enqueue("k1", "busy", "old prompt", 0, "earlier")
    busy = queue.claim("k1", "another-worker", 1800, 3)
    assert busy is not None
    runner = ScriptedRunner()
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    assert runner.agent_ids() == ["free"]
    assert (result.dispatched, result.succeeded, result.skipped) == (1, 1, 1)
    assert [(s.agent_id, s.reason, s.dispatch_id) for s in result.skipped_agents] == [
        ("busy", "running", busy.dispatch_id)
    ]
    assert queue.get(busy.dispatch_id).status is DispatchStatus.RUNNING  # type: ignore[union-attr]

    queue.complete(busy.dispatch_id, "another-worker", status="done")
    clock.advance(600)
    again = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert again.dispatched == 2


def test_a_dead_workers_leased_dispatch_is_reported_with_its_worker_and_lease(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["busy", "free"])
    queue.enqueue("k1", "busy", "old prompt", 0, "before-the-crash")
    leased = queue.claim("k1", "host:4242:dead", 1800, 3)  # its scheduler was then killed
    assert leased is not None
    clock.advance(60)
    runner = ScriptedRunner()

    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    assert runner.agent_ids() == ["free"]  # the lease is live: nobody may take it yet
    (skip,) = result.skipped_agents
    assert (skip.agent_id, skip.reason, skip.dispatch_id) == ("busy", "running", leased.dispatch_id)
    assert skip.worker_id == "host:4242:dead"
    assert skip.lease_expires_at == clock.now() + timedelta(seconds=1800 - 60)
    assert result.to_dict()["skipped_agents"] == [
        {
            "agent_id": "busy",
            "reason": "running",
            "dispatch_id": leased.dispatch_id,
            "worker_id": "host:4242:dead",
            "lease_expires_at": skip.lease_expires_at.isoformat(),
        }
    ]


def test_an_expired_lease_is_reported_and_its_dispatch_reclaimed_by_the_cycle(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["busy"])
    queue.enqueue("k1", "busy", "old prompt", 0, "before-the-crash")
    leased = queue.claim("k1", "host:4242:dead", 300, 3)
    assert leased is not None
    clock.advance(301)
    runner = ScriptedRunner()

    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    (skip,) = result.skipped_agents
    assert (skip.reason, skip.worker_id) == ("running", "host:4242:dead")
    assert skip.lease_expires_at == leased.lease_expires_at
    assert leased.lease_expires_at is not None
    assert leased.lease_expires_at < result.tick
    assert runner.calls == [("busy", "old prompt")]  # the dead worker's dispatch, run again
    (detail,) = result.details
    assert (detail.dispatch_id, detail.attempt, detail.status) == (
        leased.dispatch_id,
        2,
        ExecutionStatus.DONE,
    )


def test_a_pending_dispatch_is_reported_and_run_by_the_cycle(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["queued"])
    waiting = queue.enqueue("k1", "queued", "queued earlier", 0, "earlier")
    assert waiting is not None
    runner = ScriptedRunner()

    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())

    assert [s.to_dict() for s in result.skipped_agents] == [
        {"agent_id": "queued", "reason": "pending", "dispatch_id": waiting.dispatch_id}
    ]
    assert runner.calls == [("queued", "queued earlier")]
    assert result.dispatched == 0


def test_disabled_agent_is_skipped(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a", {"agent_id": "off", "prompt": "x", "enabled": False}])
    runner = ScriptedRunner()
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert runner.agent_ids() == ["a"]
    assert [(s.agent_id, s.reason) for s in result.skipped_agents] == [("off", "disabled")]


def test_same_tick_twice_is_deduplicated(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"])
    runner = ScriptedRunner()
    sched = scheduler(config, queue, runner, clock)
    asyncio.run(sched.run_cycle(clock.now()))
    second = asyncio.run(sched.run_cycle(clock.now()))
    assert (second.dispatched, second.skipped) == (0, 1)
    assert [(s.agent_id, s.reason) for s in second.skipped_agents] == [("a", "duplicate")]
    assert len(runner.calls) == 1


def test_max_concurrent_respected(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, [f"agent{i}" for i in range(5)], max_concurrent=2)
    runner = ScriptedRunner(hold_until_peak=2)
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert runner.peak == 2
    assert result.succeeded == 5


def test_runs_are_parallel_up_to_the_cap(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, [f"agent{i}" for i in range(3)], max_concurrent=3)
    runner = ScriptedRunner(hold_until_peak=3)
    asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert runner.peak == 3


def test_priority_decides_the_order(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    agents = [{"agent_id": n, "prompt": "p", "priority": p} for n, p in [("lo", 1), ("hi", 9)]]
    config = make_config(tmp_path, agents, max_concurrent=1)
    runner = ScriptedRunner()
    asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert runner.agent_ids() == ["hi", "lo"]


def test_timeout_marks_failed(tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock) -> None:
    config = make_config(tmp_path, ["slow", "quick"], timeout_seconds=0.05)
    runner = ScriptedRunner({"slow": "hang"})
    result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    assert (result.succeeded, result.failed) == (1, 1)
    slow = next(d for d in queue.list("k1") if d.agent_id == "slow")
    assert (slow.status, slow.termination_reason, slow.error) == (
        DispatchStatus.FAILED,
        "timeout",
        "timed out after 0.05 s",
    )
    assert runner.cancelled == ["slow"]


def test_a_runner_returning_garbage_fails_the_dispatch(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        return "not an outcome"  # type: ignore[return-value]  # a buggy runner on purpose

    result = asyncio.run(scheduler(make_config(tmp_path, ["a"]), queue, runner, clock).run_cycle())
    assert result.details[0].error == "runner returned str"
    assert result.failed == 1


def test_a_dispatch_for_an_unknown_agent_fails(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    queue.enqueue("k1", "ghost", "boo", 0, "ghost-key")
    runner = ScriptedRunner()
    result = asyncio.run(scheduler(make_config(tmp_path, ["a"]), queue, runner, clock).run_cycle())
    ghost = next(d for d in result.details if d.agent_id == "ghost")
    assert ghost.status is ExecutionStatus.FAILED
    assert ghost.error == "agent 'ghost' is not in the scheduler config"
    assert runner.agent_ids() == ["a"]


def test_stop_is_idempotent_and_stops_claiming(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"])
    runner = ScriptedRunner()
    sched = scheduler(config, queue, runner, clock)
    sched.stop()
    sched.stop()
    assert sched.stopping
    result = asyncio.run(sched.run_cycle())
    assert result.dispatched == 1
    assert result.details == ()
    assert statuses(queue) == {"a": "pending"}  # left for a worker
    asyncio.run(sched.run_forever(asyncio.Event()))  # returns at once: already stopped


def test_stop_mid_cycle_lets_in_flight_runs_finish(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a", "b"], max_concurrent=1)
    runner = ScriptedRunner({"a": "block", "b": "block"})
    sched = scheduler(config, queue, runner, clock)

    async def scenario() -> Any:
        cycle = asyncio.create_task(sched.run_cycle())
        await asyncio.wait_for(runner.started.wait(), 5)
        sched.stop()
        sched.stop()
        runner.release.set()
        return await cycle

    result = asyncio.run(scenario())
    assert len(runner.calls) == 1  # the second was never claimed
    assert (result.succeeded, result.dispatched) == (1, 2)
    assert sorted(statuses(queue).values()) == ["done", "pending"]


def test_abandoned_dispatch_keeps_its_lease_and_is_reclaimable(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"], lease_seconds=300)
    runner = ScriptedRunner({"a": "hang"})
    sched = scheduler(config, queue, runner, clock)

    async def scenario() -> Any:
        cycle = asyncio.create_task(sched.run_cycle())
        await asyncio.wait_for(runner.started.wait(), 5)
        sched.stop(abandon=True)
        return await cycle

    result = asyncio.run(scenario())
    assert [d.status for d in result.details] == [ExecutionStatus.ABANDONED]
    assert result.abandoned == 1
    assert runner.cancelled == ["a"]
    row = queue.list("k1")[0]
    assert (row.status, row.worker_id) == (DispatchStatus.RUNNING, "sched-1")
    assert queue.claim("k1", "other", 300, 3) is None  # lease still live
    clock.advance(301)
    reclaimed = queue.claim("k1", "other", 300, 3)
    assert reclaimed is not None
    assert (reclaimed.dispatch_id, reclaimed.attempts) == (row.dispatch_id, 2)


class CountingQueue(SqliteDispatchQueue):
    """The real SQLite queue, counting heartbeats."""

    heartbeats = 0

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        result = super().heartbeat(*args, **kwargs)
        self.heartbeats += 1
        return result


def test_heartbeats_renew_the_lease_while_running(tmp_path: Path, clock: FakeClock) -> None:
    queue = CountingQueue(tmp_path / "hb.db", clock=clock)
    queue.ensure_schema()
    config = make_config(tmp_path, ["a"], lease_seconds=0.06)  # a beat every 20 ms

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        clock.advance(3600)  # far past the lease as claimed
        seen = queue.heartbeats
        await wait_until(lambda: queue.heartbeats > seen, what="a heartbeat")
        row = queue.list("k1")[0]
        assert row.lease_expires_at is not None
        assert row.lease_expires_at > clock.now()  # renewed from the advanced clock
        return RunOutcome(ok=True)

    try:
        result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
    finally:
        queue.close()
    assert result.succeeded == 1


def test_a_lost_lease_cancels_the_run(tmp_path: Path, clock: FakeClock) -> None:
    queue = CountingQueue(tmp_path / "lost.db", clock=clock)
    queue.ensure_schema()
    config = make_config(tmp_path, ["a"], lease_seconds=0.06)
    cancelled: list[str] = []

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        clock.advance(3600)
        assert queue.claim("k1", "thief", 1800, 3) is not None  # reclaims the expired lease
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(agent.agent_id)
            raise
        return RunOutcome(ok=True)

    try:
        result = asyncio.run(scheduler(config, queue, runner, clock).run_cycle())
        row = queue.list("k1")[0]
    finally:
        queue.close()
    assert [d.status for d in result.details] == [ExecutionStatus.LOST]
    assert "no longer holds" in (result.details[0].error or "")
    assert cancelled == ["a"]
    assert (row.status, row.worker_id) == (DispatchStatus.RUNNING, "thief")


def test_store_failures_surface_as_store_errors(tmp_path: Path, clock: FakeClock) -> None:
    broken = tmp_path / "file"
    broken.write_text("x")
    queue = SqliteDispatchQueue(broken / "runs.db", clock=clock)
    config = make_config(tmp_path, ["a"])
    try:
        with pytest.raises(StoreError):
            asyncio.run(scheduler(config, queue, ScriptedRunner(), clock).run_cycle())
    finally:
        queue.close()


def test_stale_state_temp_files_are_cleaned_at_the_first_cycle(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, [])
    config.state_file.parent.mkdir(parents=True)
    stale = config.state_file.parent / ".STATE.md.dead.tmp"
    stale.write_text("half")
    asyncio.run(scheduler(config, queue, ScriptedRunner(), clock).run_cycle())
    assert not stale.exists()
