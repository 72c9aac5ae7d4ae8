"""Where a run's commits go and what each holds: a pure step's bookkeeping rides with the next
commit (or goes when the run next waits), a lone run's durable commits are made on the event
loop while the disk is fast, and runs that write together share the writer thread."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel.recorder as recorder_module
import fsm_kernel.store._synccost as synccost
from fsm_kernel.errors import StoreError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, Event, EventType, Message, Tool, ToolCall
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.store._sql import PendingAppend
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text

DEFAULT = Path(__file__).resolve().parents[2] / "workflows" / "default.yaml"
BOOKKEEPING = {"transition.taken", "state.entered", "iteration.completed"}


class CommitLog(SqliteEventStore):
    """A SQLite store that notes every commit: its event types, durable or not, and the
    thread it was made on."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.commits: list[tuple[list[str], bool, int]] = []
        self.groups: list[list[tuple[str, bool]]] = []
        """Each transaction's batches: (run id, durable)."""

    def _commit(self, group: list[PendingAppend], *, checkpoint: bool = True) -> None:
        self.groups.append([(job.batch[0].run_id, job.durable) for job in group])
        for job in group:
            types = [e.type.value for e in job.batch]
            self.commits.append((types, job.durable, threading.get_ident()))
        super()._commit(group, checkpoint=checkpoint)


ZONES = ["UTC", "Europe/Paris", "Asia/Tokyo", "America/Lima"]


class ClockThenAnswer:
    """A `datetime` call (another zone each turn) for each of `calls` turns, then an answer."""

    def __init__(self, calls: int = 1) -> None:
        self.calls = calls
        self.turns = 0

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        self.turns += 1
        if self.turns <= self.calls:
            zone = {"timezone": ZONES[self.turns - 1]}
            call = ToolCall(id=f"c{self.turns}", name="datetime", arguments=zone)
            return Completion(message=Message.assistant("", [call]))
        return Completion(message=Message.assistant("It is noon."))


def default_kernel(store: SqliteEventStore, calls: int = 1) -> Kernel:
    return Kernel(
        compile_workflow(load_workflow(DEFAULT)),
        model=ClockThenAnswer(calls),
        tools=builtin_registry("."),
        store=store,
    )


def test_a_pure_steps_bookkeeping_rides_with_the_next_commit(tmp_path: Path) -> None:
    store = CommitLog(tmp_path / "runs.db")
    result = asyncio.run(default_kernel(store, calls=3).run("What time is it?"))

    assert result.termination_reason == "final_answer"
    commits = [types for types, _, _ in store.commits]
    # no commit of transitions and states alone: evaluate -> observe -> think go with the
    # model request that follows them
    assert all(set(types) - BOOKKEEPING for types in commits), commits
    riding = [t for t in commits if "model.requested" in t and "transition.taken" in t]
    assert len(riding) == 4  # every model request took the steps before it along
    # the model's reply goes with the tool call's start, in the commit the tool waits for
    assert [t for t in commits if "model.responded" in t and "tool.started" in t] == [
        ["model.responded", "transition.taken", "state.entered", "tool.started"]
    ] * 3
    # a tool's result is committed when its step ends, before anything else happens
    assert [t for t in commits if "tool.finished" in t] == [
        ["tool.finished", "transition.taken", "state.entered"]
    ] * 3
    assert len(commits) == 2 + 3 * 3 + 1  # start, first request; 3 per tool call; the end
    assert store.read(result.run_id) == result.events  # nothing lost, nothing reordered
    store.close()


USER_STEP = """
name: user_step
initial: start
states:
  start: {action: "waiting_action:note"}
  think: {action: agent.think}
  done: {final: true}
transitions:
  - {source: start, target: think}
  - {source: think, target: done, reason: final_answer}
"""


def test_a_users_action_is_committed_as_soon_as_its_step_ends(
    tmp_path: Path, waiting_action: Any
) -> None:
    store = CommitLog(tmp_path / "runs.db")
    spec = load_workflow_text(USER_STEP, path="user_step.yaml")
    kernel = Kernel(compile_workflow(spec), model=ClockThenAnswer(0), tools=None, store=store)
    result = asyncio.run(kernel.run("note"))

    assert result.termination_reason == "final_answer"
    commits = [types for types, _, _ in store.commits]
    # it may have done what a resume must not redo: its step does not wait for the model's
    assert commits[1] == ["transition.taken", "state.entered"]
    assert commits[2][0] == "model.requested"
    store.close()


