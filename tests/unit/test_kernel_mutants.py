"""The kernel's run loop (kernel.py): the behaviours its mutation testing found unpinned. The
prompt `run_sync` runs, the text a run refuses before anything is recorded, the error of a
truncated run when the model names its own cap, and what a suspended run logs."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from fsm_kernel.errors import AgentConnectionError, ConfigError, ToolFatalError
from fsm_kernel.kernel import TRUNCATED_ERROR, Kernel
from fsm_kernel.protocol import Completion, EventType, Message, ToolCall
from fsm_kernel.replay import replay_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.tools import ToolRegistry, builtin_registry
from fsm_kernel.workflow.children import ChildRequest, ChildResult
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.spec import Limits

ONE_SHOT = """\
name: one_shot
initial: think
states:
  think: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: think, target: terminate, reason: final_answer}
"""


def _kernel(model: object, workspace: Path) -> Kernel:
    spec = load_workflow_text(ONE_SHOT, path="one_shot.yaml")
    return Kernel(compile_workflow(spec), model=model, tools=builtin_registry(workspace))  # type: ignore[arg-type]


def test_run_sync_runs_the_prompt_it_is_given(tmp_path: Path) -> None:
    model = ScriptedChatModel(["4"])
    result = _kernel(model, tmp_path).run_sync("What is 2 + 2?", run_id="r-sync")
    assert (result.run_id, result.response) == ("r-sync", "4")
    assert result.events[0].data["goal"] == "What is 2 + 2?"
    asked = model.requests[0].last_message
    assert asked is not None
    assert asked.content == "What is 2 + 2?"


def test_a_history_holding_a_lone_surrogate_is_refused_before_anything_is_recorded(
    tmp_path: Path,
) -> None:
    history = [Message.user("earlier"), Message.assistant("réponse \ud800 cassée")]
    kernel = _kernel(ScriptedChatModel(["never asked"]), tmp_path)
    seen: list[object] = []
    kernel.on_event = seen.append
    with pytest.raises(ConfigError) as raised:
        asyncio.run(kernel.run("go on", history=history))
    assert str(raised.value) == (
        "the history is not valid text: it holds '\\ud800', a lone surrogate, which UTF-8 "
        "cannot encode (decode bytes with errors='replace')"
    )
    assert seen == []


def test_a_history_of_valid_text_is_recorded_in_run_started(tmp_path: Path) -> None:
    call = ToolCall(id="c1", name="datetime", arguments={"timezone": "Europe/Paris"})
    history = [Message.user("Quelle heure ?"), Message.assistant("", [call])]
    model = ScriptedChatModel(["Midi."])
    result = asyncio.run(_kernel(model, tmp_path).run("Et maintenant ?", history=history))
    assert result.termination_reason == "final_answer"
    assert result.events[0].data["history"] == [m.to_dict() for m in history]


class _CappedModel(ScriptedChatModel):
    """A model that applies its own reply cap and says so (as the local model does)."""

    def __init__(self, truncation_error: object) -> None:
        cut = Completion(message=Message.assistant("It is twelve o'cl"), finish_reason="length")
        super().__init__([cut])
        self.truncation_error = truncation_error


def test_a_truncated_run_reports_the_models_own_cap_when_it_names_one(tmp_path: Path) -> None:
    own = "cut off at FSM_KERNEL_LOCAL_MAX_TOKENS=64 tokens; raise it"
    result = _kernel(_CappedModel(own), tmp_path).run_sync("What time is it?")
    assert (result.termination_reason, result.error) == ("truncated", own)
    assert result.response == "It is twelve o'cl"
    assert result.events[-1].data["error"] == own


@pytest.mark.parametrize("own", ["", None, 64])
def test_a_truncated_run_falls_back_to_the_general_advice(tmp_path: Path, own: object) -> None:
    """An empty or non-text `truncation_error` says nothing: the general advice is given."""
    result = _kernel(_CappedModel(own), tmp_path).run_sync("What time is it?")
    assert (result.termination_reason, result.error) == ("truncated", TRUNCATED_ERROR)


ASK = """\
name: ask
initial: steer
states:
  steer: {action: human.input, prompt: "How should I go on?"}
  think: {action: agent.think}
  done: {final: true}
transitions:
  - {source: steer, target: think}
  - {source: think, target: done, reason: final_answer}
