"""fsm_kernel.workflow.analysis: the graph a run can follow (compound states flattened as the
compiler does, edges in the order they are tried), shortest paths, the termination reasons a
workflow reaches or never reaches, and the cycle check validate makes: every cycle must
consume a model call, child runs, a person's answer, an event or timer, or a counter a `when:`
bounds; any other is an error at one of its edges (and a run refuses to load the workflow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.workflow.analysis import (
    Cycle,
    bounding_states,
    cycle_errors,
    edge_graph,
    explain,
    kernel_reasons,
    reason_paths,
    shortest_path,
    shortest_paths,
    unbounded_cycles,
    unreached_reasons,
)
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
STOCK = sorted((REPO / "workflows").glob("*.yaml"))
DATA = REPO / "tests" / "data"
VALID_DATA = [
    p
    for p in sorted(DATA.rglob("*.yaml"))
    if not p.name.startswith("broken_")
    and p.parent.name != "scheduler"
    and p.name not in {"yaml_alias_bomb.yaml", "cycle_a.yaml", "cycle_b.yaml"}
]


def thinking_action(ctx: Any) -> None:
    """A user's action that says it calls the model."""


thinking_action.calls_model = True  # type: ignore[attr-defined]


def plain_action(ctx: Any) -> None:
    """A user's action that calls no model."""


HERE = "tests.unit.test_workflow_analysis"


def spec_of(text: str) -> WorkflowSpec:
    """The workflow parsed, without validate's cycle check getting in the way (check_workflow_
    text keeps the spec whatever it finds)."""
    spec = check_workflow_text(text, path="w.yaml", calls=False).spec
    assert spec is not None
    return spec


def messages(text: str) -> list[str]:
    """Every cycle error of a workflow, as `path:line:col: cycle`, the advice cut off."""
    return [str(e).split(" can repeat")[0] for e in cycle_errors(spec_of(text))]


def loop(states: str, transitions: str, extra: str = "") -> str:
    """A workflow starting at `start` (a model call), with an `end` state reached from it."""
    return (
        f"name: w\n{extra}initial: start\nstates:\n  start: {{action: agent.think}}\n"
        f"{states}  end: {{final: true}}\ntransitions:\n{transitions}"
    )


# --- the graph ------------------------------------------------------------------------------


def test_graph_of_a_flat_workflow_lists_each_states_edges_in_file_order() -> None:
    graph = edge_graph(load_workflow(REPO / "workflows" / "default.yaml"))

    assert graph.initial == "observe"
    assert graph.nodes == ("observe", "think", "act", "evaluate", "terminate")
    assert [(e.index, e.target, e.label, e.reason) for e in graph.out_edges("think")] == [
        (1, "act", "has_tool_calls", None),
        (2, "think", "malformed_output and not retries_exhausted", None),
        (3, "terminate", "malformed_output", "malformed_output"),
        (4, "terminate", "", "final_answer"),
    ]
    assert graph.out_edges("terminate") == []
    assert len(graph.edges) == 12


def test_graph_flattens_compound_states_parent_edges_first() -> None:
    spec = load_workflow(DATA / "compound_research.yaml")
    graph = edge_graph(spec)

    assert graph.initial == "think"
    assert graph.nodes == ("think", "act", "found", "report", "terminate")
    think = [(e.index, e.declared_source, e.target) for e in graph.out_edges("think")]
    assert think == [(0, "research", "terminate"), (1, "think", "act"), (2, "think", "found")]
    # `completed` holds only in the final child: the edge is tried in `found`, nowhere else
    assert [(e.index, e.target) for e in graph.out_edges("found")] == [
        (0, "terminate"),
        (4, "report"),
    ]
    assert all(e.index != 4 for e in graph.out_edges("act"))


def test_history_edges_land_in_every_leaf_history_may_return_to() -> None:
    graph = edge_graph(load_workflow(DATA / "compound_history.yaml"))

    back = [(e.target, e.history) for e in graph.out_edges("check")]

    assert back == [("plan", False), ("act", True), ("finished", True)]


def test_catch_edges_come_before_the_states_own_edges() -> None:
    spec = spec_of(
        loop(
            "  work: {action: kernel.evaluate, catch: [{error: any, target: end, "
            "reason: escalated}]}\n",
            "  - {source: start, target: work}\n  - {source: work, target: end, reason: done}\n",
            "reasons: {escalated: {}}\n",
        )
    )

    edges = edge_graph(spec).out_edges("work")

    assert [(e.kind, e.index, e.label, e.reason) for e in edges] == [
        ("catch", 2, "catch any", "escalated"),
        ("transition", 1, "", "done"),
    ]
    loc = edges[0].location
    assert loc is not None
    assert (loc.line, loc.col) == (6, 43)