WAITS = """
name: waits
initial: start
states:
  start: {action: session.observe}
  wait: {action: "waiting_action:wait_here"}
  done: {final: true}
transitions:
  - {source: start, target: wait}
  - {source: wait, target: done, reason: final_answer}
"""

WAITING_ACTION = """
import asyncio

entered = None
release = None


def note(ctx):
    pass


async def wait_here(ctx):
    entered.set()
    await release.wait()
    await asyncio.sleep(0)
"""


@pytest.fixture
def waiting_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "waiting_action.py").write_text(WAITING_ACTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    import waiting_action

    monkeypatch.setitem(sys.modules, "waiting_action", waiting_action)  # gone after the test
    return waiting_action


def waits_kernel(store: SqliteEventStore) -> Kernel:
    spec = load_workflow_text(WAITS, path="waits.yaml")
    return Kernel(compile_workflow(spec), model=ClockThenAnswer(), tools=None, store=store)


def test_a_run_waiting_on_anything_else_commits_the_state_it_waits_in_first(
    tmp_path: Path, waiting_action: Any
) -> None:
    path = tmp_path / "runs.db"
    store = CommitLog(path)

    async def main() -> tuple[list[tuple[str, str | None]], str]:
        waiting_action.entered, waiting_action.release = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(waits_kernel(store).run("wait", run_id="w1"))
        await waiting_action.entered.wait()
        await asyncio.sleep(0)  # the run is parked in its action: the loop has had a turn
        with SqliteEventStore(path, read_only=True) as reader:  # another process's view
            seen = [(e.type.value, e.state) for e in reader.read("w1")]
        waiting_action.release.set()
        return seen, (await task).termination_reason

    seen, reason = asyncio.run(main())

    assert reason == "final_answer"
    assert seen[-2:] == [("transition.taken", "start"), ("state.entered", "wait")]
    assert [t for t, _, _ in store.commits][1] == ["transition.taken", "state.entered"]
    store.close()


class FailsOnBookkeeping(SqliteEventStore):
    """Refuses, at once on the loop, a commit of bookkeeping only (a full disk, say)."""

    def append_if_idle(self, events: Sequence[Event], *, durable: bool = False) -> bool:
        if {e.type.value for e in events} <= BOOKKEEPING:
            raise StoreError(f"{self.path}: append failed: database or disk is full")
        return super().append_if_idle(events, durable=durable)


def test_a_put_off_commit_that_fails_fails_the_run_at_its_next_write(
    tmp_path: Path, waiting_action: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = FailsOnBookkeeping(tmp_path / "runs.db")

    async def main() -> Exception:
        waiting_action.entered, waiting_action.release = asyncio.Event(), asyncio.Event()
        waiting_action.release.set()
        with pytest.raises(StoreError) as failed:
            await waits_kernel(store).run("wait", run_id="w2")
        return failed.value

    error = asyncio.run(main())

    assert "database or disk is full" in str(error)
    assert "Task exception was never retrieved" not in caplog.text
    assert "Exception in callback" not in caplog.text
    stored = [e.type.value for e in store.read("w2")]
    assert stored == ["run.started", "state.entered"]  # nothing after the gap
    store.close()


def test_a_failed_put_off_commit_nobody_waits_for_is_not_reported_as_unseen(
    tmp_path: Path,
) -> None:
    store = FailsOnBookkeeping(tmp_path / "runs.db")
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: reported.append(context)
        )
        recorder = recorder_module.RunRecorder("r", store)
        recorder.record(EventType.RUN_STARTED, {"workflow": "w", "goal": "g"})
        await recorder.flush()
        recorder.record(EventType.STATE_ENTERED, {})
        await recorder.end_step()
        for _ in range(3):  # the put-off commit is made, fails, and its callbacks run
            await asyncio.sleep(0)
        failed = recorder._inflight
        assert failed is not None
        assert failed.done()  # failed (its exception left unread here, as in a dead run)
        del recorder, failed  # a run that never writes again (its task destroyed)
        gc.collect()

    asyncio.run(main())

    assert reported == []  # its failure was the run's to raise, not the loop's to report
    assert [e.type for e in store.read("r")] == [EventType.RUN_STARTED]
    store.close()


def on_the_loop(store: CommitLog, runs: int = 1) -> list[tuple[bool, bool]]:
    """Run the default workflow `runs` times at once on `store`: for each commit, whether it
    was durable and whether it was made on the event loop's thread."""
    loop_thread: list[int] = []

    async def main() -> list[str]:
        loop_thread.append(threading.get_ident())
        kernels = [default_kernel(store, calls=3) for _ in range(runs)]
        results = await asyncio.gather(*(k.run(f"task {i}") for i, k in enumerate(kernels)))
        return [r.termination_reason for r in results]

    assert asyncio.run(main()) == ["final_answer"] * runs
    store.close()
    return [(durable, thread == loop_thread[0]) for _, durable, thread in store.commits]


def test_a_lone_runs_durable_commits_are_made_on_the_loop_while_the_disk_is_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synccost, "INLINE_SYNC_MAX", 60.0)  # any disk counts as fast
    commits = on_the_loop(CommitLog(tmp_path / "runs.db"))

    durable = [inline for is_durable, inline in commits if is_durable]
    assert len(durable) == 8  # 4 model requests, 3 tool starts, the ending
    assert durable == [False] + [True] * 7  # the first one measures the disk, off the loop