"""


def test_a_suspended_run_logs_what_it_waits_for_and_where(
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = WorkflowHarness(load_workflow_text(ASK, path="ask.yaml"))
    with caplog.at_level(logging.INFO, logger="fsm_kernel.kernel"):
        result = harness.run("go", model=ScriptedChatModel([]))
    assert result.status == "waiting"
    assert result.events[-1].type is EventType.RUN_SUSPENDED
    lines = [r.getMessage() for r in caplog.records if r.name == "fsm_kernel.kernel"]
    assert "suspended: waiting for input in state steer" in lines


def broken_cleanup(ctx: object) -> None:
    """A user action with a bug, run after a caught model failure."""
    raise RuntimeError("cleanup failed")


CAUGHT_THEN_CRASH = """\
name: caught_then_crash
initial: think
states:
  think:
    action: agent.think
    catch:
      - {error: agent_error, target: cleanup}
  cleanup: {action: "tests.unit.test_kernel_mutants:broken_cleanup"}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
  - {source: cleanup, target: done, reason: final_answer}
"""


def test_a_failed_iteration_records_the_error_that_ended_the_run_not_the_caught_one() -> None:
    """The model call failed and `catch:` routed it; then a later step of the same iteration
    ended the run: the iteration's record names what ended it."""
    harness = WorkflowHarness(load_workflow_text(CAUGHT_THEN_CRASH, path="c.yaml"))
    model = ScriptedChatModel([AgentConnectionError("cannot reach http://big/v1")])
    result = harness.run("go", model=model)
    ended = "RuntimeError: cleanup failed (in state 'cleanup')"
    assert (result.termination_reason, result.error) == ("error", ended)
    (record,) = [e.data for e in result.events if e.type is EventType.ITERATION_COMPLETED]
    assert (record["decision"], record["error"], record["next_state"]) == (
        "failed",
        ended,
        "cleanup",
    )


TOOL_THEN_ANSWER = """\
name: tool_then_answer
tools: [datetime]
initial: think
states:
  think: {action: agent.think}
  act: {action: tools.execute}
  done: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: done, reason: final_answer}
  - {source: act, target: think}
"""


def test_an_iteration_that_called_tools_records_no_answer_even_beside_text() -> None:
    """A reply's text beside its tool calls is not an answer: the record's `answer` is empty
    for a `tool_calls` iteration and the reply's text for an `answer` one."""
    harness = WorkflowHarness(load_workflow_text(TOOL_THEN_ANSWER, path="t.yaml"))
    model = ScriptedChatModel(
        [call("datetime", {"timezone": "UTC"}, content="Let me look at the clock."), "Noon."]
    )
    result = harness.run("What time is it?", model=model)
    records = [e.data for e in result.events if e.type is EventType.ITERATION_COMPLETED]
    assert [(r["decision"], r["answer"]) for r in records] == [
        ("tool_calls", ""),
        ("answer", "Noon."),
    ]


class _BlockingModel:
    """A model whose call blocks the event loop (a synchronous HTTP client, say) past the run's
    timeout before it answers."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def complete(self, messages: object, tools: object) -> Completion:
        time.sleep(self.seconds)  # noqa: ASYNC251 - blocks the loop, as the test needs
        return Completion(message=Message.assistant("Noon."))


def test_a_step_that_blocked_the_loop_past_the_timeout_ends_the_run_timeout(
    tmp_path: Path,
) -> None:
    spec = load_workflow_text(
        ONE_SHOT.replace("initial: think", "limits: {timeout_seconds: 0.05}\ninitial: think"),
        path="blocking.yaml",
    )
    kernel = Kernel(
        compile_workflow(spec), model=_BlockingModel(0.3), tools=builtin_registry(tmp_path)
    )
    result = kernel.run_sync("What time is it?")
    assert (result.termination_reason, result.error) == ("timeout", "run timed out after 0.05s")
    assert [e.type for e in result.events].count(EventType.TRANSITION_TAKEN) == 0


FORECAST = """\
name: forecast
output:
  type: object
  properties: {city: {type: string}, temp_c: {type: number}}
  required: [city, temp_c]
initial: answer
states:
  answer: {action: agent.think}
  end: {final: true}
transitions:
  - {source: answer, target: end, reason: final_answer}
