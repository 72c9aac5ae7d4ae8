"""Timers and named events (issue 27, part 2) at the kernel: a waiting state suspends the run
like an approval (`waiting_for: {kind: event, events, due}`), an event delivered by resume
takes its edge with its data on `ctx.event`, a timer fires when a resume finds it due (a fake
clock, never the wall clock), a timer due soon is slept on in process, time spent waiting is
off the run's clock, and every timer set, fired, cancelled and event delivered is in the log,
so a replay re-drives identically. `validate` rejects bad durations, reserved or malformed event
names, `event`/`after` out of a state with an action, and a waiting state's unguarded edge."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import AnswerError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import EventType
from fsm_kernel.replay import replay_run, resume_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, WorkflowHarness
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow
from fsm_kernel.workflow.spec import parse_duration

START = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)

WAIT_CI = """\
name: wait_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


class FakeClock:
    """Time stands still until the test (or the fake sleep) moves it."""

    def __init__(self) -> None:
        self.at = START
        self.slept: list[float] = []

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return (self.at - START).total_seconds()

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.at += timedelta(seconds=seconds)


def _workflow(tmp_path: Path, text: str = WAIT_CI) -> Path:
    path = tmp_path / "wf.yaml"
    path.write_text(text)
    return path


def _kernel(
    path: Path, store: SqliteEventStore, clock: FakeClock, replies: list[str], **kw: Any
) -> Kernel:
    return Kernel(
        compile_workflow(load_workflow(path)),
        model=ScriptedChatModel(replies),
        tools=builtin_registry("."),
        store=store,
        clock=clock,
        sleep=clock.sleep,
        **kw,
    )


def _types(store: SqliteEventStore, run_id: str) -> list[str]:
    return [e.type.value for e in store.read(run_id)]


def _data(store: SqliteEventStore, run_id: str, type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in store.read(run_id) if e.type == type_]


def test_a_waiting_state_suspends_and_an_event_takes_its_edge(tmp_path: Path) -> None:
    path, clock = _workflow(tmp_path), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(_kernel(path, store, clock, ["planned"]).run("ship it"))

        assert first.termination_reason is None
        assert first.status == "waiting"
        due = (START + timedelta(minutes=30)).isoformat()
        assert first.waiting_for == {
            "kind": "event",
            "state": "wait_for_ci",
            "events": ["ci_passed"],
            "due": due,
        }
        assert _data(store, first.run_id, EventType.TIMER_SET) == [
            {"edge": 2, "after": 1800.0, "due": due}
        ]

        clock.at += timedelta(minutes=10)
        seen: dict[str, Any] = {}
        kernel = _kernel(path, store, clock, ["deployed"])
        answer = HumanAnswer.signal("ci_passed", {"build": 7}, by="ci")
        done = asyncio.run(_resume(kernel, store, first.run_id, answer, seen))

        assert done.termination_reason == "final_answer"
        assert done.response == "deployed"
        assert _data(store, first.run_id, EventType.EVENT_DELIVERED) == [
            {"name": "ci_passed", "data": {"build": 7}, "by": "ci"}
        ]
        assert _data(store, first.run_id, EventType.TIMER_CANCELLED) == [{"edge": 2}]
        assert _data(store, first.run_id, EventType.TIMER_FIRED) == []
        taken = _data(store, first.run_id, EventType.TRANSITION_TAKEN)
        assert [(t["source"], t["target"], t["guard"]) for t in taken] == [
            ("plan", "wait_for_ci", ""),
            ("wait_for_ci", "deploy", "event ci_passed"),
            ("deploy", "done", ""),
        ]

        report = asyncio.run(replay_run(compile_workflow(load_workflow(path)), store, done.run_id))
        assert report.identical, report.to_dict()


async def _resume(
    kernel: Kernel,
    store: SqliteEventStore,
    run_id: str,
    answer: HumanAnswer | None,
    seen: dict[str, Any],
) -> Any:
    def watch(event: Any) -> None:
        if getattr(event, "type", None) == EventType.TRANSITION_TAKEN:
            seen.setdefault("events", []).append(event.data["target"])

    kernel.on_event = watch
    return await resume_run(kernel, store, run_id, answer=answer)


