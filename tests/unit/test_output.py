"""Structured output without a server: `output:` in the spec and its load-time checks (each
misuse a `path:line:col: message`), the JSON Schema of workflow files, the check of replies
against a schema or a pydantic model, and runs with a scripted model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.protocol import Completion, Message, ResponseFormat, ToolCall
from fsm_kernel.streaming import StreamNotice, deltas_to, emit_notice_once
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.output import OutputError, OutputSchema, as_json
from fsm_kernel.workflow.spec import WorkflowSpec
from tests.clikit import cli
from tests.data.output_models import Loose, Weather

WEATHER = "tests.data.output_models:Weather"

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number", "minimum": -90}},
    "required": ["city", "temp_c"],
    "additionalProperties": False,
}

WORKFLOW = """\
name: shaped
tools: [datetime, done]
{top}
initial: think
states:
  think:
    action: agent.think
{think}
  act:  {{action: tools.execute}}
  note: {{action: session.observe}}
  end:  {{final: true}}
transitions:
  - {{source: think, target: act, guard: has_tool_calls}}
  - {{source: think, target: think, guard: malformed_output, unless: retries_exhausted}}
  - {{source: think, target: end, guard: malformed_output, reason: malformed_output}}
  - {{source: think, target: end, reason: final_answer}}
  - {{source: act, target: note, guard: done_called}}
  - {{source: act, target: think}}
  - {{source: note, target: end, reason: done}}
