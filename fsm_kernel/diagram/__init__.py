"""Workflow diagrams: a WorkflowSpec as Graphviz DOT or Mermaid text, optionally with a run drawn
on top (visit counts, the path taken, the terminating edge), or many runs as heat (DOT), and
`render()` for SVG/PNG.

Works from the spec alone: never imports python-statemachine. DOT and Mermaid text need no
binary; only `render()` runs the `dot` program. Import every name from here; the private
modules behind it are _overlay (the run and heat overlays), _labels (text and colours both
renderers share), _dot and _mermaid (the renderers), _heat (how _dot draws heat) and _render
(the `dot` program).
"""

from fsm_kernel.diagram._dot import to_dot
from fsm_kernel.diagram._labels import KERNEL_REASONS, edge_label
from fsm_kernel.diagram._mermaid import to_mermaid
from fsm_kernel.diagram._overlay import HeatOverlay, RunOverlay, overlay_problems
from fsm_kernel.diagram._render import DOT_MISSING as DOT_MISSING
from fsm_kernel.diagram._render import RENDER_FORMATS, render, render_svg

__all__ = [
    "KERNEL_REASONS",
    "RENDER_FORMATS",
    "HeatOverlay",
    "RunOverlay",
    "edge_label",
    "overlay_problems",
    "render",
    "render_svg",
    "to_dot",
    "to_mermaid",
]
