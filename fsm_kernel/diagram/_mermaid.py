"""The Mermaid renderer: a WorkflowSpec, optionally with a RunOverlay, as a stateDiagram-v2."""

from __future__ import annotations

from fsm_kernel.diagram._labels import (
    DIM,
    KERNEL_REASONS,
    TAKEN,
    edge_label,
    end_color,
    ended_here,
    run_summary,
    state_hints,
)
from fsm_kernel.diagram._overlay import RunOverlay, fired_count
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["to_mermaid"]

_MERMAID_WORDS = frozenset(
    {
        "end",
        "state",
        "note",
        "direction",
        "class",
        "classdef",
        "click",
        "style",
        "as",
        "left",
        "right",
        "of",
    }
)


def _mid(sid: str) -> str:
    """A state id Mermaid will not read as a keyword."""
    return f"{sid}_" if sid.lower() in _MERMAID_WORDS else sid


def _mermaid_text(text: str) -> str:
    """Mermaid's label text runs to the line end and may hold no `:` or `;`."""
    flat = " ".join(text.split()).replace(": ", " — ")
    return flat.replace(":", " ").replace(";", ",")


def _mermaid_states(
    spec: WorkflowSpec, overlay: RunOverlay | None, parent: str | None = None
) -> list[str]:
    """The states whose parent is `parent` (None: the top level), a compound state as a
    `state id { ... }` block holding its children and the edges between them."""
    pad = "    " * (len(spec.ancestors(parent)) + 2 if parent is not None else 1)
    lines = []
    for sid, state in spec.states.items():
        if spec.parent(sid) != parent:
            continue
        if state.is_compound:
            lines.append(f"{pad}state {_mid(sid)} {{")
            lines += _mermaid_states(spec, overlay, sid)
            lines += _mermaid_edges(spec, overlay, sid)
            lines.append(pad + "}")
            continue
        parts = state_hints(spec, sid)
        if overlay is not None and overlay.visits.get(sid):
            parts.append(f"×{overlay.visits[sid]}")
        # one `id : text` line per description line; hint-less states come with their edges
        lines += [f"{pad}{_mid(sid)} : {_mermaid_text(part)}" for part in parts]
    return lines


def _mermaid_edges(
    spec: WorkflowSpec, overlay: RunOverlay | None, parent: str | None = None
) -> list[str]:
    """The edges drawn in the block of `parent`: between two of its children (Mermaid draws
    an edge inside a `state { }` block only between states of that block); all others at the
    top level."""
    pad = "    " * (len(spec.ancestors(parent)) + 2 if parent is not None else 1)
    initial = spec.initial if parent is None else str(spec.states[parent].initial)
    lines = [f"{pad}[*] --> {_mid(initial)}"]
    edges = [(i, t.source, t.target) for i, t in enumerate(spec.transitions)]
    edges += [(c.index, c.source, c.target) for c in spec.catch_edges()]
    for index, source, target in edges:
        home = spec.parent(source) if spec.parent(source) == spec.parent(target) else None
        if home != parent:
            continue
        label = edge_label(spec, index)
        if overlay is not None and fired_count(spec, overlay, index):
            label = f"{label} ×{fired_count(spec, overlay, index)}".strip()
            if index == overlay.terminating:
                label += " " + ended_here(spec, overlay, index)
        arrow = f"{pad}{_mid(source)} --> {_mid(target)}"
        lines.append(f"{arrow} : {_mermaid_text(label)}" if label else arrow)
    finals = [sid for sid, s in spec.states.items() if s.final and spec.parent(sid) == parent]
    lines += [f"{pad}{_mid(sid)} --> [*]" for sid in finals]
    return lines


def _mermaid_overlay(spec: WorkflowSpec, overlay: RunOverlay) -> list[str]:
    lines = [
        "    classDef visited stroke:" + TAKEN + ",stroke-width:2px",
        "    classDef unvisited stroke:" + DIM + ",color:" + DIM,
        "    classDef ended stroke:" + end_color(overlay) + ",stroke-width:3px",
    ]
    for sid in spec.states:
        if overlay.reason is not None and sid == overlay.last_state:
            kind = "ended"
        else:
            kind = "visited" if overlay.visits.get(sid) else "unvisited"
        lines.append(f"    class {_mid(sid)} {kind}")
    if overlay.last_state in spec.states:
        lines.append(
            f"    note right of {_mid(overlay.last_state)} : {_mermaid_text(run_summary(overlay))}"
        )
    return lines


def to_mermaid(spec: WorkflowSpec, *, overlay: RunOverlay | None = None) -> str:
    """The workflow as a Mermaid stateDiagram-v2 (deterministic, like `to_dot`)."""
    lines = ["stateDiagram-v2", f"    %% {spec.name}: {_mermaid_text(spec.description)}".rstrip()]
    lines += _mermaid_states(spec, overlay)
    lines += _mermaid_edges(spec, overlay)
    if overlay is not None:
        lines += _mermaid_overlay(spec, overlay)
    if spec.catch_edges():
        lines.append(
            "    %% catch edges are taken first when the state's action fails with that error"
        )
    lines.append("    %% the kernel may end any run with: " + ", ".join(KERNEL_REASONS))
    return "\n".join(lines) + "\n"
