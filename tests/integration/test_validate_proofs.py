"""Static proofs in `validate` (issue 28, part 3): a cycle that can repeat without consuming
anything bounded is an error at file:line:col naming it (inside compound states too, with full
paths); cycles through a model call, a waiting state, a person or a declared counter pass; and
`validate --explain` lists how a workflow's runs can end, with a shortest path to each reason,
and the reasons it names that no path reaches."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clikit import cli

DATA = Path(__file__).resolve().parents[1] / "data"

FREE = "can repeat without a model call, a person, an event or a timer"

BOUNDED = {
    "a model call": """\
name: ok
initial: think
states:
  think: {action: agent.think}
  check: {action: kernel.evaluate}
  done: {final: true}
transitions:
  - {source: think, target: check}
  - {source: check, target: done, guard: has_answer, reason: final_answer}
  - {source: check, target: think}
""",
    "a waiting state": """\
name: ok
initial: check
states:
  check: {action: kernel.evaluate}
  wait: {}
  done: {final: true}
transitions:
  - {source: check, target: done, guard: has_answer, reason: final_answer}
  - {source: check, target: wait}
  - {source: wait, target: check, event: poke}
""",
    "a person": """\
name: ok
initial: ask
states:
  ask: {action: human.input, prompt: "Again?"}
  check: {action: kernel.evaluate}
  done: {final: true}
transitions:
  - {source: ask, target: check}
  - {source: check, target: done, guard: has_answer, reason: final_answer}
  - {source: check, target: ask}
""",
    "a declared counter": """\
name: ok
variables:
  rounds: {type: integer, default: 0}
initial: check
states:
  check: {action: kernel.evaluate}
  tidy: {action: session.observe}
  done: {final: true}
transitions:
  - {source: check, target: done, when: "vars.rounds >= 3", reason: final_answer}
  - {source: check, target: tidy, assign: {rounds: "vars.rounds + 1"}}
  - {source: tidy, target: check}
""",
}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "wf.yaml"
    path.write_text(text)
    return path


def test_a_cycle_that_consumes_nothing_is_an_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = DATA / "broken_unbounded_cycle.yaml"

    checked = cli(capsys, "validate", str(path))

    assert checked.code == 2
    assert checked.err == (
        f"error: {path}:12:5: check → tidy → check {FREE} (nothing bounds it but "
        "limits.max_transitions): make a state on it call the model, wait, or count rounds in a "
        "variable a `when:` on it checks\n"
    )


@pytest.mark.parametrize("what", sorted(BOUNDED))
def test_a_cycle_through_something_bounded_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    checked = cli(capsys, "validate", str(_write(tmp_path, BOUNDED[what])))

    assert checked.code == 0, checked.err


def test_a_free_cycle_inside_a_compound_state_is_named_by_full_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = """\
name: nested
initial: work
states:
  work:
    initial: think
    states:
      think: {action: agent.think}
      a: {action: session.observe}
      b: {action: kernel.evaluate}
  done: {final: true}
transitions:
  - {source: work, target: done, guard: has_answer, reason: final_answer}
  - {source: think, target: a}
  - {source: a, target: b}
  - {source: b, target: a}
"""
    checked = cli(capsys, "validate", str(_write(tmp_path, text)))

    assert checked.code == 2
    assert f":14:5: work.a → work.b → work.a {FREE}" in checked.err


def test_the_stock_workflows_prove_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    stock = sorted((Path(__file__).resolve().parents[2] / "workflows").glob("*.yaml"))

    checked = cli(capsys, "validate", *map(str, stock))

    assert checked.code == 0, checked.err


def test_explain_lists_each_reason_with_a_shortest_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = cli(capsys, "validate", "--explain", "default")

    assert shown.code == 0
    lines = shown.out.splitlines()
    assert lines[1].endswith("default.yaml: how its runs can end")
    assert "  final_answer: observe → think → terminate" in lines
    assert "  done: observe → think → act → evaluate → terminate [done_called]" in lines
    assert (
        "  max_iterations: observe → think → act → evaluate → terminate [iteration_limit]" in lines
    )
    assert lines[-1].startswith("  and, whatever its edges say, the kernel may end a run with: ")


def test_explain_names_the_reasons_no_path_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = """\
name: lost
reasons:
  never_used: {description: "declared, nothing ends with it"}
initial: think
states:
  think: {action: agent.think}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
"""
    shown = cli(capsys, "validate", "--explain", str(_write(tmp_path, text)))
    as_json = cli(capsys, "validate", "--explain", "--json", str(tmp_path / "wf.yaml")).json()

    assert shown.code == 0
    assert (
        "  never: never_used (declared under reasons:, but no edge ends a run with it)"
        in shown.out.splitlines()
    )
    assert as_json["files"][0]["explanation"]["unreachable"] == [
        {"reason": "never_used", "why": "declared under reasons:, but no edge ends a run with it"}
    ]


def test_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    shown = cli(capsys, "validate", "--explain", "--json", "single_shot")

    assert shown.code == 0
    explanation = shown.json()["files"][0]["explanation"]
    assert explanation["reachable"] == [
        {"reason": "malformed_output", "path": ["answer", "terminate"],
         "edges": ["answer → terminate [malformed_output]"]},
        {"reason": "final_answer", "path": ["answer", "terminate"],
         "edges": ["answer → terminate"]},
    ]  # fmt: skip
    assert explanation["unreachable"] == []
