"""The workflow graph `validate` reasons on (fsm_kernel.workflow.analysis): edges from each
leaf in the order a run tries them, history entries landing on every leaf inside, catch edges;
a free cycle through a catch entry is found."""

from __future__ import annotations

from fsm_kernel.workflow.analysis import cycle_errors, graph
from fsm_kernel.workflow.loader import load_workflow_text

HISTORY = """\
name: h
initial: work
states:
  work:
    initial: a
    history: deep
    states:
      a: {action: agent.think}
      b: {action: agent.think}
  pause: {action: agent.think}
  done: {final: true}
transitions:
  - {source: work, target: pause, guard: has_tool_calls}
  - {source: a, target: b}
  - {source: b, target: done, reason: final_answer}
  - {source: pause, target: work, enter: history}
"""

CATCHING = """\
name: c
initial: fetch
states:
  fetch:
    action: tools.execute
    catch: [{error: any, target: cleanup}]
  cleanup: {action: session.observe}
  think: {action: agent.think}
  done: {final: true}
transitions:
  - {source: fetch, target: think}
  - {source: cleanup, target: fetch}
  - {source: think, target: done, reason: final_answer}
"""


def test_edges_come_in_the_order_a_run_tries_them_and_history_lands_anywhere_inside() -> None:
    g = graph(load_workflow_text(HISTORY, path="h.yaml"))

    assert [(e.index, e.to) for e in g["a"]] == [(0, "pause"), (1, "b")]
    assert [(e.index, e.to, e.final) for e in g["b"]] == [(0, "pause", False), (2, "done", True)]
    assert [(e.index, e.to) for e in g["pause"]] == [(3, "a"), (3, "b")]


def test_a_free_cycle_through_a_catch_entry_is_found() -> None:
    spec = load_workflow_text(CATCHING, path="c.yaml", import_code=False)
    spends = {"fetch": False, "cleanup": False, "think": True, "done": False}

    errors = [str(e) for e in cycle_errors(spec, spends)]

    assert len(errors) == 1
    # reported at its first edge in the file: cleanup → fetch (the catch entry is numbered after)
    assert errors[0].startswith("c.yaml:12:5: fetch → cleanup → fetch can repeat without")
