"""Worker behaviours that mutation testing found unpinned: what `start()` opens and waits for
(once), the warning when the listener is not up in time, the poll interval an idle worker
waits (its own or the config's), and a listener that keeps relaying wake-ups after a cancel
request for a run the worker does not hold. A real SQLite queue, scripted runners."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import (
    DispatchDetail,
    DispatchStatus,
    ExecutionStatus,
    QueueSignal,
    Worker,
)
from fsm_kernel.scheduler.queue import SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, ScriptedRunner, make_config, wait_until


class HeldSleep:
    """The worker's injected sleep: notes each delay and returns only when released (the test
    decides when an idle worker looks again)."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.released = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await self.released.wait()


class Listener:
    """A listener fed by the test: `get` returns what the test puts in `signals`. Notes
    whether it was entered and left."""

    def __init__(self) -> None:
        self.signals: asyncio.Queue[QueueSignal] = asyncio.Queue()
        self.entered = 0
        self.exited = 0

    async def __aenter__(self) -> Listener:
        self.entered += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited += 1

    async def get(self) -> QueueSignal:
        return await self.signals.get()


_OPENED: list[SqliteDispatchQueue] = []
"""The queues this module's tests opened, closed after each test (see _close_queues)."""


@pytest.fixture(autouse=True)
def _close_queues() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


class NotingQueue(SqliteDispatchQueue):
    """The SQLite queue, noting its connects and claims, with the test's listener if any
    (as PostgreSQL's NOTIFY would feed one); `refuse_connects` connects that fail."""

    def __init__(self, *args: Any, listener: Listener | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _OPENED.append(self)
        self.the_listener = listener
        self.listeners_made = 0
        self.connects = 0
        self.claims = 0
        self.refuse_connects = 0

    def listener(self, kernel_id: str) -> Any:
        if self.the_listener is None:
            return None
        self.listeners_made += 1
        return self.the_listener

    async def connect_async(self) -> None:
        self.connects += 1
        if self.refuse_connects:
            self.refuse_connects -= 1
            raise StoreError("connection refused")
        await super().connect_async()

    async def complete_and_claim_async(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        return await super().complete_and_claim_async(*args, **kwargs)


def open_noting_queue(tmp_path: Path, listener: Listener | None = None) -> NotingQueue:
    queue = NotingQueue(tmp_path / "runs.db", clock=FakeClock(), listener=listener)
    queue.ensure_schema()
    return queue


def make_worker(
    tmp_path: Path,
    queue: NotingQueue,
    results: list[DispatchDetail],
    *,
    sleep: Any = asyncio.sleep,
    poll_seconds: float | None = 0.01,
    config_poll: float = 1.0,
    runner: ScriptedRunner | None = None,
) -> Worker:
    return Worker(
        make_config(tmp_path, ["a", "b"], poll_seconds=config_poll),
        queue,
        runner or ScriptedRunner(),  # type: ignore[arg-type]  # a fake runner
        worker_id="w1",
        poll_seconds=poll_seconds,
        sleep=sleep,
        on_result=results.append,
    )


def test_start_connects_and_waits_until_the_listener_listens_once(tmp_path: Path) -> None:
    listener = Listener()
    queue = open_noting_queue(tmp_path, listener)
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, results)

    async def scenario() -> None:
        async def listening_soon() -> None:
            await asyncio.sleep(0.02)
            listener.signals.put_nowait(QueueSignal("reconnected", "k1"))

        announcing = asyncio.create_task(listening_soon())
        await worker.start()
        assert worker.listening.is_set()  # returned only once listening
        assert (queue.connects, queue.listeners_made, listener.entered) == (1, 1, 1)
        assert queue.claims == 0  # nothing claimed before run()
        await worker.start()  # again: nothing more
        assert (queue.connects, queue.listeners_made) == (1, 1)
        await announcing

        task = asyncio.create_task(worker.run())
        assert queue.enqueue("k1", "a", "task", 0, "a1") is not None
        listener.signals.put_nowait(QueueSignal("enqueued", "k1"))
        await wait_until(lambda: len(results) == 1, what="the dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)
        # run() went on with the listener start() opened, and closed it when it stopped
        assert (queue.connects, queue.listeners_made, listener.entered, listener.exited) == (
            1,
            1,
            1,
            1,
        )

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


def test_start_warns_when_not_listening_in_time_and_the_worker_polls_meanwhile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listener = Listener()  # never says it listens
    queue = open_noting_queue(tmp_path, listener)
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, results)

    async def scenario() -> None:
        with caplog.at_level(logging.WARNING, logger="fsm_kernel.scheduler.worker"):
            await worker.start(listen_timeout=0.05)
        assert not worker.listening.is_set()
        assert queue.enqueue("k1", "a", "task", 0, "a1") is not None  # no signal: polled
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 1, what="the polled dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1: not listening for wake-ups after 0.05s; polling meanwhile"
    ]
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