def test_event_data_reaches_ctx_event_for_guards(tmp_path: Path) -> None:
    text = WAIT_CI.replace(
        "  - {source: wait_for_ci, target: deploy, event: ci_passed}\n",
        "  - {source: wait_for_ci, target: deploy, event: ci_passed,"
        " guard: 'tests.unit.test_workflow_timers_events:green'}\n",
    )
    path, clock = _workflow(tmp_path, text), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(_kernel(path, store, clock, ["planned"]).run("ship it"))
        red = HumanAnswer.signal("ci_passed", {"status": "red"})
        again = asyncio.run(resume_run(_kernel(path, store, clock, []), store, first.run_id,
                                       answer=red))  # fmt: skip

        assert again.status == "waiting"  # its guard failed: dropped, still waiting
        assert again.waiting_for is not None
        assert again.waiting_for["state"] == "wait_for_ci"
        green = HumanAnswer.signal("ci_passed", {"status": "green"})
        done = asyncio.run(
            resume_run(_kernel(path, store, clock, ["ok"]), store, first.run_id, answer=green)
        )

        assert done.termination_reason == "final_answer"
        delivered = _data(store, first.run_id, EventType.EVENT_DELIVERED)
        assert [d["data"]["status"] for d in delivered] == ["red", "green"]
        report = asyncio.run(replay_run(compile_workflow(load_workflow(path)), store, done.run_id))
        assert report.identical, report.to_dict()


def green(ctx: Any) -> bool:
    """A user's guard reading the delivered event's data."""
    return bool(ctx.event and ctx.event["data"].get("status") == "green")


def test_a_resume_after_the_due_time_fires_the_timer(tmp_path: Path) -> None:
    path, clock = _workflow(tmp_path), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(_kernel(path, store, clock, ["planned"]).run("ship it"))
        clock.at += timedelta(minutes=29)
        with pytest.raises(AnswerError, match="resume it once the timer is due"):
            asyncio.run(resume_run(_kernel(path, store, clock, []), store, first.run_id))
        before = _types(store, first.run_id)

        clock.at += timedelta(minutes=2)  # now past due: a signal is refused, a resume fires
        late = HumanAnswer.signal("ci_passed")
        with pytest.raises(AnswerError, match=r"was due at .* before this event"):
            asyncio.run(
                resume_run(_kernel(path, store, clock, []), store, first.run_id, answer=late)
            )
        assert _types(store, first.run_id) == before  # refused: nothing recorded
        done = asyncio.run(resume_run(_kernel(path, store, clock, []), store, first.run_id))

        assert done.termination_reason == "timed_out"
        assert _data(store, first.run_id, EventType.TIMER_FIRED) == [
            {"edge": 2, "due": (START + timedelta(minutes=30)).isoformat()}
        ]
        assert _data(store, first.run_id, EventType.TIMER_CANCELLED) == []
        report = asyncio.run(replay_run(compile_workflow(load_workflow(path)), store, done.run_id))
        assert report.identical, report.to_dict()


def test_an_event_the_state_does_not_await_is_refused_with_nothing_recorded(
    tmp_path: Path,
) -> None:
    path, clock = _workflow(tmp_path), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(_kernel(path, store, clock, ["planned"]).run("ship it"))
        before = _types(store, first.run_id)
        with pytest.raises(AnswerError, match="waits in state 'wait_for_ci' for ci_passed"):
            asyncio.run(
                resume_run(
                    _kernel(path, store, clock, []),
                    store,
                    first.run_id,
                    answer=HumanAnswer.signal("ci_failed"),
                )
            )
        assert _types(store, first.run_id) == before


