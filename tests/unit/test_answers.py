"""What a run answers with (issue #17): a reply cut off by the model's length limit is never a
success (`truncated`), and text from a state marked `answer: false` (a plan, a thought, a
critique) never becomes the run's response, whatever the iteration cap cuts it short at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.agent.wire import completion_from_wire
from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.kernel import TRUNCATED_ERROR
from fsm_kernel.protocol import Completion, EventType, Message, Role, Tool, Usage
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import (
    FunctionChatModel,
    ReplyLike,
    ScriptedChatModel,
    WorkflowHarness,
    call,
)
from fsm_kernel.workflow.actions import BUILTIN_GUARDS
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.spec import SUCCESS_REASONS, TERMINATION_REASONS, WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "workflows"
DEFAULT = WorkflowHarness(WORKFLOWS / "default.yaml")
REFLECT = WorkflowHarness(WORKFLOWS / "reflect.yaml")
PLAN_EXECUTE = WorkflowHarness(WORKFLOWS / "plan_execute.yaml")
REACT = WorkflowHarness(WORKFLOWS / "react.yaml")

PARTIAL = "The three largest moons of Jupiter are Ganymede, Callisto and"


def cut_off(text: str) -> Completion:
    """A text reply the server stopped at its token limit (finish_reason "length")."""
    usage = Usage(prompt_tokens=10, completion_tokens=512, total_tokens=522)
    return Completion(message=Message.assistant(text), finish_reason="length", usage=usage)


def cut_off_call() -> Completion:
    """A tool call cut off mid-arguments, as a server sends it and the wire layer reads it."""
    body = {
        "choices": [
            {
                "finish_reason": "length",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": '{"path": "notes/ja'},
                        }
                    ],
                },
            }
        ]
    }
    return completion_from_wire(body)


def events(result: Any, type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in result.events if e.type is type_]


# --- truncated ---------------------------------------------------------------------------------


def test_truncated_is_a_termination_reason_and_a_guard_but_no_success() -> None:
    assert "cut off by its length limit" in TERMINATION_REASONS["truncated"]
    assert "truncated" not in SUCCESS_REASONS
    assert "truncated" in BUILTIN_GUARDS


def test_cut_off_text_through_the_default_workflow_ends_truncated() -> None:
    model = ScriptedChatModel([call("datetime"), cut_off(PARTIAL)])

    result = DEFAULT.run("Name Jupiter's largest moons.", model=model)

    assert result.termination_reason == "truncated"
    assert result.response == PARTIAL  # the partial text is kept
    assert not result.ok  # exit code 1
    assert result.error == TRUNCATED_ERROR
    assert "length limit" in result.error
    assert "max tokens or context window" in result.error
    assert result.iterations == 2
    (terminated,) = events(result, EventType.RUN_TERMINATED)
    assert terminated == {
        "reason": "truncated",
        "answer": PARTIAL,
        "iterations": 2,
        "error": TRUNCATED_ERROR,
    }
    # The workflow's own edge fired as declared; the kernel's rule changed how the run ended.
    last = events(result, EventType.TRANSITION_TAKEN)[-1]
    assert (last["source"], last["target"], last["reason"]) == (
        "think",
        "terminate",
        "final_answer",
    )
    assert result.to_dict()["termination_reason"] == "truncated"
    model.assert_complete()


def test_model_responded_records_every_finish_reason(tmp_path: Path) -> None:
    model = ScriptedChatModel([call("datetime"), cut_off(PARTIAL)])

    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = DEFAULT.run("Name Jupiter's largest moons.", model=model, store=store)
        stored = store.read(result.run_id)

    responded = [e.data for e in stored if e.type is EventType.MODEL_RESPONDED]
    assert [d["completion"]["finish_reason"] for d in responded] == ["tool_calls", "length"]
    assert responded[1]["completion"]["message"]["content"] == PARTIAL
    assert stored[-1].data["reason"] == "truncated"


def test_single_shot_cut_off_answer_is_truncated() -> None:
    harness = WorkflowHarness(WORKFLOWS / "single_shot.yaml")
    result = harness.run("Summarise this.", model=ScriptedChatModel([cut_off("In short, the")]))
    assert (result.termination_reason, result.response) == ("truncated", "In short, the")


def test_reflect_cut_off_final_answer_is_truncated() -> None:
    model = ScriptedChatModel(["draft", "PASS", cut_off("The final ans")])
    result = REFLECT.run("question", model=model)
    assert (result.termination_reason, result.response) == ("truncated", "The final ans")


CONTINUE_YAML = """
name: continue_cut_off
tools: [read_file]
limits: {max_iterations: 4, max_malformed_outputs: 1}
initial: think
states:
  think: {action: agent.think}
  more:
    action: agent.think
    prompt: Your reply was cut off. Continue exactly where it stopped.
  terminate: {final: true}