def test_edges_that_cannot_fire_are_left_out() -> None:
    spec = spec_of(
        loop(
            "",
            "  - {source: start, target: end, guard: has_answer, unless: has_answer, "
            "reason: done}\n  - {source: start, target: end, reason: final_answer}\n",
        )
    )

    assert [e.index for e in edge_graph(spec).edges] == [1]


# --- paths ----------------------------------------------------------------------------------


def test_shortest_paths_reach_every_state_by_the_fewest_edges() -> None:
    graph = edge_graph(load_workflow(REPO / "workflows" / "reflect.yaml"))

    paths = shortest_paths(graph)

    assert [e.target for e in paths["finalize"]] == ["critique", "finalize"]
    assert [e.index for e in paths["evaluate"]] == [0, 4]
    assert paths["draft"] == []
    assert set(paths) == set(graph.nodes)


def test_shortest_path_to_an_edge_ends_with_that_edge() -> None:
    graph = edge_graph(load_workflow(REPO / "workflows" / "default.yaml"))

    path = shortest_path(graph, lambda e: e.index == 9)

    assert path is not None
    assert [(e.source, e.target) for e in path] == [
        ("observe", "think"),
        ("think", "act"),
        ("act", "evaluate"),
        ("evaluate", "terminate"),
    ]
    assert shortest_path(graph, lambda e: e.index == 99) is None


def test_reason_paths_of_the_default_workflow() -> None:
    spec = load_workflow(REPO / "workflows" / "default.yaml")

    found = {r.reason: (r.success, r.states(spec)) for r in reason_paths(edge_graph(spec))}

    via_tools = ["observe", "think", "act", "evaluate", "terminate"]
    assert found == {
        "malformed_output": (False, ["observe", "think", "terminate"]),
        "final_answer": (True, ["observe", "think", "terminate"]),
        "done": (True, via_tools),
        "fatal_tool_error": (False, via_tools),
        "tool_failures": (False, via_tools),
        "no_progress": (False, via_tools),
        "max_iterations": (False, via_tools),
    }


def test_reason_paths_name_states_by_their_full_compound_path() -> None:
    spec = load_workflow(DATA / "compound_research.yaml")

    found = {r.reason: r.states(spec) for r in reason_paths(edge_graph(spec))}

    assert found == {
        "escalated": ["research.think", "terminate"],
        "final_answer": ["research.think", "research.found", "report", "terminate"],
    }


def test_unreached_reasons_declared_unused_or_on_an_edge_that_never_fires() -> None:
    spec = spec_of(
        loop(
            "",
            "  - {source: start, target: end, guard: has_answer, unless: has_answer, "
            "reason: done}\n  - {source: start, target: end, reason: final_answer}\n",
            "reasons: {escalated: {}, gave_up: {}}\n",
        )
    )

    unreached = unreached_reasons(edge_graph(spec))

    assert list(unreached) == ["done", "escalated", "gave_up"]
    [(index, loc)] = unreached["done"]
    assert index == 0
    assert loc is not None
    assert (loc.line, loc.col) == (8, 5)
    assert unreached["escalated"] == []


def test_kernel_reasons_follow_what_the_workflow_does_and_its_limits() -> None:
    no_model = spec_of(
        "name: w\nlimits: {timeout_seconds: 0}\ninitial: a\nstates:\n"
        "  a: {action: session.observe}\n  end: {final: true}\n"
        "transitions:\n  - {source: a, target: end, reason: done}\n"
    )
    budget = spec_of(loop("", "  - {source: start, target: end, reason: final_answer}\n",
                          "limits: {max_tokens: 500, max_iterations: 0}\n"))  # fmt: skip

    assert list(kernel_reasons(edge_graph(no_model))) == ["cancelled", "error", "no_progress"]
    assert list(kernel_reasons(edge_graph(budget))) == [
        "agent_error",
        "budget_exceeded",
        "cancelled",
        "error",
        "malformed_output",
        "no_progress",
        "timeout",
        "truncated",
    ]


def test_explain_puts_it_together() -> None:
    spec = load_workflow(REPO / "workflows" / "single_shot.yaml")

    data = explain(spec).to_dict()

    assert data["initial"] == "answer"
    assert [(r["reason"], r["success"], r["states"]) for r in data["reached"]] == [
        ("malformed_output", False, ["answer", "terminate"]),
        ("final_answer", True, ["answer", "terminate"]),
    ]
    assert data["reached"][1]["edges"] == [
        {
            "index": 1,
            "kind": "transition",
            "from": "answer",
            "to": "terminate",
            "source": "answer",
            "target": "terminate",
            "history": False,
            "label": "",
            "reason": "final_answer",
            "line": 22,
            "col": 5,
        }
    ]
    assert data["unreached"] == []


