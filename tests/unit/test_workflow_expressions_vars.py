"""Guard expressions (`when:`) and declared variables (`variables:`, `assign:`): what validate
reports at file:line:col, and how a `when:` chooses between edges at the transition level."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_kernel import reads, writes
from fsm_kernel.diagram import edge_label, to_mermaid
from fsm_kernel.testing import WorkflowHarness
from fsm_kernel.workflow.expressions import check, evaluate
from fsm_kernel.workflow.loader import load_workflow
from tests.clikit import cli

ROUTER = """\
name: router
variables:
  attempts: {type: integer, default: 0}
  plan: {type: array, items: {type: string}, default: []}
initial: think
states:
  think: {action: agent.think, assign: {attempts: "vars.attempts + 1"}}
  more: {action: agent.think}
  done: {final: true}
transitions:
  - {source: think, target: done, when: "vars.attempts >= 3", reason: final_answer}
  - {source: think, target: more, when: "size(vars.plan) > 0"}
  - {source: think, target: done, reason: final_answer}
  - {source: more, target: think}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "wf.yaml"
    path.write_text(text)
    return path


def test_validate_rejects_an_unknown_name_at_its_line_and_column(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, ROUTER.replace('when: "vars.attempts >= 3"', 'when: "tries >= 3"'))

    refused = cli(capsys, "validate", str(path))

    assert refused.code == 2
    assert refused.err.splitlines() == [
        f"error: {path}:11:42: unknown name 'tries' "
        "(known: event, iteration, last_tool, output, tool_failures, vars)"
    ]


def test_validate_rejects_a_type_error_and_an_unknown_variable_each_where_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = ROUTER.replace('"vars.attempts + 1"', "\"vars.attempts + 'x'\"").replace(
        'when: "size(vars.plan) > 0"', 'when: "vars.plan > 3 || vars.plna == 1"'
    )
    path = write(tmp_path, text)

    refused = cli(capsys, "validate", str(path))

    assert refused.code == 2
    assert refused.err.splitlines() == [
        f"error: {path}:7:52: no + for int and string",
        f"error: {path}:12:42: no > for list and int",
        f"error: {path}:12:64: unknown variable 'plna' (attempts, plan)",
    ]


def test_validate_reports_syntax_errors_wrong_assign_types_and_unwritten_variables(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = (
        ROUTER.replace("default: []}", "}")
        .replace('"vars.attempts + 1"', '"[1]"')
        .replace('when: "vars.attempts >= 3"', 'when: "vars.attempts >="')
    )
    path = write(tmp_path, text)

    refused = cli(capsys, "validate", str(path))

    assert refused.code == 2
    assert refused.err.splitlines() == [
        f"error: {path}:4:9: variable 'plan' is read but never written (no assign: or "
        "@writes sets it) and has no default: it is always null",
        f"error: {path}:7:51: assign attempts: the expression is list, the variable is int",
        f"error: {path}:11:56: syntax error: unexpected end of expression",
    ]


def test_a_declared_python_writer_counts_as_writing_the_variable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "planner_mod.py").write_text(
        "from fsm_kernel import writes\n\n"
        "@writes('plan')\n"
        "def make_plan(ctx):\n"
        "    ctx.vars['plan'] = ['a']\n"
    )
    text = ROUTER.replace("default: []}", "}").replace(
        "  more: {action: agent.think}", "  more: {action: planner_mod:make_plan}"
    )
    path = write(tmp_path, text)

    assert cli(capsys, "validate", str(path)).code == 0


def test_reads_and_writes_mark_the_function() -> None:
    @reads("plan")
    @writes("attempts", "plan")
    def act(ctx: object) -> None:
        return None

    assert act.__fsm_reads__ == ("plan",)  # type: ignore[attr-defined]
    assert act.__fsm_writes__ == ("attempts", "plan")  # type: ignore[attr-defined]


def test_a_when_expression_chooses_between_edges(tmp_path: Path) -> None:
    harness = WorkflowHarness(write(tmp_path, ROUTER))

    assert harness.step("think", vars={"attempts": 3, "plan": ["a"]}).target == "done"
    assert harness.step("think", vars={"attempts": 1, "plan": ["a"]}).target == "more"
    fired = harness.step("think", vars={"attempts": 1, "plan": []})
    assert (fired.target, fired.index) == ("done", 2)
    assert harness.step("think").index == 2, "variables start at their defaults (0, [])"
    assert harness.transitions[1].guard == "size(vars.plan) > 0"


def test_the_checker_types_macros_and_the_evaluator_returns_plain_values() -> None:
    types = {"plan": "list", "attempts": "int"}
    assert check('vars.plan.exists(p, p == "a") && iteration < 5', types).problems == []
    assert check("vars.plan.size() + vars.attempts", types).kind == "int"
    assert evaluate("vars.plan + ['b']", {"vars": {"plan": ["a"]}}) == ["a", "b"]
    assert evaluate("output.n * 2", {"output": {"n": 21}}) == 42


def test_diagrams_show_when_on_the_edge_and_assign_on_state_and_edge(tmp_path: Path) -> None:
    text = ROUTER.replace(
        "  - {source: more, target: think}",
        '  - {source: more, target: think, assign: {plan: "[]"}}',
    )
    spec = load_workflow(write(tmp_path, text))

    assert edge_label(spec, 0) == "1. [vars.attempts >= 3] → final_answer"
    assert edge_label(spec, 1) == "2. [size(vars.plan) > 0]"
    assert edge_label(spec, 3) == "/ plan = []"
    mermaid = to_mermaid(spec)
    assert "/ attempts = vars.attempts + 1" in mermaid
    assert "[size(vars.plan) > 0]" in mermaid