transitions:
  - {source: think, target: more,      guard: truncated}
  - {source: think, target: terminate, guard: malformed_output, reason: malformed_output}
  - {source: think, target: terminate, reason: final_answer}
  - {source: more,  target: more,      guard: truncated}
  - {source: more,  target: terminate, reason: final_answer}
"""


@pytest.fixture(scope="module")
def continuing() -> WorkflowHarness:
    return WorkflowHarness(load_workflow_text(CONTINUE_YAML, path="continue.yaml"))


def test_a_workflow_that_routes_truncated_to_a_continue_state_does_not_end_truncated(
    continuing: WorkflowHarness,
) -> None:
    model = ScriptedChatModel([cut_off("Ganymede, Callisto and"), cut_off(" Io,"), " and Europa."])

    result = continuing.run("Name Jupiter's largest moons.", model=model)

    assert (result.termination_reason, result.ok) == ("final_answer", True)
    assert result.error is None
    assert result.response == " and Europa."  # the last answering reply
    path = [(d["source"], d["target"]) for d in events(result, EventType.TRANSITION_TAKEN)]
    assert path == [("think", "more"), ("more", "more"), ("more", "terminate")]
    assert model.requests[1].last_message.content.startswith("Your reply was cut off")
    model.assert_complete()


def test_truncated_guard_reads_the_last_reply(continuing: WorkflowHarness) -> None:
    assert continuing.step("think", last_reply=cut_off("Gany")).target == "more"
    assert continuing.step("think", last_reply=cut_off("")).target == "more"  # all thinking
    assert continuing.step("think", last_reply="Ganymede.").reason == "final_answer"
    assert continuing.step("more", last_reply=cut_off("more")).target == "more"


def test_a_cut_off_tool_call_is_malformed_output_not_truncated(
    continuing: WorkflowHarness,
) -> None:
    reply = cut_off_call()
    assert reply.finish_reason == "length"
    assert reply.message.tool_calls[0].arguments_error is not None

    result = continuing.run("Read notes/jan.txt", model=ScriptedChatModel([reply]))

    assert result.termination_reason == "malformed_output"
    path = [(d["source"], d["target"]) for d in events(result, EventType.TRANSITION_TAKEN)]
    assert path == [("think", "terminate")]  # never through the `truncated` edge
    (record,) = result.tool_calls
    assert record.result.is_error
    assert "not JSON" in record.result.content


def test_a_cut_off_tool_call_through_the_default_workflow_is_retried_as_malformed() -> None:
    model = ScriptedChatModel([cut_off_call(), "I could not read it."])

    result = DEFAULT.run("Read notes/jan.txt", model=model)

    assert (result.termination_reason, result.response) == ("final_answer", "I could not read it.")
    first = events(result, EventType.ITERATION_COMPLETED)[0]
    assert first["decision"] == "malformed"
    assert "not JSON" in first["error"]
    model.assert_complete()


def test_a_cut_off_reply_with_complete_tool_calls_runs_them() -> None:
    # finish_reason "length" after whole, valid tool calls: the calls run; `done` still succeeds.
    done = call("done", {"answer": "Ganymede, Callisto, Io and Europa."})
    done = Completion(message=done.message, finish_reason="length")

    result = DEFAULT.run("q", model=ScriptedChatModel([done]))

    assert (result.termination_reason, result.ok) == ("done", True)
    assert result.response == "Ganymede, Callisto, Io and Europa."


# --- answer: false -----------------------------------------------------------------------------

CRITIQUE = "Review your latest answer"
REWRITE = "Rewrite your answer"


class ReflectModel:
    """Answers reflect's prompts in kind (draft, critique, revision), numbering each reply by its
    iteration; with `tool_first`, the first draft step calls a tool instead (which shifts the
    critiques to odd iterations)."""

    def __init__(self, *, tool_first: bool, critique: str = "") -> None:
        self.tool_first = tool_first
        self.critique = critique
        self.replies: list[tuple[str, str]] = []

    def __call__(self, messages: list[Message], tools: list[Tool]) -> ReplyLike:
        n = len(self.replies) + 1
        last = messages[-1].content if messages[-1].role is Role.USER else ""
        if self.tool_first and n == 1:
            self.replies.append(("call", ""))
            return call("datetime")
        if last.startswith(CRITIQUE):
            kind, text = "critique", self.critique or f"critique {n}: 1. The answer is too vague."
        elif last.startswith(REWRITE):
            kind, text = "revision", f"revision {n}: the Eiffel Tower is 330 m tall."
        else:
            kind, text = "draft", f"draft {n}: the Eiffel Tower is tall."
        self.replies.append((kind, text))
        return text

    def latest(self, *kinds: str) -> str:
        return [text for kind, text in self.replies if kind in kinds][-1]


@pytest.mark.parametrize("cap", [2, 3, 4, 5, 6, 12])
def test_reflect_cut_short_after_a_critique_answers_with_the_latest_draft_or_revision(
    cap: int,
) -> None:
    replies = ReflectModel(tool_first=cap % 2 == 1)

    result = REFLECT.run(
        "How tall is the Eiffel Tower?",
        model=FunctionChatModel(replies),
        limits={"max_iterations": cap},
    )

    assert result.termination_reason == "max_iterations"
    assert result.iterations == cap
    assert replies.replies[-1][0] == "critique"  # the cap struck right after a critique
    assert result.response == replies.latest("draft", "revision")
    assert not result.response.startswith("critique")
    (terminated,) = events(result, EventType.RUN_TERMINATED)
    assert terminated["answer"] == result.response


def test_reflect_cut_short_after_a_pass_answers_with_the_approved_draft() -> None:
    replies = ReflectModel(tool_first=False, critique="PASS")

    result = REFLECT.run("q", model=FunctionChatModel(replies), limits={"max_iterations": 2})

    assert replies.replies[-1] == ("critique", "PASS")
    assert (result.termination_reason, result.response) == (
        "max_iterations",
        replies.latest("draft"),
    )


def test_plan_execute_cut_short_after_planning_does_not_answer_with_the_plan() -> None:
    model = ScriptedChatModel([json.dumps({"steps": ["read a.txt"]})])

    result = PLAN_EXECUTE.run("What is in a.txt?", model=model, limits={"max_iterations": 1})

    assert (result.termination_reason, result.response) == ("max_iterations", "")
    model.assert_complete()


def test_plan_execute_cut_short_in_a_step_does_not_answer_with_the_plan() -> None:
    model = ScriptedChatModel([json.dumps({"steps": ["read a.txt"]}), "I should read a.txt."])

    result = PLAN_EXECUTE.run("What is in a.txt?", model=model, limits={"max_iterations": 2})

    assert result.termination_reason == "max_iterations"
    assert result.response == ""
    model.assert_complete()


def test_react_cut_short_after_reasoning_does_not_answer_with_the_thought() -> None:
    model = ScriptedChatModel(["I should look up the time with the datetime tool."])

    result = REACT.run("What time is it?", model=model, limits={"max_iterations": 1})

    assert (result.termination_reason, result.response) == ("max_iterations", "")


def test_stock_workflows_mark_only_intermediate_text_as_not_the_answer() -> None:
    not_answers = {
        h.spec.name: sorted(sid for sid, s in h.spec.states.items() if not s.answer)
        for h in (DEFAULT, REFLECT, PLAN_EXECUTE, REACT)
    }
    assert not_answers == {
        "default": [],
        "reflect": ["critique"],
        "plan_execute": ["plan", "replan"],
        "react": ["reason"],
    }


ASK_YAML = """
name: ask
initial: think
states:
  think: {action: agent.think, answer: false}
  terminate: {final: true}
