"""The diagram as the viewer embeds it: dot's SVG with its states and edges tagged for clicks,
the live and final states classed, and anything active refused rather than embedded."""

from __future__ import annotations

import shutil

import pytest

from fsm_kernel.diagram import render_svg, to_dot
from fsm_kernel.ui._diagrams import tag_svg
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="needs the dot program")

WORKFLOW = """
name: tiny
description: "a description with once = true, onload=x and href = y in it"
initial: ask
states:
  ask: {action: agent.think}
  done: {final: true}
transitions:
  - {source: ask, target: done, reason: final_answer}
"""


@pytest.fixture
def spec() -> WorkflowSpec:
    return load_workflow_text(WORKFLOW)


def test_states_and_edges_are_tagged_and_classed(spec: WorkflowSpec) -> None:
    svg = tag_svg(render_svg(to_dot(spec, legend=False)), spec, current="ask", ended=None)
    assert svg.startswith("<svg")
    assert '<g id="node2" class="node state current" data-state="ask"><title>ask</title>' in svg
    assert 'class="node state" data-state="done"' in svg
    assert '<g id="edge2" class="edge" data-edge="ask-&gt;done"><title>ask&#45;&gt;done' in svg
    assert "onload=x" in svg  # text that merely looks like an attribute is kept

    ended = tag_svg(render_svg(to_dot(spec, legend=False)), spec, current=None, ended="done")
    assert 'class="node state ended" data-state="done"' in ended
    assert "current" not in ended


@pytest.mark.parametrize(
    "active",
    [
        "<svg><script>alert(1)</script></svg>",
        '<svg><g onclick="alert(1)"></g></svg>',
        '<svg><a xlink:href="javascript:alert(1)"><text>x</text></a></svg>',
        "<svg><foreignObject><div></div></foreignObject></svg>",
        '<svg><g style="background:url(x)"></g></svg>',
    ],
)
def test_anything_active_is_refused(spec: WorkflowSpec, active: str) -> None:
    assert tag_svg(active, spec, current=None, ended=None) == (
        '<p class="error">the diagram could not be shown safely</p>'
    )
