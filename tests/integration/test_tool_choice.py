"""Requests real servers understand: with tools, `tool_choice` is sent (`auto` unless the
workflow says otherwise), per agent or per state, validated at file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_kernel.cli import main
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from tests.fakes.openai_server import FakeOpenAIServer, text_reply, tool_reply
from tests.fakes.openai_server import call as wire_call

WORKFLOW = """\
name: choices
tools: [datetime, done]
agent: {{tool_choice: {agent}}}
initial: pick
states:
  pick:  {{action: agent.think, tool_choice: {state}}}
  act:   {{action: tools.execute}}
  think: {{action: agent.think}}
  quiet: {{action: agent.think, tools: []}}
  end:   {{final: true}}
transitions:
  - {{source: pick,  target: act,   guard: has_tool_calls}}
  - {{source: pick,  target: end,   reason: final_answer}}
  - {{source: act,   target: think}}
  - {{source: think, target: quiet}}
  - {{source: quiet, target: end,   reason: final_answer}}
"""


def write(tmp_path: Path, *, agent: str = "auto", state: str = "auto") -> Path:
    path = tmp_path / "choices.yaml"
    path.write_text(WORKFLOW.format(agent=agent, state=state))
    return path


def run(tmp_path: Path, workflow: Path, server: FakeOpenAIServer) -> int:
    return main(
        ["run", str(workflow), "-p", "time?", "--base-url", server.base_url, "--json",
         "--store", str(tmp_path / "r.db")]
    )  # fmt: skip


def script(server: FakeOpenAIServer) -> None:
    server.enqueue(tool_reply(wire_call("datetime")), text_reply("noon"), text_reply("Noon."))


def test_auto_is_sent_with_tools_and_nothing_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer() as server:
        script(server)
        assert run(tmp_path, write(tmp_path), server) == 0

    pick, think, quiet = server.requests
    assert pick["tool_choice"] == "auto"
    assert think["tool_choice"] == "auto"
    assert "tools" not in quiet
    assert "tool_choice" not in quiet  # no tools offered: no choice to make


def test_a_state_can_force_one_tool_and_the_agent_can_omit_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer() as server:
        script(server)
        assert run(tmp_path, write(tmp_path, agent="omit", state="datetime"), server) == 0

    pick, think, _ = server.requests
    assert pick["tool_choice"] == {"type": "function", "function": {"name": "datetime"}}
    assert "tool_choice" not in think  # the agent's `omit`, for servers that reject the field
    assert "tools" in think


@pytest.mark.parametrize(
    ("agent", "state", "line_col", "message"),
    [
        ("auto", "clock", "6:45", "tool_choice 'clock' is not a tool offered here"),
        ("nosuch", "auto", "3:22", "tool_choice 'nosuch' is not a tool offered here"),
        ("auto", "'two words'", "6:45", "tool_choice: String should match pattern"),
    ],
)
def test_bad_choices_are_reported_where_they_are_written(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    agent: str,
    state: str,
    line_col: str,
    message: str,
) -> None:
    path = write(tmp_path, agent=agent, state=state)

    code = main(["validate", str(path)])

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {path}:{line_col}: {message}"), err


def test_required_where_no_tool_is_offered_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path)
    path.write_text(path.read_text().replace("tools: []}", "tools: [], tool_choice: required}"))

    assert main(["validate", str(path)]) == 2
    assert "tool_choice 'required' where no tool is offered" in capsys.readouterr().err


def test_the_scripted_model_sees_the_states_choice(tmp_path: Path) -> None:
    model = ScriptedChatModel([call("datetime"), "noon", "Noon."])
    harness = WorkflowHarness(write(tmp_path, state="required"))

    result = harness.run("time?", model=model)

    assert result.termination_reason == "final_answer"
    assert [r.tool_choice for r in model.requests] == ["required", None, None]
