"""The executor's one timer for all its runs (real SQLite queue, real clock): each run's timeout
fires at its own deadline, leases are renewed every heartbeat interval while a run lasts, a run
that ended is never renewed again, and the run is awaited in the caller's task (a cancellation of
that task is the caller's, not a timeout)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import AgentSpec, ExecutionStatus, RunOutcome
from fsm_kernel.scheduler.executor import DispatchExecutor
from fsm_kernel.scheduler.queue import Dispatch, SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import make_config

TIMEOUT = 0.3
INTERVAL = 0.06
SLACK = 0.002
"""asyncio may run a timer up to its clock's resolution early."""
LATE = 0.25
"""How late a busy machine may run a timer (the run's own task included)."""


class BeatLog(SqliteDispatchQueue):
    """The real SQLite queue, noting when (loop clock) each dispatch's lease was renewed, and
    each renewal's span (taking `beat_seconds`, in the executor's thread)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.beats: list[tuple[str, float]] = []
        self.spans: list[tuple[str, float, float]] = []
        self.beat_seconds = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None

    def heartbeat(self, dispatch_id: str, *args: Any, **kwargs: Any) -> Dispatch:
        assert self.loop is not None
        began = self.loop.time()
        self.beats.append((dispatch_id, began))
        time.sleep(self.beat_seconds)
        try:
            return super().heartbeat(dispatch_id, *args, **kwargs)
        finally:
            self.spans.append((dispatch_id, began, self.loop.time()))

    def beats_of(self, dispatch_id: str) -> list[float]:
        return [at for d, at in self.beats if d == dispatch_id]


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[BeatLog]:
    q = BeatLog(tmp_path / "runs.db")
    q.ensure_schema()
    yield q
    q.close()


def claim(queue: BeatLog, agent_id: str) -> Dispatch:
    queue.enqueue("k1", agent_id, "p", 0, None)
    claimed = queue.claim("k1", "w1", 60, 10)
    assert claimed is not None
    assert claimed.agent_id == agent_id
    return claimed


def executor_for(
    tmp_path: Path, queue: BeatLog, runner: Any, *, timeout: float = TIMEOUT
) -> DispatchExecutor:
    config = make_config(tmp_path, ["a", "b"], timeout_seconds=timeout, heartbeat_seconds=INTERVAL)
    return DispatchExecutor(config, queue, runner, worker_id="w1")


def test_each_run_times_out_at_its_own_deadline(tmp_path: Path, queue: BeatLog) -> None:
    ended: dict[str, float] = {}
    started: dict[str, float] = {}

    async def hang(agent: AgentSpec, prompt: str) -> RunOutcome:
        loop = asyncio.get_running_loop()
        started[agent.agent_id] = loop.time()
        try:
            await asyncio.Event().wait()
        finally:
            ended[agent.agent_id] = loop.time()
        raise AssertionError("unreachable")

    async def scenario() -> list[Any]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, hang)
        first = asyncio.create_task(executor.execute(claim(queue, "a")))
        await asyncio.sleep(TIMEOUT / 2)  # the second run's deadline is later than the first's
        second = asyncio.create_task(executor.execute(claim(queue, "b")))
        return list(await asyncio.gather(first, second))

    details = asyncio.run(scenario())
    assert [(d.agent_id, d.status, d.termination_reason) for d in details] == [
        ("a", ExecutionStatus.FAILED, "timeout"),
        ("b", ExecutionStatus.FAILED, "timeout"),
    ]
    for agent_id in ("a", "b"):
        lasted = ended[agent_id] - started[agent_id]
        assert lasted >= TIMEOUT - SLACK, (agent_id, lasted)  # never early
        assert lasted < TIMEOUT + LATE, (agent_id, lasted)  # on time, give or take the machine
    assert ended["b"] - ended["a"] >= TIMEOUT / 2 - 2 * SLACK  # its own deadline, not a's


def test_leases_are_renewed_every_interval_and_never_after_the_run(
    tmp_path: Path, queue: BeatLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timed when the executor issues each renewal (on the loop), not when its thread gets to
    run it: a renewal issued just before the run ended may reach the store just after, on a
    busy machine, and that is allowed (the store fences it)."""
    times: dict[str, tuple[float, float]] = {}
    lengths = {"a": 2.5 * INTERVAL, "b": 7.5 * INTERVAL}  # no end coincides with a beat
    issued: list[tuple[str, float]] = []
    renew = DispatchExecutor._heartbeat

    async def stamped(self: DispatchExecutor, due: list[Any]) -> None:
        now = asyncio.get_running_loop().time()
        issued.extend((run.dispatch.dispatch_id, now) for run in due)
        await renew(self, due)

    monkeypatch.setattr(DispatchExecutor, "_heartbeat", stamped)

    async def work(agent: AgentSpec, prompt: str) -> RunOutcome:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(lengths[agent.agent_id])
        times[agent.agent_id] = (start, loop.time())
        return RunOutcome(ok=True)

    async def scenario() -> list[Any]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, work, timeout=60)
        a, b = claim(queue, "a"), claim(queue, "b")
        done = await asyncio.gather(executor.execute(a), executor.execute(b))
        await asyncio.sleep(3 * INTERVAL)  # a beat due now would show
        return [done, a.dispatch_id, b.dispatch_id]

    details, a_id, b_id = asyncio.run(scenario())
    assert [d.status for d in details] == [ExecutionStatus.DONE, ExecutionStatus.DONE]
    for dispatch_id, agent_id, least in ((a_id, "a", 1), (b_id, "b", 4)):
        start, end = times[agent_id]
        beats = [at for d, at in issued if d == dispatch_id]
        assert len(queue.beats_of(dispatch_id)) == len(beats)  # each one issued reached the store
        assert len(beats) >= least, (agent_id, beats)  # renewed all along the run (a busy
        # machine may run a beat late, so fewer than one per interval fit)
        assert beats[0] - start >= INTERVAL - SLACK  # the first one interval after the start
        gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
        assert all(gap >= INTERVAL - SLACK for gap in gaps), gaps  # never faster
        assert all(gap < INTERVAL + 1.0 for gap in gaps), gaps  # never skipped
        assert all(at <= end for at in beats), (agent_id, beats, end)  # none after its end


