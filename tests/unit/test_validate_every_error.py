"""`fsm-kernel validate` reports every independent error of a file, as a compiler does: YAML key
errors, every schema error pydantic finds, every semantic check, each at `path:line:col`, in
file order, exit 2; checks that need a known state are skipped when a name is unknown (no
cascade). `--json` gives the same per file. From Python, load_workflow raises the first error
with all of them in `errors`. An MCP server with an empty command is refused where it is."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from fsm_kernel.errors import WorkflowError, WorkflowSyntaxError, WorkflowValidationError
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import SourceLocation
from tests.clikit import cli

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"

SEMANTIC = """\
name: many
tools: [datetime, done]
initial: observe
states:
  observe: {action: session.observe}
  think: {action: agent.thinkk}
  act: {action: tools.execute, answer: false}
  send: {action: kernel.evaluate}
  end: {final: true}
transitions:
  - {source: observe, target: think}
  - {source: think, target: act, guard: has_tool_callz}
  - {source: think, target: end, reason: finished}
  - {source: act, target: thinkk}
  - {source: send, target: end, reason: final_answer}
"""
SEMANTIC_ERRORS = [
    (6, 19, "unknown action 'agent.thinkk'"),
    (7, 40, "'answer: false' does nothing on state 'act'"),
    (8, 3, "state id 'send' is reserved (a python-statemachine name)"),
    (12, 41, "unknown guard 'has_tool_callz'"),
    (13, 42, "unknown termination reason 'finished'"),
    (14, 27, "unknown target state 'thinkk'"),
]

SCHEMA = """\
name: schema
colour: blue
limits:
  max_iterations: -1
initial: start
states:
  start: {action: session.observe, tool: [x]}
  end: {final: true}
transitions:
  - {source: start, target: end, reason: final_answer, cond: has_answer}
  - {source: start}
"""
SCHEMA_ERRORS = [
    (2, 1, "unknown key 'colour'"),
    (4, 19, "max_iterations: Input should be greater than or equal to 0"),
    (7, 36, "unknown key 'tool'"),
    (10, 56, "unknown key 'cond'; guards are written 'guard:'"),
    (11, 5, "missing required key 'target'"),
]

TWINS = """\
name: twins
initial: start
states:
  start: {action: session.observe}
  start: {action: agent.think}
  end: {final: true}
  end: {final: true}
transitions:
  - {source: start, target: end, reason: final_answer}
  - {source: start, target: nowhere}
"""
TWINS_ERRORS = [
    (5, 3, "duplicate key 'start'"),
    (7, 3, "duplicate key 'end'"),
    (10, 29, "unknown target state 'nowhere'"),
]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def assert_lines(err: str, path: Path, expected: list[tuple[int, int, str]]) -> None:
    """`err` is exactly one `error: path:line:col: message...` line per expected error, in
    that order."""
    lines = err.splitlines()
    assert len(lines) == len(expected), err
    for line, (row, col, message) in zip(lines, expected, strict=True):
        assert line.startswith(f"error: {path}:{row}:{col}: {message}"), line


@pytest.mark.parametrize(
    ("text", "expected"),
    [(SEMANTIC, SEMANTIC_ERRORS), (SCHEMA, SCHEMA_ERRORS), (TWINS, TWINS_ERRORS)],
    ids=["semantic", "schema", "duplicate-keys"],
)
def test_validate_reports_every_error_of_a_file_in_file_order(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    text: str,
    expected: list[tuple[int, int, str]],
) -> None:
    path = write(tmp_path, "w.yaml", text)

    outcome = cli(capsys, "validate", path)

    assert outcome.code == 2
    assert outcome.out == ""
    assert_lines(outcome.err, path, expected)


def test_an_unknown_state_name_is_one_error_not_a_cascade(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With `thinkk` unknown, the graph checks (reachability, a path to a final state, the
    fallback edge) would only echo the typo; they are skipped."""
    text = DEFAULT.read_text(encoding="utf-8")
    line = "  - {source: act,      target: evaluate}"
    assert line in text
    path = write(tmp_path, "typo.yaml", text.replace(line, line.replace("evaluate", "evaluat")))
    row = text.splitlines().index(line) + 1

    outcome = cli(capsys, "validate", path)

    assert outcome.code == 2
    assert outcome.err == f"error: {path}:{row}:32: unknown target state 'evaluat'\n"


