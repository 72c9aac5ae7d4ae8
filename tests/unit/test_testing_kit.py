"""fsm_kernel.testing (fake models, WorkflowHarness, coverage) and fsm_kernel.pytest_plugin
(through pytester: an inner pytest session that loads the plugin as a user's conftest would)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fsm_kernel.errors import AgentConnectionError, ConfigError, WorkflowValidationError
from fsm_kernel.protocol import Completion, Message, Role, Tool, ToolResult
from fsm_kernel.testing import (
    DeclaredTransition,
    FunctionChatModel,
    ScriptedChatModel,
    ScriptExhaustedError,
    TransitionCoverage,
    WorkflowHarness,
    as_completion,
    assert_all_transitions_covered,
    bad_call,
    call,
    calls,
    text_reply,
    tool_call,
    uncovered_transitions,
)
from fsm_kernel.tools import ToolRegistry
from fsm_kernel.workflow.context import ToolCallRecord
from fsm_kernel.workflow.loader import load_workflow

pytest_plugins = ["pytester"]

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
DEFAULT = WORKFLOWS / "default.yaml"
HELLO = [Message.user("hello")]
NO_TOOLS: list[Tool] = []


def ask(
    model: ScriptedChatModel | FunctionChatModel, messages: list[Message] = HELLO
) -> Completion:
    return asyncio.run(model.complete(messages, NO_TOOLS))


# --- reply shorthands ---------------------------------------------------------------------------


def test_shorthands_build_completions() -> None:
    assert as_completion("hi").message.content == "hi"
    assert as_completion("hi").message.role is Role.ASSISTANT
    reply = call("read_file", {"path": "a.txt"}, id="c1")
    assert reply.finish_reason == "tool_calls"
    (only,) = reply.message.tool_calls
    assert (only.id, only.name, only.arguments) == ("c1", "read_file", {"path": "a.txt"})
    assert text_reply("x", reasoning="because").message.reasoning == "because"
    assert as_completion(Message.assistant("m")).finish_reason == "stop"


def test_calls_accepts_tool_calls_replies_and_pairs() -> None:
    reply = calls(tool_call("a"), call("b", {"x": 1}), ("c", {"y": 2}), content="three")
    assert [c.name for c in reply.message.tool_calls] == ["a", "b", "c"]
    assert reply.message.content == "three"
    assert len({c.id for c in reply.message.tool_calls}) == 3
    with pytest.raises(TypeError, match="calls\\(\\) takes"):
        calls("a")  # type: ignore[arg-type]  # a bare name is a mistake


def test_bad_call_is_a_call_whose_arguments_are_not_json() -> None:
    (broken,) = bad_call("read_file", "{oops").message.tool_calls
    assert broken.arguments_error
    assert broken.raw_arguments == "{oops"


def test_as_completion_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="not int"):
        as_completion(42)  # type: ignore[arg-type]


# --- ScriptedChatModel and FunctionChatModel ----------------------------------------------------


def test_scripted_model_answers_in_order_and_records_requests() -> None:
    model = ScriptedChatModel(["first", call("datetime")])
    tools = [Tool(name="datetime")]
    assert asyncio.run(model.complete(HELLO, tools)).message.content == "first"
    assert ask(model).message.tool_calls[0].name == "datetime"
    assert model.requests[0].tool_names == ["datetime"]
    assert model.requests[1].tools == ()
    assert model.requests[0].last_message == HELLO[0]
    assert model.remaining == 0
    model.assert_complete()


def test_scripted_model_raises_scripted_exceptions() -> None:
    model = ScriptedChatModel([AgentConnectionError("server down")])
    with pytest.raises(AgentConnectionError, match="server down"):
        ask(model)


def test_scripted_model_out_of_replies_is_an_assertion_error() -> None:
    model = ScriptedChatModel(["only one"])
    ask(model)
    with pytest.raises(ScriptExhaustedError, match=r"request #2 but only 1 reply") as info:
        ask(model, [Message.user("and again?")])
    assert isinstance(info.value, AssertionError)
    assert "'and again?'" in str(info.value)
    assert model.failure is info.value


def test_assert_complete_fails_on_leftover_replies() -> None:
    model = ScriptedChatModel(["used", "left", "over"])
    ask(model)
    with pytest.raises(AssertionError, match="2 scripted reply"):
        model.assert_complete()
    model.add("more")
    assert model.remaining == 3


def test_scripted_model_refuses_bad_script_items() -> None:
    with pytest.raises(TypeError):
        ScriptedChatModel([42])  # type: ignore[list-item]


def test_function_model_builds_replies_from_the_request() -> None:
    model = FunctionChatModel(lambda messages, tools: f"echo: {messages[-1].content}")
    assert ask(model).message.content == "echo: hello"
    assert len(model.requests) == 1


def test_function_model_may_be_async() -> None:
    async def reply(messages: list[Message], tools: list[Tool]) -> Completion:
        return call("datetime")

    assert ask(FunctionChatModel(reply)).message.tool_calls[0].name == "datetime"


# --- WorkflowHarness: declared transitions, contexts, steps --------------------------------------


def test_harness_loads_paths_stock_names_and_specs() -> None:
    by_path = WorkflowHarness(DEFAULT)
    assert WorkflowHarness("default").spec.content_hash == by_path.spec.content_hash
    assert WorkflowHarness(load_workflow(DEFAULT)).spec.name == "default"
    with pytest.raises(WorkflowValidationError, match="no such workflow"):
        WorkflowHarness("no_such_workflow")


def test_transitions_are_the_declared_ones_in_file_order() -> None:
    harness = WorkflowHarness(DEFAULT)
    assert len(harness.transitions) == len(harness.spec.transitions)
    assert harness.transitions[2] == DeclaredTransition(
        2, "think", "think", "malformed_output and not retries_exhausted", None
    )
    assert harness.transitions[-1] == (11, "evaluate", "observe", "", None)


def test_context_shortcuts() -> None:
    harness = WorkflowHarness(DEFAULT)
    ctx = harness.context(
        last_reply="It is 42.",
        tool_results=[("read_file", "text"), ("datetime", "boom", True)],
        iteration=3,
        limits={"max_iterations": 4},
    )
    assert ctx.last_completion is not None
    assert ctx.answer == "It is 42."
    assert [(r.call.name, r.result.content, r.result.is_error) for r in ctx.last_results] == [
        ("read_file", "text", False),
        ("datetime", "boom", True),
    ]
    assert ctx.tool_calls == ctx.last_results
    assert ctx.last_results[0].iteration == 3
    assert ctx.limits.max_iterations == 4
    assert ctx.limits.max_tool_failures == harness.spec.limits.max_tool_failures
    assert list(ctx.tool_names) == harness.spec.tool_names


def test_context_keeps_explicit_fields() -> None:
    harness = WorkflowHarness(DEFAULT)
    record = ToolCallRecord(iteration=1, call=tool_call("done"), result=ToolResult(content="42"))
    ctx = harness.context(last_reply="PASS", answer="the answer", tool_results=[record])
    assert ctx.answer == "the answer"
    assert ctx.last_results == [record]
    assert harness.context(last_reply=call("datetime")).answer == ""
    assert harness.context(last_reply=None).last_completion is None


def test_context_rejects_mistakes() -> None:
    harness = WorkflowHarness(DEFAULT)
    with pytest.raises(TypeError, match=r"unknown context field.*iterations"):
        harness.context(iterations=3)
    with pytest.raises(TypeError, match="not both"):
        harness.context(last_reply="a", last_completion=as_completion("b"))
    with pytest.raises(TypeError, match="name, output"):
        harness.context(tool_results=["read_file"])
    with pytest.raises(ConfigError, match="max_iteration: Extra inputs are not permitted"):
        harness.context(limits={"max_iteration": 3})
    with pytest.raises(ConfigError, match="max_iterations: Input should be greater"):
        harness.context(limits={"max_iterations": -1})


def test_step_fires_one_transition_without_running_actions() -> None:
    harness = WorkflowHarness(DEFAULT)
    # agent.think would raise (no model) and count an iteration: step() runs no action
    fired = harness.step("think", last_reply=call("datetime"), iteration=2)
    assert (fired.index, fired.source, fired.target, fired.guard) == (
        1,
        "think",
        "act",
        "has_tool_calls",
    )
    assert fired.final is False
    ctx = harness.context(iteration=10)
    assert harness.step("evaluate", context=ctx).reason == "max_iterations"
    assert ctx.iteration == 10
    assert ctx.current_state == "terminate"
    assert harness.fired[-1].target == "terminate"
    assert len(harness.fired) == 2


def test_step_rejects_unknown_and_final_states() -> None:
    harness = WorkflowHarness(DEFAULT)
    with pytest.raises(ValueError, match="unknown state 'thinking'"):
        harness.step("thinking")
    with pytest.raises(ValueError, match="is final"):
        harness.step("terminate")
    with pytest.raises(TypeError, match="not both"):
        harness.step("think", context=harness.context(), iteration=1)


def test_listeners_see_every_step() -> None:
    harness = WorkflowHarness(DEFAULT)
    seen: list[str] = []
    harness.add_listener(lambda h, fired: seen.append(fired.target))
    harness.step("observe")
    harness.step("act")
    assert seen == ["think", "evaluate"]


# --- WorkflowHarness.run --------------------------------------------------------------------------


def test_run_drives_the_real_kernel_and_records_what_fired(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    harness = WorkflowHarness(DEFAULT)
    model = ScriptedChatModel([call("read_file", {"path": "a.txt"}), "It says hello."])
    result = harness.run("read a.txt", model=model, workspace=tmp_path)
    assert (result.termination_reason, result.response) == ("final_answer", "It says hello.")
    assert [(f.source, f.target) for f in harness.fired] == [
        ("observe", "think"),
        ("think", "act"),
        ("act", "evaluate"),
        ("evaluate", "observe"),
        ("observe", "think"),
        ("think", "terminate"),
    ]
    assert harness.fired[-1].final
    assert model.requests[0].messages[0].role is Role.SYSTEM


def test_run_uses_a_fresh_workspace_by_default() -> None:
    model = ScriptedChatModel([call("list_directory", {"path": "."}), "empty"])
    result = WorkflowHarness(DEFAULT).run("list", model=model)
    assert result.tool_calls[0].result.content == "(empty directory)"


def test_run_raises_when_the_script_runs_out() -> None:
    model = ScriptedChatModel([call("datetime")])
    with pytest.raises(ScriptExhaustedError, match="request #2"):
        WorkflowHarness(DEFAULT).run("time?", model=model)


def test_run_raises_a_function_models_failed_assertion() -> None:
    def model_fn(messages: list[Message], tools: list[Tool]) -> str:
        assert tools == [], "expected no tools"
        return "never"

    with pytest.raises(AssertionError, match="expected no tools"):
        WorkflowHarness(DEFAULT).run("q", model=FunctionChatModel(model_fn))


def test_run_reports_a_scripted_model_error_as_agent_error() -> None:
    model = ScriptedChatModel([AgentConnectionError("connection refused")])
    result = WorkflowHarness(DEFAULT).run("q", model=model)
    assert result.termination_reason == "agent_error"
    assert "connection refused" in (result.error or "")


def test_run_limits_override_leaves_the_workflow_alone() -> None:
    harness = WorkflowHarness(DEFAULT)
    looping = [call("datetime", {"timezone": f"Etc/GMT+{i}"}) for i in range(3)]
    capped = harness.run("loop", model=ScriptedChatModel(looping[:2]), limits={"max_iterations": 2})
    assert capped.termination_reason == "max_iterations"
    assert harness.spec.limits.max_iterations == 10
    # the same workflow without the override is not served the capped compilation
    uncapped = harness.run("loop", model=ScriptedChatModel([*looping, "done looping"]))
    assert uncapped.termination_reason == "final_answer"
    assert uncapped.iterations == 4


def test_run_with_extra_tool_functions() -> None:
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: what to shout.
        """
        return text.upper()

    model = ScriptedChatModel([call("shout", {"text": "hi"}), "HI"])
    result = WorkflowHarness(DEFAULT).run("shout hi", model=model, tools=[shout])
    assert result.tool_calls[0].result.content == "HI"
    assert "shout" in model.requests[0].tool_names


