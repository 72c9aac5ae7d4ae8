"""Loading and validating `retry:`, `catch:` and a state's `agent:`: every misuse is reported as
`path:line:col: message` (and by `fsm-kernel validate` with exit 2), catch edges count for
reachability, and `fsm-kernel schema` describes the new keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.spec import RetrySpec
from tests.clikit import cli

HEAD = """name: recovery
initial: think
states:
"""
TAIL = """  act: {action: tools.execute}
  done: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: done, reason: final_answer}
  - {source: act, target: think}
"""


def workflow(think: str, *, extra: str = "", tail: str = TAIL) -> str:
    return HEAD + think + extra + tail


OK_THINK = """  think:
    action: agent.think
    retry: {max_attempts: 2, backoff_seconds: 0.5}
    catch:
      - {error: agent_error, target: backup}
      - {error: any, target: failed, reason: gave_up}
"""
OK_EXTRA = """  backup: {action: agent.think, agent: {model: small, temperature: 0}}
  failed: {final: true}
"""
OK_TAIL = TAIL + "  - {source: backup, target: done, reason: final_answer}\n"
REASONS = "reasons:\n  gave_up: {}\n"


def test_a_valid_workflow_numbers_its_catch_edges_after_its_transitions() -> None:
    spec = load_workflow_text(workflow(OK_THINK, extra=OK_EXTRA, tail=OK_TAIL) + REASONS)

    edges = [
        (c.index, c.source, c.position, c.target, c.reason, c.label()) for c in spec.catch_edges()
    ]
    assert edges == [
        (4, "think", 0, "backup", None, "catch agent_error"),
        (5, "think", 1, "failed", "gave_up", "catch any"),
    ]
    assert spec.catch_edge(3) is None
    assert spec.catch_edge(6) is None
    assert spec.catch_edge(5) == spec.catch_edges()[1]
    retry = spec.states["think"].retry
    assert retry == RetrySpec(max_attempts=2, backoff_seconds=0.5)
    assert retry is not None
    assert retry.error == "any"
    agent = spec.states["backup"].agent
    assert agent is not None
    assert (agent.model, agent.temperature) == ("small", 0)


def test_retry_delays_grow_by_the_rate_up_to_the_cap() -> None:
    assert [RetrySpec(backoff_seconds=1).delay(n) for n in (1, 2, 3)] == [1, 2, 4]
    capped = RetrySpec(backoff_seconds=2, backoff_rate=3, max_backoff_seconds=10)
    assert [capped.delay(n) for n in (1, 2, 3)] == [2, 6, 10]


def test_a_state_reached_only_through_a_catch_edge_is_reachable() -> None:
    think = "  think: {action: agent.think, catch: [{error: any, target: backup}]}\n"
    spec = load_workflow_text(workflow(think, extra=OK_EXTRA.splitlines()[0] + "\n", tail=OK_TAIL))

    assert "backup" in spec.states


BROKEN: list[tuple[str, str, str]] = [
    (
        "unknown catch target",
        workflow("  think: {action: agent.think, catch: [{error: any, target: nowhere}]}\n"),
        "<string>:4:61: unknown catch target state 'nowhere'",
    ),
    (
        "catch on a state without action",
        workflow(
            "  think: {action: agent.think}\n",
            extra="  idle: {catch: [{error: any, target: done, reason: final_answer}]}\n",
            tail=TAIL + "  - {source: act, target: idle, guard: done_called}\n"
            "  - {source: idle, target: done, reason: final_answer}\n",
        ),
        "<string>:5:17: 'catch:' does nothing on state 'idle': it has no action to fail",
    ),
    (
        "retry on a state without action",
        workflow(
            "  think: {action: agent.think}\n",
            extra="  idle: {retry: {max_attempts: 1}}\n",
            tail=TAIL + "  - {source: act, target: idle, guard: done_called}\n"
            "  - {source: idle, target: done, reason: final_answer}\n",
        ),
        "<string>:5:17: 'retry:' does nothing on state 'idle': it has no action to fail",
    ),
    (
        "agent on a state that does not call the model",
        workflow(
            "  think: {action: agent.think}\n",
            extra="  note: {action: kernel.evaluate, agent: {model: x}}\n",
            tail=TAIL + "  - {source: act, target: note, guard: done_called}\n"
            "  - {source: note, target: done, reason: final_answer}\n",
        ),
        "<string>:5:42: 'agent:' does nothing on state 'note': only a state whose action calls "
        "the model (agent.think) makes model calls",
    ),
    (
        "an entry after `any`",
        workflow(
            "  think:\n    action: agent.think\n    catch:\n"
            "      - {error: any, target: act}\n      - {error: agent_error, target: act}\n"
        ),
        "<string>:8:17: catch entry never fires: an earlier entry of state 'think' already "
        "catches 'any'",
    ),
    (
        "the same kind twice",
        workflow(
            "  think:\n    action: agent.think\n    catch:\n"
            "      - {error: error, target: act}\n      - {error: error, target: done,"
            " reason: final_answer}\n"
        ),
        "<string>:8:17: catch entry never fires: an earlier entry of state 'think' already "
        "catches 'error'",
    ),
    (
        "a catch into a final state without reason",
        workflow("  think: {action: agent.think, catch: [{error: any, target: done}]}\n"),
        "<string>:4:40: catch into final state 'done' needs a 'reason'",
    ),
    (
        "a reason on a catch into a non-final state",
        workflow(
            "  think: {action: agent.think, catch: [{error: any, target: act, reason: done}]}\n"
        ),
        "<string>:4:74: 'reason' is only for a catch into a final state",
    ),
    (
        "an unknown reason",
        workflow(
            "  think: {action: agent.think, catch: [{error: any, target: done, reason: oops}]}\n"
        ),
        "<string>:4:75: unknown termination reason 'oops' (declare your own under 'reasons:')",
    ),
    (
        "an unknown error kind",
        workflow("  think: {action: agent.think, catch: [{error: timeout, target: act}]}\n"),
        "<string>:4:48: error: Input should be 'agent_error', 'error' or 'any'",
    ),
    (
        "a catch entry without error",
        workflow("  think: {action: agent.think, catch: [{target: act}]}\n"),
        "<string>:4:40: missing required key 'error'",
    ),
    (
        "negative max_attempts",
        workflow("  think: {action: agent.think, retry: {max_attempts: -1}}\n"),
        "<string>:4:54: max_attempts: Input should be greater than or equal to 0",
    ),
    (
        "an unknown retry key (Step Functions spelling)",
        workflow("  think: {action: agent.think, retry: {IntervalSeconds: 2}}\n"),
        "<string>:4:40: unknown key 'IntervalSeconds'",
    ),
]


@pytest.mark.parametrize(("text", "message"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_misuse_is_reported_where_it_is(text: str, message: str) -> None:
    with pytest.raises(WorkflowValidationError) as info:
        load_workflow_text(text)

    assert str(info.value) == message


def test_validate_reports_misuse_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(workflow(OK_THINK, extra=OK_EXTRA, tail=OK_TAIL) + REASONS)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN[0][1])

    outcome = cli(capsys, "validate", str(good), str(bad))

    assert outcome.code == 2
    assert outcome.out == f"{good}: ok (5 states, 4 transitions, 2 catch edges)\n"
    assert outcome.err == f"error: {bad}:4:61: unknown catch target state 'nowhere'\n"
    assert cli(capsys, "validate", str(good)).code == 0


def test_validate_checks_a_state_agent_tool_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "choice.yaml"
    path.write_text(
        "name: choice\ntools: [datetime]\ninitial: think\nstates:\n"
        "  think: {action: agent.think, agent: {tool_choice: read_file}}\n"
        "  done: {final: true}\n"
        "transitions:\n  - {source: think, target: done, reason: final_answer}\n"
    )

    outcome = cli(capsys, "validate", str(path))

    assert outcome.code == 2
    assert outcome.err == (
        f"error: {path}:5:53: tool_choice 'read_file' is not a tool offered here "
        "(offered: datetime)\n"
    )


def test_schema_describes_retry_catch_and_state_agent(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, "schema")

    schema = json.loads(outcome.out)
    defs = schema["$defs"]
    state = defs["StateSpec"]["properties"]
    assert state["retry"]["anyOf"][0] == {"$ref": "#/$defs/RetrySpec"}
    assert state["catch"]["items"] == {"$ref": "#/$defs/CatchSpec"}
    assert state["agent"]["anyOf"][0] == {"$ref": "#/$defs/AgentBlock"}
    assert set(defs["RetrySpec"]["properties"]) == {
        "error",
        "max_attempts",
        "backoff_seconds",
        "backoff_rate",
        "max_backoff_seconds",
    }
    assert defs["RetrySpec"]["additionalProperties"] is False
    assert defs["CatchSpec"]["required"] == ["error", "target"]
    assert defs["CatchSpec"]["properties"]["error"]["enum"] == ["agent_error", "error", "any"]


def test_the_guide_example_is_a_valid_workflow() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "errors.md"
    block = page.read_text().split("```yaml\n")[1].split("```")[0]

    spec = load_workflow_text(block, path=str(page))

    assert [(c.source, c.target, c.error) for c in spec.catch_edges()] == [
        ("think", "fallback", "agent_error"),
        ("think", "failed", "any"),
    ]
    assert spec.states["think"].retry == RetrySpec(
        error="agent_error", max_attempts=2, backoff_seconds=1
    )