def test_files_are_reported_one_after_another(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    first = write(tmp_path, "first.yaml", TWINS)
    second = write(tmp_path, "second.yaml", SCHEMA)

    outcome = cli(capsys, "validate", first, DEFAULT, second)

    assert outcome.code == 2
    assert outcome.out == f"{DEFAULT}: ok (5 states, 12 transitions)\n"
    lines = outcome.err.splitlines()
    assert_lines("\n".join(lines[:3]), first, TWINS_ERRORS)
    assert_lines("\n".join(lines[3:]), second, SCHEMA_ERRORS)


# --- --json -------------------------------------------------------------------------------------


def test_validate_json_lists_each_files_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    broken = write(tmp_path, "twins.yaml", TWINS)
    missing = tmp_path / "missing.yaml"

    outcome = cli(capsys, "validate", "--json", DEFAULT, broken, missing)

    assert outcome.code == 2
    assert outcome.err == ""
    report = outcome.json()
    assert report["ok"] is False
    good, bad, absent = report["files"]
    assert good == {
        "workflow": str(DEFAULT),
        "path": str(DEFAULT),
        "ok": True,
        "errors": [],
        "states": 5,
        "transitions": 12,
        "catch_edges": 0,
    }
    assert (bad["path"], bad["ok"]) == (str(broken), False)
    assert [(e["file"], e["line"], e["col"], e["message"]) for e in bad["errors"]] == [
        (str(broken), row, col, message) for row, col, message in TWINS_ERRORS
    ]
    assert bad["errors"][0]["text"] == f"{broken}:5:3: duplicate key 'start'"
    assert absent["ok"] is False
    (error,) = absent["errors"]
    assert (error["file"], error["line"], error["col"]) == (str(missing), None, None)
    assert error["message"].startswith(f"{missing}: no such workflow file")


def test_validate_json_of_valid_files_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, "validate", "--json", "default", "react")

    assert outcome.code == 0
    report = outcome.json()
    assert report["ok"] is True
    assert [f["workflow"] for f in report["files"]] == ["default", "react"]
    assert all(f["ok"] and f["errors"] == [] for f in report["files"])


# --- the Python API -----------------------------------------------------------------------------


def test_load_workflow_raises_the_first_error_with_every_error_attached(tmp_path: Path) -> None:
    path = write(tmp_path, "many.yaml", SEMANTIC)

    with pytest.raises(WorkflowValidationError) as info:
        load_workflow(path)

    err = info.value
    row, col, message = SEMANTIC_ERRORS[0]
    assert str(err).startswith(f"{path}:{row}:{col}: {message}")
    assert err.location == SourceLocation(str(path), row, col)
    found = [(e.location.line, e.location.col) for e in err.errors]
    assert found == [(row, col) for row, col, _ in SEMANTIC_ERRORS]
    assert str(err.errors[0]) == str(err)
    copy = pickle.loads(pickle.dumps(err))  # errors cross process boundaries (the scheduler)
    assert [str(e) for e in copy.errors] == [str(e) for e in err.errors]


def test_a_single_error_is_its_own_list() -> None:
    with pytest.raises(WorkflowSyntaxError) as info:
        load_workflow_text("a: [\n", path="w.yaml")

    assert info.value.errors == [info.value]


def test_check_workflow_text_returns_the_spec_and_every_error() -> None:
    check = check_workflow_text(TWINS, path="w.yaml")

    assert check.spec is not None
    assert not check.ok
    assert [str(e) for e in check.errors] == [
        f"w.yaml:{row}:{col}: {message}" for row, col, message in TWINS_ERRORS
    ]
    assert all(isinstance(e, WorkflowError) for e in check.errors)
    assert check_workflow_text(DEFAULT.read_text(encoding="utf-8")).ok


# --- MCP servers --------------------------------------------------------------------------------

MCP = """\
name: mcp
tools: [done, "mcp:files"]
mcp_servers:
  files: {{command: {command}}}
initial: think
states:
  think: {{action: agent.think}}
  end: {{final: true}}
transitions:
  - {{source: think, target: end, reason: final_answer}}
"""


@pytest.mark.parametrize("command", ['""', '"   "'])
def test_an_empty_mcp_command_is_refused_where_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    path = write(tmp_path, "mcp.yaml", MCP.format(command=command))
    message = (
        "MCP server 'files' has an empty command: name the program to start (e.g. npx, uvx, python)"
    )

    refused = cli(capsys, "validate", path)
    ran = cli(capsys, "run", path, "-p", "hi", "--base-url", "http://127.0.0.1:9/v1")

    assert refused.code == 2
    assert refused.err == f"error: {path}:4:20: {message}\n"
    assert ran.code == 2
    assert f"{path}:4:20: {message}" in ran.err
    assert "PermissionError" not in ran.err