def test_run_with_a_tool_executor_offers_all_of_its_tools() -> None:
    registry = ToolRegistry()

    @registry.register
    def answer() -> str:
        """The answer."""
        return "42"

    model = ScriptedChatModel([call("answer"), "42"])
    result = WorkflowHarness(DEFAULT).run("q", model=model, tools=registry)
    assert model.requests[0].tool_names == ["answer"]
    assert result.tool_calls[0].result.content == "42"


# --- coverage -------------------------------------------------------------------------------------


def test_coverage_from_steps_and_triples() -> None:
    harness = WorkflowHarness(WORKFLOWS / "single_shot.yaml")
    fired = harness.step("answer", last_reply="hi")
    with pytest.raises(AssertionError, match=r"1 of 2 declared transition\(s\)") as info:
        assert_all_transitions_covered(harness, [fired])
    assert "#0 answer -> terminate [malformed_output] (malformed_output)" in str(info.value)
    assert_all_transitions_covered(harness, [fired, ("answer", "terminate", "malformed_output")])
    assert_all_transitions_covered(harness.spec, harness.transitions)


def test_coverage_refuses_cases_that_match_nothing() -> None:
    harness = WorkflowHarness(WORKFLOWS / "single_shot.yaml")
    with pytest.raises(ValueError, match="matches no declared transition"):
        assert_all_transitions_covered(harness, [("answer", "terminate", "malformed")])
    foreign = WorkflowHarness(DEFAULT).step("evaluate", iteration=10)
    with pytest.raises(ValueError, match="is not from"):
        assert_all_transitions_covered(harness, [foreign])


