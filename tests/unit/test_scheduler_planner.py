"""The planner: prompt rendering and which agents to skip."""

from __future__ import annotations

from datetime import UTC, datetime

from fsm_kernel.scheduler import AgentSpec, Dispatch, DispatchStatus, plan_dispatches
from fsm_kernel.scheduler.planner import render_prompt


def agent(agent_id: str, prompt: str = "Do it. STATE: {STATE}", **kw: object) -> AgentSpec:
    return AgentSpec.model_validate({"agent_id": agent_id, "prompt": prompt, **kw})


def dispatch(agent_id: str, status: DispatchStatus) -> Dispatch:
    return Dispatch(
        dispatch_id=f"d-{agent_id}",
        kernel_id="k1",
        agent_id=agent_id,
        prompt="p",
        priority=0,
        status=status,
        dedupe_key=None,
        worker_id=None,
        lease_expires_at=None,
        attempts=0,
        run_id=None,
        termination_reason=None,
        error=None,
        created_at=datetime(2026, 2, 11, tzinfo=UTC),
        started_at=None,
        finished_at=None,
    )


def test_placeholder_replaced_everywhere_without_format() -> None:
    template = "state={STATE}; again {STATE}; keep {other} and {0} and {{braces}}"
    state = "# STATE\nuses {curly} and {STATE_X}"
    expected = (
        "state=# STATE\nuses {curly} and {STATE_X}; again # STATE\nuses {curly} and "
        "{STATE_X}; keep {other} and {0} and {{braces}}"
    )
    assert render_prompt(template, state) == expected
    plan = plan_dispatches([agent("a", template)], state, {})
    assert [p.prompt for p in plan.dispatches] == [expected]
    assert plan.dispatches[0].agent.agent_id == "a"


def test_a_prompt_without_placeholder_is_sent_as_is() -> None:
    plan = plan_dispatches([agent("a", "no state here")], "ignored", {})
    assert plan.dispatches[0].prompt == "no state here"


def test_disabled_agent_skipped() -> None:
    plan = plan_dispatches([agent("on"), agent("off", enabled=False)], "s", {})
    assert [p.agent.agent_id for p in plan.dispatches] == ["on"]
    assert [(s.agent_id, s.reason, s.dispatch_id) for s in plan.skipped] == [
        ("off", "disabled", None)
    ]


def test_running_and_pending_agents_skipped_finished_ones_planned() -> None:
    agents = [agent(name) for name in ("run", "pend", "done", "failed", "new")]
    latest = {
        "run": dispatch("run", DispatchStatus.RUNNING),
        "pend": dispatch("pend", DispatchStatus.PENDING),
        "done": dispatch("done", DispatchStatus.DONE),
        "failed": dispatch("failed", DispatchStatus.FAILED),
    }
    plan = plan_dispatches(agents, "s", latest)
    assert [p.agent.agent_id for p in plan.dispatches] == ["done", "failed", "new"]
    assert [(s.agent_id, s.reason, s.dispatch_id) for s in plan.skipped] == [
        ("run", "running", "d-run"),
        ("pend", "pending", "d-pend"),
    ]
    assert plan.skipped[0].to_dict() == {
        "agent_id": "run",
        "reason": "running",
        "dispatch_id": "d-run",
    }


def test_no_agents_no_plan() -> None:
    plan = plan_dispatches([], "state", {})
    assert plan.dispatches == ()
    assert plan.skipped == ()
