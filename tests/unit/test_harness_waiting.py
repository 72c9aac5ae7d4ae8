"""The test kit drives waiting states (issue 27, part 7): `step()` delivers an event (its data
read by a `when:` guard) or lets time pass (`elapsed=`: the earliest timer due by then fires),
refuses what the state does not wait for, and a whole `run()` gets its events from a
ScriptedHuman and its timers fired on a fake clock, recorded as in production."""

from __future__ import annotations

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, WorkflowHarness
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.loader import load_workflow_text

WAIT = """\
name: wait_ci
reasons:
  timed_out: {description: CI never answered}
  escalated: {description: a person was asked}
  rejected: {description: CI failed}
initial: wait_for_ci
states:
  wait_for_ci: {}
  deploy: {action: agent.think}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: wait_for_ci, target: deploy, event: ci_passed, when: 'event.data.branch == "main"'}
  - {source: wait_for_ci, target: gave_up, event: ci_passed, reason: rejected}
  - {source: wait_for_ci, target: gave_up, after: 2h, reason: timed_out}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: escalated}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def harness() -> WorkflowHarness:
    return WorkflowHarness(load_workflow_text(WAIT, path="wait.yaml"))


def test_an_event_fires_its_edge_and_its_data_reaches_the_guard(harness: WorkflowHarness) -> None:
    on_main = harness.step("wait_for_ci", event="ci_passed", data={"branch": "main"})
    elsewhere = harness.step("wait_for_ci", event="ci_passed", data={"branch": "dev"})

    assert (on_main.index, on_main.target) == (0, "deploy")
    assert (elsewhere.index, elsewhere.target, elsewhere.reason) == (1, "gave_up", "rejected")


@pytest.mark.parametrize(("elapsed", "reason"), [(1800, "escalated"), ("3h", "escalated"),
                                                 ("45m", "escalated")])  # fmt: skip
def test_elapsed_fires_the_earliest_timer_due_by_then(
    harness: WorkflowHarness, elapsed: object, reason: str
) -> None:
    fired = harness.step("wait_for_ci", elapsed=elapsed)  # type: ignore[arg-type]

    assert (fired.index, fired.reason) == (3, reason)


def test_what_the_state_does_not_wait_for_is_refused(harness: WorkflowHarness) -> None:
    with pytest.raises(ValueError, match="waits for ci_passed, not event 'deploy_now'"):
        harness.step("wait_for_ci", event="deploy_now")
    with pytest.raises(ValueError, match=r"no timer of state 'wait_for_ci' is due after 60 s"):
        harness.step("wait_for_ci", elapsed=60)
    with pytest.raises(ValueError, match="not a duration"):
        harness.step("wait_for_ci", elapsed="soon")
    with pytest.raises(ValueError, match="state 'deploy' does not wait"):
        harness.step("deploy", event="ci_passed")
    with pytest.raises(TypeError, match="not both"):
        harness.step("wait_for_ci", event="ci_passed", elapsed=60)


def test_a_run_takes_its_event_from_a_scripted_human(harness: WorkflowHarness) -> None:
    human = ScriptedHuman([HumanAnswer.signal("ci_passed", {"branch": "main"})])

    result = harness.run("ship it", model=ScriptedChatModel(["deployed"]), human=human)

    assert (result.termination_reason, result.response) == ("final_answer", "deployed")
    delivered = [e.data for e in result.events if e.type is EventType.EVENT_DELIVERED]
    assert delivered[0]["name"] == "ci_passed"
    assert delivered[0]["data"] == {"branch": "main"}


def test_a_run_with_nobody_to_signal_fires_its_earliest_timer_on_a_fake_clock(
    harness: WorkflowHarness,
) -> None:
    result = harness.run("ship it", model=ScriptedChatModel([]), fire_timers=True)

    assert result.termination_reason == "escalated"
    types = [e.type for e in result.events]
    assert types.count(EventType.TIMER_SET) == 2
    fired = [e for e in result.events if e.type is EventType.TIMER_FIRED]
    assert [e.data["edge"] for e in fired] == [3]
    set_at = next(e for e in result.events if e.type is EventType.TIMER_SET).timestamp
    assert (fired[0].timestamp - set_at).total_seconds() == 1800  # the fake clock moved on
    cancelled = [e.data["edge"] for e in result.events if e.type is EventType.TIMER_CANCELLED]
    assert cancelled == [2]


def test_a_run_can_suspend_on_its_timer_as_in_production(harness: WorkflowHarness) -> None:
    result = harness.run("ship it", model=ScriptedChatModel([]))

    assert result.status == "waiting"
    assert result.waiting_for is not None
    assert result.waiting_for["kind"] == "event"
    assert result.waiting_for["events"] == ["ci_passed"]
