"""What `validate` refuses that would otherwise fail every run: a chain of `workflow.call`s
deeper than MAX_CALL_DEPTH (reported at the state that starts it, without RecursionError on a
400-file chain, each file loaded once however many paths lead to it), and output schemas whose
`$ref`s loop without descending into the value; a recursive schema (a tree) validates and
works in a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fsm_kernel.workflow.call_chain as call_chain
from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness
from fsm_kernel.workflow.limits import MAX_CALL_DEPTH
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from tests.clikit import cli

CALLER = """\
name: {name}
initial: call
states:
  call: {{action: workflow.call, workflow: {child}}}
  end: {{final: true}}
transitions:
  - {{source: call, target: end, reason: final_answer}}
"""
LEAF = """\
name: leaf
initial: start
states:
  start: {action: session.observe}
  end: {final: true}
transitions:
  - {source: start, target: end, reason: final_answer}
"""
WORKFLOW_COL = len("  call: {action: workflow.call, workflow: ") + 1


def chain(folder: Path, files: int) -> list[Path]:
    """c000.yaml calls c001.yaml ... calls the last, a leaf: `files - 1` nested calls."""
    paths = [folder / f"c{i:03d}.yaml" for i in range(files)]
    for i, path in enumerate(paths[:-1]):
        path.write_text(CALLER.format(name=path.stem, child=paths[i + 1].name))
    paths[-1].write_text(LEAF)
    return paths


def test_a_chain_of_400_files_is_refused_at_the_state_that_starts_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    top = chain(tmp_path, 400)[0]

    refused = cli(capsys, "validate", top)

    assert refused.code == 2
    assert refused.err == (
        f"error: {top}:4:{WORKFLOW_COL}: state 'call' starts a chain of 399 nested workflow "
        f"calls, deeper than calls may nest (MAX_CALL_DEPTH = {MAX_CALL_DEPTH}): c000.yaml → "
        "c001.yaml → c002.yaml → c003.yaml → … (392 more) → c396.yaml → c397.yaml → "
        "c398.yaml → c399.yaml\n"
    )
    with pytest.raises(WorkflowValidationError, match="399 nested workflow calls"):
        load_workflow(top)


def test_a_chain_as_deep_as_the_limit_validates_and_one_more_call_does_not(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    deepest = chain(tmp_path, MAX_CALL_DEPTH + 2)  # MAX_CALL_DEPTH + 1 calls from the top

    refused = cli(capsys, "validate", deepest[0])
    allowed = cli(capsys, "validate", deepest[1])

    assert refused.code == 2
    assert f"a chain of {MAX_CALL_DEPTH + 1} nested workflow calls" in refused.err
    assert refused.err.startswith(f"error: {deepest[0]}:4:{WORKFLOW_COL}: ")
    assert allowed.code == 0, allowed.err
    assert allowed.out == f"{deepest[1]}: ok (2 states, 1 transitions)\n"


def test_a_lattice_of_calls_loads_each_file_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of layer i calls both files of layer i + 1: 2**30 paths from the top,
    walked in 60 loads (a walk along every path would not end within the test's timeout)."""
    layers = 30
    for i in range(layers):
        for side in "ab":
            if i == layers - 1:
                text = LEAF.replace("name: leaf", f"name: {side}{i}")
            else:
                text = (
                    f"name: {side}{i}\ninitial: one\nstates:\n"
                    f"  one: {{action: workflow.call, workflow: a{i + 1}.yaml}}\n"
                    f"  two: {{action: workflow.call, workflow: b{i + 1}.yaml}}\n"
                    "  end: {final: true}\ntransitions:\n"
                    "  - {source: one, target: two}\n"
                    "  - {source: two, target: end, reason: final_answer}\n"
                )
            (tmp_path / f"{side}{i}.yaml").write_text(text)
    loads: list[Path] = []
    real = call_chain.check_workflow

    def counted(path: Path, **kwargs: bool) -> call_chain.WorkflowCheck:
        loads.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(call_chain, "check_workflow", counted)

    outcome = cli(capsys, "validate", tmp_path / "a0.yaml")

    assert outcome.code == 0, outcome.err
    assert sorted(p.name for p in loads) == sorted(
        f"{side}{i}.yaml" for i in range(1, layers) for side in "ab"
    )


