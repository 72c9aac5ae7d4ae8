"""The workflow explorer (issue 28, part 2): every stock workflow keeps the invariants over a
bounded, derandomized set of drawn runs; a workflow whose action or guard raises, whose state
assigns from output a malformed reply never gave, or whose guard decides differently on replay
yields a shrunk counterexample naming the invariant, the replies and the path; `fsm-kernel
explore` (what `test --explore` runs) exits 0, 1 or 2; the pytest fixture; and the kernel bug
the explorer found (a rejected call replayed as approved)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.cli import main
from fsm_kernel.protocol import EventType
from fsm_kernel.replay import replay_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, WorkflowHarness, call
from fsm_kernel.testing._explore import ExploreReport, explore
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.spec import TerminationReason

pytest_plugins = ["pytester"]

STOCK = Path(__file__).resolve().parents[2] / "workflows"
KERNEL_REASONS = {str(r) for r in TerminationReason}

# A loop whose evaluate step asks a user's guard; {guard} is filled in per test.
WITH_GUARD = """\
name: with_guard
tools: [datetime, read_file]
limits: {{max_iterations: 6}}
initial: think
states:
  think: {{action: agent.think}}
  act: {{action: tools.execute}}
  evaluate: {{action: kernel.evaluate}}
  terminate: {{final: true}}
transitions:
  - {{source: think, target: act, guard: has_tool_calls}}
  - {{source: think, target: think, guard: malformed_output, unless: retries_exhausted}}
  - {{source: think, target: terminate, guard: malformed_output, reason: malformed_output}}
  - {{source: think, target: terminate, reason: final_answer}}
  - {{source: act, target: evaluate}}
  - {{source: evaluate, target: terminate, guard: "{guard}", reason: done}}
  - {{source: evaluate, target: terminate, guard: iteration_limit, reason: max_iterations}}
  - {{source: evaluate, target: think}}
"""


def failed_tool_breaks(ctx: RunContext) -> bool:
    """A buggy guard: it raises once a tool failed."""
    if any(r.result.is_error for r in ctx.last_results):
        raise ValueError("cannot handle a failed tool")
    return False


_FLIPS = itertools.count()


def flips(ctx: RunContext) -> bool:
    """A guard that reads something outside the run: it decides differently on replay."""
    return next(_FLIPS) % 2 == 0


def keeps_notes(ctx: RunContext) -> None:
    """A buggy action: it raises on any answer longer than 10 characters."""
    if ctx.last_completion is not None and len(ctx.last_completion.message.content) > 10:
        raise RuntimeError("note too long")


def _write(tmp_path: Path, text: str, name: str = "wf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _reasons(path: Path) -> set[str]:
    spec = WorkflowHarness(path).spec
    return {t.reason for t in spec.transitions if t.reason} | KERNEL_REASONS


# -- every stock workflow ----------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(STOCK.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_stock_workflow_keeps_the_invariants(path: Path) -> None:
    report = explore(path, examples=25)

    assert report.passed, report.counterexample
    assert report.counterexample is None
    assert report.runs == 25
    assert sum(report.endings.values()) == 25
    assert set(report.endings) <= _reasons(path) | {"waiting"}
    assert "error" not in report.endings


def test_the_examples_are_the_same_every_time_unless_a_seed_is_given() -> None:
    first, again = explore("default", examples=15), explore("default", examples=15)
    seeded = [explore("default", examples=15, seed=s).endings for s in (1, 2, 3)]

    assert first.endings == again.endings
    assert first.seed is None
    assert any(endings != first.endings for endings in seeded)


def test_a_workflow_that_waits_gets_answers_events_and_timers(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
name: waits
reasons:
  gave_up: {description: CI never answered}
tools: [{name: read_file, approval: required}]
initial: plan
states:
  plan: {action: agent.think}
  act: {action: tools.execute}
  steer: {action: human.input, prompt: "How should I go on?"}
  wait_ci: {description: waits for CI}
  done: {final: true}
transitions:
  - {source: plan, target: act, guard: has_tool_calls}
  - {source: plan, target: wait_ci}
  - {source: act, target: steer, guard: rejected}
  - {source: act, target: wait_ci}
  - {source: steer, target: wait_ci}
  - {source: wait_ci, target: done, event: ci_passed, reason: final_answer}
  - {source: wait_ci, target: done, after: 30m, reason: gave_up}
""",
    )
    report = explore(path, examples=60)

    assert report.passed, report.counterexample
    assert {"final_answer", "gave_up", "waiting"} <= set(report.endings)