def test_uncovered_transitions_lists_what_is_left() -> None:
    harness = WorkflowHarness(DEFAULT)
    harness.step("observe")
    missing = uncovered_transitions(harness, harness.fired)
    assert [t.index for t in missing] == list(range(1, 12))


def test_transition_coverage_collects_per_workflow() -> None:
    coverage = TransitionCoverage()
    with pytest.raises(AssertionError, match="no workflow was watched"):
        coverage.assert_all_covered()
    single = coverage.watch(WorkflowHarness(WORKFLOWS / "single_shot.yaml"))
    again = coverage.watch(WorkflowHarness("single_shot"))  # the same workflow, merged
    single.step("answer", last_reply="hi")
    again.step("answer", last_reply=bad_call("x"), malformed_reason="bad")
    coverage.assert_all_covered()
    coverage.assert_all_covered(WORKFLOWS / "single_shot.yaml")
    assert len(coverage.fired(single)) == 2
    default = coverage.watch(WorkflowHarness(DEFAULT))
    default.step("observe")
    with pytest.raises(AssertionError, match="11 of 12") as info:
        coverage.assert_all_covered()
    assert "default.yaml" in str(info.value)
    assert "single_shot" not in str(info.value)


# --- the pytest plugin ----------------------------------------------------------------------------