def test_a_timer_due_soon_is_slept_on_in_process_off_the_run_clock(tmp_path: Path) -> None:
    text = WAIT_CI.replace("after: 30m", "after: 45s")
    path, clock = _workflow(tmp_path, text), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        kernel = _kernel(path, store, clock, ["planned"])
        result = asyncio.run(kernel.run("ship it"))

        assert result.termination_reason == "timed_out"
        assert clock.slept == [45.0]
        assert _data(store, result.run_id, EventType.TIMER_FIRED) == [
            {"edge": 2, "due": (START + timedelta(seconds=45)).isoformat()}
        ]
        report = asyncio.run(
            replay_run(compile_workflow(load_workflow(path)), store, result.run_id)
        )
        assert report.identical, report.to_dict()


def test_waiting_in_process_does_not_count_against_the_timeout(tmp_path: Path) -> None:
    text = WAIT_CI.replace("after: 30m", "after: 1s") + "limits: {timeout_seconds: 0.5}\n"
    path, clock = _workflow(tmp_path, text), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        kernel = _kernel(path, store, clock, ["planned"])
        kernel.sleep = asyncio.sleep  # a real second of waiting, twice the run's timeout
        result = asyncio.run(kernel.run("ship it"))

        assert result.termination_reason == "timed_out"  # the workflow's reason, not timeout
        assert result.error is None


