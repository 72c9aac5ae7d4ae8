"""`after:` on a compound state (issue 27, parts 1-2): a deadline for the run's whole stay
inside it. It is set when the run enters the compound state, checked each time the run leaves
a state inside it (a model call in flight is never cut short), cancelled when the run leaves
it, waited for by a waiting child; and a re-driven run (resume, replay) fires it at the steps
the log says, never by the clock, so replay is identical long after the due time passed."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fsm_kernel.errors import AgentConnectionError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import EventType, Message, Tool
from fsm_kernel.replay import replay_run, resume_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import FunctionChatModel, ScriptedChatModel, call
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow

START = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)  # long past: a wall clock would fire at once

RESEARCH = """\
name: research_deadline
tools: [datetime]
reasons:
  out_of_time: {description: research took too long}
initial: research
states:
  research:
    initial: think
    states:
      think: {action: agent.think}
      act: {action: tools.execute}
      found: {final: true}
  report: {action: agent.think, prompt: Write the report.}
  terminate: {final: true}
  late: {final: true}
transitions:
  - {source: research, target: late, after: 10m, reason: out_of_time}
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: found}
  - {source: act, target: think}
  - {source: research, target: report, guard: completed}
  - {source: report, target: terminate, reason: final_answer}
"""

WAITING_CHILD = """\
name: ci_deadline
reasons:
  out_of_time: {description: CI took too long}
initial: release
states:
  release:
    initial: build
    states:
      build: {action: agent.think}
      wait_ci: {}
      shipped: {final: true}
  done: {final: true}
  late: {final: true}
transitions:
  - {source: release, target: late, after: 1h, reason: out_of_time}
  - {source: build, target: wait_ci}
  - {source: wait_ci, target: shipped, event: ci_passed}
  - {source: release, target: done, guard: completed, reason: final_answer}
