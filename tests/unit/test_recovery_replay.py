"""Replay and resume follow recorded retries and catches: the recorded failures (the model's,
served by the recorded model; an action's own, raised where it ran) make a re-drive take the same
catch edges, and a resume hands over to each state's own live model where the log ends."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from fsm_kernel.errors import AgentConnectionError, AgentServerError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import ChatModel, EventType
from fsm_kernel.replay import RecordedRun, replay_run, resume_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.loader import load_workflow_text

FAILS: list[Exception] = []
RAN: list[int] = []


def fetch(ctx: RunContext) -> None:
    """A user's action that fails while FAILS holds errors."""
    RAN.append(ctx.attempt)
    if FAILS:
        raise FAILS.pop(0)


WORKFLOW = """
name: recover
initial: fetch_data
states:
  fetch_data:
    action: "tests.unit.test_recovery_replay:fetch"
    retry: {error: error, max_attempts: 1, backoff_seconds: 0}
    catch: [{error: error, target: think}]
  think:
    action: agent.think
    retry: {error: agent_error, max_attempts: 1, backoff_seconds: 5}
    catch: [{error: agent_error, target: backup}]
  backup:
    action: agent.think
    agent: {model: small}
  done: {final: true}
transitions:
  - {source: fetch_data, target: think}
  - {source: think, target: done, reason: final_answer}
  - {source: backup, target: done, reason: final_answer}
"""
DOWN = AgentServerError("failed with 500", status_code=500)
UNREACHABLE = AgentConnectionError("cannot reach the small model's server")


class Waits:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)


def make_kernel(
    store: SqliteEventStore, model: ChatModel, small: ChatModel, waits: Waits | None = None
) -> Kernel:
    return Kernel(
        compile_workflow(load_workflow_text(WORKFLOW)),
        model=model,
        tools=builtin_registry("."),
        store=store,
        state_models={"backup": small},
        sleep=waits or Waits(),
    )


def guards(result: RunResult) -> list[str]:
    return [e.data["guard"] for e in result.events if e.type == EventType.TRANSITION_TAKEN]


def test_a_replay_takes_the_recorded_catches_though_the_action_now_succeeds(
    tmp_path: Path,
) -> None:
    FAILS[:] = [KeyError("a"), KeyError("b")]
    RAN.clear()
    with SqliteEventStore(tmp_path / "r.db") as store:
        big = ScriptedChatModel([DOWN, DOWN])
        small = ScriptedChatModel(["answer from the small model"])
        result = make_kernel(store, big, small).run_sync("go")
        assert guards(result) == ["catch error", "catch agent_error", ""]
        assert RAN == [1, 2]

        report = asyncio.run(
            replay_run(compile_workflow(load_workflow_text(WORKFLOW)), store, result.run_id)
        )

    assert report.identical, report.to_dict()
    assert [s.replayed for s in report.steps] == [
        "fetch_data → think [catch error]",
        "think → backup [catch agent_error]",
        "backup → done → final_answer",
    ]
    assert report.model_calls == 3  # two recorded failures and one answer
    assert RAN == [1, 2]  # the recorded failures were raised; the action did not run again


def test_recorded_run_sorts_recovered_failures(tmp_path: Path) -> None:
    FAILS[:] = [KeyError("a")]
    with SqliteEventStore(tmp_path / "r.db") as store:
        result = make_kernel(
            store, ScriptedChatModel([DOWN, "big answer"]), ScriptedChatModel()
        ).run_sync("go")
        run = RecordedRun.load(store, result.run_id)

    assert [type(c).__name__ for c in run.completions] == ["AgentServerError", "Completion"]
    failure = run.completions[0]
    assert isinstance(failure, AgentServerError)
    assert (failure.status_code, failure.retryable, str(failure)) == (500, True, "failed with 500")
    assert list(run.action_failures) == [("fetch_data", 1, 1)]
    recorded = run.action_failures[("fetch_data", 1, 1)]
    assert (type(recorded).__name__, str(recorded)) == ("KeyError", "'a'")
    model_failed = [e.seq for e in run.events if e.type == EventType.MODEL_FAILED]
    assert run.handled == set(model_failed)


def test_resume_goes_live_on_the_fallback_states_own_model(tmp_path: Path) -> None:
    FAILS.clear()
    with SqliteEventStore(tmp_path / "r.db") as store:
        first = make_kernel(
            store, ScriptedChatModel([DOWN, DOWN]), ScriptedChatModel([UNREACHABLE])
        )
        ended = first.run_sync("go")
        assert (ended.termination_reason, ended.error) == (
            "agent_error",
            "cannot reach the small model's server",
        )
        before = store.read(ended.run_id)

        big, small, waits = ScriptedChatModel(), ScriptedChatModel(["now it answers"]), Waits()
        resumed = asyncio.run(
            resume_run(make_kernel(store, big, small, waits), store, ended.run_id)
        )
        events = store.read(ended.run_id)

    assert (resumed.termination_reason, resumed.response) == ("final_answer", "now it answers")
    assert (len(big.requests), len(small.requests)) == (0, 1)
    assert waits.seconds == []  # the recorded retry's backoff is not waited out again
    assert guards(resumed) == ["", "catch agent_error", ""]
    # Nothing recorded is written twice: the resume only appended its own marker and what
    # came after the reopened ending.
    assert events[: len(before)] == before
    added = Counter(e.type for e in events[len(before) :])
    assert added == Counter(
        {
            EventType.RUN_RESUMED: 1,
            EventType.MODEL_RESPONDED: 1,
            EventType.TRANSITION_TAKEN: 1,
            EventType.ITERATION_COMPLETED: 1,
            EventType.RUN_TERMINATED: 1,
        }
    )


def test_resume_after_a_kill_during_a_backoff_retries_live(tmp_path: Path) -> None:
    FAILS.clear()
    with SqliteEventStore(tmp_path / "full.db") as full:
        done = make_kernel(
            full, ScriptedChatModel([DOWN, "second attempt"]), ScriptedChatModel()
        ).run_sync("go")
        events = full.read(done.run_id)
    cut = next(i for i, e in enumerate(events) if e.type == EventType.ACTION_FAILED) + 1
    with SqliteEventStore(tmp_path / "killed.db") as store:
        store.append(events[:cut])  # the process died while waiting to retry
        big, waits = ScriptedChatModel(["live second attempt"]), Waits()
        resumed = asyncio.run(
            resume_run(make_kernel(store, big, ScriptedChatModel(), waits), store, done.run_id)
        )
        log = store.read(done.run_id)

    assert (resumed.termination_reason, resumed.response) == ("final_answer", "live second attempt")
    assert waits.seconds == [5.0]  # past the log, the retry waits its backoff live
    assert len(big.requests) == 1
    requested = [e.data.get("attempt") for e in log if e.type == EventType.MODEL_REQUESTED]
    assert requested == [None, 2]
    assert [e.type for e in log].count(EventType.ACTION_FAILED) == 1
