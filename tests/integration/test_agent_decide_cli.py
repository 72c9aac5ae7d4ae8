"""agent.decide through the CLI against the fake OpenAI server over loopback: the request offers
the model ONLY the choices whose guards hold (one forced tool, `choose`, with an enum), the
edge picked is taken, an illegal pick is retried then the run ends malformed_output, a resume
and a replay take the recorded picks without asking, and validate reports each decide error at
file:line:col."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, http_error, text_reply, tool_reply

REPO = Path(__file__).resolve().parents[2]
ROUTE = REPO / "tests" / "data" / "decide_route.yaml"
LOOK, WRITE = "look something up", "write the answer now"
FORCED = {"type": "function", "function": {"name": "choose"}}


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def pick(text: str, id: str = "p1") -> Any:
    return tool_reply(call("choose", {"choice": text}, id=id))


def offered(request: dict[str, Any]) -> list[str]:
    """The choices a request offers: its one tool must be `choose`, forced."""
    (tool,) = request["tools"]
    assert tool["function"]["name"] == "choose"
    assert request["tool_choice"] == FORCED
    enum: list[str] = tool["function"]["parameters"]["properties"]["choice"]["enum"]
    return enum


def run(capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path) -> Any:
    return cli(
        capsys,
        "run",
        str(ROUTE),
        "--prompt",
        "What is the capital of France?",
        "--base-url",
        server.base_url,
        "--store",
        str(tmp_path / "runs.db"),
        "--max-retries",
        "0",
        "--json",
    )


def test_only_the_legal_choices_are_offered_and_the_pick_is_taken_then_replayed(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(
        pick(LOOK, "p1"),
        text_reply("Paris is the capital of France."),
        pick(WRITE, "p2"),
        text_reply("Paris."),
    )

    outcome = run(capsys, server, tmp_path)

    assert outcome.code == 0, outcome.err
    result = outcome.json()
    assert (result["termination_reason"], result["response"]) == ("final_answer", "Paris.")
    assert result["tool_calls"] == []  # a pick is no tool call of the workflow's
    first, research, second, write = server.requests
    assert offered(first) == [LOOK]  # write's guard (has_answer) is false: not offered
    assert first["messages"][-1] == {"role": "user", "content": "What next?"}
    assert "tools" not in research
    assert offered(second) == [LOOK, WRITE]
    assert write["messages"][-3]["tool_calls"][0]["function"]["name"] == "choose"
    assert write["messages"][-2] == {
        "role": "tool",
        "content": f"chosen: {WRITE}",
        "tool_call_id": "p2",
        "name": "choose",
    }
    server.assert_complete()

    events = cli(
        capsys, "runs", "events", result["run_id"], "--store", str(tmp_path / "runs.db"), "--json"
    )
    taken = [
        json.loads(line)["data"]
        for line in events.out.splitlines()
        if json.loads(line)["type"] == "transition.taken"
    ]
    assert [(t["source"], t["target"], t.get("choice")) for t in taken] == [
        ("route", "research", LOOK),
        ("research", "route", None),
        ("route", "write", WRITE),
        ("write", "terminate", None),
    ]

    replay = cli(capsys, "replay", result["run_id"], "--store", str(tmp_path / "runs.db"), "--json")
    report = replay.json()
    assert replay.code == 0
    assert report["identical"] is True
    assert report["model_calls_served"] == 4
    assert report["steps"][2]["recorded"] == f'route → write [choice "{WRITE}" and has_answer]'
    assert len(server.requests) == 4, "a replay asks no model"


def test_an_illegal_pick_is_retried_then_the_run_ends_malformed_output(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(pick(WRITE, "p1"), pick("fly to the moon", "p2"))

    outcome = run(capsys, server, tmp_path)

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "malformed_output"
    assert result["error"] == (
        "2 malformed model replies in a row (limits.max_malformed_outputs = 2); the last: "
        f'"fly to the moon" is not one of the offered choices ("{LOOK}")'
    )
    assert result["iterations"] == 2
    first, retry = server.requests
    assert offered(first) == offered(retry) == [LOOK]
    refusal = retry["messages"][-1]
    assert refusal["role"] == "tool"
    assert refusal["tool_call_id"] == "p1"
    assert refusal["content"].startswith(
        f'error: not accepted: "{WRITE}" is not one of the offered choices ("{LOOK}")'
    )
    server.assert_complete()

    replay = cli(capsys, "replay", result["run_id"], "--store", str(tmp_path / "runs.db"), "--json")
    assert replay.json()["identical"] is True
    assert replay.json()["replayed_reason"] == "malformed_output"


def test_a_resume_takes_the_recorded_pick_without_asking_again(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(pick(LOOK), http_error(500))
    ended = run(capsys, server, tmp_path)
    assert ended.code != 0
    assert ended.json()["termination_reason"] == "agent_error"
    run_id = ended.json()["run_id"]
    server.enqueue(text_reply("Paris is the capital."), pick(WRITE, "p2"), text_reply("Paris."))

    resumed = cli(
        capsys,
        "resume",
        run_id,
        "--store",
        str(tmp_path / "runs.db"),
        "--base-url",
        server.base_url,
        "--json",
    )

    assert resumed.code == 0, resumed.err
    assert resumed.json()["response"] == "Paris."
    assert len(server.requests) == 5  # pick, failed research; then research, pick, write
    research = server.requests[2]
    assert "tools" not in research
    assert research["messages"][-3]["tool_calls"][0]["function"]["arguments"] == json.dumps(
        {"choice": LOOK}
    )
    assert offered(server.requests[3]) == [LOOK, WRITE]
    server.assert_complete()


BROKEN = """\
name: decide_broken
initial: route
states:
  route: {action: agent.decide, prompt: "What next?"}
  think: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: route, target: think, choice: think more}
  - {source: route, target: terminate, choice: think more, reason: done}
  - {source: think, target: route, choice: go back}
  - {source: think, target: terminate, reason: final_answer}
"""


def test_validate_names_each_decide_error_at_file_line_col(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN, encoding="utf-8")

    outcome = cli(capsys, "validate", str(path))

    assert outcome.code == 2
    assert outcome.err.splitlines() == [
        f"error: {path}:9:48: choice 'think more' is offered twice out of 'route' "
        "(transitions[0] has it): each choice names one edge",
        f"error: {path}:10:44: 'choice:' only on edges out of an agent.decide state; 'think' "
        "runs agent.think",
    ]


def test_the_schema_covers_choice(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, "schema")

    assert outcome.code == 0
    choice = json.loads(outcome.out)["$defs"]["TransitionSpec"]["properties"]["choice"]
    assert choice["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert choice["description"].startswith("Out of an agent.decide state: the text of this")