def test_a_slow_disk_keeps_durable_commits_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synccost, "INLINE_SYNC_MAX", 0.0)  # no sync is fast enough
    commits = on_the_loop(CommitLog(tmp_path / "runs.db"))

    assert [inline for is_durable, inline in commits if is_durable] == [False] * 8
    relaxed = [inline for is_durable, inline in commits if not is_durable]
    assert relaxed == [True] * len(relaxed)  # a relaxed commit costs less than a hand-off


def test_runs_writing_together_share_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synccost, "INLINE_SYNC_MAX", 60.0)
    commits = on_the_loop(CommitLog(tmp_path / "runs.db"), runs=4)

    durable = [inline for is_durable, inline in commits if is_durable]
    assert len(durable) == 4 * 8
    assert durable.count(True) <= 1  # only a run that found nobody else writing


def test_runs_writing_together_commit_their_relaxed_batches_together_in_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synccost, "INLINE_SYNC_MAX", 60.0)
    store = CommitLog(tmp_path / "runs.db")
    commits = on_the_loop(store, runs=4)

    relaxed = [inline for is_durable, inline in commits if not is_durable]
    assert len(relaxed) >= 4 * 3  # each run's tool results at least
    assert relaxed.count(True) <= 1  # only a run that found nobody else writing
    shared = [g for g in store.groups if len({run for run, _ in g}) > 1]
    assert any(not durable for g in shared for _, durable in g)  # relaxed ones grouped too


def test_a_run_writes_alone_until_another_run_wrote_within_the_window(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    now = [100.0]
    monkeypatch.setattr(recorder_module.time, "monotonic", lambda: now[0])
    store = SqliteEventStore(tmp_path / "runs.db")
    writer = recorder_module._Writer(store)

    assert writer.alone("a") is True  # nobody wrote before
    assert writer.alone("a") is True  # nor anybody else since
    now[0] += recorder_module._LONE_WINDOW / 2
    assert writer.alone("b") is False  # a wrote just now
    assert writer.alone("b") is False  # still within the window of a's write
    assert writer.alone("a") is False  # and b just now
    now[0] += recorder_module._LONE_WINDOW / 2 + 0.001
    assert writer.alone("a") is False  # b wrote after a's previous write
    now[0] += recorder_module._LONE_WINDOW
    assert writer.alone("b") is False  # a wrote exactly the window ago: not yet
    now[0] += 0.001
    assert writer.alone("b") is True  # a's last write is older than the window
    writer._busy = True
    assert writer.alone("b") is False  # a write is going: join it in the thread
    writer._busy = False
    loop = asyncio.new_event_loop()
    try:
        writer._waiting.append(([], True, loop.create_future()))
        assert writer.alone("b") is False  # a write is queued
    finally:
        loop.close()
    store.close()


def test_sync_cost_is_a_moving_average_of_durable_commits_only() -> None:
    cost = synccost.SyncCost()
    assert cost.average is None
    assert cost.cheap is False
    cost.add(0.001)
    assert cost.average == 0.001
    assert cost.cheap is True
    cost.add(0.009)
    assert cost.average == pytest.approx(0.003)  # a quarter of the way to the newest
    assert cost.cheap is False
    with cost.timing(durable=False):
        time.sleep(0.01)
    assert cost.average == pytest.approx(0.003)  # relaxed commits are not timed
    with cost.timing(durable=True):
        time.sleep(0.02)
    assert cost.average is not None
    assert cost.average > 0.003 + 0.25 * 0.017
    with pytest.raises(RuntimeError), cost.timing(durable=True):
        raise RuntimeError("a failed commit still took its time")
