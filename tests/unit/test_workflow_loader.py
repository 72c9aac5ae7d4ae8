"""Workflow loading: every broken file in tests/data gives its exact `path:line:col: message`,
YAML 1.2 booleans (on/off/yes/no stay strings), the YAML limits (size, depth, alias bombs), and
the stock default.yaml loads."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import pytest

from fsm_kernel.cli import main
from fsm_kernel.errors import WorkflowError, WorkflowSyntaxError, WorkflowValidationError
from fsm_kernel.workflow.loader import (
    MAX_YAML_ALIASES,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    YamlLimitError,
    load_workflow,
    load_workflow_text,
    parse_yaml_with_locations,
)
from fsm_kernel.workflow.spec import SourceLocation, WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
DEFAULT = REPO / "workflows" / "default.yaml"
ALIAS_BOMB = DATA / "yaml_alias_bomb.yaml"

NOT_CALLABLE = 42

# file -> (line, col, exact start of the message)
BROKEN: dict[str, tuple[int, int, str]] = {
    "broken_yaml_syntax.yaml": (3, 18, "YAML syntax error: mapping values are not allowed here"),
    "broken_unknown_target.yaml": (9, 31, "unknown target state 'thinkk'"),
    "broken_unreachable_state.yaml": (7, 3, "state 'orphan' is unreachable from 'observe'"),
    "broken_no_final_state.yaml": (5, 3, "no final state"),
    "broken_unknown_action.yaml": (6, 19, "unknown action 'agent.thinkk'"),
    "broken_unknown_guard.yaml": (10, 47, "unknown guard 'has_answr'"),
    "broken_unknown_unless.yaml": (13, 33, "unknown guard 'too_many'"),
    "broken_on_key.yaml": (10, 40, "unknown key 'on'; guards are written 'guard:'"),
    "broken_duplicate_key.yaml": (7, 3, "duplicate key 'observe'"),
    "broken_reserved_send.yaml": (6, 3, "state id 'send' is reserved"),
    "broken_reserved_next.yaml": (6, 3, "state id 'next' is reserved (the kernel's event)"),
    "broken_out_of_final.yaml": (
        11,
        14,
        "final state 'terminate' cannot have transitions out of it",
    ),
    "broken_missing_reason.yaml": (
        10,
        5,
        "transition into final state 'terminate' needs a 'reason'",
    ),
    "broken_unknown_reason.yaml": (10, 48, "unknown termination reason 'finished'"),
    "broken_guarded_last.yaml": (
        11,
        5,
        "state 'think' needs an unguarded fallback transition last",
    ),
    "broken_after_unguarded.yaml": (11, 5, "transition never fires"),
    "broken_no_path_to_final.yaml": (6, 3, "state 'spin' has no path to a final state"),
    "broken_unbounded_cycle.yaml": (
        13,
        5,
        "poll → check → poll can repeat without a model call, a limit or a timer",
    ),
    "broken_list_workflow.yaml": (2, 1, "a workflow must be a mapping of keys"),
    "broken_unknown_top_key.yaml": (4, 1, "unknown key 'colour'"),
}

MINIMAL = """\
name: minimal
initial: start
states:
  start: {action: session.observe}
  end: {final: true}
transitions:
  - {source: start, target: end, reason: final_answer}
