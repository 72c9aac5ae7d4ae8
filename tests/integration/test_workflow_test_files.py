"""Workflow test files and `fsm-kernel test` (issue 28, part 1): the issue's own example runs
green; a failing case names its first difference at its file:line:col (exit 1); a broken file
is one line per mistake (exit 2); --json and --junit-xml carry the same results; --coverage
reports and --coverage-min fails below its threshold; answers, events, timers, scripted child
runs, variables and structured output are scriptable and checkable; the pytest plugin collects
*.test.yaml, one item per case; --generate writes a file that runs green."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.clikit import cli

ISSUE_EXAMPLE = """\
workflow: default
cases:
  answers_after_a_tool:
    prompt: What time is it?
    model:
      - tool_calls: [{name: datetime, arguments: {}}]
      - text: It is noon.
    tools:
      datetime: [{return: "12:00 UTC"}]
    expect:
      reason: final_answer
      path: [observe, think, act, evaluate, observe, think, terminate]
      response_contains: noon
  tool_keeps_failing:
    prompt: Read it.
    model: [{tool_calls: [{name: read_file, arguments: {path: x}}]}]
    tools: {read_file: [{error: "boom"}]}
    expect: {reason: tool_failures}
"""

WAITING = """\
name: release
reasons:
  rejected: {description: CI failed}
  timed_out: {description: CI never answered}
variables:
  builds: {type: integer, default: 0}
initial: build
states:
  build: {action: agent.think, assign: {builds: "vars.builds + 1"}}
  wait_ci: {}
  review: {action: workflow.call, workflow: single_shot}
  done: {final: true}
  stopped: {final: true}
transitions:
  - {source: build, target: wait_ci}
  - {source: wait_ci, target: review, event: ci_passed, when: 'event.data.branch == "main"'}
  - {source: wait_ci, target: stopped, event: ci_passed, reason: rejected}
  - {source: wait_ci, target: stopped, after: 2h, reason: timed_out}
  - {source: review, target: done, guard: child_succeeded, reason: final_answer}
  - {source: review, target: stopped, reason: rejected}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_issue_example_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tests = _write(tmp_path, "default.test.yaml", ISSUE_EXAMPLE)

    ran = cli(capsys, "test", str(tests))

    assert ran.code == 0, ran.out + ran.err
    assert f"PASS {tests}::answers_after_a_tool" in ran.out
    assert f"PASS {tests}::tool_keeps_failing" in ran.out
    assert ran.out.splitlines()[-1].startswith("2 passed, 0 failed in ")


def test_a_failing_case_names_its_first_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = ISSUE_EXAMPLE.replace(
        "path: [observe, think, act, evaluate, observe, think, terminate]",
        "path: [observe, think, terminate]",
    ).replace("expect: {reason: tool_failures}", "expect: {reason: final_answer}")
    tests = _write(tmp_path, "default.test.yaml", wrong)

    ran = cli(capsys, "test", str(tests))
    as_json = cli(capsys, "test", str(tests), "--json").json()

    assert ran.code == 1
    assert (
        f"FAIL {tests}:3:3: answers_after_a_tool: step 3: expected state terminate, got act"
        in ran.out
    )
    assert (
        f"FAIL {tests}:14:3: tool_keeps_failing: reason: expected final_answer, got tool_failures"
        in ran.out
    )
    assert ran.out.splitlines()[-1].startswith("0 passed, 2 failed")
    assert (as_json["passed"], as_json["failed"], as_json["ok"]) == (0, 2, False)
    assert [c["outcome"] for c in as_json["cases"]] == ["failed", "failed"]
    assert as_json["cases"][1]["reason"] == "tool_failures"


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("workflow: default\ncases:\n  a: {prompt: x, expect: {}, modle: []}\n", ":3:30:",
         "unknown key 'modle'"),
        ("workflow: default\ncases:\n  a: {prompt: x}\n", ":3:6:", "missing required key 'expect'"),
        ("workflow: default\ncases:\n  a: {prompt: x, expect: {}, tools: {d: [{}]}}\n", ":3:42:",
         "a tool result is `return: VALUE` or `error: MESSAGE`"),
        ("workflow: [\n", ":2:1:", "YAML syntax error"),
        ("workflow: nowhere\ncases: {}\n", "", "no such workflow file or stock workflow"),
    ],
)  # fmt: skip
def test_a_broken_file_is_one_line_per_mistake_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str, message: str
) -> None:
    tests = _write(tmp_path, "broken.test.yaml", text)

    ran = cli(capsys, "test", str(tests))

    assert ran.code == 2, ran.out + ran.err
    assert message in ran.err
    if where:
        assert f"{tests}{where}" in ran.err
    assert "Traceback" not in ran.err