def test_start_waits_five_seconds_for_the_listener_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = open_noting_queue(tmp_path, Listener())
    worker = make_worker(tmp_path, queue, [])
    waited: list[tuple[int, float | None]] = []

    async def times_out(
        awaitables: set[asyncio.Future[Any]],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 -- asyncio.wait's signature
        return_when: str,
    ) -> tuple[set[Any], set[Any]]:  # asyncio.wait's place: nothing done within `timeout`
        waited.append((len(awaitables), timeout))
        return set(), awaitables

    async def scenario() -> None:
        with monkeypatch.context() as patch:
            patch.setattr(asyncio, "wait", times_out)
            with caplog.at_level(logging.WARNING, logger="fsm_kernel.scheduler.worker"):
                await worker.start()
        worker.stop()
        await asyncio.wait_for(worker.run(), 5)

    asyncio.run(scenario())
    assert waited == [(2, 5.0)]  # listening, or stopped: whichever comes first
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1: not listening for wake-ups after 5s; polling meanwhile"
    ]


def test_start_that_cannot_connect_raises_and_the_next_start_connects_again(
    tmp_path: Path,
) -> None:
    queue = open_noting_queue(tmp_path)
    queue.refuse_connects = 1
    worker = make_worker(tmp_path, queue, [])

    async def scenario() -> None:
        with pytest.raises(StoreError, match=r"^connection refused$"):
            await worker.start()
        await worker.start()
        await worker.start()

    asyncio.run(scenario())
    assert (queue.connects, queue.claims) == (2, 0)


@pytest.mark.parametrize(
    ("poll_seconds", "config_poll", "waited"),
    [(0.25, 7.0, 0.25), (None, 7.0, 7.0)],
    ids=["its-own", "the-configs"],
)
def test_an_idle_worker_waits_its_poll_interval_between_claims(
    tmp_path: Path, poll_seconds: float | None, config_poll: float, waited: float
) -> None:
    queue = open_noting_queue(tmp_path)
    results: list[DispatchDetail] = []

    async def scenario() -> None:
        sleep = HeldSleep()
        worker = make_worker(
            tmp_path,
            queue,
            results,
            sleep=sleep,
            poll_seconds=poll_seconds,
            config_poll=config_poll,
        )
        assert worker.poll_seconds == waited
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: bool(sleep.delays), what="the idle wait")
        await asyncio.sleep(0.05)
        assert (sleep.delays, queue.claims) == ([waited], 1)  # one look, then the wait
        assert queue.enqueue("k1", "a", "task", 0, "a1") is not None
        sleep.released.set()  # the interval passed: it looks again
        await wait_until(lambda: len(results) == 1, what="the dispatch after the wait")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


def test_a_cancel_request_for_another_run_leaves_the_listener_relaying_wake_ups(
    tmp_path: Path,
) -> None:
    listener = Listener()
    queue = open_noting_queue(tmp_path, listener)
    results: list[DispatchDetail] = []

    async def scenario() -> None:
        sleep = HeldSleep()  # never released: only a signal wakes the idle worker
        worker = make_worker(tmp_path, queue, results, sleep=sleep, poll_seconds=60.0)
        listener.signals.put_nowait(QueueSignal("reconnected", "k1"))
        await worker.start()
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: bool(sleep.delays), what="the idle wait")
        listener.signals.put_nowait(QueueSignal("cancel", "k1", "not-running-here"))
        await asyncio.sleep(0.02)
        assert queue.enqueue("k1", "a", "task", 0, "a1") is not None
        listener.signals.put_nowait(QueueSignal("enqueued", "k1"))
        await wait_until(lambda: len(results) == 1, what="the dispatch the signal announced")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