def test_a_run_shorter_than_the_interval_is_never_renewed(tmp_path: Path, queue: BeatLog) -> None:
    async def quick(agent: AgentSpec, prompt: str) -> RunOutcome:
        return RunOutcome(ok=True)

    async def scenario() -> str:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, quick)
        dispatch = claim(queue, "a")
        detail = await executor.execute(dispatch)
        assert detail.status is ExecutionStatus.DONE
        await asyncio.sleep(3 * INTERVAL)
        return dispatch.dispatch_id

    asyncio.run(scenario())
    assert queue.beats == []


def test_cancelling_the_callers_task_is_not_a_timeout(tmp_path: Path, queue: BeatLog) -> None:
    """The run is awaited in the caller's task: cancelling that task cancels the run and
    propagates (the dispatch is left to its lease), even when the runner swallows it."""
    cancelled: list[str] = []

    async def stubborn(agent: AgentSpec, prompt: str) -> RunOutcome:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(agent.agent_id)
        return RunOutcome(ok=False, termination_reason="cancelled")

    async def scenario() -> str:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, stubborn)
        dispatch = claim(queue, "a")
        task = asyncio.create_task(executor.execute(dispatch))
        await asyncio.sleep(INTERVAL / 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return dispatch.dispatch_id

    dispatch_id = asyncio.run(scenario())
    assert cancelled == ["a"]
    row = queue.get(dispatch_id)
    assert row is not None
    assert row.status.value == "running"


def test_a_run_ending_while_its_renewal_is_in_flight_leaves_the_others_beating(
    tmp_path: Path, queue: BeatLog
) -> None:
    """Runs due together renew in one hop; one of them ending meanwhile must not stop the
    timer for the others."""
    queue.beat_seconds = INTERVAL / 2
    lengths = {"a": 1.2 * INTERVAL, "b": 6 * INTERVAL}

    async def work(agent: AgentSpec, prompt: str) -> RunOutcome:
        await asyncio.sleep(lengths[agent.agent_id])
        return RunOutcome(ok=True)

    async def scenario() -> tuple[str, str]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, work, timeout=60)
        a, b = claim(queue, "a"), claim(queue, "b")
        details = await asyncio.gather(executor.execute(a), executor.execute(b))
        assert [d.status for d in details] == [ExecutionStatus.DONE] * 2
        return a.dispatch_id, b.dispatch_id

    a_id, b_id = asyncio.run(scenario())
    assert len(queue.beats_of(a_id)) == 1  # due with b's, in flight when a ended
    assert len(queue.beats_of(b_id)) >= 3  # b went on beating after a's end


def test_a_runs_renewals_never_overlap_when_one_outlasts_the_interval(
    tmp_path: Path, queue: BeatLog
) -> None:
    """A renewal slower than the interval (a slow database) is not joined by a second one for
    the same run, even when another run's timer fires meanwhile."""
    queue.beat_seconds = 1.5 * INTERVAL

    async def work(agent: AgentSpec, prompt: str) -> RunOutcome:
        await asyncio.sleep(7 * INTERVAL)
        return RunOutcome(ok=True)

    async def scenario() -> None:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, work, timeout=60)
        first = asyncio.create_task(executor.execute(claim(queue, "a")))
        await asyncio.sleep(INTERVAL / 3)  # b's timer fires while a's renewals run
        second = asyncio.create_task(executor.execute(claim(queue, "b")))
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    for dispatch_id in {d for d, _, _ in queue.spans}:
        spans = sorted((began, ended) for d, began, ended in queue.spans if d == dispatch_id)
        assert len(spans) >= 2
        for (_, ended), (began, _) in itertools.pairwise(spans):
            assert began >= ended, spans  # the next began after the last one ended