def test_a_waiting_state_takes_a_guarded_edge_at_once_when_it_passes(tmp_path: Path) -> None:
    text = WAIT_CI.replace(
        "  - {source: wait_for_ci, target: deploy, event: ci_passed}\n",
        "  - {source: wait_for_ci, target: deploy, guard: has_answer}\n"
        "  - {source: wait_for_ci, target: deploy, event: ci_passed}\n",
    )
    path, clock = _workflow(tmp_path, text), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = asyncio.run(_kernel(path, store, clock, ["planned", "ok"]).run("ship it"))

        assert result.termination_reason == "final_answer"
        assert _data(store, result.run_id, EventType.TIMER_SET) == []


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0), ("1.5m", 90.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0s", "30", "m", "-1m", "1w", "1 m", "30mins"])
def test_not_durations(text: str) -> None:
    assert parse_duration(text) is None


BAD = """\
name: bad
initial: think
states:
  think: {action: agent.think}
  wait: {}
  done: {final: true}
transitions:
  - {source: think, target: wait, event: go}
  - {source: wait, target: done, after: soon, reason: final_answer}
  - {source: wait, target: done, event: next, reason: final_answer}
  - {source: wait, target: done, event: Go-On, reason: final_answer}
  - {source: wait, target: done, event: go, after: 1m, reason: final_answer}
  - {source: wait, target: done, reason: final_answer}
"""


def test_validate_reports_every_timer_and_event_error_at_its_place() -> None:
    check = check_workflow_text(BAD, path="w.yaml")

    assert [str(e) for e in check.errors] == [
        "w.yaml:8:42: " + _acting("think", "event"),
        "w.yaml:9:41: 'after: soon' is not a duration: a positive number and a unit, s, m, h "
        "or d (90s, 30m, 2h, 1d)",
        "w.yaml:10:41: event name 'next' is reserved (python-statemachine or the kernel use it)",
        "w.yaml:11:41: event name 'Go-On' must be snake_case: a lower-case letter, then a-z, "
        "0-9 or _",
        "w.yaml:12:52: an edge fires on an 'event' or 'after' a time, not both",
        "w.yaml:13:5: an unguarded transition out of waiting state 'wait' fires at once: the "
        "state never waits (give it a guard, or an 'event' or 'after')",
    ]


def _acting(state: str, key: str) -> str:
    return (
        f"'{key}:' only on edges out of a state without an action (a waiting state); state "
        f"{state!r} runs an action: wait in a state of its own"
    )


def test_the_example_validates() -> None:
    assert check_workflow_text(WAIT_CI, path="w.yaml").errors == []


def test_a_forced_resume_under_a_changed_timer_edge_sets_it_again(tmp_path: Path) -> None:
    path, clock = _workflow(tmp_path), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        first = asyncio.run(_kernel(path, store, clock, ["planned"]).run("ship it"))
        path.write_text(
            WAIT_CI.replace(
                "  - {source: wait_for_ci, target: gave_up, after: 30m",
                "  - {source: wait_for_ci, target: deploy, event: ci_forced}\n"
                "  - {source: wait_for_ci, target: gave_up, after: 1h",
            )
        )
        clock.at += timedelta(minutes=40)  # past the recorded timer's due time
        again = asyncio.run(
            resume_run(_kernel(path, store, clock, []), store, first.run_id, force=True)
        )

        assert again.status == "waiting"  # the 1h timer of edge 3 is set anew, not fired
        assert again.waiting_for is not None
        assert again.waiting_for["due"] == (START + timedelta(minutes=100)).isoformat()
        assert [d["edge"] for d in _data(store, first.run_id, EventType.TIMER_SET)] == [2, 3]
        assert _data(store, first.run_id, EventType.TIMER_FIRED) == []


def test_the_harness_delivers_events_and_fires_timers_from_a_script(tmp_path: Path) -> None:
    harness = WorkflowHarness(_workflow(tmp_path))

    delivered = harness.run(
        "ship it",
        model=ScriptedChatModel(["planned", "deployed"]),
        human=ScriptedHuman([HumanAnswer.signal("ci_passed", {"build": 7})]),
    )
    timed_out = harness.run(
        "ship it",
        model=ScriptedChatModel(["planned"]),
        human=ScriptedHuman([HumanAnswer.timer_fired(2)]),  # the after: edge, third in the file
    )
    waiting = harness.run("ship it", model=ScriptedChatModel(["planned"]))

    assert (delivered.termination_reason, delivered.response) == ("final_answer", "deployed")
    assert timed_out.termination_reason == "timed_out"
    assert waiting.status == "waiting"
    assert waiting.waiting_for is not None
    assert waiting.waiting_for["events"] == ["ci_passed"]


NESTED = """\
name: nested_wait
initial: work
states:
  work:
    initial: plan
    states:
      plan: {action: agent.think}
      wait_ci: {}
      ok: {final: true}
  deploy: {action: agent.think}
  done: {final: true}
transitions:
  - {source: work, target: done, guard: 'tests.unit.test_workflow_timers_events:stop',
     reason: final_answer}
  - {source: plan, target: wait_ci}
  - {source: wait_ci, target: ok, event: ci_passed}
  - {source: work, target: deploy, guard: completed}
  - {source: deploy, target: done, reason: final_answer}
"""


def stop(ctx: Any) -> bool:
    """A parent's edge: the model said stop."""
    return ctx.answer == "stop"


def test_a_waiting_state_inside_a_compound_state(tmp_path: Path) -> None:
    path, clock = _workflow(tmp_path, NESTED), FakeClock()
    with SqliteEventStore(tmp_path / "runs.db") as store:
        stopped = asyncio.run(_kernel(path, store, clock, ["stop"]).run("ship it"))
        first = asyncio.run(_kernel(path, store, clock, ["go"]).run("ship it"))
        done = asyncio.run(
            resume_run(
                _kernel(path, store, clock, ["deployed"]),
                store,
                first.run_id,
                answer=HumanAnswer.signal("ci_passed"),
            )
        )

        assert stopped.termination_reason == "final_answer"  # the parent's edge, at once
        assert stopped.response == "stop"
        assert first.waiting_for is not None
        assert (first.waiting_for["state"], first.waiting_for["events"]) == (
            "wait_ci",
            ["ci_passed"],
        )
        assert (done.termination_reason, done.response) == ("final_answer", "deployed")
        report = asyncio.run(replay_run(compile_workflow(load_workflow(path)), store, done.run_id))
        assert report.identical, report.to_dict()


def test_a_compound_state_cannot_wait_itself() -> None:
    text = NESTED.replace(
        "  - {source: work, target: deploy, guard: completed}\n",
        "  - {source: work, target: deploy, guard: completed}\n"
        "  - {source: work, target: deploy, event: skip}\n",
    )
    errors = [str(e) for e in check_workflow_text(text, path="w.yaml").errors]

    assert errors == [
        "w.yaml:18:43: 'event:' only on edges out of a waiting state; 'work' has children: put "
        "the event edge on the child that waits (an 'after:' on a compound state is its deadline)"
    ]