def test_a_cycle_below_the_top_is_reported_at_the_top_state(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    paths = chain(tmp_path, 4)
    paths[-1].write_text(CALLER.format(name="c003", child="c001.yaml"))

    refused = cli(capsys, "validate", paths[0])

    assert refused.code == 2
    assert refused.err == (
        f"error: {paths[0]}:4:{WORKFLOW_COL}: state 'call' starts a cycle of workflow calls that "
        "would never end: c001.yaml → c002.yaml → c003.yaml → c001.yaml\n"
    )


def test_a_called_files_errors_are_reported_at_their_place_in_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    top, child = chain(tmp_path, 2)
    child.write_text(LEAF.replace("target: end", "target: ending").replace("name: leaf", "x: 1"))

    refused = cli(capsys, "validate", top)

    assert refused.code == 2
    assert refused.err.splitlines() == [
        f"error: {child}:1:1: missing required key 'name'",
        f"error: {child}:1:1: unknown key 'x'",
    ]


# --- output schemas whose $refs loop ------------------------------------------------------------

SHAPED = """\
name: shaped
initial: think
output:
{schema}
states:
  think: {{action: agent.think}}
  end: {{final: true}}
transitions:
  - {{source: think, target: think, guard: malformed_output, unless: retries_exhausted}}
  - {{source: think, target: end, reason: final_answer}}
"""


def shaped(schema: str) -> str:
    return SHAPED.format(schema="\n".join("  " + line for line in schema.splitlines()))


@pytest.mark.parametrize(
    ("schema", "row", "col", "loop"),
    [
        ('$ref: "#"', 4, 9, "$ref '#' loops back"),
        ('allOf: [{$ref: "#"}]', 4, 18, "allOf[0] → $ref '#' loops back"),
        (
            "$ref: '#/$defs/a'\n$defs:\n  a: {$ref: '#/$defs/b'}\n  b: {$ref: '#/$defs/a'}",
            7,
            15,
            "$ref '#/$defs/b' → $ref '#/$defs/a' loops back",
        ),
        (
            "type: object\nproperties:\n  x: {$ref: '#/$defs/a'}\n"
            "$defs:\n  a: {anyOf: [{type: string}, {$ref: '#/$defs/a'}]}",
            8,
            40,
            "anyOf[1] → $ref '#/$defs/a' loops back",
        ),
    ],
    ids=["top", "allOf", "defs-a-b-a", "anyOf-self"],
)
def test_a_schema_whose_refs_loop_without_descending_is_refused_where_the_loop_closes(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    schema: str,
    row: int,
    col: int,
    loop: str,
) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text(shaped(schema))

    refused = cli(capsys, "validate", path)

    assert refused.code == 2
    assert refused.err.startswith(f"error: {path}:{row}:{col}: output: {loop}"), refused.err
    assert "without descending into the value" in refused.err
    assert len(refused.err.splitlines()) == 1


TREE = """\
$ref: '#/$defs/node'
$defs:
  node:
    type: object
    properties:
      name: {type: string}
      children: {type: array, items: {$ref: '#/$defs/node'}}
    required: [name, children]
    additionalProperties: false"""


def test_a_recursive_schema_validates_and_checks_replies_in_a_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "tree.yaml"
    path.write_text(shaped(TREE))
    tree = {"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]}
    bad = {"name": "a", "children": [{"name": "b", "children": [{"name": 3, "children": []}]}]}
    model = ScriptedChatModel([json.dumps(bad), json.dumps(tree)])

    ok = cli(capsys, "validate", path)
    result = WorkflowHarness(load_workflow_text(path.read_text(), path=str(path))).run(
        "a tree?", model=model
    )

    assert ok.code == 0, ok.err
    assert result.termination_reason == "final_answer"
    assert result.output == tree
    retry = model.requests[1].last_message
    assert retry is not None
    assert "at $.children[0].children[0].name: 3 is not of type 'string'" in retry.content