"""


def test_every_broken_file_is_in_the_table() -> None:
    assert {p.name for p in DATA.glob("broken_*.yaml")} == set(BROKEN)


@pytest.mark.parametrize(("name", "expected"), sorted(BROKEN.items()))
def test_broken_file_reports_path_line_col(name: str, expected: tuple[int, int, str]) -> None:
    line, col, message = expected
    path = DATA / name

    with pytest.raises(WorkflowError) as info:
        load_workflow(path)

    err = info.value
    assert str(err).startswith(f"{path}:{line}:{col}: {message}")
    assert err.message.startswith(message)
    assert isinstance(err.location, SourceLocation)
    assert (err.location.path, err.location.line, err.location.col) == (str(path), line, col)
    assert "\n" not in str(err)


def test_syntax_and_validation_errors_are_told_apart() -> None:
    with pytest.raises(WorkflowSyntaxError):
        load_workflow(DATA / "broken_yaml_syntax.yaml")
    with pytest.raises(WorkflowValidationError):
        load_workflow(DATA / "broken_unknown_target.yaml")


def test_syntax_error_keeps_the_yaml_cause() -> None:
    import yaml

    with pytest.raises(WorkflowSyntaxError) as info:
        load_workflow(DATA / "broken_yaml_syntax.yaml")

    assert isinstance(info.value.__cause__, yaml.YAMLError)


def test_relative_path_is_reported_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)

    with pytest.raises(WorkflowValidationError) as info:
        load_workflow("tests/data/broken_unknown_target.yaml")

    assert str(info.value).startswith("tests/data/broken_unknown_target.yaml:9:31: ")


# --- smaller cases, inline --------------------------------------------------------------------


def _error(text: str) -> str:
    with pytest.raises(WorkflowError) as info:
        load_workflow_text(text, path="w.yaml")
    return str(info.value)


def test_missing_file() -> None:
    with pytest.raises(WorkflowValidationError, match="no such workflow file"):
        load_workflow(DATA / "does_not_exist.yaml")


def test_empty_file_is_not_a_mapping() -> None:
    assert _error("") == "w.yaml:1:1: a workflow must be a mapping of keys"
    assert _error("# only a comment\n") == "w.yaml:1:1: a workflow must be a mapping of keys"


def test_a_scalar_is_not_a_workflow() -> None:
    assert _error("\n\njust text\n") == "w.yaml:3:1: a workflow must be a mapping of keys"


def test_missing_required_key() -> None:
    text = MINIMAL.replace("initial: start\n", "")
    assert _error(text) == "w.yaml:1:1: missing required key 'initial'"


def test_unknown_key_inside_a_state_points_at_the_key() -> None:
    text = MINIMAL.replace("{action: session.observe}", "{action: session.observe, tool: [x]}")
    assert _error(text) == "w.yaml:4:36: unknown key 'tool'"


def test_cond_key_gets_the_guard_hint() -> None:
    # `when:` is a CEL expression on a transition now (see test_workflow_expressions_vars.py)
    text = MINIMAL.replace("reason: final_answer}", "reason: final_answer, cond: has_answer}")
    assert _error(text) == "w.yaml:7:56: unknown key 'cond'; guards are written 'guard:'"


def test_when_on_a_state_says_it_belongs_on_a_transition() -> None:
    text = MINIMAL.replace("{action: session.observe}", "{action: session.observe, when: x}")
    assert _error(text) == (
        "w.yaml:4:36: unknown key 'when'; 'when:' (a guard expression) goes on a transition, "
        "not on a state"
    )


def test_an_unknown_guard_lists_completed_among_the_built_in_ones() -> None:
    text = MINIMAL.replace("reason: final_answer}", "reason: final_answer, guard: complete}")
    with pytest.raises(WorkflowError) as info:
        load_workflow_text(text, path="w.yaml")
    (error,) = [str(e) for e in info.value.errors if "unknown guard" in str(e)]
    assert "unknown guard 'complete' (built-in: " in error
    assert ", completed, " in error


def test_bad_limit_value_points_at_the_value() -> None:
    text = MINIMAL + "limits:\n  max_iterations: -1\n"
    error = _error(text)
    assert error.startswith("w.yaml:9:19: max_iterations: ")
    assert "greater than or equal to 0" in error


def test_bad_name_pattern() -> None:
    error = _error(MINIMAL.replace("name: minimal", "name: 9 lives"))
    assert error.startswith("w.yaml:1:7: name: ")


def test_state_id_must_be_snake_case() -> None:
    text = MINIMAL.replace("start", "Start")
    assert _error(text) == "w.yaml:4:3: state id 'Start' must be snake_case"


@pytest.mark.parametrize("reserved", ["model", "states", "configuration", "send", "next"])
def test_reserved_state_ids(reserved: str) -> None:
    text = MINIMAL.replace("start", reserved)
    assert _error(text).startswith(f"w.yaml:4:3: state id '{reserved}' is reserved")


def test_initial_state_must_exist() -> None:
    text = MINIMAL.replace("initial: start", "initial: begin")
    assert _error(text) == "w.yaml:2:10: initial state 'begin' is not a declared state"


def test_initial_state_cannot_be_final() -> None:
    text = MINIMAL.replace("initial: start", "initial: end")
    assert _error(text) == "w.yaml:2:10: initial state 'end' cannot be final"


def test_final_state_cannot_have_an_action() -> None:
    text = MINIMAL.replace("{final: true}", "{final: true, action: kernel.evaluate}")
    assert _error(text) == "w.yaml:5:30: final state 'end' cannot have an action"


def test_reason_only_on_transitions_into_final_states() -> None:
    text = MINIMAL.replace(
        "  - {source: start, target: end, reason: final_answer}\n",
        "  - {source: start, target: mid, reason: done}\n"
        "  - {source: mid, target: end, reason: final_answer}\n",
    ).replace("  end:", "  mid: {action: kernel.evaluate}\n  end:")
    assert _error(text) == ("w.yaml:8:42: 'reason' is only for transitions into a final state")


def test_states_after_a_final_one_are_still_checked_for_a_way_out() -> None:
    text = """\