class CountingListenerQueue(NotingQueue):
    """Notes the kernel id each listener was asked for, and the outcomes each claim carried."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listened_for: list[str] = []
        self.carried: list[list[str]] = []

    def listener(self, kernel_id: str) -> Any:
        self.listened_for.append(kernel_id)
        return super().listener(kernel_id)

    async def complete_and_claim_async(self, completions: Any, *args: Any, **kwargs: Any) -> Any:
        self.carried.append([c.dispatch_id for c in completions])
        return await super().complete_and_claim_async(completions, *args, **kwargs)


def test_the_listener_is_the_workers_kernels_and_closed_when_run_returns_which_logs_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listener = Listener()
    queue = CountingListenerQueue(tmp_path / "runs.db", clock=FakeClock(), listener=listener)
    queue.ensure_schema()
    worker = make_worker(tmp_path, queue, [])

    async def scenario() -> None:
        listener.signals.put_nowait(QueueSignal("reconnected", "k1"))
        await worker.start()
        assert (listener.entered, listener.exited) == (1, 0)
        worker.stop()
        await worker.run()
        assert listener.exited == 1  # closed before run() returned

    with caplog.at_level(logging.INFO, logger="fsm_kernel.scheduler.worker"):
        asyncio.run(scenario())
    assert queue.listened_for == ["k1"]
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1 started (kernel k1)",
        "worker w1 stopped",
    ]


def test_a_busy_worker_claims_no_more_than_its_free_slots_and_waits_for_a_run_to_end(
    tmp_path: Path,
) -> None:
    """Every slot taken: no claim and no poll until a run ends; then one claim for the freed
    slot. The fleet's cap (3) allows more than this worker's concurrency (2)."""
    queue = CountingListenerQueue(tmp_path / "runs.db", clock=FakeClock())
    queue.ensure_schema()
    for agent in "abc":
        assert queue.enqueue("k1", agent, "task", 0, f"key-{agent}") is not None
    runner = ScriptedRunner({"a": "block", "b": "block", "c": "block"})
    results: list[DispatchDetail] = []

    async def scenario() -> None:
        sleep = HeldSleep()
        worker = Worker(
            make_config(tmp_path, ["a", "b", "c"], max_concurrent=3),
            queue,
            runner,  # type: ignore[arg-type]  # a fake runner
            worker_id="w1",
            concurrency=2,
            poll_seconds=60.0,
            sleep=sleep,
            on_result=results.append,
        )
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: runner.active == 2, what="two runs")
        await asyncio.sleep(0.05)
        assert (runner.active, queue.claims, sleep.delays) == (2, 1, [])  # busy: waits
        runner.release.set()  # both end; the third is claimed into a freed slot
        await wait_until(lambda: len(results) == 3, what="all three dispatches")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert runner.peak == 2
    assert sorted(d.agent_id for d in results) == ["a", "b", "c"]


def test_a_runs_outcome_is_recorded_by_the_workers_next_claim(tmp_path: Path) -> None:
    """While the worker claims, each claim records the outcomes that ended before it (one
    statement); the outcome of a run that ends as the worker stops is recorded on its own."""
    queue = CountingListenerQueue(tmp_path / "runs.db", clock=FakeClock())
    queue.ensure_schema()
    first = queue.enqueue("k1", "a", "task", 0, "key-a")
    assert first is not None
    runner = ScriptedRunner({"b": "block"})
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, results, runner=runner)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 1, what="the first dispatch")
        await wait_until(lambda: [first.dispatch_id] in queue.carried, what="its outcome")
        second = queue.enqueue("k1", "b", "task", 0, "key-b")
        assert second is not None
        await wait_until(lambda: runner.active == 1, what="the second run")
        worker.stop()
        runner.release.set()
        await asyncio.wait_for(task, 5)
        assert second.dispatch_id not in {d for c in queue.carried for d in c}
        statuses = {d.dispatch_id: d.status for d in queue.list("k1")}
        assert statuses == {
            first.dispatch_id: DispatchStatus.DONE,
            second.dispatch_id: DispatchStatus.DONE,
        }

    asyncio.run(scenario())
    assert [d.status for d in results] == [ExecutionStatus.DONE] * 2


class FailingClaimQueue(CountingListenerQueue):
    """A claim that carries an outcome fails once with a StoreError (nothing recorded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed = 0

    async def complete_and_claim_async(self, completions: Any, *args: Any, **kwargs: Any) -> Any:
        if completions and not self.failed:
            self.failed += 1
            self.carried.append([c.dispatch_id for c in completions])
            raise StoreError("connection reset")
        return await super().complete_and_claim_async(completions, *args, **kwargs)


def test_an_outcome_whose_claim_failed_is_recorded_on_its_own_and_the_failure_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    queue = FailingClaimQueue(tmp_path / "runs.db", clock=FakeClock())
    queue.ensure_schema()
    dispatch = queue.enqueue("k1", "a", "task", 0, "key-a")
    assert dispatch is not None
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, results)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 1, what="the outcome, recorded")
        worker.stop()
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.WARNING, logger="fsm_kernel.scheduler.worker"):
        asyncio.run(scenario())
        statuses = [d.status for d in queue.list("k1")]
    assert queue.failed == 1
    assert [dispatch.dispatch_id] in queue.carried
    assert [d.status for d in results] == [ExecutionStatus.DONE]
    assert statuses == [DispatchStatus.DONE]
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1: claim failed, retrying: connection reset"
    ]


