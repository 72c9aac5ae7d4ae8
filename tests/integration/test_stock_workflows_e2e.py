"""Every stock workflow end to end: the real HTTP client against FakeOpenAIServer (real sockets
on loopback), the real kernel and the built-in tools on a temporary workspace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.config import AgentSettings
from fsm_kernel.kernel import RunResult
from fsm_kernel.testing import WorkflowHarness
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    (tmp_path / "answer.txt").write_text("forty-two", encoding="utf-8")
    return tmp_path


def run_over_http(name: str, server: FakeOpenAIServer, prompt: str, **options: Any) -> RunResult:
    """Run stock workflow `name` with the HTTP client pointed at the fake server."""

    async def go() -> RunResult:
        settings = AgentSettings(base_url=server.base_url, model="fake", max_retries=0)
        async with HttpChatModel(settings) as model:
            return await WorkflowHarness(WORKFLOWS / f"{name}.yaml").arun(
                prompt, model=model, **options
            )

    return asyncio.run(go())


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


def last_content(request: dict[str, Any]) -> str:
    return str(request["messages"][-1]["content"])


def test_default_reads_a_file_then_answers(server: FakeOpenAIServer, workspace: Path) -> None:
    server.enqueue(
        tool_reply(call("read_file", {"path": "answer.txt"}, id="c1")), text_reply("forty-two")
    )
    result = run_over_http("default", server, "What is in answer.txt?", workspace=workspace)
    assert (result.termination_reason, result.response) == ("final_answer", "forty-two")
    tool_message = server.requests[1]["messages"][-1]
    assert (tool_message["role"], tool_message["tool_call_id"]) == ("tool", "c1")
    assert tool_message["content"] == "forty-two"
    server.assert_complete()


def test_react_reasons_acts_and_checks_its_answer(
    server: FakeOpenAIServer, workspace: Path
) -> None:
    server.enqueue(
        text_reply("The answer should be in answer.txt."),
        tool_reply(call("read_file", {"path": "answer.txt"}, id="c1")),
        text_reply("The file says forty-two."),
        text_reply("It says forty-two."),
        text_reply("answer.txt says: forty-two."),
    )
    result = run_over_http("react", server, "What is in answer.txt?", workspace=workspace)
    assert result.termination_reason == "final_answer"
    assert result.response == "answer.txt says: forty-two."
    assert [r.call.name for r in result.tool_calls] == ["read_file"]
    requests = server.requests
    assert len(requests) == 5
    assert [("tools" in r) for r in requests] == [False, True, False, True, False]
    assert "read_file" in tool_names(requests[1])
    assert last_content(requests[0]).startswith("Think about the next step")
    assert last_content(requests[4]).startswith("Check your answer")
    server.assert_complete()


def test_plan_execute_runs_each_step_as_a_react_child_run(
    server: FakeOpenAIServer, workspace: Path
) -> None:
    server.enqueue(
        text_reply(json.dumps({"steps": ["Read answer.txt."]})),
        text_reply("I should read answer.txt."),
        tool_reply(call("read_file", {"path": "answer.txt"}, id="c1")),
        text_reply("I have it."),
        text_reply("answer.txt holds forty-two."),
        text_reply("answer.txt holds forty-two."),
        text_reply("The file says forty-two."),
    )
    result = run_over_http("plan_execute", server, "What does the file say?", workspace=workspace)
    assert (result.termination_reason, result.response) == (
        "final_answer",
        "The file says forty-two.",
    )
    requests = server.requests
    assert len(requests) == 7
    assert "tools" not in requests[0]
    assert requests[0]["response_format"]["type"] == "json_schema"  # the plan is JSON
    assert "read_file" in tool_names(requests[2])  # the react child's think state
    assert "Your part is step 1: Read answer.txt." in requests[1]["messages"][1]["content"]
    assert "tools" not in requests[6]
    assert "→ answer.txt holds forty-two." in requests[6]["messages"][-2]["content"]
    server.assert_complete()


def test_reflect_revises_once_then_passes(server: FakeOpenAIServer) -> None:
    server.enqueue(
        text_reply("Water boils at 100 degrees."),
        text_reply("1. Say which scale and at what pressure."),
        text_reply("Water boils at 100 °C at sea-level pressure."),
        text_reply("PASS"),
        text_reply("Water boils at 100 °C at sea-level pressure."),
    )
    result = run_over_http("reflect", server, "At what temperature does water boil?")
    assert result.termination_reason == "final_answer"
    assert result.response == "Water boils at 100 °C at sea-level pressure."
    requests = server.requests
    assert len(requests) == 5
    assert tool_names(requests[0]) == ["datetime", "read_file", "list_directory"]
    assert all("tools" not in r for r in requests[1:])
    assert last_content(requests[1]).startswith("Review your latest answer")
    assert last_content(requests[2]).startswith("Rewrite your answer")
    assert last_content(requests[3]).startswith("Review your latest answer")
    server.assert_complete()


def test_single_shot_is_one_request_without_tools(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("Bonjour."))
    result = run_over_http("single_shot", server, "Say hello in French.")
    assert (result.termination_reason, result.response) == ("final_answer", "Bonjour.")
    assert len(server.requests) == 1
    assert "tools" not in server.requests[0]
    assert [m["role"] for m in server.requests[0]["messages"]] == ["system", "user"]
    server.assert_complete()