# --- cycles ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", STOCK + VALID_DATA, ids=lambda p: p.name)
def test_stock_and_test_workflows_have_no_unbounded_cycle(path: Path) -> None:
    spec = load_workflow(path)

    assert unbounded_cycles(edge_graph(spec)) == []


def test_the_broken_file_names_its_cycle_at_its_first_edge() -> None:
    with pytest.raises(WorkflowValidationError) as info:
        load_workflow(DATA / "broken_unbounded_cycle.yaml")

    assert str(info.value) == (
        f"{DATA / 'broken_unbounded_cycle.yaml'}:13:5: poll → check → poll can repeat without a "
        "model call, a limit or a timer: give the cycle a state that calls the model, an edge "
        "that waits (event: or after:), or a counter (when: vars.n < 3 with assign: {n: vars.n "
        "+ 1})"
    )


def test_a_run_refuses_a_workflow_with_an_unbounded_cycle() -> None:
    text = loop(
        "  spin: {action: kernel.evaluate}\n",
        "  - {source: start, target: spin}\n"
        "  - {source: spin, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: spin, target: spin}\n",
    )

    with pytest.raises(WorkflowValidationError, match=r"^w\.yaml:10:5: spin → spin can repeat"):
        load_workflow_text(text, path="w.yaml")


SPIN_EDGES = (
    "  - {source: start, target: a}\n"
    "  - {source: a, target: end, guard: has_answer, reason: final_answer}\n"
    "  - {source: a, target: b}\n"
    "  - {source: b, target: a}\n"
)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("{action: agent.think}", "{action: kernel.evaluate}"),
        ("{action: kernel.evaluate}", "{action: agent.decide}"),
        ("{action: kernel.evaluate}", f'{{action: "{HERE}:thinking_action"}}'),
        ("{action: kernel.evaluate}", "{action: human.input, prompt: Go on}"),
        ("{action: kernel.evaluate}", "{action: workflow.call, workflow: single_shot}"),
        (
            "{action: kernel.evaluate}",
            "{action: workflow.map, workflow: single_shot, items: output}",
        ),
    ],
    ids=["think", "decide", "user-model", "human", "call", "map"],
)
def test_a_state_that_calls_the_model_asks_a_person_or_starts_children_bounds(
    a: str, b: str
) -> None:
    text = loop(f"  a: {a}\n  b: {b}\n", SPIN_EDGES)

    assert messages(text) == []


@pytest.mark.parametrize(
    "b",
    ["{action: kernel.evaluate}", "{action: tools.execute}", f'{{action: "{HERE}:plain_action"}}'],
    ids=["evaluate", "tools", "user-plain"],
)
def test_states_that_call_no_model_do_not_bound(b: str) -> None:
    text = loop(f"  a: {{action: session.observe}}\n  b: {b}\n", SPIN_EDGES)

    assert messages(text) == ["w.yaml:11:5: a → b → a"]


def test_without_importing_code_a_users_action_is_taken_at_its_word() -> None:
    spec = spec_of(
        loop('  a: {action: session.observe}\n  b: {action: "no.such:thing"}\n', SPIN_EDGES)
    )

    assert "b" in bounding_states(spec, import_code=False)
    assert cycle_errors(spec, import_code=False) == []


@pytest.mark.parametrize("wait", ["event: go", "after: 1h"])
def test_an_edge_that_waits_bounds(wait: str) -> None:
    text = loop(
        "  a: {action: kernel.evaluate}\n  b: {description: waits}\n",
        "  - {source: start, target: a}\n"
        "  - {source: a, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: a, target: b}\n"
        f"  - {{source: b, target: a, {wait}}}\n",
    )

    assert messages(text) == []


def test_a_limit_guard_without_a_model_call_does_not_bound() -> None:
    # iteration_limit reads a count only model calls move: this loop would spin forever
    text = loop(
        "  a: {action: kernel.evaluate}\n",
        "  - {source: start, target: a}\n"
        "  - {source: a, target: a, unless: iteration_limit}\n"
        "  - {source: a, target: end, reason: max_iterations}\n",
    )

    assert messages(text) == ["w.yaml:9:5: a → a"]


COUNTER = "variables: {n: {type: integer, default: 0}}\n"


def counted(a_to_b: str, b_to_a: str, state_assign: str = "") -> str:
    return loop(
        f"  a: {{action: kernel.evaluate{state_assign}}}\n  b: {{action: session.observe}}\n",
        "  - {source: start, target: a}\n"
        f"  - {{source: a, target: b{a_to_b}}}\n"
        "  - {source: a, target: end, reason: final_answer}\n"
        f"  - {{source: b, target: a{b_to_a}}}\n",
        COUNTER,
    )


