"""What the kernel writes down, field by field: a RunResult as the CLI prints it and as a
parent run sees it, each iteration.completed record (tool calls, errors, answers, what was
shortened), and the one-line errors of malformed replies and buggy actions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fsm_kernel.kernel import RunResult, _one_line
from fsm_kernel.protocol import EventType, Usage
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, bad_call, call, calls

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
DEFAULT = WorkflowHarness(WORKFLOWS / "default.yaml")


def boom(why: str) -> str:
    """Fail with a long message.

    Args:
        why: what to say.
    """
    raise ValueError(why)


def records(result: RunResult) -> list[dict[str, Any]]:
    return [e.data for e in result.events if e.type is EventType.ITERATION_COMPLETED]


def test_a_run_result_as_printed_and_as_a_parent_sees_it() -> None:
    result = RunResult(
        run_id="r1",
        workflow="w",
        termination_reason="final_answer",
        response="hi",
        iterations=2,
        output={"k": 1},
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
    )
    assert result.to_dict() == {
        "run_id": "r1",
        "workflow": "w",
        "status": "ended",
        "termination_reason": "final_answer",
        "response": "hi",
        "output": {"k": 1},
        "iterations": 2,
        "tool_calls": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    child = result.as_child()
    assert (child.run_id, child.workflow, child.reason, child.ok) == (
        "r1",
        "w",
        "final_answer",
        True,
    )
    assert (child.answer, child.output, child.iterations) == ("hi", {"k": 1}, 2)
    assert child.usage == result.usage
    assert (child.error, child.waiting_for) == (None, None)

    waiting = RunResult(
        run_id="r2",
        workflow="w",
        termination_reason=None,
        response="",
        iterations=1,
        error="e",
        waiting_for={"kind": "input", "state": "ask"},
    )
    d = waiting.to_dict()
    assert (d["status"], d["termination_reason"], d["error"]) == ("waiting", None, "e")
    assert d["waiting_for"] == {"kind": "input", "state": "ask"}
    as_child = waiting.as_child()
    assert (as_child.reason, as_child.ok, as_child.error) == (None, False, "e")
    assert as_child.waiting_for == {"kind": "input", "state": "ask"}


def test_an_iteration_record_holds_its_calls_errors_and_where_the_run_went(tmp_path: Path) -> None:
    long = "x" * 300
    model = ScriptedChatModel(
        [
            call("boom", {"why": long}),
            "A" * 600,
        ]
    )
    result = DEFAULT.run("go", model=model, tools=[boom], workspace=tmp_path)

    first, second = records(result)
    assert first["step"] == 1
    assert first["decision"] == "tool_calls"
    assert first["answer"] == ""
    assert first["next_state"] == "think"
    (tool,) = first["tools"]
    assert set(tool) == {"id", "name", "input", "output", "is_error"}
    assert tool["name"] == "boom"
    assert tool["input"] == {"why": long}
    assert tool["is_error"] is True
    assert len(tool["output"]) == 200
    assert first["error"] == f"boom: {tool['output']}"
    assert first["summary"].startswith("iteration 1/10; 1 tool call(s), 1 failed")
    assert second["decision"] == "answer"
    assert second["answer"] == "A" * 500
    assert second["error"] is None
    assert second["summary"] == ""
    assert second["next_state"] == "terminate"


def test_an_iteration_with_two_failed_calls_lists_both_errors(tmp_path: Path) -> None:
    model = ScriptedChatModel(
        [
            calls(("read_file", {"path": "a"}), ("read_file", {"path": "b"})),
            "done",
        ]
    )
    result = DEFAULT.run("go", model=model, workspace=tmp_path)

    error = records(result)[0]["error"]
    assert error.count("read_file: ") == 2
    assert "; read_file: " in error


def test_malformed_replies_are_reported_in_one_line_with_their_count() -> None:
    one = ScriptedChatModel([bad_call("datetime")])
    single = DEFAULT.run("go", model=one, limits={"max_malformed_outputs": 1})
    assert single.termination_reason == "malformed_output"
    assert single.error is not None
    assert single.error.startswith("1 malformed model reply in a row; the last: ")
    assert records(single)[-1]["decision"] == "malformed"
    assert records(single)[-1]["error"] == single.error.split("; the last: ", 1)[1]

    three = ScriptedChatModel([bad_call("datetime")] * 3)
    triple = DEFAULT.run("go", model=three)
    assert triple.error is not None
    assert triple.error.startswith("3 malformed model replies in a row; the last: ")


def test_an_exception_is_one_line_naming_its_state() -> None:
    assert _one_line(ValueError("first\nsecond\n"), "act") == "ValueError: first … (in state 'act')"
    assert _one_line(ValueError("only"), "act") == "ValueError: only (in state 'act')"
    assert _one_line(KeyError(), "s") == "KeyError:  (in state 's')"
    assert _one_line(ValueError("\n  \nlast"), "s") == "ValueError: last (in state 's')"


def test_run_sync_runs_without_an_event_loop() -> None:
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.tools import builtin_registry

    kernel = Kernel(
        DEFAULT.compiled,
        model=ScriptedChatModel(["hello"]),
        tools=builtin_registry("."),
    )
    result = kernel.run_sync("hi", run_id="sync-1")
    assert (result.run_id, result.response, result.termination_reason) == (
        "sync-1",
        "hello",
        "final_answer",
    )
    assert asyncio.get_event_loop_policy() is not None


def test_a_kernel_error_inside_the_loop_ends_the_run_error_with_its_message() -> None:
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.tools import builtin_registry

    kernel = Kernel(DEFAULT.compiled, model=None, tools=builtin_registry("."))  # type: ignore[arg-type]
    result = kernel.run_sync("hi")

    assert result.termination_reason == "error"
    assert result.error == "agent.think needs a model, but the run has none"
    ended = [e.data for e in result.events if e.type is EventType.RUN_TERMINATED]
    assert ended == [{"reason": "error", "answer": "", "iterations": 0,
                      "error": "agent.think needs a model, but the run has none"}]  # fmt: skip


def test_a_cancelled_run_leaves_its_task_free_to_go_on() -> None:
    """The kernel ends a cancelled run `cancelled` and clears the task's cancel request, so
    the code that awaited the run may await more (record, clean up) without being cancelled."""
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.protocol import Completion
    from fsm_kernel.tools import builtin_registry

    entered = asyncio.Event()

    class Hangs:
        async def complete(self, messages: Any, tools: Any, **options: Any) -> Completion:
            entered.set()
            await asyncio.sleep(60)
            raise AssertionError("not reached")

    kernel = Kernel(DEFAULT.compiled, model=Hangs(), tools=builtin_registry("."))

    async def body() -> tuple[RunResult, int, str]:
        result = await kernel.run("hi")
        after = asyncio.current_task()
        assert after is not None
        await asyncio.sleep(0)  # would raise CancelledError if the request were still pending
        return result, after.cancelling(), "went on"

    async def scenario() -> tuple[RunResult, int, str]:
        task = asyncio.ensure_future(body())
        await entered.wait()
        task.cancel()
        return await task

    result, cancelling, went_on = asyncio.run(scenario())

    assert result.termination_reason == "cancelled"
    assert (cancelling, went_on) == (0, "went on")


def test_a_model_call_that_never_answered_is_a_failed_iteration_stamped_with_its_state(
    tmp_path: Path,
) -> None:
    from fsm_kernel.errors import AgentConnectionError

    down = AgentConnectionError("cannot reach model server at http://x/v1: refused")
    model = ScriptedChatModel([call("datetime", {}), down])
    result = DEFAULT.run("go", model=model, workspace=tmp_path)

    assert result.termination_reason == "agent_error"
    first, second = records(result)
    assert (first["step"], first["decision"], first["error"]) == (1, "tool_calls", None)
    assert second["step"] == 2
    assert second["decision"] == "failed"  # the model call of this iteration never answered
    assert second["answer"] == ""
    assert second["tools"] == []
    assert second["error"] == "cannot reach model server at http://x/v1: refused"
    assert second["next_state"] == "think"  # where the run was when it ended
    stamped = {
        (e.type.value, e.state)
        for e in result.events
        if e.type.value.startswith(("model.", "tool."))
    }
    assert stamped == {
        ("model.requested", "think"),
        ("model.responded", "think"),
        ("model.failed", "think"),
        ("tool.started", "act"),
        ("tool.finished", "act"),
    }  # each event carries the state whose action recorded it
    by_iteration = [
        (e.type.value, e.iteration) for e in result.events if e.type.value == "model.requested"
    ]
    assert by_iteration == [("model.requested", 1), ("model.requested", 2)]


def test_a_decision_taken_again_is_recorded_alike_and_redacted_once_a_secret_is_known() -> None:
    # A decision the engine made before is taken from the cache with its transition's data,
    # built and redacted once; registering a secret must still redact that data.
    import json

    from fsm_kernel.redact import REDACTED, _forget_secrets, register_secret

    def transitions() -> list[dict[str, Any]]:
        result = DEFAULT.run("go", model=ScriptedChatModel(["hi"]))
        return [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]

    def checks(data: list[dict[str, Any]]) -> list[str]:
        return [c["check"] for t in data for tried in t["tried"] for c in tried["checks"]]

    first, again = transitions(), transitions()
    assert again == first
    assert [(t["source"], t["target"]) for t in first] == [
        ("observe", "think"),
        ("think", "terminate"),
    ]
    assert checks(first)[0] == "has_tool_calls"
    try:
        register_secret("has_tool_calls")
        secret = transitions()
    finally:
        _forget_secrets()

    assert checks(secret) == [REDACTED, *checks(first)[1:]]
    assert "has_tool_calls" not in json.dumps(secret)
    assert transitions() == first  # forgotten: as before
