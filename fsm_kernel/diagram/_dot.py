"""The DOT renderer: a WorkflowSpec, optionally with a RunOverlay, as Graphviz DOT text built with
the graphviz package (which only writes text here; rendering is _render's job).
"""

from __future__ import annotations

import html

import graphviz

from fsm_kernel.diagram import _heat
from fsm_kernel.diagram._labels import (
    CAUGHT,
    DIM,
    INK,
    KERNEL_REASONS,
    SOFT,
    TAKEN,
    edge_label,
    end_color,
    ended_here,
    run_summary,
    short,
    state_hints,
)
from fsm_kernel.diagram._overlay import HeatOverlay, RunOverlay, fired_count
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["to_dot"]

_FONT = "Helvetica"
_FINAL_FILL = "#f5f7fa"
_CALL_FILL = "#eaf2fc"
"""A state that runs another workflow (workflow.call, workflow.map)."""
_MAX_DEPTH = 4
"""How deep --expand draws workflows that call workflows."""
_START = "_start"  # state ids are snake_case starting with a letter, so these never clash
_LEGEND = "_legend"

Overlay = RunOverlay | HeatOverlay
"""What is drawn on the workflow: one run, or many added up (heat)."""


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def _font(text: str, *, size: int, color: str, bold: bool = False) -> str:
    inner = f"<B>{_esc(text)}</B>" if bold else _esc(text)
    return f'<FONT POINT-SIZE="{size}" COLOR="{color}">{inner}</FONT>'


def _state_label(spec: WorkflowSpec, sid: str, overlay: Overlay | None) -> str:
    visits = overlay.visits.get(sid, 0) if overlay is not None else 0
    dim = overlay is not None and visits == 0
    title, extra = (f"{sid}  ×{visits}" if visits else sid), list[str]()
    if isinstance(overlay, HeatOverlay):
        title, extra = _heat.state_lines(sid, overlay)
    lines = [_font(title, size=12, color=DIM if dim else INK, bold=True)]
    hints = [*state_hints(spec, sid), *extra]
    lines += [_font(h, size=9, color=DIM if dim else SOFT) for h in hints]
    if isinstance(overlay, RunOverlay) and overlay.ended_by_kernel and overlay.last_state == sid:
        lines.append(
            _font(f"■ ended here: {overlay.reason}", size=9, color=end_color(overlay), bold=True)
        )
    return "<" + "<BR/>".join(lines) + ">"


def _state_attrs(spec: WorkflowSpec, sid: str, overlay: Overlay | None) -> dict[str, str]:
    attrs = {"label": _state_label(spec, sid, overlay)}
    if spec.states[sid].final:
        attrs.update(peripheries="2", style="rounded,filled", fillcolor=_FINAL_FILL)
    elif spec.states[sid].workflow:
        attrs.update(style="rounded,filled,bold", fillcolor=_CALL_FILL)
    if overlay is None:
        return attrs
    if isinstance(overlay, HeatOverlay):
        return {**attrs, **_heat.state_attrs(sid, overlay)}
    if overlay.visits.get(sid, 0) == 0:
        attrs["color"] = DIM
    elif overlay.last_state == sid and overlay.reason is not None:
        attrs.update(color=end_color(overlay), penwidth="2")
    else:
        attrs.update(color=TAKEN, penwidth="1.5")
    return attrs


def _edge_groups(spec: WorkflowSpec) -> list[tuple[str, str, list[int]]]:
    """Transitions sharing a source and a target, drawn as one edge with a row per transition;
    catch edges are grouped apart (they are drawn in their own style)."""
    groups: dict[tuple[str, str, bool], list[int]] = {}
    for index, t in enumerate(spec.transitions):
        groups.setdefault((t.source, t.target, False), []).append(index)
    for edge in spec.catch_edges():
        groups.setdefault((edge.source, edge.target, True), []).append(edge.index)
    return [(source, target, indexes) for (source, target, _), indexes in groups.items()]


def _edge_row(spec: WorkflowSpec, index: int, overlay: Overlay | None) -> tuple[str, str]:
    """(text, colour) of one transition's line on its edge."""
    text = edge_label(spec, index)
    if overlay is None:
        return text, CAUGHT if spec.catch_edge(index) is not None else INK
    if isinstance(overlay, HeatOverlay):
        return _heat.edge_row(spec, index, overlay)
    count = fired_count(spec, overlay, index)
    if count == 0:
        return text, DIM
    text = f"{text}  ×{count}".strip()
    if index == overlay.terminating:
        return f"{text}  {ended_here(spec, overlay, index)}", end_color(overlay)
    return text, TAKEN


