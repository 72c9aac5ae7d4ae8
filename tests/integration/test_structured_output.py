"""Structured output end to end: `fsm-kernel run` (and the Python API) over real HTTP against
the fake OpenAI-compatible server: the schema sent as `response_format`, a server that rejects
it (the schema goes in the prompt, recorded once per run), replies that fail the schema retried
inside the malformed budget or ending the run, a pydantic model's instance as `.output`, and
resume and replay reproducing the output from the log."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel.protocol import Event, EventType, ResponseFormat
from fsm_kernel.store import JsonlEventStore, SqliteEventStore
from tests.clikit import cli
from tests.data.output_models import Weather
from tests.fakes.openai_server import (
    NO_RESPONSE_FORMAT,
    FakeOpenAIServer,
    call,
    http_error,
    text_reply,
    tool_reply,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number", "minimum": -90}},
    "required": ["city", "temp_c"],
    "additionalProperties": False,
}
WIRE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "output", "schema": SCHEMA, "strict": True},
}
OSLO = '{"city": "Oslo", "temp_c": 3}'

WORKFLOW = """\
name: forecast
system_prompt: You forecast the weather.
tools: [datetime, done]
output: {output}
limits: {{max_malformed_outputs: {budget}}}
initial: think
states:
  think: {{action: agent.think}}
  act:   {{action: tools.execute}}
  check: {{action: kernel.evaluate}}
  end:   {{final: true}}
transitions:
  - {{source: think, target: act,   guard: has_tool_calls}}
  - {{source: think, target: think, guard: malformed_output, unless: retries_exhausted}}
  - {{source: think, target: end,   guard: malformed_output, reason: malformed_output}}
  - {{source: think, target: end,   reason: final_answer}}
  - {{source: act,   target: check}}
  - {{source: check, target: end,   guard: done_called, reason: done}}
  - {{source: check, target: think}}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def write(tmp_path: Path, output: str = json.dumps(SCHEMA), budget: int = 3) -> Path:
    path = tmp_path / "forecast.yaml"
    path.write_text(WORKFLOW.format(output=output, budget=budget))
    return path


def run(
    capsys: pytest.CaptureFixture[str],
    workflow: Path,
    base_url: str,
    store: Path,
    *extra: str,
) -> tuple[int, dict[str, Any]]:
    outcome = cli(
        capsys,
        "run", str(workflow), "-p", "Weather in Oslo?", "--base-url", base_url,
        "--store", str(store), "--workspace", str(workflow.parent), "--json", *extra,
    )  # fmt: skip
    return outcome.code, outcome.json()


def events(store: Path) -> list[Event]:
    with SqliteEventStore(store) as opened:
        (summary,) = opened.list_runs()
        return opened.read(summary.run_id)


def notices(log: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in log if e.type == EventType.MODEL_NOTICE]


def iterations(log: list[Event]) -> list[tuple[str, str | None]]:
    return [
        (e.data["decision"], e.data["error"])
        for e in log
        if e.type == EventType.ITERATION_COMPLETED
    ]


# --- asking for JSON ------------------------------------------------------------------------