"""


class Clock:
    def __init__(self) -> None:
        self.at = START

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return (self.at - START).total_seconds()

    async def sleep(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


def _slow_researcher(clock: Clock, minutes: float) -> FunctionChatModel:
    """Each call takes `minutes` of the clock and asks for the time again."""

    def reply(_messages: list[Message], _tools: list[Tool]) -> Any:
        clock.at += timedelta(minutes=minutes)
        return call("datetime")

    return FunctionChatModel(reply)


def _kernel(text: str, tmp_path: Path, store: SqliteEventStore, clock: Clock, model: Any) -> Kernel:
    path = tmp_path / "wf.yaml"
    path.write_text(text)
    return Kernel(
        compile_workflow(load_workflow(path)),
        model=model,
        tools=builtin_registry("."),
        store=store,
        clock=clock,
        sleep=clock.sleep,
    )


def _of(store: SqliteEventStore, run_id: str, type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in store.read(run_id) if e.type is type_]


def test_the_deadline_fires_when_a_state_inside_is_left_after_it_is_due(tmp_path: Path) -> None:
    clock = Clock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        model = _slow_researcher(clock, 4)
        result = asyncio.run(_kernel(RESEARCH, tmp_path, store, clock, model).run("look"))

        assert result.termination_reason == "out_of_time"
        assert len(model.requests) == 3  # 4, 8, 12 minutes: the third call was not cut short
        taken = [
            (d["source"], d["target"])
            for d in _of(store, result.run_id, EventType.TRANSITION_TAKEN)
        ]
        assert taken == [("think", "act"), ("act", "think"), ("think", "act"), ("act", "think"),
                         ("research", "late")]  # fmt: skip
        (timer,) = _of(store, result.run_id, EventType.TIMER_SET)
        due = (START + timedelta(minutes=10)).isoformat()
        assert timer == {"edge": 0, "after": 600.0, "due": due, "state": "research"}
        (fired,) = _of(store, result.run_id, EventType.TIMER_FIRED)
        assert (fired["edge"], fired["step"]) == (0, 4)
        assert _of(store, result.run_id, EventType.TIMER_CANCELLED) == []

        report = asyncio.run(replay_run(compile_workflow(load_workflow(tmp_path / "wf.yaml")),
                                        store, result.run_id))  # fmt: skip
        assert report.identical, report.to_dict()


def test_leaving_the_compound_state_in_time_cancels_its_deadline(tmp_path: Path) -> None:
    clock = Clock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        model = ScriptedChatModel([call("datetime"), "found it", "the report"])
        result = asyncio.run(_kernel(RESEARCH, tmp_path, store, clock, model).run("look"))

        assert (result.termination_reason, result.response) == ("final_answer", "the report")
        assert _of(store, result.run_id, EventType.TIMER_CANCELLED) == [{"edge": 0}]
        assert _of(store, result.run_id, EventType.TIMER_FIRED) == []


def test_a_resume_after_the_due_time_fires_the_deadline_where_the_log_ends(
    tmp_path: Path,
) -> None:
    clock = Clock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        calls = 0

        def flaky(_messages: list[Message], _tools: list[Tool]) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise AgentConnectionError("the model server is down")
            return call("datetime")

        first = asyncio.run(
            _kernel(RESEARCH, tmp_path, store, clock, FunctionChatModel(flaky)).run("look")
        )
        assert first.termination_reason == "agent_error"  # resumable, 2 steps in
        clock.at += timedelta(hours=1)  # the deadline passed while the server was down
        live = FunctionChatModel(lambda _m, _t: call("datetime"))
        resumed = asyncio.run(
            resume_run(_kernel(RESEARCH, tmp_path, store, clock, live), store, first.run_id)
        )

        assert resumed.termination_reason == "out_of_time"
        assert len(live.requests) == 1  # the re-drive asked nothing; the live step finished
        types = [e.type for e in store.read(first.run_id)]
        assert types.count(EventType.TIMER_SET) == 1  # matched on the re-drive, not set again
        assert [d["step"] for d in _of(store, first.run_id, EventType.TIMER_FIRED)] == [4]
        report = asyncio.run(replay_run(compile_workflow(load_workflow(tmp_path / "wf.yaml")),
                                        store, first.run_id))  # fmt: skip
        assert report.identical, report.to_dict()


def test_a_waiting_child_waits_for_its_parents_deadline_too(tmp_path: Path) -> None:
    clock = Clock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(
            _kernel(WAITING_CHILD, tmp_path, store, clock, ScriptedChatModel(["built"])).run("go")
        )
        assert first.waiting_for is not None
        assert first.waiting_for["due"] == (START + timedelta(hours=1)).isoformat()
        clock.at += timedelta(hours=2)
        late = asyncio.run(
            resume_run(
                _kernel(WAITING_CHILD, tmp_path, store, clock, ScriptedChatModel([])),
                store,
                first.run_id,
            )
        )

        assert late.termination_reason == "out_of_time"
        assert _of(store, first.run_id, EventType.TIMER_FIRED)[0]["edge"] == 0
        report = asyncio.run(replay_run(compile_workflow(load_workflow(tmp_path / "wf.yaml")),
                                        store, first.run_id))  # fmt: skip
        assert report.identical, report.to_dict()


def test_an_event_in_time_leaves_the_deadline_cancelled(tmp_path: Path) -> None:
    clock = Clock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(
            _kernel(WAITING_CHILD, tmp_path, store, clock, ScriptedChatModel(["built"])).run("go")
        )
        done = asyncio.run(
            resume_run(
                _kernel(WAITING_CHILD, tmp_path, store, clock, ScriptedChatModel([])),
                store,
                first.run_id,
                answer=HumanAnswer.signal("ci_passed"),
            )
        )

        assert done.termination_reason == "final_answer"
        assert _of(store, first.run_id, EventType.TIMER_CANCELLED) == [{"edge": 0}]


def test_validate_takes_after_on_a_compound_state_but_not_event() -> None:
    assert check_workflow_text(RESEARCH, path="w.yaml").errors == []
    text = RESEARCH.replace("after: 10m", "event: stop")
    errors = [str(e) for e in check_workflow_text(text, path="w.yaml").errors]
    assert len(errors) == 1
    assert "'event:' only on edges out of a waiting state; 'research' has children" in errors[0]
