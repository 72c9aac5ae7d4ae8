"""Structured output on hostile input, through the CLI and the Python API against the fake
server: a `pattern` that backtracks without end on the model's text, an answer nested thousands
of levels deep, and a schema whose `$ref`s loop. Each is malformed output fed back to the model
(the run goes on and succeeds on the next reply) or a clear error, never a hung or crashed run.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel.workflow.output import OutputError, OutputSchema
from fsm_kernel.workflow.spec import WorkflowSpec
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.integration.test_structured_output import events, iterations, run, write

EVIL: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^(a+)+$"}},
    "required": ["code"],
}
"""A pattern that backtracks exponentially on a run of `a`s that does not match."""


def test_a_pattern_that_backtracks_without_end_is_malformed_output_fed_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile = json.dumps({"code": "a" * 40 + "!"})  # 2**40 steps for re: hours
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply(hostile), text_reply('{"code": "aaa"}'))
        code, result = run(
            capsys, write(tmp_path, output=json.dumps(EVIL)), server.base_url, tmp_path / "r.db"
        )
        retry = server.requests[1]["messages"][-1]["content"]

    assert code == 0
    assert (result["termination_reason"], result["output"]) == ("final_answer", {"code": "aaa"})
    problem = (
        "the reply does not match the output schema: could not be checked against the output "
        "schema's patterns within 2 s (a string too long or too repetitive for them)"
    )
    assert iterations(events(tmp_path / "r.db")) == [("malformed", problem), ("answer", None)]
    assert retry.startswith(f"Your reply was not accepted: {problem}.")


def test_patterns_still_check_what_they_should(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}},
        "patternProperties": {"^x-": {"type": "integer"}},
        "required": ["id"],
    }
    bad = '{"id": "ab-1", "x-n": "two"}'
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply(bad), text_reply('{"id": "ABC-12", "x-n": 2}'))
        code, result = run(
            capsys, write(tmp_path, output=json.dumps(schema)), server.base_url, tmp_path / "r.db"
        )

    assert code == 0
    assert result["output"] == {"id": "ABC-12", "x-n": 2}
    problem = (
        "the reply does not match the output schema: at $.id: 'ab-1' does not match "
        "'^[A-Z]{3}-[0-9]+$'; at $.x-n: 'two' is not of type 'integer'"
    )
    assert iterations(events(tmp_path / "r.db")) == [("malformed", problem), ("answer", None)]


@pytest.mark.parametrize("levels", [65, 5_000])
def test_an_answer_nested_too_deeply_is_malformed_output_fed_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], levels: int
) -> None:
    schema = {"type": "array"}
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply("[" * levels + "]" * levels), text_reply("[[1], [2]]"))
        code, result = run(
            capsys, write(tmp_path, output=json.dumps(schema)), server.base_url, tmp_path / "r.db"
        )

    assert code == 0
    assert (result["termination_reason"], result["output"]) == ("final_answer", [[1], [2]])
    problem = "the reply nests deeper than 64 levels of arrays and objects"
    assert iterations(events(tmp_path / "r.db")) == [("malformed", problem), ("answer", None)]


def test_an_answer_64_levels_deep_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = "[" * 64 + "]" * 64
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply(deep))
        code, result = run(
            capsys, write(tmp_path, output='{"type": "array"}'), server.base_url, tmp_path / "r.db"
        )
    assert code == 0
    assert json.dumps(result["output"]).replace(" ", "") == deep


LOOPS = [
    ({"$ref": "#"}, "$ref '#' loops back", ("$ref",)),
    (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "$ref '#/$defs/b' → $ref '#/$defs/a' loops back",
        ("$defs", "b", "$ref"),
    ),
    (
        {"anyOf": [{"type": "string"}, {"allOf": [{"$ref": "#"}]}]},
        "anyOf[1] → allOf[0] → $ref '#' loops back",
        ("anyOf", 1, "allOf", 0, "$ref"),
    ),
]


@pytest.mark.parametrize(("schema", "message", "where"), LOOPS)
def test_a_schema_whose_refs_loop_is_refused_when_resolved(
    schema: dict[str, Any], message: str, where: tuple[Any, ...]
) -> None:
    with pytest.raises(OutputError) as info:
        OutputSchema.resolve(schema)
    assert str(info.value) == (
        f"{message} without descending into the value: checking any value against it would "
        "never end"
    )
    assert info.value.path == where


def test_recursive_schemas_that_descend_are_fine() -> None:
    tree = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
        "$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pair"}]},
                  "pair": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
    }  # fmt: skip
    checked = OutputSchema.resolve(tree).check_text('{"kids": [{"kids": []}, {}]}')
    assert checked.problem is None
    with pytest.raises(OutputError, match=r"^\$ref '#/\$defs/nope' points at nothing"):
        OutputSchema.resolve({"$ref": "#/$defs/nope"})


def test_a_workflow_built_in_python_with_a_looping_schema_fails_with_a_clear_error(
    tmp_path: Path,
) -> None:
    looping = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#"}
    spec = WorkflowSpec.model_validate(
        {
            "name": "loopy",
            "tools": [],
            "output": looping,
            "initial": "think",
            "states": {"think": {"action": "agent.think"}, "end": {"final": True}},
            "transitions": [{"source": "think", "target": "end", "reason": "final_answer"}],
        }
    )  # built in code: `validate` never saw it
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply("{}"))
        with pytest.raises(OutputError, match="loops back without descending into the value"):
            fsm_kernel.run(spec, "go", base_url=server.base_url, model="m")
        assert server.requests == []  # refused before any model call


def test_validate_reports_a_looping_schema_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.clikit import cli

    workflow = write(tmp_path, output='{"$ref": "#"}')
    done = cli(capsys, "validate", str(workflow))
    assert done.code == 2
    assert f"{workflow}:4:" in done.err
    assert "loops back without descending into the value" in done.err


def test_a_pattern_check_leaves_the_event_loop_to_the_other_runs(tmp_path: Path) -> None:
    """The check of a reply against patterns runs in a process of its own for up to 2 s: it is
    waited for off the event loop, so the process's other runs (and anything else on the loop)
    go on meanwhile."""
    from fsm_kernel.testing import ScriptedChatModel

    hostile = json.dumps({"code": "a" * 40 + "!"})  # the check is stopped at its 2 s deadline
    workflow = write(tmp_path, output=json.dumps(EVIL), budget=1)
    ticks = 0

    async def tick(done: asyncio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            await asyncio.sleep(0.02)
            ticks += 1

    async def main() -> str:
        done = asyncio.Event()
        ticker = asyncio.ensure_future(tick(done))
        model = ScriptedChatModel([hostile, hostile])
        async with fsm_kernel.Agent(str(workflow), chat_model=model, store=None) as agent:
            result = await agent.run("Weather in Oslo?")
        done.set()
        await ticker
        return result.termination_reason

    assert asyncio.run(main()) == "malformed_output"
    assert ticks >= 25  # the loop turned all along (blocked, it turned about once)