def test_a_workflow_given_as_a_test_file_says_so_and_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's likely slip: `fsm-kernel test my_workflow.yaml`. One line saying what the
    file is and the command that writes its tests, not four unknown-key errors."""
    workflow = _write(tmp_path, "flow.yaml", "name: flow\nstates: {a: {final: true}}\n")

    ran = cli(capsys, "test", str(workflow))

    assert ran.code == 2, ran.out + ran.err
    assert ran.err.splitlines() == [
        f"error: {workflow}:1:1: this is a workflow, not a test file (one with 'workflow:' and "
        f"'cases:'); 'fsm-kernel test --generate {workflow}' writes one for it"
    ]
    assert ran.out.splitlines()[-1].startswith("0 passed, 0 failed, 1 error in test files in ")


def test_a_tool_the_workflow_does_not_offer_is_a_broken_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = _write(
        tmp_path, "t.test.yaml", ISSUE_EXAMPLE.replace("datetime: [{return", "clock: [{return")
    )

    ran = cli(capsys, "test", str(tests))

    assert ran.code == 2
    assert "BROKEN" in ran.out
    assert "tools: clock not offered by the workflow (it offers: datetime, done, " in ran.out


def test_a_reason_the_workflow_cannot_end_with_is_a_broken_case_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = _write(
        tmp_path,
        "t.test.yaml",
        ISSUE_EXAMPLE.replace("{reason: tool_failures}", "{reason: toolfail}"),
    )

    ran = cli(capsys, "test", str(tests), "--json").json()

    assert [c["outcome"] for c in ran["cases"]] == ["passed", "broken"]
    assert ran["cases"][1]["location"] == f"{tests}:18:22"
    assert ran["cases"][1]["difference"] == (
        "expect: reason: 'toolfail' is no reason this workflow can end with "
        "(its own: done, fatal_tool_error, final_answer, malformed_output, max_iterations, "
        "no_progress, tool_failures; or one of the kernel's)"
    )
    assert cli(capsys, "test", str(tests)).code == 2


def test_junit_xml_and_coverage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tests = _write(tmp_path, "default.test.yaml", ISSUE_EXAMPLE)
    report = tmp_path / "out" / "junit.xml"

    ran = cli(capsys, "test", str(tests), "--junit-xml", str(report), "--coverage")
    below = cli(capsys, "test", str(tests), "--coverage-min", "100")

    assert ran.code == 0
    suite = ElementTree.parse(report).getroot()[0]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "0", "0")
    assert [c.get("name") for c in suite] == ["answers_after_a_tool", "tool_keeps_failing"]
    assert "  states      5/5" in ran.out
    assert "  edges       6/12 (50%); missed: think → think [malformed_output and not " in ran.out
    assert "    evaluate → terminate: done_called: never true" in ran.out  # a check per edge
    assert below.code == 1
    assert "edges below --coverage-min 100%" in below.out


def test_answers_events_timers_children_and_vars_are_scripted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "release.yaml", WAITING)
    tests = _write(
        tmp_path,
        "release.test.yaml",
        """\
workflow: release.yaml
cases:
  main_passes_review:
    prompt: ship
    model: [{text: built}]
    answers: [{event: ci_passed, data: {branch: main}}]
    children: [{ok: true, answer: looks good, iterations: 1}]
    expect: {reason: final_answer, path: [build, wait_ci, review, done], vars: {builds: 1}}
  a_branch_is_rejected:
    prompt: ship
    model: [{text: built}]
    answers: [{event: ci_passed, data: {branch: dev}}]
    expect: {reason: rejected, path: [build, wait_ci, stopped]}
  ci_never_answers:
    prompt: ship
    model: [{text: built}]
    answers: [{timer: 2h}]
    expect: {reason: timed_out}
  nobody_answers_yet:
    prompt: ship
    model: [{text: built}]
    expect: {status: waiting, waiting_for: event, path: [build, wait_ci]}
  the_review_fails:
    prompt: ship
    model: [{text: built}]
    answers: [{event: ci_passed, data: {branch: main}}]
    children: [{ok: false, reason: max_iterations}]
    expect: {reason: rejected, vars: {builds: 2}}