name: final_first
initial: start
states:
  end: {final: true}
  start: {action: agent.think}
  stuck: {action: kernel.evaluate}
transitions:
  - {source: start, target: end, guard: has_answer, reason: final_answer}
  - {source: start, target: stuck}
"""
    assert _error(text) == "w.yaml:6:3: state 'stuck' has no transition out of it"


def test_each_state_needs_a_path_to_some_final_state_not_to_every_one() -> None:
    text = """\
name: two_ends
initial: start
states:
  start: {action: agent.think}
  ok: {final: true}
  gave_up: {final: true}
transitions:
  - {source: start, target: ok, guard: has_answer, reason: final_answer}
  - {source: start, target: gave_up, reason: no_progress}
"""
    assert load_workflow_text(text, path="w.yaml").final_states() == ["ok", "gave_up"]


def test_a_state_with_no_way_out() -> None:
    text = MINIMAL.replace("  end:", "  dead: {action: kernel.evaluate}\n  end:").replace(
        "  - {source: start, target: end, reason: final_answer}\n",
        "  - {source: start, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: start, target: dead}\n",
    )
    assert _error(text) == "w.yaml:5:3: state 'dead' has no transition out of it"


def test_unknown_source_state() -> None:
    text = MINIMAL + "  - {source: nowhere, target: end, reason: done}\n"
    assert _error(text) == "w.yaml:8:14: unknown source state 'nowhere'"


def test_no_states() -> None:
    text = "name: x\ninitial: a\nstates: {}\ntransitions: []\n"
    assert _error(text) == "w.yaml:3:9: a workflow needs at least one state"


def test_keys_must_be_plain_names() -> None:
    assert _error(MINIMAL + "? [a, b]\n: c\n") == "w.yaml:8:3: keys must be plain names"


@pytest.mark.parametrize(
    ("ref", "fragment"),
    [
        ("nowhere_pkg_xyz.mod:fn", "cannot import module 'nowhere_pkg_xyz.mod'"),
        ("tests.unit.test_workflow_loader:missing", "has no attribute 'missing'"),
        ("tests.unit.test_workflow_loader:NOT_CALLABLE", "is not callable"),
        ("tests.unit.test_workflow_loader:", "is not a 'package.module:function' reference"),
    ],
)
def test_bad_action_references(ref: str, fragment: str) -> None:
    text = MINIMAL.replace("session.observe", f'"{ref}"')
    error = _error(text)
    assert error.startswith("w.yaml:4:19: ")
    assert fragment in error


def test_user_references_that_exist_load() -> None:
    text = MINIMAL.replace("session.observe", '"tests.unit.test_workflow_loader:user_action"')
    text = text.replace(
        "  - {source: start, target: end, reason: final_answer}\n",
        '  - {source: start, target: end, guard: "tests.unit.test_workflow_loader:user_guard",'
        " reason: done}\n"
        "  - {source: start, target: end, reason: final_answer}\n",
    )

    spec = load_workflow_text(text)

    assert spec.states["start"].action == "tests.unit.test_workflow_loader:user_action"
    assert spec.transitions[0].guard == ["tests.unit.test_workflow_loader:user_guard"]


def user_action(ctx: object) -> None:
    return None


def user_guard(ctx: object) -> bool:
    return True


# --- YAML 1.2 booleans ------------------------------------------------------------------------


def test_on_off_yes_no_stay_strings() -> None:
    data, _ = parse_yaml_with_locations(
        "on: off\nyes: no\nY: n\nlist: [on, off, yes, no, y, n]\nflag: true\nother: False\n",
        "x.yaml",
    )

    assert data == {
        "on": "off",
        "yes": "no",
        "Y": "n",
        "list": ["on", "off", "yes", "no", "y", "n"],
        "flag": True,
        "other": False,
    }


def test_states_named_on_off_yes_no_load_as_strings() -> None:
    text = """\