def _edge_label_attrs(rows: list[tuple[str, str]]) -> dict[str, str]:
    if len(rows) == 1:
        text, color = rows[0]
        if not text:
            return {}
        if len(text) > 32:  # a long conjunction reads better over two lines
            text = text.replace(" and ", "\\nand ")
        return {"label": text, "fontcolor": color}
    cells = "".join(
        f'<TR><TD ALIGN="LEFT">{_font(text, size=9, color=color)}</TD></TR>' for text, color in rows
    )
    return {"label": f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="1">{cells}</TABLE>>'}


def _edge_attrs(spec: WorkflowSpec, indexes: list[int], overlay: Overlay | None) -> dict[str, str]:
    attrs = _edge_label_attrs([_edge_row(spec, i, overlay) for i in indexes])
    if spec.catch_edge(indexes[0]) is not None:
        attrs.update(style="dashed", color=CAUGHT)
    if overlay is None:
        return attrs
    if isinstance(overlay, HeatOverlay):
        return {**attrs, **_heat.edges_attrs(indexes, overlay)}
    if overlay.terminating in indexes:
        attrs.update(color=end_color(overlay), penwidth="3")
    elif any(fired_count(spec, overlay, i) for i in indexes):
        attrs.update(color=TAKEN, penwidth="2.5")
    else:
        attrs.update(color=DIM)
    return attrs


def _legend_rows(spec: WorkflowSpec, overlay: Overlay | None) -> list[str]:
    rows = [
        "● → the initial state; a double border marks a final state",
        "n. [guard]: the edge's place in transitions:, the order a state's edges are tried in; "
        "the first that passes fires",
        "[else]: taken when no other edge of its state passes",
        "[guard] → reason: the run ends with that termination reason",
        "the kernel may end any run with: " + ", ".join(KERNEL_REASONS),
    ]
    if any(s.workflow for s in spec.states.values()):
        rows.insert(
            3,
            "shaded, bold: a state that runs the workflow after ⇢ as child runs "
            "(diagram --expand draws it inside)",
        )
    if spec.has_compound:
        rows.insert(
            3,
            "a box around states: a compound state (● its initial child); its edges are tried "
            "first, from every state inside it",
        )
    if spec.catch_edges():
        rows.insert(
            3,
            "dashed catch edge: taken first when the state's action fails with that error "
            "(after its retries)",
        )
    if isinstance(overlay, HeatOverlay):
        rows += _heat.legend_rows(overlay)
    elif overlay is not None:
        rows += [
            "×n: times a state was entered / an edge fired; grey: not reached",
            "■ where the run ended: green for final_answer or done, red for any other reason",
        ]
        if overlay.error:
            rows.append("error: " + short(overlay.error, 90))
    elif spec.limits.max_iterations:
        n = spec.limits.max_iterations
        rows.append(f"max_iterations: {n} model call{'s' if n != 1 else ''} in this workflow")
    return rows


def _legend_label(spec: WorkflowSpec, overlay: Overlay | None) -> str:
    cells = "".join(
        f'<TR><TD ALIGN="LEFT">{_font(row, size=9, color=SOFT)}</TD></TR>'
        for row in _legend_rows(spec, overlay)
    )
    head = f'<TR><TD ALIGN="LEFT">{_font("legend", size=10, color=INK, bold=True)}</TD></TR>'
    return (
        f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">{head}{cells}</TABLE>>'
    )


def _title(spec: WorkflowSpec, overlay: Overlay | None) -> str:
    lines = [_font(spec.name, size=14, color=INK, bold=True)]
    if spec.description:
        lines.append(_font(short(spec.description, 90), size=10, color=SOFT))
    if isinstance(overlay, HeatOverlay):
        lines.append(_font(_heat.title_line(overlay), size=10, color=INK, bold=True))
    elif overlay is not None:
        color = TAKEN if overlay.reason is None else end_color(overlay)
        lines.append(_font(run_summary(overlay), size=10, color=color, bold=True))
    return "<" + "<BR/>".join(lines) + ">"


def _new_digraph(spec: WorkflowSpec, overlay: Overlay | None) -> graphviz.Digraph:
    return graphviz.Digraph(
        name=spec.name,
        graph_attr={
            "rankdir": "TB",
            "label": _title(spec, overlay),
            "labelloc": "t",
            "fontname": _FONT,
            "nodesep": "0.5",
            "ranksep": "0.55",
            "pad": "0.3",
        },
        node_attr={
            "shape": "box",
            "style": "rounded",
            "fontname": _FONT,
            "color": INK,
            "margin": "0.18,0.07",
        },
        edge_attr={
            "fontname": _FONT,
            "fontsize": "9",
            "color": SOFT,
            "fontcolor": INK,
            "arrowsize": "0.7",
        },
    )


def _draw_states(
    g: graphviz.Digraph, spec: WorkflowSpec, overlay: Overlay | None, parent: str | None
) -> None:
    """The states whose parent is `parent` (None: the top level): a compound state as a cluster
    (`cluster_<id>`) holding its children and a start dot into its initial child."""
    for sid, state in spec.states.items():
        if spec.parent(sid) != parent:
            continue
        if not state.is_compound:
            g.node(sid, **_state_attrs(spec, sid, overlay))
            continue
        with g.subgraph(name=f"cluster_{sid}") as box:
            box.attr(label=_cluster_label(spec, sid), style="rounded", color=INK, labeljust="l")
            start = f"{_START}_{sid}"
            box.node(start, label="", shape="circle", style="filled", fillcolor=INK, width="0.1")
            _draw_states(box, spec, overlay, sid)
            tail, head, ends = _ends(spec, start, str(state.initial))
            box.edge(tail, head, **ends)


def _cluster_label(spec: WorkflowSpec, sid: str) -> str:
    lines = [_font(sid, size=12, color=INK, bold=True)]
    history = spec.states[sid].history
    if history is not None:
        lines.append(_font(f"history: {history}", size=9, color=SOFT))
    if spec.states[sid].description:
        lines.append(_font(short(spec.states[sid].description, 60), size=9, color=SOFT))
    return "<" + "<BR/>".join(lines) + ">"


def _ends(spec: WorkflowSpec, source: str, target: str) -> tuple[str, str, dict[str, str]]:
    """The nodes an edge joins, and how it is cut at a compound state's cluster: Graphviz joins
    nodes, so an edge out of (into) a compound state leaves (enters) the state it is entered at,
    drawn from (to) the cluster's border."""
    tail, head, attrs = source, target, {}
    if source in spec.states and spec.states[source].is_compound:
        tail = spec.entry(source)
        if not spec.inside(target, source):
            attrs["ltail"] = f"cluster_{source}"
    if target in spec.states and spec.states[target].is_compound:
        head = spec.entry(target)
        if source not in spec.states or not spec.inside(source, target):
            attrs["lhead"] = f"cluster_{target}"
    return tail, head, attrs


def _draw_called(g: graphviz.Digraph, spec: WorkflowSpec, prefix: str, depth: int) -> None:
    """Each workflow `spec`'s states call, drawn as a cluster under the calling state: its
    states and edges (ids prefixed by the caller's), entered by a dashed edge from the caller."""
    from fsm_kernel.workflow.loader import find_workflow, load_workflow

    for sid, state in spec.states.items():
        if not state.workflow or depth > _MAX_DEPTH:
            continue
        child = load_workflow(
            find_workflow(state.workflow, relative_to=spec.path), import_code=False, calls=False
        )
        inner = f"{prefix}{sid}__"
        with g.subgraph(name=f"cluster_{inner}") as box:
            how = "once per item" if state.action == "workflow.map" else "as a child run"
            box.attr(
                label=_font(f"{child.name} ({how})", size=10, color=SOFT, bold=True).join("<>"),
                style="rounded,dashed",
                color=SOFT,
                labeljust="l",
            )
            for cid in child.states:
                box.node(inner + cid, **_state_attrs(child, cid, None))
            for source, target, indexes in _edge_groups(child):
                box.edge(inner + source, inner + target, **_edge_attrs(child, indexes, None))
            _draw_called(box, child, inner, depth + 1)
        g.edge(prefix + sid, inner + child.initial, style="dashed", color=SOFT, arrowhead="empty")


def to_dot(
    spec: WorkflowSpec,
    *,
    overlay: Overlay | None = None,
    legend: bool = True,
    expand: bool = False,
) -> str:
    """The workflow as Graphviz DOT text; the same spec (and overlay) gives the same bytes.
    `overlay`: one run (RunOverlay) or many added up (HeatOverlay, drawn as heat).
    `legend=False` leaves the legend out (for a page that explains the notation itself);
    `expand=True` draws each workflow a state calls inside a cluster (see `_draw_called`)."""
    g = _new_digraph(spec, overlay)
    g.node(
        _START,
        label="",
        shape="circle",
        style="filled",
        fillcolor=INK,
        width="0.16",
        fixedsize="true",
    )
    if spec.has_compound:
        g.attr(compound="true")  # edges may end at a cluster's border (lhead, ltail)
    _draw_states(g, spec, overlay, None)
    entry = {"color": TAKEN, "penwidth": "2.5"} if overlay is not None and overlay.visits else {}
    tail, head, ends = _ends(spec, _START, spec.initial)
    g.edge(tail, head, **entry, **ends)
    for source, target, indexes in _edge_groups(spec):
        tail, head, ends = _ends(spec, source, target)
        g.edge(tail, head, **_edge_attrs(spec, indexes, overlay), **ends)
    if expand:
        _draw_called(g, spec, "", 1)
    if not legend:
        return str(g.source)
    with g.subgraph(name="cluster_legend") as box:
        box.attr(style="rounded,dashed", color=DIM, label="", margin="6")
        box.node(_LEGEND, label=_legend_label(spec, overlay), shape="plaintext")
    for final in spec.final_states():  # keep the legend under the diagram, not beside it
        g.edge(final, _LEGEND, style="invis")
    return str(g.source)