transitions:
  - {source: think, target: terminate, guard: has_answer, reason: final_answer}
  - {source: think, target: terminate, reason: no_progress}
"""


def test_guards_read_the_last_reply_not_the_answer() -> None:
    harness = WorkflowHarness(load_workflow_text(ASK_YAML, path="ask.yaml"))

    result = harness.run("q", model=ScriptedChatModel(["some text"]))

    # has_answer saw the reply although it did not become the response.
    assert (result.termination_reason, result.response) == ("final_answer", "")


def test_has_answer_wants_text_and_no_tool_calls() -> None:
    harness = WorkflowHarness(load_workflow_text(ASK_YAML, path="ask.yaml"))
    assert harness.step("think", last_reply="Ganymede.").reason == "final_answer"
    assert harness.step("think", last_reply=" \n ").reason == "no_progress"  # blank
    assert harness.step("think", last_reply=call("datetime", {})).reason == "no_progress"


# --- the `answer:` key -------------------------------------------------------------------------

MINIMAL = """\
name: minimal
initial: start
states:
  start: {action: agent.think}
  check: {action: kernel.evaluate}
  end: {final: true}
transitions:
  - {source: start, target: check}
  - {source: check, target: end, reason: final_answer}
"""


def user_think(ctx: Any) -> None:
    """A user's action that calls the model (marked like agent.think)."""