PLUGIN_TESTS = f"""
import pytest
from fsm_kernel.testing import call

WORKFLOW = {str(WORKFLOWS / "single_shot.yaml")!r}
CASES = [
    ("answer", {{"last_reply": "hi"}}, "terminate", "final_answer"),
    ("answer", {{"last_reply": call("x"), "malformed_reason": "not offered"}}, "terminate",
     "malformed_output"),
]

@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(workflow_harness, state, ctx, target, reason):
    fired = workflow_harness(WORKFLOW).step(state, **ctx)
    assert (fired.target, fired.reason) == (target, reason)

def test_all_covered(transition_coverage):
    transition_coverage.assert_all_covered(WORKFLOW)
"""


@pytest.fixture
def plugin_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # Only what a user's conftest loads: no other installed plugins (and a faster start).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest('pytest_plugins = ["fsm_kernel.pytest_plugin"]')
    return pytester


def test_plugin_records_steps_and_checks_coverage(plugin_project: pytest.Pytester) -> None:
    plugin_project.makepyfile(test_flow=PLUGIN_TESTS)
    plugin_project.runpytest().assert_outcomes(passed=3)


def test_plugin_lists_uncovered_transitions(plugin_project: pytest.Pytester) -> None:
    only_one_case = PLUGIN_TESTS.replace('("answer", {"last_reply": call("x")', "# (")
    only_one_case = only_one_case.replace('     "malformed_output"),', "")
    plugin_project.makepyfile(test_flow=only_one_case)
    result = plugin_project.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*#0 answer -> terminate [[]malformed_output[]]*"])


def test_plugin_skips_coverage_on_a_partial_run(plugin_project: pytest.Pytester) -> None:
    plugin_project.makepyfile(test_flow=PLUGIN_TESTS)
    result = plugin_project.runpytest("-k", "final_answer or all_covered")
    result.assert_outcomes(passed=1, skipped=1, deselected=1)
    result = plugin_project.runpytest("test_flow.py::test_all_covered", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*only part of this module ran*"])


def test_plugin_scripted_model_must_be_used_up(plugin_project: pytest.Pytester) -> None:
    plugin_project.makepyfile(
        test_models="""
        def test_leftover(scripted_model):
            scripted_model(["used", "left over"])

        def test_allowed(scripted_model):
            scripted_model(["left over"], allow_leftovers=True)

        def test_failing_test_reports_only_its_failure(scripted_model):
            scripted_model(["left over"])
            assert False, "the real failure"

        def test_used_up(workflow_harness, scripted_model):
            model = scripted_model(["hi"])
            result = workflow_harness("single_shot").run("hello", model=model)
            assert result.termination_reason == "final_answer"
        """
    )
    result = plugin_project.runpytest()
    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*scripted model #1: 2 reply(ies) never requested*"])
    assert "the real failure" in result.stdout.str()