"""


def test_an_answer_that_is_not_the_declared_output_ends_the_run_malformed_output() -> None:
    """The workflow's edge says final_answer, but an answer that fails `output:` is no
    success: the run ends malformed_output with why, in the result and the log."""
    harness = WorkflowHarness(load_workflow_text(FORECAST, path="f.yaml"))
    result = harness.run("Weather in Oslo?", model=ScriptedChatModel(["Cold in Oslo."]))
    why = "the reply is not JSON (Expecting value: line 1 column 1 (char 0))"
    assert (result.termination_reason, result.error, result.output) == (
        "malformed_output",
        why,
        None,
    )
    assert result.events[-1].data["reason"] == "malformed_output"
    assert result.events[-1].data["error"] == why
    assert "output" not in result.events[-1].data


def test_the_structured_output_is_recorded_in_run_terminated() -> None:
    harness = WorkflowHarness(load_workflow_text(FORECAST, path="f.yaml"))
    model = ScriptedChatModel(['{"city": "Oslo", "temp_c": 3}'])
    result = harness.run("Weather in Oslo?", model=model)
    assert (result.termination_reason, result.output) == (
        "final_answer",
        {"city": "Oslo", "temp_c": 3},
    )
    assert result.events[-1].data["output"] == {"city": "Oslo", "temp_c": 3}


def explode(reason: str) -> str:
    """Give up on the whole run.

    Args:
        reason: Why.
    """
    raise ToolFatalError(f"disk is gone: {reason}")


FATAL = """\
name: fatal
tools: ["tests.unit.test_kernel_mutants:explode"]
reasons:
  escalated: {success: false, description: a tool failed for good}
initial: think
states:
  think: {action: agent.think}
  act: {action: tools.execute}
  end: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: end, reason: final_answer}
  - {source: act, target: end, guard: fatal_tool_error, reason: REASON}
  - {source: act, target: think}
"""


@pytest.mark.parametrize(
    ("reason", "error"), [("fatal_tool_error", "explode: disk is gone: full"), ("escalated", None)]
)
def test_a_fatal_tool_error_routed_by_the_workflow_says_why_only_under_its_own_reason(
    reason: str, error: str | None
) -> None:
    """An edge into `fatal_tool_error` reports the failed call as the run's error; an edge into
    a reason of the workflow's own ends the run for it, without an error of the kernel's."""
    harness = WorkflowHarness(load_workflow_text(FATAL.replace("REASON", reason), path="x.yaml"))
    model = ScriptedChatModel([call("explode", {"reason": "full"})])
    result = harness.run("go", model=model)
    assert (result.termination_reason, result.error) == (reason, error)
    assert result.events[-1].data.get("error") == error


PARENT = """\
name: parent
initial: delegate
states:
  delegate: {action: workflow.call, workflow: one_shot.yaml}
  end: {final: true}
transitions:
  - {source: delegate, target: end, reason: final_answer}