user_think.calls_model = True  # type: ignore[attr-defined]  # the marker resolve_action reads


def _load(text: str) -> WorkflowSpec:
    return load_workflow_text(text, path="w.yaml")


def test_answer_defaults_to_true_and_false_loads_on_a_model_state() -> None:
    assert _load(MINIMAL).states["start"].answer is True
    spec = _load(MINIMAL.replace("{action: agent.think}", "{action: agent.think, answer: false}"))
    assert spec.states["start"].answer is False


def test_answer_false_on_a_user_action_that_calls_the_model_loads() -> None:
    text = MINIMAL.replace(
        "{action: agent.think}", '{action: "tests.unit.test_answers:user_think", answer: false}'
    )
    assert _load(text).states["start"].answer is False


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ("{action: kernel.evaluate}", "{action: kernel.evaluate, answer: false}", "5:44"),
        ("{final: true}", "{final: true, answer: false}", "6:30"),
    ],
)
def test_answer_false_where_no_model_is_asked_is_an_error(old: str, new: str, where: str) -> None:
    with pytest.raises(WorkflowValidationError) as info:
        _load(MINIMAL.replace(old, new))
    sid = "check" if "evaluate" in old else "end"
    assert str(info.value) == (
        f"w.yaml:{where}: 'answer: false' does nothing on state {sid!r}: only a state whose "
        "action calls the model (agent.think) or a workflow (workflow.call) replies with an "
        "answer"
    )


def test_answer_true_is_harmless_anywhere() -> None:
    text = MINIMAL.replace("{action: kernel.evaluate}", "{action: kernel.evaluate, answer: true}")
    assert _load(text).states["check"].answer is True


@pytest.mark.parametrize("value", ["maybe", "no", "yes", "0", '"false"'])
def test_answer_must_be_true_or_false(value: str) -> None:
    text = MINIMAL.replace("{action: agent.think}", f"{{action: agent.think, answer: {value}}}")
    with pytest.raises(WorkflowValidationError) as info:
        _load(text)
    assert str(info.value) == "w.yaml:4:40: answer: Input should be a valid boolean"


def test_the_json_schema_describes_answer() -> None:
    schema = WorkflowSpec.model_json_schema()
    answer = schema["$defs"]["StateSpec"]["properties"]["answer"]
    assert answer["type"] == "boolean"
    assert answer["default"] is True
    assert "run's answer" in answer["description"]
    assert "validation error" in answer["description"]