name: answers
description: off
initial: "on"
states:
  on: {action: session.observe}
  yes: {action: kernel.evaluate}
  no: {final: true}
transitions:
  - {source: on, target: yes}
  - {source: yes, target: no, reason: final_answer}
"""
    spec = load_workflow_text(text)

    assert spec.description == "off"
    assert list(spec.states) == ["on", "yes", "no"]
    assert spec.transitions[0].source == "on"
    assert spec.final_states() == ["no"]


def test_locations_are_one_based() -> None:
    _, locs = parse_yaml_with_locations("a:\n  b: [x, y]\n", "f.yaml")

    assert locs[()] == SourceLocation("f.yaml", 1, 1)
    assert locs[("a",)] == SourceLocation("f.yaml", 2, 3)
    assert locs[("a", "<key>")] == SourceLocation("f.yaml", 1, 1)
    assert locs[("a", "b")] == SourceLocation("f.yaml", 2, 6)
    assert locs[("a", "b", 1)] == SourceLocation("f.yaml", 2, 10)
    assert str(locs[("a", "b", 1)]) == "f.yaml:2:10"


# --- YAML limits ------------------------------------------------------------------------------

DEPTH_ERROR = f"YAML limit exceeded: nesting deeper than {MAX_YAML_DEPTH} levels"
NODES_ERROR = f"YAML limit exceeded: more than {MAX_YAML_NODES} nodes once aliases are expanded"
SIZE_ERROR = f"YAML limit exceeded: file larger than {MAX_YAML_BYTES} bytes"

# name -> (text, line, col) of the first collection past MAX_YAML_DEPTH (the 65th)
DEEP: dict[str, tuple[str, int, int]] = {
    "flow_sequences": ("[" * 100_000 + "]" * 100_000, 1, 65),
    "flow_mappings": ("{a: " * 100_000 + "}" * 100_000, 1, 4 * 64 + 1),
    "block_sequences": ("- " * 100_000 + "x\n", 1, 2 * 64 + 1),
    # One space per level: 1,000 levels is already ~0.5 MB (100,000 would be 5 GB).
    "block_mappings": ("".join(" " * i + "a:\n" for i in range(1_000)), 65, 65),
}


def test_the_limits() -> None:
    assert (MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_ALIASES, MAX_YAML_NODES) == (
        1024 * 1024,
        64,
        100,
        10_000,
    )


def test_alias_bomb_is_refused_at_the_alias_before_it_expands() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(WorkflowSyntaxError) as info:
            load_workflow(ALIAS_BOMB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    # Line 5 `e: &e [*d, ...]`: the first *d (7,381 nodes) takes the total past the budget.
    assert str(info.value) == f"{ALIAS_BOMB}:5:8: {NODES_ERROR}"
    assert isinstance(info.value.__cause__, YamlLimitError)
    assert peak < 20 * 1024 * 1024  # expanded, the bomb is 10**9 nodes


@pytest.mark.parametrize(("name", "case"), sorted(DEEP.items()))
def test_deep_nesting_is_refused_at_the_first_level_too_deep(
    tmp_path: Path, name: str, case: tuple[str, int, int]
) -> None:
    text, line, col = case
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(WorkflowSyntaxError) as info:
        load_workflow(path)

    assert str(info.value) == f"{path}:{line}:{col}: {DEPTH_ERROR}"


@pytest.mark.parametrize("style", ["flow", "block"])
def test_nesting_up_to_the_limit_parses(style: str) -> None:
    depth = MAX_YAML_DEPTH
    text = "[" * depth + "]" * depth if style == "flow" else "- " * (depth - 1) + "[]\n"

    data, _ = parse_yaml_with_locations(text, "deep.yaml")

    for _ in range(depth - 1):
        (data,) = data
    assert data == []


def test_a_file_over_the_size_cap_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"[" + b" " * MAX_YAML_BYTES)  # would be a syntax error at the end

    with pytest.raises(WorkflowSyntaxError) as info:
        load_workflow(path)

    assert str(info.value) == f"{path}:1:1: {SIZE_ERROR}"


def test_text_over_the_size_cap_is_measured_in_utf8_bytes() -> None:
    text = "# " + "é" * (MAX_YAML_BYTES // 2)  # fewer characters than the cap, more bytes

    assert _error(text) == f"w.yaml:1:1: {SIZE_ERROR}"


def test_a_file_at_the_size_cap_is_read(tmp_path: Path) -> None:
    path = tmp_path / "comments.yaml"
    path.write_bytes(b"#" * MAX_YAML_BYTES)

    with pytest.raises(WorkflowValidationError, match="a workflow must be a mapping of keys"):
        load_workflow(path)


def test_too_many_aliases_are_refused_at_the_first_one_over() -> None:
    text = "x: &x 1\nys: [" + ", ".join(["*x"] * (MAX_YAML_ALIASES + 1)) + "]\n"

    col = len("ys: [") + 4 * MAX_YAML_ALIASES + 1
    assert _error(text) == f"w.yaml:2:{col}: YAML limit exceeded: more than 100 aliases"


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    assert _error("a: &a [1, *a]\n") == (
        "w.yaml:1:11: YAML limit exceeded: alias *a refers to a node that contains it"
    )


def test_plain_documents_count_against_the_node_budget_too() -> None:
    text = "[" + "1," * MAX_YAML_NODES + "]"

    assert _error(text) == f"w.yaml:1:{2 * MAX_YAML_NODES}: {NODES_ERROR}"


def test_a_small_anchor_reused_a_few_times_still_loads() -> None:
    text = """\