""",
    )

    ran = cli(capsys, "test", str(tests))

    assert ran.code == 1, ran.out + ran.err
    lines = [line for line in ran.out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[0] for line in lines] == ["PASS", "PASS", "PASS", "PASS", "FAIL"]
    assert lines[-1].endswith("the_review_fails: vars.builds: expected 2, got 1")


def test_the_pytest_plugin_collects_one_item_per_case(tmp_path: Path) -> None:
    wrong = ISSUE_EXAMPLE.replace("response_contains: noon", "response_contains: midnight")
    _write(tmp_path, "default.test.yaml", wrong)

    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip

    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "1 failed, 1 passed" in ran.stdout
    assert "default.test.yaml::answers_after_a_tool" in ran.stdout
    assert "response: expected it to contain 'midnight', got 'It is noon.'" in ran.stdout


def test_generate_writes_a_file_that_runs_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = _write(tmp_path, "release.yaml", WAITING)
    out = tmp_path / "tests" / "release.test.yaml"

    made = cli(capsys, "test", "--generate", str(workflow), "-o", str(out))
    ran = cli(capsys, "test", str(out), "--coverage-min", "100", "--json")

    assert made.code == 0, made.err
    document = out.read_text()
    assert "workflow: ../release.yaml" in document
    assert ran.code == 0, ran.out
    assert ran.json()["coverage"][0]["edges"]["percent"] == 100.0
    assert json.dumps(ran.json()["cases"]).count('"passed"') == len(ran.json()["cases"])


def test_generate_lists_the_edges_it_cannot_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = WAITING.replace(
        "  - {source: review, target: stopped, reason: rejected}\n",
        "  - {source: review, target: stopped, guard: done_called, reason: rejected}\n"
        "  - {source: review, target: stopped, reason: rejected}\n",
    )
    workflow = _write(tmp_path, "release.yaml", dead)

    made = cli(capsys, "test", "--generate", str(workflow))

    assert made.code == 1
    assert "not reached: review → stopped [done_called]" in made.err
    assert "#   not reached: review → stopped [done_called]" in made.out


CATCHING = """\
name: catching
initial: think
states:
  think:
    action: agent.think
    retry: {max_attempts: 1, backoff_seconds: 0}
    catch:
      - {error: agent_error, target: apologise}
  apologise: {action: agent.think, prompt: Apologise briefly.}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
  - {source: apologise, target: done, reason: final_answer}
"""


def test_model_errors_files_json_tools_called_and_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "catching.yaml", CATCHING)
    tests = _write(
        tmp_path,
        "catching.test.yaml",
        """\
workflow: catching.yaml
cases:
  the_server_fails_twice_and_is_caught:
    prompt: hi
    model:
      - {error: overloaded, status: 503}
      - {error: overloaded, status: 503}
      - {text: Sorry.}
    expect: {path: [think, apologise, done], response: Sorry.}
  a_json_reply:
    prompt: hi
    model: [{json: {answer: 42}}]
    expect: {response: '{"answer": 42}'}
  unreachable_server_is_retried:
    prompt: hi
    model: [{error: connection refused}, {text: Hello.}]
    expect: {path: [think, done], response: Hello.}
  scripts_more_than_happens:
    prompt: hi
    model: [{text: Hello.}, {text: never asked}]
    expect: {reason: final_answer}
""",
    )
    _write(
        tmp_path,
        "files.test.yaml",
        """\
workflow: default
cases:
  reads_a_seeded_file:
    prompt: What does a.txt say?
    files: {a.txt: forty-two}
    model:
      - {tool_calls: [{name: read_file, arguments: {path: a.txt}}]}
      - {text: It says forty-two.}
    expect: {tools_called: [read_file], reason: final_answer}
  a_file_outside_the_workspace:
    prompt: x
    files: {../escape.txt: no}
    model: [{text: ok}]
    expect: {}
""",
    )

    ran = cli(capsys, "test", str(tests))
    files = cli(capsys, "test", str(tmp_path / "files.test.yaml"), "--json")

    lines = [line for line in ran.out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[0] for line in lines] == ["PASS", "PASS", "PASS", "FAIL"]
    assert lines[-1].endswith(
        "scripts_more_than_happens: model: 1 scripted reply(ies) never asked for"
    )
    outcomes = [c["outcome"] for c in files.json()["cases"]]
    assert outcomes == ["passed", "broken"]
    assert (
        "files: '../escape.txt' is not a path inside the workspace"
        in files.json()["cases"][1]["difference"]
    )
    assert files.code == 2