"""


def workflow(top: str = "", think: str = "") -> str:
    return WORKFLOW.format(top=top, think=think)


def load(text: str) -> WorkflowSpec:
    return load_workflow_text(text, path="shaped.yaml")


# --- the spec and its checks ----------------------------------------------------------------


def test_a_mapping_and_a_reference_load_and_apply_where_the_reply_is_the_answer() -> None:
    spec = load(workflow(top=f"output: {json.dumps(SCHEMA)}"))
    compiled = compile_workflow(spec)

    assert spec.output == SCHEMA
    assert set(compiled.outputs) == {"think"}  # not act or note: they do not call the model
    assert compiled.outputs["think"].schema == SCHEMA
    assert compiled.outputs["think"].model is None

    own = load(workflow(think=f"    output: {WEATHER}"))
    schema = compile_workflow(own).outputs["think"]
    assert schema.model is Weather
    assert schema.schema == Weather.model_json_schema()
    assert schema.name == "Weather"


def test_a_state_with_answer_false_gets_no_workflow_output_but_may_have_its_own() -> None:
    text = workflow(top=f"output: {WEATHER}", think="    answer: false").replace(
        "  end:  {final: true}",
        "  final_check: {action: agent.think}\n  end:  {final: true}",
    )
    text = text.replace(
        "  - {source: think, target: end, reason: final_answer}",
        "  - {source: think, target: final_check}\n"
        "  - {source: final_check, target: end, reason: final_answer}",
    )
    compiled = compile_workflow(load(text))
    assert set(compiled.outputs) == {"final_check"}

    own = text.replace("    answer: false", f"    answer: false\n    output: {json.dumps(SCHEMA)}")
    assert compile_workflow(load(own)).outputs["think"].schema == SCHEMA


@pytest.mark.parametrize(
    ("top", "think", "where", "message"),
    [
        (
            "output: no_such_module_xyz:Model",
            "",
            "3:9",
            "output: cannot import module 'no_such_module_xyz' for 'no_such_module_xyz:Model'",
        ),
        (
            "output: tests.data.output_models:Missing",
            "",
            "3:9",
            "output: module 'tests.data.output_models' has no attribute 'Missing'",
        ),
        (
            "output: tests.data.output_models:not_a_model",
            "",
            "3:9",
            "output: 'tests.data.output_models:not_a_model' is not a pydantic model",
        ),
        (
            "output: tests.data.output_models:NUMBER",
            "",
            "3:9",
            "output: 'tests.data.output_models:NUMBER' is not callable",
        ),
        (
            "output: just words",
            "",
            "3:9",
            "output: Value error, must be a JSON Schema (a mapping) or a 'package.module:Model'",
        ),
        ("output: [a, b]", "", "3:9", "output: Value error, must be a JSON Schema"),
        (
            "output:\n  type: object\n  properties:\n    city: {type: strng}",
            "",
            "6:18",
            "output: not a valid JSON Schema: 'strng' is not valid under any of the given schemas",
        ),
        (
            "output:\n  type: object\n  required: city",
            "",
            "5:13",
            "output: not a valid JSON Schema: 'city' is not of type 'array'",
        ),
        (
            "output:\n  $schema: http://example.com/my-schema\n  type: object",
            "",
            "4:12",
            "output: unknown $schema 'http://example.com/my-schema'",
        ),
        (
            "output:\n  type: object\n  properties:\n    a: {$ref: 'https://example.com/a.json'}",
            "",
            "6:15",
            "output: $ref 'https://example.com/a.json' points outside the schema; only local "
            "references (#/$defs/...) are supported",
        ),
        (
            "output:\n  type: string\n  default: 2024-01-01",
            "",
            "5:12",
            "output: datetime.date(2024, 1, 1) is not a JSON value (a YAML date or timestamp? "
            "quote it)",
        ),
        (
            "",
            "    output: tests.data.output_models:not_a_model",
            "8:13",
            "output: 'tests.data.output_models:not_a_model' is not a pydantic model",
        ),
        (
            "",
            "    answer: false",
            None,
            None,
        ),
    ],
)
def test_misuse_is_reported_where_it_is(
    top: str, think: str, where: str | None, message: str | None
) -> None:
    text = workflow(top=top, think=think)
    if where is None:  # a control case: loads
        load(text)
        return
    with pytest.raises(WorkflowValidationError) as caught:
        load(text)
    assert str(caught.value).startswith(f"shaped.yaml:{where}: {message}"), str(caught.value)


def test_output_on_a_state_that_does_not_call_the_model_is_refused() -> None:
    text = workflow().replace(
        "  note: {action: session.observe}",
        f"  note: {{action: session.observe, output: {WEATHER}}}",
    )
    with pytest.raises(WorkflowValidationError) as caught:
        load(text)
    assert str(caught.value).startswith(
        "shaped.yaml:10:43: 'output' does nothing on state 'note': only a state whose action "
        "calls the model"
    ), str(caught.value)


def test_a_workflow_output_that_applies_to_no_state_is_refused() -> None:
    text = workflow(top=f"output: {WEATHER}", think=f"    output: {json.dumps(SCHEMA)}")
    with pytest.raises(WorkflowValidationError) as caught:
        load(text)
    assert str(caught.value).startswith("shaped.yaml:3:9: 'output' applies to no state"), str(
        caught.value
    )


def test_validate_reports_misuse_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(workflow(top=f"output: {WEATHER}"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(workflow(top="output: tests.data.output_models:not_a_model"))

    ok = cli(capsys, "validate", str(good))
    failed = cli(capsys, "validate", str(good), str(bad))

    assert ok.code == 0
    assert ok.out == f"{good}: ok (4 states, 7 transitions)\n"
    assert failed.code == 2
    assert failed.err == (
        f"error: {bad}:3:9: output: 'tests.data.output_models:not_a_model' is not a pydantic "
        "model (a class derived from pydantic.BaseModel)\n"
    )


def test_the_json_schema_of_workflow_files_covers_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import jsonschema

    schema = json.loads(cli(capsys, "schema").out)
    for where in (schema["properties"], schema["$defs"]["StateSpec"]["properties"]):
        kinds = [branch.get("type") for branch in where["output"]["anyOf"]]
        assert kinds == ["object", "string", "null"]
    validator = jsonschema.Draft202012Validator(schema)
    ok = {"name": "x", "initial": "a", "states": {}, "transitions": [], "output": SCHEMA}
    assert list(validator.iter_errors(ok)) == []
    assert list(validator.iter_errors({**ok, "output": WEATHER})) == []
    assert [e.message for e in validator.iter_errors({**ok, "output": "no ref"})] != []
    assert [e.message for e in validator.iter_errors({**ok, "output": 3})] != []


# --- checking replies -----------------------------------------------------------------------


def reply(text: str = "", *calls: ToolCall) -> Completion:
    return Completion(message=Message.assistant(text, calls))


def test_a_schema_reply_is_parsed_validated_and_its_errors_named_by_path() -> None:
    schema = OutputSchema.resolve(SCHEMA)

    good = schema.check_reply(reply('{"city": "Oslo", "temp_c": 3}'))
    fenced = schema.check_reply(reply('```json\n{"city": "Oslo", "temp_c": 3}\n```'))
    prose = schema.check_reply(reply("It is 3 degrees in Oslo."))
    wrong = schema.check_reply(reply('{"city": 7, "temp_c": -100, "wind": 3}'))

    assert (good.value, good.problem, good.checked) == ({"city": "Oslo", "temp_c": 3}, None, True)
    assert fenced.value == {"city": "Oslo", "temp_c": 3}
    assert prose.value is None
    assert prose.problem == ("the reply is not JSON (Expecting value: line 1 column 1 (char 0))")
    assert wrong.problem == (
        "the reply does not match the output schema: "
        "at $: Additional properties are not allowed ('wind' was unexpected); "
        "at $.city: 7 is not of type 'string'; "
        "at $.temp_c: -100 is less than the minimum of -90"
    )


def test_a_model_reply_is_the_models_instance_and_its_validators_run() -> None:
    schema = OutputSchema.resolve(WEATHER)

    good = schema.check_reply(reply('{"city": "Oslo", "temp_c": 3, "conditions": ["snow"]}'))
    lower = schema.check_reply(reply('{"city": "oslo", "temp_c": 3, "conditions": []}'))

    assert good.value == Weather(city="Oslo", temp_c=3, conditions=["snow"])
    assert isinstance(good.value, Weather)
    assert as_json(good.value) == {"city": "Oslo", "temp_c": 3.0, "conditions": ["snow"]}
    assert lower.problem == (
        "the reply does not match the output schema: at $.city: Value error, a city name "
        "starts with a capital letter"
    )


def test_many_errors_are_cut_to_five() -> None:
    properties = {f"p{i}": {"type": "integer"} for i in range(8)}
    schema = OutputSchema.resolve({"type": "object", "properties": properties})
    check = schema.check_text(json.dumps({f"p{i}": "x" for i in range(8)}))
    assert check.problem is not None
    assert check.problem.count("is not of type 'integer'") == 5
    assert check.problem.endswith("(and 3 more)")


def test_done_carries_the_answer_and_other_calls_are_not_checked() -> None:
    schema = OutputSchema.resolve(SCHEMA)
    done = ToolCall(id="d", name="done", arguments={"answer": '{"city": "Rome", "temp_c": 20}'})
    bad_done = ToolCall(id="d", name="done", arguments={"answer": "Rome, 20 degrees"})
    other = ToolCall(id="t", name="datetime", arguments={})

    assert schema.check_reply(reply("", done)).value == {"city": "Rome", "temp_c": 20}
    assert schema.check_reply(reply("", bad_done)).problem == (
        "the answer given to done is not JSON (Expecting value: line 1 column 1 (char 0))"
    )
    assert schema.check_reply(reply("", other)) == schema.check_reply(reply("", other))
    assert not schema.check_reply(reply("", other)).checked
    assert schema.check_reply(reply("", other)).problem is None


def test_the_response_format_is_strict_only_for_closed_schemas() -> None:
    closed = OutputSchema.resolve(SCHEMA).response_format()
    open_ = OutputSchema.resolve({**SCHEMA, "additionalProperties": True}).response_format()
    optional = OutputSchema.resolve({**SCHEMA, "required": ["city"]}).response_format()
    titled = OutputSchema.resolve({**SCHEMA, "title": "A forecast (metric)!"}).response_format()

    assert closed == ResponseFormat(name="output", schema=SCHEMA, strict=True)
    assert (open_.strict, optional.strict) == (False, False)
    assert titled.name == "A_forecast_metric"
    assert OutputSchema.resolve(WEATHER).response_format().strict is True
    assert OutputSchema.resolve("tests.data.output_models:Loose").response_format().strict is False
    assert OutputSchema.resolve("tests.data.output_models:Loose").model is Loose


def test_a_schema_as_prompt_instructions() -> None:
    fmt = ResponseFormat(name="x", schema={"type": "object"})
    assert fmt.instructions() == (
        "Reply with one JSON value and nothing else (no prose, no code fence) that conforms "
        'to this JSON Schema:\n{"type": "object"}'
    )
    assert fmt.instructions(tools=True).startswith(
        "When you answer instead of calling a tool, reply with one JSON value"
    )


def test_an_unusable_reference_is_an_output_error() -> None:
    with pytest.raises(OutputError, match="is not a pydantic model"):
        OutputSchema.resolve("json:dumps")


def test_a_notice_once_is_once_per_sink() -> None:
    seen: list[object] = []
    with deltas_to(seen.append):
        emit_notice_once("x", reason="a")
        emit_notice_once("x", reason="b")
        emit_notice_once("y")
    with deltas_to(seen.append):
        emit_notice_once("x", reason="c")
    emit_notice_once("x")  # no sink: nowhere to go

    assert seen == [
        StreamNotice("x", {"reason": "a"}),
        StreamNotice("y", {}),
        StreamNotice("x", {"reason": "c"}),
    ]


# --- runs with a scripted model -------------------------------------------------------------


def test_a_scripted_run_retries_a_bad_reply_and_ends_with_the_output() -> None:
    harness = WorkflowHarness(load(workflow(top=f"output: {WEATHER}")))
    model = ScriptedChatModel(
        [
            '{"city": "oslo", "temp_c": 3, "conditions": []}',
            '{"city": "Oslo", "temp_c": 3, "conditions": ["clear"]}',
        ]
    )

    result = harness.run("weather?", model=model)

    assert result.termination_reason == "final_answer"
    assert result.output == Weather(city="Oslo", temp_c=3, conditions=["clear"])
    assert result.response == '{"city": "Oslo", "temp_c": 3, "conditions": ["clear"]}'
    first, second = model.requests
    assert first.response_format == OutputSchema.resolve(WEATHER).response_format()
    assert second.last_message is not None
    assert second.last_message.content.startswith(
        "Your reply was not accepted: the reply does not match the output schema: at $.city: "
        "Value error, a city name starts with a capital letter. Reply again with only a JSON "
        "value that matches this JSON Schema:\n{"
    )


def test_done_with_a_valid_answer_gives_the_output_and_a_bad_one_is_malformed() -> None:
    harness = WorkflowHarness(load(workflow(top=f"output: {json.dumps(SCHEMA)}")))
    model = ScriptedChatModel(
        [
            call("done", {"answer": "Rome, warm"}),
            call("done", {"answer": '{"city": "Rome", "temp_c": 20}'}),
        ]
    )

    result = harness.run("weather?", model=model)

    assert result.termination_reason == "done"
    assert result.output == {"city": "Rome", "temp_c": 20}
    assert result.response == '{"city": "Rome", "temp_c": 20}'
    refused = result.tool_calls[0]
    assert refused.result.is_error
    assert refused.result.content.startswith(
        "error: your reply was not executed: the answer given to done is not JSON"
    )


def test_a_plain_answer_later_clears_the_output() -> None:
    text = (
        workflow(think=f"    output: {json.dumps(SCHEMA)}")
        .replace(
            "  - {source: think, target: end, reason: final_answer}",
            "  - {source: think, target: again}\n"
            "  - {source: again, target: end, reason: final_answer}",
        )
        .replace("  end:  {final: true}", "  again: {action: agent.think}\n  end:  {final: true}")
    )
    harness = WorkflowHarness(load(text))

    result = harness.run(
        "weather?", model=ScriptedChatModel(['{"city": "Oslo", "temp_c": 1}', "Cold."])
    )

    assert (result.response, result.output) == ("Cold.", None)


def test_a_list_or_a_scalar_can_be_the_output() -> None:
    tags = OutputSchema.resolve({"type": "array", "items": {"type": "string"}, "minItems": 1})
    count = OutputSchema.resolve({"type": "integer"})

    assert tags.check_text('["a", "b"]').value == ["a", "b"]
    assert tags.check_text('["a", "b"]').problem is None
    assert tags.check_text("[]").problem == (
        "does not match the output schema: at $: [] should be non-empty"
    )
    assert count.check_text("3").value == 3
    assert count.check_text('"3"').problem == (
        "does not match the output schema: at $: '3' is not of type 'integer'"
    )