def test_the_schema_is_sent_as_response_format_and_the_output_is_in_json(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {}, id="c1")), text_reply(OSLO))

    code, result = run(capsys, write(tmp_path), server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["termination_reason"] == "final_answer"
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    assert result["response"] == OSLO
    first, second = server.requests
    assert first["response_format"] == WIRE_FORMAT
    assert second["response_format"] == WIRE_FORMAT
    assert {t["function"]["name"] for t in first["tools"]} == {"datetime", "done"}
    assert first["messages"][0] == {"role": "system", "content": "You forecast the weather."}
    log = events(tmp_path / "r.db")
    assert notices(log) == []
    requested = [e.data for e in log if e.type == EventType.MODEL_REQUESTED]
    assert [r["output"] for r in requested] == ["output", "output"]
    (ended,) = [e.data for e in log if e.type == EventType.RUN_TERMINATED]
    assert ended["output"] == {"city": "Oslo", "temp_c": 3}
    server.assert_complete()


def test_the_human_output_prints_the_json_answer(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply(OSLO))

    outcome = cli(
        capsys,
        "run", str(write(tmp_path)), "-p", "Weather?", "--base-url", server.base_url,
        "--store", str(tmp_path / "r.db"),
    )  # fmt: skip

    assert outcome.code == 0
    assert outcome.out.splitlines()[0] == OSLO


def test_a_server_that_rejects_response_format_gets_the_schema_in_the_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer(reject_response_format=True) as server:
        server.enqueue(tool_reply(call("datetime", {}, id="c1")), text_reply(OSLO))
        code, result = run(capsys, write(tmp_path), server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    assert server.rejected == 1  # detected once: later requests ask in the prompt at once
    rejected, asked, answered = server.requests
    assert rejected["response_format"] == WIRE_FORMAT
    instructions = ResponseFormat(name="output", schema=SCHEMA).instructions(tools=True)
    for request in (asked, answered):
        assert "response_format" not in request
        assert request["messages"][0] == {
            "role": "system",
            "content": f"You forecast the weather.\n\n{instructions}",
        }
        assert [m["role"] for m in request["messages"]].count("system") == 1
    assert instructions.endswith(json.dumps(SCHEMA))
    (notice,) = notices(events(tmp_path / "r.db"))
    assert notice["kind"] == "response_format_fallback"
    assert NO_RESPONSE_FORMAT in notice["reason"]


def test_each_run_of_an_agent_records_the_fallback_once_but_detects_it_once(
    tmp_path: Path,
) -> None:
    workflow = write(tmp_path)

    async def two_runs(base_url: str) -> list[fsm_kernel.RunResult]:
        async with fsm_kernel.Agent(workflow, base_url=base_url) as agent:
            return [await agent.run("Oslo?"), await agent.run("Oslo again?")]

    with FakeOpenAIServer(reject_response_format=True) as server:
        server.enqueue(text_reply(OSLO), text_reply(OSLO))
        first, second = asyncio.run(two_runs(server.base_url))

    assert server.rejected == 1
    assert len(server.requests) == 3
    for result in (first, second):
        assert result.output == {"city": "Oslo", "temp_c": 3}
        (notice,) = notices(result.events)
        assert notice["kind"] == "response_format_fallback"


# --- replies that fail the schema -------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (
            "It is 3 degrees in Oslo.",
            "the reply is not JSON (Expecting value: line 1 column 1 (char 0))",
        ),
        (
            '{"city": "Oslo"}',
            "the reply does not match the output schema: at $: 'temp_c' is a required property",
        ),
    ],
)
def test_an_invalid_reply_then_a_valid_one_is_accepted_within_the_budget(
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    bad: str,
    problem: str,
) -> None:
    server.enqueue(text_reply(bad), text_reply(OSLO))

    code, result = run(capsys, write(tmp_path, budget=2), server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["termination_reason"] == "final_answer"
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    assert result["iterations"] == 2
    assert iterations(events(tmp_path / "r.db")) == [("malformed", problem), ("answer", None)]
    retry = server.requests[1]
    assert retry["response_format"] == WIRE_FORMAT
    assert retry["messages"][-2] == {"role": "assistant", "content": bad}
    assert retry["messages"][-1] == {
        "role": "user",
        "content": f"Your reply was not accepted: {problem}. Reply again with only a JSON value "
        f"that matches this JSON Schema:\n{json.dumps(SCHEMA)}",
    }


def test_an_exhausted_budget_ends_the_run_malformed_output(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("Cold."), text_reply('{"city": 1}'))

    code, result = run(capsys, write(tmp_path, budget=2), server.base_url, tmp_path / "r.db")

    assert code == 1
    assert result["termination_reason"] == "malformed_output"
    assert result["output"] is None
    assert result["response"] == ""
    assert result["error"] == (  # the workflow's edge ended it; the error says why
        "2 malformed model replies in a row; the last: the reply does not match the output "
        "schema: at $: 'temp_c' is a required property; at $.city: 1 is not of type 'string'"
    )
    assert len(server.requests) == 2


def test_a_done_answer_is_validated_too(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("done", {"answer": "Oslo: 3 degrees"}, id="d1")),
        tool_reply(call("done", {"answer": OSLO}, id="d2")),
    )

    code, result = run(capsys, write(tmp_path), server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["termination_reason"] == "done"
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    refused, accepted = result["tool_calls"]
    assert refused["is_error"]
    assert refused["result"].startswith(
        "error: your reply was not executed: the answer given to done is not JSON"
    )
    assert (accepted["is_error"], accepted["result"]) == (False, OSLO)


def test_a_failing_reply_where_no_edge_retries_is_never_a_success(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "once.yaml"
    workflow.write_text(
        f"name: once\noutput: {json.dumps(SCHEMA)}\ninitial: answer\nstates:\n"
        "  answer: {action: agent.think}\n  end: {final: true}\n"
        "transitions:\n  - {source: answer, target: end, reason: final_answer}\n"
    )
    server.enqueue(text_reply("Cold in Oslo."))

    code, result = run(capsys, workflow, server.base_url, tmp_path / "r.db")

    assert code == 1
    assert result["termination_reason"] == "malformed_output"
    assert result["error"] == "the reply is not JSON (Expecting value: line 1 column 1 (char 0))"


def test_only_states_whose_reply_is_the_answer_get_the_workflow_schema(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "planned.yaml"
    workflow.write_text(
        f"name: planned\noutput: {json.dumps(SCHEMA)}\ninitial: plan\nstates:\n"
        "  plan: {action: agent.think, answer: false, prompt: Plan first.}\n"
        "  answer: {action: agent.think}\n  end: {final: true}\n"
        "transitions:\n  - {source: plan, target: answer}\n"
        "  - {source: answer, target: end, reason: final_answer}\n"
    )
    server.enqueue(text_reply("I will look it up."), text_reply(OSLO))

    code, result = run(capsys, workflow, server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    plan, answer = server.requests
    assert "response_format" not in plan
    assert answer["response_format"] == WIRE_FORMAT


# --- a pydantic model ------------------------------------------------------------------------


def test_a_pydantic_model_gives_its_instance_through_the_python_api(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow = write(tmp_path, output="tests.data.output_models:Weather")
    server.enqueue(
        text_reply('{"city": "oslo", "temp_c": 3, "conditions": ["snow"]}'),
        text_reply('{"city": "Oslo", "temp_c": 3, "conditions": ["snow"]}'),
    )

    result = fsm_kernel.run(workflow, "Weather in Oslo?", base_url=server.base_url)

    assert result.ok
    assert isinstance(result.output, Weather)
    assert result.output == Weather(city="Oslo", temp_c=3.0, conditions=["snow"])
    assert result.to_dict()["output"] == {"city": "Oslo", "temp_c": 3.0, "conditions": ["snow"]}
    first, retry = server.requests
    assert first["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Weather", "schema": Weather.model_json_schema(), "strict": True},
    }
    assert retry["messages"][-1]["content"].startswith(
        "Your reply was not accepted: the reply does not match the output schema: at $.city: "
        "Value error, a city name starts with a capital letter."
    )


# --- resume and replay -----------------------------------------------------------------------


def test_resume_rebuilds_the_retry_from_the_log_and_replay_reproduces_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "r.db"
    workflow = write(tmp_path)
    with FakeOpenAIServer() as down:
        down.enqueue(text_reply("Cold."), http_error(503))
        code, failed = run(capsys, workflow, down.base_url, store)
    assert (code, failed["termination_reason"]) == (1, "agent_error")

    with FakeOpenAIServer() as up:
        up.enqueue(text_reply(OSLO))
        resumed = cli(
            capsys, "resume", failed["run_id"], "--base-url", up.base_url,
            "--store", str(store), "--json",
        )  # fmt: skip

    assert resumed.code == 0
    assert resumed.json()["output"] == {"city": "Oslo", "temp_c": 3}
    (request,) = up.requests  # the first reply came from the log, its correction with it
    assert request["messages"][-2:] == [
        {"role": "assistant", "content": "Cold."},
        {
            "role": "user",
            "content": "Your reply was not accepted: the reply is not JSON (Expecting value: "
            "line 1 column 1 (char 0)). Reply again with only a JSON value that matches this "
            f"JSON Schema:\n{json.dumps(SCHEMA)}",
        },
    ]

    replayed = cli(capsys, "replay", failed["run_id"], "--store", str(store), "--json")

    assert replayed.code == 0
    report = replayed.json()
    assert report["identical"] is True
    assert report["recorded_output"] == report["replayed_output"] == {"city": "Oslo", "temp_c": 3}


def test_a_killed_run_is_resumed_from_its_answers_without_calling_the_model(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "r.jsonl"
    server.enqueue(text_reply("Cold."), text_reply(OSLO))
    code, done = run(capsys, write(tmp_path), server.base_url, store)
    assert code == 0
    # Cut the log right after the last model answer, as a SIGKILL there would leave it.
    lines = store.read_text().splitlines()
    kept = 1 + max(
        i for i, line in enumerate(lines) if json.loads(line)["type"] == "model.responded"
    )
    store.write_text("\n".join(lines[:kept]) + "\n")

    resumed = cli(capsys, "resume", done["run_id"], "--store", str(store), "--json")

    assert resumed.code == 0
    assert len(server.requests) == 2  # both answers came from the log: no model was asked
    assert resumed.json()["output"] == {"city": "Oslo", "temp_c": 3}
    assert resumed.json()["response"] == OSLO
    with JsonlEventStore(store) as opened:
        log = opened.read(done["run_id"])
    assert [e.type for e in log].count(EventType.MODEL_RESPONDED) == 2
    assert log[-1].data["output"] == {"city": "Oslo", "temp_c": 3}


def refuse_format(status: int, body: Any) -> Any:
    """A reply that refuses any request carrying response_format with `status` and `body`."""

    def answer(request: dict[str, Any]) -> Any:
        return http_error(status, body) if "response_format" in request else text_reply(OSLO)

    return answer


LLAMA_CPP_PYTHON_500 = {  # llama_cpp.server 0.3's answer to a json_schema response_format
    "error": {
        "message": "1 validation error: {'type': 'literal_error', 'loc': ('body', "
        "'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\", "
        "'input': 'json_schema'}",
        "type": "internal_server_error",
    }
}


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, {"error": "Unsupported parameter: 'response_format'"}),
        (400, {"object": "error", "message": "json_schema format is not supported", "code": 400}),
        (422, "response_format is not supported by this server"),
        (500, LLAMA_CPP_PYTHON_500),
    ],
    ids=["ollama-shape", "vllm-flat", "plain-text-422", "llama-cpp-python-500"],
)
def test_refusals_of_the_field_in_other_shapes_fall_back_too(
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    status: int,
    body: Any,
) -> None:
    server.enqueue(refuse_format(status, body), refuse_format(status, body))

    code, result = run(
        capsys, write(tmp_path), server.base_url, tmp_path / "r.db", "--max-retries", "2"
    )

    assert code == 0
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    assert ["response_format" in r for r in server.requests] == [True, False]  # no retry


def test_a_refusal_about_something_else_is_not_taken_for_one_of_the_field(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(http_error(400, {"error": {"message": "Invalid 'messages[1]'.", "code": None}}))

    code, result = run(capsys, write(tmp_path), server.base_url, tmp_path / "r.db")

    assert code == 1
    assert result["termination_reason"] == "agent_error"
    assert "Invalid 'messages[1]'." in result["error"]
    assert len(server.requests) == 1
    assert notices(events(tmp_path / "r.db")) == []


# --- the local model -------------------------------------------------------------------------

try:
    from fsm_kernel.agent.local import local_model_available
except ImportError:  # pragma: no cover - the module imports without the extra
    local_model_available = None  # type: ignore[assignment]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    local_model_available is None or not local_model_available(),
    reason="needs the 'local' extra (llama_cpp and the bundled model)",
)
def test_the_local_model_answers_under_the_schema(tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    workflow = tmp_path / "local.yaml"
    workflow.write_text(
        f"name: local\nsystem_prompt: You report the weather.\noutput: {json.dumps(schema)}\n"
        "limits: {max_malformed_outputs: 1}\ninitial: answer\nstates:\n"
        "  answer: {action: agent.think}\n  end: {final: true}\n"
        "transitions:\n  - {source: answer, target: end, reason: final_answer}\n"
    )

    result = fsm_kernel.run(workflow, "Is it sunny in Paris today?", model="local")

    assert result.termination_reason == "final_answer", result.error
    assert isinstance(result.output, dict)
    assert set(result.output) == {"city", "sunny"}
    assert isinstance(result.output["city"], str)
    assert isinstance(result.output["sunny"], bool)
    assert json.loads(result.response) == result.output


# --- the structured-output guide's example ---------------------------------------------------


def test_the_guide_example_runs_as_written(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "structured-output.md"
    (example,) = re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)[:1]
    workflow = tmp_path / "forecast.yaml"
    workflow.write_text(example)
    server.enqueue(
        tool_reply(call("datetime", {}, id="c1")),
        text_reply('{"city": "Oslo", "temp_c": -100}'),
        text_reply(OSLO),
    )

    code, result = run(capsys, workflow, server.base_url, tmp_path / "r.db")

    assert code == 0
    assert result["output"] == {"city": "Oslo", "temp_c": 3}
    assert server.requests[0]["response_format"] == WIRE_FORMAT
    assert server.requests[2]["messages"][-1]["content"].startswith(
        "Your reply was not accepted: the reply does not match the output schema: at $.temp_c: "
        "-100 is less than the minimum of -90."
    )