def test_a_dispatch_for_an_agent_the_config_lacks_fails_and_frees_its_slot(
    tmp_path: Path,
) -> None:
    queue = open_noting_queue(tmp_path)
    unknown = queue.enqueue("k1", "gone", "task", 5, "key-gone")  # claimed first
    assert unknown is not None
    assert queue.enqueue("k1", "a", "task", 0, "key-a") is not None
    results: list[DispatchDetail] = []

    async def scenario() -> None:
        worker = Worker(
            make_config(tmp_path, ["a"]),
            queue,
            ScriptedRunner(),  # type: ignore[arg-type]  # a fake runner
            worker_id="w1",
            concurrency=1,
            poll_seconds=0.01,
            on_result=results.append,
        )
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 2, what="both dispatches, one after the other")
        await asyncio.sleep(0.02)
        assert not worker._in_flight  # nothing kept of the dispatches that ended
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [
        ("gone", ExecutionStatus.FAILED),
        ("a", ExecutionStatus.DONE),
    ]


class StallingClaimQueue(CountingListenerQueue):
    """A claim that carries an outcome never returns (a statement stuck in the store)."""

    async def complete_and_claim_async(self, completions: Any, *args: Any, **kwargs: Any) -> Any:
        if completions:
            self.carried.append([c.dispatch_id for c in completions])
            await asyncio.Event().wait()
        return await super().complete_and_claim_async(completions, *args, **kwargs)


def test_an_outcome_carried_by_a_claim_cut_short_by_cancelling_the_worker_is_still_recorded(
    tmp_path: Path,
) -> None:
    queue = StallingClaimQueue(tmp_path / "runs.db", clock=FakeClock())
    queue.ensure_schema()
    dispatch = queue.enqueue("k1", "a", "task", 0, "key-a")
    assert dispatch is not None
    worker = make_worker(tmp_path, queue, [])

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: any(queue.carried), what="the claim carrying the outcome")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(
            lambda: queue.list("k1")[0].status is DispatchStatus.DONE,
            what="the outcome, recorded on its own",
        )

    asyncio.run(scenario())
    assert [c for c in queue.carried if c] == [[dispatch.dispatch_id]]


class AbandoningQueue(CountingListenerQueue):
    """Asks the worker to stop and abandon its work as soon as a claim returns dispatches,
    before their runs could start."""

    worker: Worker | None = None

    async def complete_and_claim_async(self, *args: Any, **kwargs: Any) -> Any:
        results, claimed = await super().complete_and_claim_async(*args, **kwargs)
        if claimed and self.worker is not None:
            asyncio.get_running_loop().call_soon(lambda: self.worker.stop(abandon=True))  # type: ignore[union-attr]
        return results, claimed


def test_dispatches_claimed_as_the_worker_abandons_its_work_are_left_unrun(
    tmp_path: Path,
) -> None:
    queue = AbandoningQueue(tmp_path / "runs.db", clock=FakeClock())
    queue.ensure_schema()
    assert queue.enqueue("k1", "a", "task", 0, "key-a") is not None
    runner = ScriptedRunner()
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, results, runner=runner)
    queue.worker = worker

    async def scenario() -> None:
        await asyncio.wait_for(worker.run(), 5)

    asyncio.run(scenario())
    statuses = [d.status for d in queue.list("k1")]
    assert runner.calls == []
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.ABANDONED)]
    assert statuses == [DispatchStatus.RUNNING]  # left for its lease to expire