def test_a_workflow_without_an_iteration_cap_is_explored_with_one(tmp_path: Path) -> None:
    text = WITH_GUARD.format(guard="done_called").replace("max_iterations: 6", "max_iterations: 0")
    report = explore(_write(tmp_path, text), examples=20)

    assert report.passed, report.counterexample
    assert report.notes == ["max_iterations is 0 (unlimited): explored with max_iterations 25"]


# -- counterexamples ---------------------------------------------------------------------------


def test_a_raising_guard_yields_a_shrunk_counterexample(tmp_path: Path) -> None:
    guard = "tests.unit.test_explore:failed_tool_breaks"
    path = _write(tmp_path, WITH_GUARD.format(guard=guard))

    report = explore(path, examples=50)

    assert not report.passed
    text = report.counterexample
    assert text is not None
    lines = text.splitlines()
    assert lines[0] == "workflow with_guard: a run broke 1 invariant(s):"
    assert lines[1].startswith("  - the run ended with reason error (something raised): ")
    assert "ValueError: cannot handle a failed tool" in lines[1]
    assert lines[2] == "the run (shrunk by Hypothesis):"
    steps = lines[3:]
    # shrunk: one reply calling one tool, whose one result is an error, and nothing more
    assert [s for s in steps if "model replies" in s] == [
        "  [think] model replies call datetime({})"
    ]
    assert [s for s in steps if "] tool " in s] == ['  [act] tool datetime → error "error: PASS"']
    assert steps[-1] == (
        "  ended: error: ValueError: cannot handle a failed tool (in state 'evaluate')"
    )
    assert "think → act [has_tool_calls]" in text


def test_a_raising_action_yields_a_shrunk_counterexample(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
name: notes
initial: answer
states:
  answer: {action: agent.think}
  note: {action: "tests.unit.test_explore:keeps_notes"}
  terminate: {final: true}
transitions:
  - {source: answer, target: terminate, guard: malformed_output, reason: malformed_output}
  - {source: answer, target: note}
  - {source: note, target: terminate, reason: final_answer}
""",
    )
    report = explore(path, examples=50)

    assert not report.passed
    text = report.counterexample or ""
    assert "RuntimeError: note too long" in text
    (reply,) = [line for line in text.splitlines() if "model replies" in line]
    assert len(json.loads(reply.split("model replies text ", 1)[1])) > 10


def test_a_state_assigning_output_assigns_nothing_from_a_malformed_reply(tmp_path: Path) -> None:
    # a reply that is not the JSON asked for is malformed output: nothing to assign, and the
    # malformed_output edge decides (this broke the run with `error` before)
    path = _write(
        tmp_path,
        """\
name: plans
variables:
  plan: {type: array, items: {type: string}}
initial: plan
states:
  plan:
    action: agent.think
    output: {type: object, properties: {steps: {type: array, items: {type: string}}},
             required: [steps]}
    assign: {plan: output.steps}
  answer: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: plan, target: terminate, guard: malformed_output, reason: malformed_output}
  - {source: plan, target: answer}
  - {source: answer, target: terminate, reason: final_answer}