"""


def test_a_parents_ending_records_the_model_calls_of_its_children(tmp_path: Path) -> None:
    (tmp_path / "one_shot.yaml").write_text(ONE_SHOT)
    (tmp_path / "parent.yaml").write_text(PARENT)
    harness = WorkflowHarness(tmp_path / "parent.yaml")
    result = harness.run("go", model=ScriptedChatModel(["the child's answer"]))
    assert (result.termination_reason, result.iterations, result.child_iterations) == (
        "final_answer",
        0,
        1,
    )
    ending = result.events[-1].data
    assert (ending["iterations"], ending["child_iterations"]) == (0, 1)
    assert result.to_dict()["child_iterations"] == 1


def test_a_run_logs_its_ending_reason_and_error(caplog: pytest.LogCaptureFixture) -> None:
    harness = WorkflowHarness(load_workflow_text(CAUGHT_THEN_CRASH, path="c.yaml"))
    with caplog.at_level(logging.INFO, logger="fsm_kernel.kernel"):
        harness.run("go", model=ScriptedChatModel([AgentConnectionError("down")]))
        harness.run("go", model=ScriptedChatModel(["Noon."]))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("terminated")]
    assert lines == [
        "terminated: error (RuntimeError: cleanup failed (in state 'cleanup'))",
        "terminated: final_answer",
    ]


def test_run_started_links_a_child_to_its_parent_only_when_it_has_one(tmp_path: Path) -> None:
    kernel = _kernel(ScriptedChatModel(["a", "b"]), tmp_path)
    child = asyncio.run(kernel.run("go", parent_run_id="parent-1"))
    alone = asyncio.run(kernel.run("go"))
    assert child.events[0].data["parent_run_id"] == "parent-1"
    assert "parent_run_id" not in alone.events[0].data


def test_run_started_names_the_run_it_continues_instead_of_copying_its_messages(
    tmp_path: Path,
) -> None:
    history = [Message.user("Capital of France?"), Message.assistant("Paris.")]
    model = ScriptedChatModel(["About 2.1 million."])
    result = asyncio.run(
        _kernel(model, tmp_path).run("Its population?", continues="run-0", history=history)
    )
    started = result.events[0].data
    assert (started["continues"], started["history_messages"]) == ("run-0", 2)
    assert "history" not in started
    assert [m.content for m in model.requests[0].messages][-3:] == [
        "Capital of France?",
        "Paris.",
        "Its population?",
    ]


def test_a_runs_own_tools_and_limits_replace_the_kernels_for_that_run(tmp_path: Path) -> None:
    spec = load_workflow_text(TOOL_THEN_ANSWER, path="t.yaml")
    kernel = Kernel(
        compile_workflow(spec),
        model=ScriptedChatModel([]),
        tools=builtin_registry(tmp_path),
    )
    own_tools = ToolRegistry()

    def datetime(timezone: str) -> str:
        """The time in a timezone, stopped at noon.

        Args:
            timezone: An IANA name.
        """
        return f"12:00 in {timezone}"

    own_tools.register(datetime)
    model = ScriptedChatModel([call("datetime", {"timezone": "UTC"}), "Noon."])
    result = asyncio.run(kernel.run("What time is it?", model=model, tools=own_tools))
    assert (result.termination_reason, result.response) == ("final_answer", "Noon.")
    assert result.tool_calls[0].result.content == "12:00 in UTC"

    capped = ScriptedChatModel([call("datetime", {"timezone": "UTC"}), "Noon."])
    result = asyncio.run(
        kernel.run(
            "What time is it?", model=capped, tools=own_tools, limits=Limits(max_iterations=1)
        )
    )
    assert (result.termination_reason, result.iterations) == ("max_iterations", 1)
    assert result.events[0].data["limits"]["max_iterations"] == 1


def test_a_replayed_parent_meets_its_recorded_children_again(tmp_path: Path) -> None:
    """A replay re-drives the parent and replays each child run it recorded, by id."""
    (tmp_path / "one_shot.yaml").write_text(ONE_SHOT)
    (tmp_path / "parent.yaml").write_text(PARENT)
    harness = WorkflowHarness(tmp_path / "parent.yaml")
    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = harness.run("go", model=ScriptedChatModel(["the child's answer"]), store=store)
        child_id = next(
            e.data["run_id"] for e in result.events if e.type is EventType.CHILD_STARTED
        )
        report = asyncio.run(replay_run(compile_workflow(harness.spec), store, result.run_id))
    assert report.identical
    assert [c.run_id for c in report.children] == [child_id]
    assert report.replayed_reason == "final_answer"


class _Requests:
    """A child runner that answers every child at once and keeps what it was asked."""

    def __init__(self) -> None:
        self.requests: list[ChildRequest] = []

    async def run(self, request: ChildRequest) -> ChildResult:
        self.requests.append(request)
        return ChildResult(
            run_id=request.run_id,
            workflow=request.workflow,
            reason="final_answer",
            ok=True,
            answer="done",
        )


def test_a_child_is_asked_with_the_parents_goal_and_the_parents_file_as_caller(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "parent.yaml"
    parent.write_text(
        PARENT.replace(
            "workflow: one_shot.yaml}", 'workflow: one_shot.yaml, input: "Check: {goal}"}'
        )
    )
    (tmp_path / "one_shot.yaml").write_text(ONE_SHOT)
    harness = WorkflowHarness(parent)
    runner = _Requests()
    result = harness.run("Is the sky blue?", model=ScriptedChatModel([]), children=runner)
    assert result.termination_reason == "final_answer"
    (request,) = runner.requests
    assert (request.prompt, request.caller) == ("Check: Is the sky blue?", str(parent))


APPROVE = """\
name: approve
tools: [{name: datetime, approval: required}]
initial: think
states:
  think: {action: agent.think}
  act: {action: tools.execute}
  done: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: done, reason: final_answer}
  - {source: act, target: think}
"""


def test_a_tool_that_needs_approval_suspends_the_run_before_it_runs() -> None:
    harness = WorkflowHarness(load_workflow_text(APPROVE, path="a.yaml"))
    model = ScriptedChatModel([call("datetime", {"timezone": "UTC"})])
    result = harness.run("What time is it?", model=model)
    assert result.status == "waiting"
    assert result.waiting_for is not None
    assert (result.waiting_for["kind"], result.waiting_for["tool_call"]["name"]) == (
        "approval",
        "datetime",
    )
    assert result.tool_calls == []  # nothing ran