def test_a_run_stopped_twice_ends_once_with_the_first_cause(tmp_path: Path, queue: BeatLog) -> None:
    """A run that timed out and is still winding down when the worker abandons everything is
    not cancelled a second time: it ends as the timeout, and the caller's task goes on."""

    async def slow_to_stop(agent: AgentSpec, prompt: str) -> RunOutcome:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(INTERVAL)  # recording its end, say
        return RunOutcome(ok=False, termination_reason="cancelled")

    async def scenario() -> Any:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, slow_to_stop, timeout=INTERVAL)
        task = asyncio.create_task(executor.execute(claim(queue, "a")))
        await asyncio.sleep(1.5 * INTERVAL)  # timed out, still stopping
        executor.abandon_all()
        return await task

    detail = asyncio.run(scenario())
    assert (detail.status, detail.termination_reason) == (ExecutionStatus.FAILED, "timeout")


def test_a_renewal_answered_after_its_run_ended_changes_nothing(
    tmp_path: Path, queue: BeatLog
) -> None:
    """A cancel request seen by a renewal that comes back after the run ended is left alone:
    the run's outcome stands and the caller's task is not cancelled."""
    queue.beat_seconds = INTERVAL / 2

    async def work(agent: AgentSpec, prompt: str) -> RunOutcome:
        await asyncio.sleep(1.2 * INTERVAL)  # ends while its first renewal is in flight
        return RunOutcome(ok=True)

    async def scenario() -> tuple[Any, str]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, work, timeout=60)
        dispatch = claim(queue, "a")
        assert queue.cancel("k1", dispatch.dispatch_id) is not None  # its renewal reports it
        detail = await executor.execute(dispatch)
        await asyncio.sleep(INTERVAL)  # the renewal comes back meanwhile
        return detail, dispatch.dispatch_id

    detail, dispatch_id = asyncio.run(scenario())
    assert len(queue.beats_of(dispatch_id)) == 1
    assert detail.status is ExecutionStatus.DONE


def test_a_failed_renewal_is_reported_and_the_run_goes_on_beating(
    tmp_path: Path, queue: BeatLog, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal that fails for another reason than a lost lease (the database away for a
    moment) is logged and tried again at the next beat; the run is not stopped."""
    failures = [StoreError("database is locked")]
    renew = queue.heartbeat

    def flaky(dispatch_id: str, *args: Any, **kwargs: Any) -> Dispatch:
        if failures:
            queue.beats.append((dispatch_id, queue.loop.time() if queue.loop else 0.0))
            raise failures.pop()
        return renew(dispatch_id, *args, **kwargs)

    queue.heartbeat = flaky  # type: ignore[method-assign]

    async def work(agent: AgentSpec, prompt: str) -> RunOutcome:
        await asyncio.sleep(4 * INTERVAL)
        return RunOutcome(ok=True)

    async def scenario() -> tuple[Any, str]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, work, timeout=60)
        dispatch = claim(queue, "a")
        return await executor.execute(dispatch), dispatch.dispatch_id

    with caplog.at_level("WARNING", logger="fsm_kernel.scheduler.executor"):
        detail, dispatch_id = asyncio.run(scenario())
    assert detail.status is ExecutionStatus.DONE
    assert len(queue.beats_of(dispatch_id)) >= 2  # the failed one, then again
    assert [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()] == [
        f"dispatch {dispatch_id}: heartbeat failed: database is locked"
    ]


def test_the_same_dispatch_run_twice_at_once_ends_both_runs_cleanly(
    tmp_path: Path, queue: BeatLog
) -> None:
    """A worker whose lease ran out (heartbeats late on a stalled machine) may claim its own
    dispatch again while the first run goes on: each run's end removes its own entry only, so
    neither fails on the other's bookkeeping (before: KeyError when the second one ended)."""
    release = asyncio.Event()

    async def held(agent: AgentSpec, prompt: str) -> RunOutcome:
        await release.wait()
        return RunOutcome(ok=True)

    async def scenario() -> list[Any]:
        queue.loop = asyncio.get_running_loop()
        executor = executor_for(tmp_path, queue, held, timeout=60)
        dispatch = claim(queue, "a")
        first = asyncio.create_task(executor.execute(dispatch))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(executor.execute(dispatch))
        await asyncio.sleep(0.01)
        release.set()
        return list(await asyncio.gather(first, second, return_exceptions=True))

    details = asyncio.run(scenario())
    assert not [d for d in details if isinstance(d, BaseException)], details
    assert [d.agent_id for d in details] == ["a", "a"]