""",
    )
    report = explore(path, examples=30)

    assert report.passed, report.counterexample
    assert "malformed_output" in report.to_dict()["endings"]


def test_a_guard_that_decides_differently_on_replay_is_caught(tmp_path: Path) -> None:
    path = _write(tmp_path, WITH_GUARD.format(guard="tests.unit.test_explore:flips"))

    report = explore(path, examples=30)

    assert not report.passed
    assert report.counterexample is not None
    problem = report.counterexample.splitlines()[1]
    assert problem.startswith("  - the replay diverged at step 3: recorded evaluate → ")


# -- the kernel bug the explorer found ---------------------------------------------------------


def test_a_rejected_call_replays_as_rejected(tmp_path: Path) -> None:
    """approve_tools through WorkflowHarness.run (a Kernel built without bootstrap's settings):
    the log must say which tools need approval, or the replay never asks and takes
    act → evaluate where the run took act → steer [rejected]."""
    harness = WorkflowHarness("approve_tools")
    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = harness.run(
            "Read a.",
            model=ScriptedChatModel([call("read_file", {"path": "a"}), "Fine."]),
            store=store,
            human=ScriptedHuman([HumanAnswer.reject("not that"), HumanAnswer.input("go on")]),
        )
        started = store.read(result.run_id)[0]
        report = asyncio.run(replay_run(compile_workflow(harness.spec), store, result.run_id))

    assert result.termination_reason == "final_answer"
    assert started.type is EventType.RUN_STARTED
    assert started.data["settings"]["approval"] == ["list_directory", "read_file"]
    assert report.identical, report.to_dict()
    assert [s.replayed for s in report.steps][2] == "act → steer [rejected]"


# -- the command -------------------------------------------------------------------------------


def test_cli_exits_0_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["test", "--explore", "single_shot", "--examples", "5"])

    out = capsys.readouterr().out
    assert code == 0
    assert out == "explore single_shot: ok after 5 run(s) (endings: final_answer 5)\n"


def test_cli_exits_1_with_the_counterexample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, WITH_GUARD.format(guard="tests.unit.test_explore:failed_tool_breaks"))

    code = main(["test", "--explore", str(path), "--examples", "50", "--seed", "3"])

    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith("workflow with_guard: a run broke 1 invariant(s):\n")
    assert "ValueError: cannot handle a failed tool" in out
    assert out.splitlines()[-1].startswith("explore with_guard: FAILED after ")


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["test", "--explore", "default", "--examples", "5", "--json"])

    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["workflow"] == "default"
    assert report["passed"] is True
    assert report["runs"] == 5
    assert report["counterexample"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["test", "--explore", "nope"], "error: nope: no such workflow file or stock workflow"),
        (
            ["test", "--explore", "default", "--examples", "0"],
            "--examples: must be at least 1, not 0",
        ),
        (["test", "--explore", "default", "--seed", "x"], "--seed: invalid int value: 'x'"),
    ],
)
def test_cli_exits_2_on_bad_input(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(argv)

    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_cli_names_a_broken_workflow_file_at_its_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, WITH_GUARD.format(guard="no_such_guard"))

    code = main(["test", "--explore", str(path)])

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {path}:16:50: unknown guard 'no_such_guard' (built-in: ")
    assert len(err.splitlines()) == 1


def test_cli_without_hypothesis_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis now fails

    code = main(["test", "--explore", "default"])

    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        "error: --explore needs Hypothesis, which is not installed: pip install "
        "'fsm-kernel[test]' (or pip install hypothesis)\n"
    )


# -- the pytest fixture ------------------------------------------------------------------------


def test_the_fixture_returns_the_report(workflow_explorer: Any) -> None:
    report = workflow_explorer("react", examples=10)

    assert isinstance(report, ExploreReport)
    assert report.passed
    assert report.runs == 10


def test_the_fixture_fails_the_test_with_the_counterexample(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only what a user's conftest loads: no other installed plugins (and a faster start).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest('pytest_plugins = ["fsm_kernel.pytest_plugin"]')
    pytester.makepyfile(
        test_wf=f"""
        from fsm_kernel.workflow.loader import load_workflow_text

        TEXT = {WITH_GUARD.format(guard="tests.unit.test_explore:failed_tool_breaks")!r}

        def test_explore(workflow_explorer):
            workflow_explorer(load_workflow_text(TEXT, path="wf.yaml"), examples=50)
        """
    )
    pytester.syspathinsert(str(Path(__file__).resolve().parents[2]))

    result = pytester.runpytest("-p", "no:cacheprovider")

    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*workflow with_guard: a run broke 1 invariant(s):",
            "*ValueError: cannot handle a failed tool*",
            "*explore with_guard: FAILED after *",
        ]
    )