@pytest.mark.parametrize(
    ("a_to_b", "b_to_a", "state_assign"),
    [
        (', when: "vars.n < 3", assign: {n: "vars.n + 1"}', "", ""),
        (', when: "vars.n <= 3"', ', assign: {n: "vars.n + 2"}', ""),
        (', when: "3 > vars.n"', "", ', assign: {n: "vars.n + 1"}'),
    ],
    ids=["same-edge", "other-edge", "state"],
)
def test_a_counter_a_when_bounds_and_the_cycle_adds_to_bounds(
    a_to_b: str, b_to_a: str, state_assign: str
) -> None:
    assert messages(counted(a_to_b, b_to_a, state_assign)) == []


@pytest.mark.parametrize(
    ("a_to_b", "b_to_a"),
    [
        (', when: "vars.n < 3"', ""),  # nothing adds
        (', when: "vars.n < 3", assign: {n: "vars.n + 1"}', ', assign: {n: "0"}'),  # reset
        (', when: "vars.n < 3 || true", assign: {n: "vars.n + 1"}', ""),  # not only a bound
        (', when: "vars.n > 3", assign: {n: "vars.n + 1"}', ""),  # bound from below
        (', when: "vars.n < 3", assign: {n: "vars.n - 1"}', ""),  # counts down
    ],
    ids=["no-step", "reset", "or", "below", "down"],
)
def test_a_counter_that_may_not_grow_does_not_bound(a_to_b: str, b_to_a: str) -> None:
    assert messages(counted(a_to_b, b_to_a)) == ["w.yaml:11:5: a → b → a"]


def test_a_counter_bounds_only_the_cycles_that_add_to_it() -> None:
    text = loop(
        "  a: {action: kernel.evaluate}\n  b: {action: session.observe}\n"
        "  c: {action: session.observe}\n",
        "  - {source: start, target: a}\n"
        '  - {source: a, target: b, when: "vars.n < 3"}\n'
        "  - {source: a, target: end, reason: final_answer}\n"
        '  - {source: b, target: a, guard: has_answer, assign: {n: "vars.n + 1"}}\n'
        "  - {source: b, target: c}\n"
        "  - {source: c, target: a}\n",
        COUNTER,
    )

    assert messages(text) == ["w.yaml:12:5: a → b → c → a"]


def test_a_catch_edge_back_into_the_cycle_does_not_bound() -> None:
    text = loop(
        "  work: {action: kernel.evaluate, catch: [{error: any, target: work}]}\n",
        "  - {source: start, target: work}\n  - {source: work, target: end, reason: done}\n",
    )

    assert messages(text) == ["w.yaml:5:43: work → work"]


def test_a_cycle_inside_a_compound_state_is_named_by_full_paths() -> None:
    text = (
        "name: w\ninitial: box\nstates:\n"
        "  box:\n    initial: a\n    states:\n"
        "      a: {action: kernel.evaluate}\n      b: {action: session.observe}\n"
        "  end: {final: true}\n"
        "transitions:\n"
        "  - {source: box, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: a, target: b}\n"
        "  - {source: b, target: a}\n"
    )

    assert messages(text) == ["w.yaml:12:5: box.a → box.b → box.a"]


def test_each_unbounded_part_is_reported_once_with_its_shortest_cycle() -> None:
    text = loop(
        "  a: {action: kernel.evaluate}\n  b: {action: session.observe}\n"
        "  c: {action: agent.think}\n  d: {action: kernel.evaluate}\n",
        "  - {source: start, target: a}\n"
        "  - {source: a, target: c, guard: has_answer}\n"
        "  - {source: a, target: b}\n"
        "  - {source: b, target: b, guard: has_tool_calls}\n"
        "  - {source: b, target: a}\n"
        "  - {source: c, target: d}\n"
        "  - {source: d, target: end, guard: has_answer, reason: final_answer}\n"
        "  - {source: d, target: d}\n",
    )

    spec = spec_of(text)
    cycles = unbounded_cycles(edge_graph(spec))

    assert [c.text(spec) for c in cycles] == ["b → b", "d → d"]
    assert all(isinstance(c, Cycle) for c in cycles)
    assert messages(text) == ["w.yaml:14:5: b → b", "w.yaml:18:5: d → d"]


def test_an_unreachable_loop_is_left_to_the_reachability_error() -> None:
    text = loop(
        "  a: {action: kernel.evaluate}\n",
        "  - {source: start, target: end, reason: final_answer}\n"
        "  - {source: a, target: a, guard: has_answer}\n"
        "  - {source: a, target: end, reason: done}\n",
    )

    errors = [e.message for e in check_workflow_text(text, path="w.yaml").errors]

    assert errors == ["state 'a' is unreachable from 'start'"]
