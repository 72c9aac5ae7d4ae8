"""`fsm-kernel validate` refuses a workflow with a cycle that could repeat forever (exit 2, the
cycle named at `path:line:col` of one of its edges), and `validate --explain [--json]` lists
the termination reasons a valid workflow's edges reach, each with its shortest path, those it
declares or names but never reaches, and those the kernel may end any run with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clikit import cli

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
BROKEN = str(DATA / "broken_unbounded_cycle.yaml")
CYCLE_ERROR = (
    f"{BROKEN}:13:5: poll → check → poll can repeat without a model call, a limit or a timer: "
    "give the cycle a state that calls the model, an edge that waits (event: or after:), or a "
    "counter (when: vars.n < 3 with assign: {n: vars.n + 1})"
)
STOCK = ["approve_tools", "default", "plan_execute", "react", "reflect", "single_shot"]

UNREACHED = """\
name: unreached
reasons:
  escalated: {description: never used}
initial: think
states:
  think: {action: agent.think}
  end: {final: true}
transitions:
  - {source: think, target: end, guard: has_answer, unless: has_answer, reason: done}
  - {source: think, target: end, reason: final_answer}
"""


def test_an_unbounded_cycle_is_refused_at_its_edge(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", BROKEN)

    assert result.code == 2
    assert result.err == f"error: {CYCLE_ERROR}\n"
    assert result.out == ""


def test_an_unbounded_cycle_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", "--json", BROKEN)

    assert result.code == 2
    [report] = result.json()["files"]
    assert report["ok"] is False
    assert report["errors"] == [
        {
            "file": str(BROKEN),
            "line": 13,
            "col": 5,
            "message": CYCLE_ERROR.split(":13:5: ")[1],
            "text": CYCLE_ERROR,
        }
    ]


def test_the_console_script_exits_2_without_a_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "fsm_kernel", "validate", BROKEN],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )

    assert done.returncode == 2
    assert done.stderr == f"error: {CYCLE_ERROR}\n"


def test_every_stock_workflow_still_validates(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", *STOCK)

    assert result.code == 0
    assert result.err == ""
    assert [line.split(": ")[1].split(" ")[0] for line in result.out.splitlines()] == ["ok"] * 6


def test_explain_lists_reasons_with_shortest_paths(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", "--explain", "single_shot")

    assert result.code == 0
    assert result.out.splitlines() == [
        f"{REPO / 'workflows' / 'single_shot.yaml'}: ok (2 states, 2 transitions)",
        "termination reasons reached (shortest path from answer):",
        "  malformed_output  failure  answer →[malformed_output] terminate",
        "  final_answer      success  answer → terminate",
        "the kernel may also end a run, whatever the edges say, with:",
        "  agent_error       the model server fails after retries, where no catch: handles it",
        "  cancelled         the run is cancelled (Ctrl-C, runs cancel)",
        "  error             an action raises (a bug) where no catch: handles it",
        "  malformed_output  before a model call, after 3 malformed replies in a row "
        "(limits.max_malformed_outputs)",
        "  max_iterations    before a model call, once limits.max_iterations (1) is reached",
        "  no_progress       after 1000 transitions (limits.max_transitions)",
        "  timeout           the run takes longer than 600s (limits)",
        "  truncated         instead of a success reason, when the last reply was cut off",
    ]


def test_explain_shows_each_edges_conditions_on_the_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = cli(capsys, "validate", "--explain", "default")

    lines = result.out.splitlines()
    assert result.code == 0
    assert lines[1:9] == [
        "termination reasons reached (shortest path from observe):",
        "  malformed_output  failure  observe → think →[malformed_output] terminate",
        "  final_answer      success  observe → think → terminate",
        "  done              success  observe → think →[has_tool_calls] act → evaluate "
        "→[done_called] terminate",
        "  fatal_tool_error  failure  observe → think →[has_tool_calls] act → evaluate "
        "→[fatal_tool_error] terminate",
        "  tool_failures     failure  observe → think →[has_tool_calls] act → evaluate "
        "→[tool_failures] terminate",
        "  no_progress       failure  observe → think →[has_tool_calls] act → evaluate "
        "→[no_progress] terminate",
        "  max_iterations    failure  observe → think →[has_tool_calls] act → evaluate "
        "→[iteration_limit] terminate",
    ]
    assert "never reached:" not in lines


def test_explain_names_states_by_full_compound_path(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", "--explain", str(DATA / "compound_research.yaml"))

    assert result.code == 0
    assert result.out.splitlines()[1:4] == [
        "termination reasons reached (shortest path from research.think):",
        "  escalated     failure  research.think →[tool_failed] terminate",
        "  final_answer  success  research.think → research.found →[completed] report → terminate",
    ]


def test_explain_lists_reasons_never_reached(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "unreached.yaml"
    path.write_text(UNREACHED)

    result = cli(capsys, "validate", "--explain", str(path))

    lines = result.out.splitlines()
    assert result.code == 0
    start = lines.index("never reached:")
    assert lines[start - 2 : start + 3] == [
        "termination reasons reached (shortest path from think):",
        "  final_answer  success  think → end",
        "never reached:",
        f"  done  (built-in; named at {path}:9:5)",
        "  escalated  (declared under reasons:; no edge)",
    ]


def test_explain_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "unreached.yaml"
    path.write_text(UNREACHED)

    result = cli(capsys, "validate", "--explain", "--json", "default", str(path))

    assert result.code == 0
    default, unreached = result.json()["files"]
    explained = default["explain"]
    assert explained["initial"] == "observe"
    assert [r["reason"] for r in explained["reached"]] == [
        "malformed_output",
        "final_answer",
        "done",
        "fatal_tool_error",
        "tool_failures",
        "no_progress",
        "max_iterations",
    ]
    done = explained["reached"][2]
    assert done["success"] is True
    assert done["states"] == ["observe", "think", "act", "evaluate", "terminate"]
    assert [(e["index"], e["label"], e["line"]) for e in done["edges"]] == [
        (0, "", 27),
        (1, "has_tool_calls", 28),
        (5, "", 32),
        (6, "done_called", 33),
    ]
    assert explained["unreached"] == []
    assert [k["reason"] for k in explained["kernel"]] == [
        "agent_error",
        "cancelled",
        "error",
        "fatal_tool_error",
        "malformed_output",
        "max_iterations",
        "no_progress",
        "timeout",
        "tool_failures",
        "truncated",
    ]
    assert unreached["explain"]["unreached"] == [
        {"reason": "done", "declared": False, "edges": [{"index": 0, "line": 9, "col": 5}]},
        {"reason": "escalated", "declared": True, "edges": []},
    ]
    assert "explain_lines" not in default


def test_explain_on_a_broken_file_reports_its_errors_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = cli(capsys, "validate", "--explain", BROKEN, "single_shot")

    assert result.code == 2
    assert result.err == f"error: {CYCLE_ERROR}\n"
    assert "poll" not in result.out
    assert result.out.startswith(f"{REPO / 'workflows' / 'single_shot.yaml'}: ok")
    assert "termination reasons reached (shortest path from answer):" in result.out


def test_explain_json_on_a_broken_file_has_no_explanation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = cli(capsys, "validate", "--explain", "--json", BROKEN)

    [report] = result.json()["files"]
    assert result.code == 2
    assert "explain" not in report


def test_help_explains_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli(capsys, "validate", "--help")

    assert result.code == 0
    help_text = " ".join(result.out.split())
    assert "--explain" in help_text
    assert "termination reason its edges can end a run with and the shortest path" in help_text