name: reuse
initial: start
states:
  start: &observe {action: session.observe}
  again: *observe
  end: {final: true}
transitions:
  - &to_again {source: start, target: again}
  - {source: again, target: end, guard: &answer [has_answer], reason: final_answer}
  - {source: again, target: end, guard: *answer, reason: done}
  - {source: again, target: end, reason: final_answer}
"""
    spec = load_workflow_text(text, path="w.yaml")

    assert spec.states["again"] == spec.states["start"]
    assert spec.transitions[1].guard == spec.transitions[2].guard == ["has_answer"]
    assert spec.location("states", "again") == spec.location("states", "start")


def test_an_undefined_alias_is_still_a_syntax_error() -> None:
    assert _error("a: *nowhere\n").startswith("w.yaml:1:4: YAML syntax error: found undefined")


@pytest.mark.parametrize("name", ["alias_bomb", "deep"])
def test_validate_command_exits_2_with_the_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    if name == "alias_bomb":
        path, where, message = ALIAS_BOMB, "5:8", NODES_ERROR
    else:
        path, where, message = tmp_path / "deep.yaml", "1:65", DEPTH_ERROR
        path.write_text(DEEP["flow_sequences"][0], encoding="utf-8")

    assert main(["validate", str(path)]) == 2

    err = capsys.readouterr().err
    assert f"{path}:{where}: {message}" in err
    assert "internal error" not in err


# --- the stock default workflow ---------------------------------------------------------------


def test_default_workflow_loads() -> None:
    spec = load_workflow(DEFAULT)

    assert isinstance(spec, WorkflowSpec)
    assert spec.name == "default"
    assert spec.path == str(DEFAULT)
    assert spec.initial == "observe"
    assert list(spec.states) == ["observe", "think", "act", "evaluate", "terminate"]
    assert spec.final_states() == ["terminate"]
    assert spec.tool_names == ["datetime", "read_file", "list_directory", "done"]
    assert spec.limits.max_iterations == 10
    assert spec.limits.max_malformed_outputs == 3
    assert len(spec.transitions) == 12
    assert spec.content_hash == hashlib.sha256(DEFAULT.read_bytes()).hexdigest()


def test_default_transition_triples() -> None:
    spec = load_workflow(DEFAULT)

    assert spec.transition_triples() == {
        ("observe", "think", ""),
        ("think", "act", "has_tool_calls"),
        ("think", "think", "malformed_output and not retries_exhausted"),
        ("think", "terminate", "malformed_output"),
        ("think", "terminate", ""),
        ("act", "evaluate", ""),
        ("evaluate", "terminate", "done_called"),
        ("evaluate", "terminate", "fatal_tool_error"),
        ("evaluate", "terminate", "tool_failures"),
        ("evaluate", "terminate", "no_progress"),
        ("evaluate", "terminate", "iteration_limit"),
        ("evaluate", "observe", ""),
    }


def test_default_reasons_and_locations() -> None:
    spec = load_workflow(DEFAULT)

    reasons = {t.reason for t in spec.transitions if t.reason}
    assert reasons == {
        "malformed_output",
        "final_answer",
        "done",
        "fatal_tool_error",
        "tool_failures",
        "no_progress",
        "max_iterations",
    }
    first = spec.location("transitions", 0)
    assert first is not None
    assert first.path == str(DEFAULT)
    assert (
        DEFAULT.read_text(encoding="utf-8")
        .splitlines()[first.line - 1]
        .lstrip()
        .startswith("- {source: observe")
    )
    assert spec.location("transitions", 0, "no_such_key") == first


def test_content_hash_follows_the_text() -> None:
    a = load_workflow_text(MINIMAL)
    b = load_workflow_text(MINIMAL + "# a comment\n")

    assert a.content_hash != b.content_hash
    assert a.content_hash == load_workflow_text(MINIMAL).content_hash
    assert a.path == "<string>"


def test_guard_accepts_a_name_or_a_list() -> None:
    text = MINIMAL.replace(
        "  - {source: start, target: end, reason: final_answer}\n",
        "  - {source: start, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: start, target: end, guard: [has_answer, done_called], reason: done}\n"
        "  - {source: start, target: end, reason: final_answer}\n",
    )
    spec = load_workflow_text(text)

    assert spec.transitions[0].guard == ["has_answer"]
    assert spec.transitions[1].guard == ["has_answer", "done_called"]
    assert spec.transitions[1].label() == "has_answer and done_called"


def test_a_workflow_read_as_data_imports_nothing_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`import_code=False` (the run viewer): the structure is checked, the code is not run."""
    marker = tmp_path / "imported"
    (tmp_path / "side_effect_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef act(ctx): pass\ndef ok(ctx): return True\n"
    )
    text = (
        DEFAULT.read_text()
        .replace("action: tools.execute", "action: side_effect_mod:act")
        .replace("guard: done_called", "guard: side_effect_mod:ok")
    )
    path = tmp_path / "custom.yaml"
    path.write_text(text)

    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_workflow(path, import_code=False)

    assert spec.states["act"].action == "side_effect_mod:act"
    assert not marker.exists()
    load_workflow(path)  # as `run` loads it: the module is imported
    assert marker.exists()
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("target: evaluate", "target: nowhere"))
    with pytest.raises(WorkflowValidationError, match="unknown target state 'nowhere'"):
        load_workflow(broken, import_code=False)  # the structure is still checked
