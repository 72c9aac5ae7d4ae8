"""Workflow diagrams: a WorkflowSpec as Graphviz DOT or Mermaid text, optionally with a run drawn
on top (visit counts, the path taken, the terminating edge), and `render()` for SVG/PNG.

Works from the spec alone: never imports python-statemachine. DOT and Mermaid text need no
binary; only `render()` runs the `dot` program.
"""

from __future__ import annotations

import html
import logging
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import graphviz

from fsm_kernel.errors import ConfigError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.workflow.spec import SUCCESS_REASONS, TransitionSpec, WorkflowSpec

__all__ = [
    "KERNEL_REASONS",
    "RENDER_FORMATS",
    "RunOverlay",
    "edge_label",
    "overlay_problems",
    "render",
    "to_dot",
    "to_mermaid",
]

logger = logging.getLogger(__name__)

KERNEL_REASONS: tuple[str, ...] = (
    "max_iterations",
    "timeout",
    "cancelled",
    "agent_error",
    "error",
    "no_progress",
    "truncated",
)
"""Reasons the kernel itself may end any run with, whatever the transitions say (no_progress:
limits.max_transitions reached; truncated: an edge ending with final_answer or done fired while
the last model reply was cut off by its length limit)."""

RENDER_FORMATS: tuple[str, ...] = ("svg", "png")

DOT_MISSING = (
    "the 'dot' program is needed for svg/png: apt-get install graphviz "
    "(or brew install graphviz); dot and mermaid output need nothing"
)

_FONT = "Helvetica"
_INK = "#1f2933"
_SOFT = "#52606d"
_DIM = "#b8c2cc"
_TAKEN = "#1d4ed8"
_FAILED = "#c0392b"
_SUCCEEDED = "#15803d"
_FINAL_FILL = "#f5f7fa"
_START = "_start"  # state ids are snake_case starting with a letter, so these never clash
_LEGEND = "_legend"
_HINT_MAX = 40


# -- the run overlay ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunOverlay:
    """What one run did on its workflow, derived from its events."""

    run_id: str = ""
    workflow: str | None = None
    """The workflow name the run recorded at its start."""
    workflow_hash: str | None = None
    """The workflow file's sha256 the run last ran under (a forced resume changes it)."""
    workflow_path: str | None = None
    """The workflow file the run was started from."""
    visits: dict[str, int] = field(default_factory=dict)
    """Times each state was entered (final states included)."""
    traversals: dict[int, int] = field(default_factory=dict)
    """Times each transition (by its index in the workflow's list) fired."""
    edges: dict[int, tuple[str, str]] = field(default_factory=dict)
    """(source, target) each fired transition index had in the run, to check against a spec."""
    path: tuple[int, ...] = ()
    """Transition indexes in the order they fired."""
    terminating: int | None = None
    """The transition into a final state that ended the run; None if the kernel ended it."""
    reason: str | None = None
    """The termination reason; None while the run is in flight (or was killed)."""
    error: str | None = None
    last_state: str | None = None
    """The state the run was in when it ended (or is in now)."""

    @property
    def ended_by_kernel(self) -> bool:
        """The run terminated without taking a transition into a final state."""
        return self.reason is not None and self.terminating is None

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> RunOverlay:
        """Build the overlay from one run's events (in seq order)."""
        builder = _OverlayBuilder()
        for event in sorted(events, key=lambda e: e.seq):
            builder.feed(event)
        return builder.build()


class _OverlayBuilder:
    """Folds events into the counters of a RunOverlay."""

    def __init__(self) -> None:
        self.run_id = ""
        self.started: dict[str, object] = {}
        self.visits: dict[str, int] = {}
        self.traversals: dict[int, int] = {}
        self.edges: dict[int, tuple[str, str]] = {}
        self.path: list[int] = []
        self.pending: int | None = None  # last transition whose target has not been entered
        self.state: str | None = None
        self.reason: str | None = None
        self.error: str | None = None

    def feed(self, event: Event) -> None:
        self.run_id = self.run_id or event.run_id
        if event.type is EventType.RUN_STARTED:
            self.started = dict(event.data)
        elif event.type is EventType.RUN_RESUMED and event.data.get("workflow_hash"):
            self.started["workflow_hash"] = event.data["workflow_hash"]  # resume --force
        elif event.type is EventType.STATE_ENTERED and event.state is not None:
            self._enter(event.state)
        elif event.type is EventType.TRANSITION_TAKEN:
            self._take(event.data)
        elif event.type is EventType.RUN_TERMINATED:
            self.reason = _text_or_none(event.data.get("reason"))
            self.error = _text_or_none(event.data.get("error"))

    def _enter(self, state: str) -> None:
        self.visits[state] = self.visits.get(state, 0) + 1
        self.state = state
        self.pending = None

    def _take(self, data: dict[str, object]) -> None:
        index = data.get("index")
        if not isinstance(index, int):
            logger.warning("transition event without an index: %r", data)
            return
        self.traversals[index] = self.traversals.get(index, 0) + 1
        self.edges[index] = (str(data.get("source")), str(data.get("target")))
        self.path.append(index)
        self.pending = index

    def build(self) -> RunOverlay:
        terminating = self.pending if self.reason is not None else None
        visits = dict(self.visits)
        state = self.state
        if terminating is not None:
            # The kernel does not record `state.entered` for the final state it stops in.
            state = self.edges[terminating][1]
            visits[state] = visits.get(state, 0) + 1
        return RunOverlay(
            run_id=self.run_id,
            workflow=_text_or_none(self.started.get("workflow")),
            workflow_hash=_text_or_none(self.started.get("workflow_hash")),
            workflow_path=_text_or_none(self.started.get("workflow_path")),
            visits=visits,
            traversals=dict(self.traversals),
            edges=dict(self.edges),
            path=tuple(self.path),
            terminating=terminating,
            reason=self.reason,
            error=self.error,
            last_state=state,
        )


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def overlay_problems(spec: WorkflowSpec, overlay: RunOverlay) -> list[str]:
    """Why `overlay` may not fit `spec` (another workflow, a changed file); empty if it fits."""
    problems = []
    if overlay.workflow and overlay.workflow != spec.name:
        problems.append(
            f"run {overlay.run_id} is of workflow {overlay.workflow!r}, not {spec.name!r}"
        )
    elif overlay.workflow_hash and spec.content_hash and overlay.workflow_hash != spec.content_hash:
        problems.append(f"the workflow file changed since run {overlay.run_id}")
    for index, (source, target) in sorted(overlay.edges.items()):
        if not _edge_matches(spec, index, source, target):
            problems.append(
                f"transition {index} ({source} -> {target}) is not in the workflow; it is not drawn"
            )
    return problems


def _edge_matches(spec: WorkflowSpec, index: int, source: str, target: str) -> bool:
    if not 0 <= index < len(spec.transitions):
        return False
    t = spec.transitions[index]
    return (t.source, t.target) == (source, target)


def _fired(spec: WorkflowSpec, overlay: RunOverlay, index: int) -> int:
    """How often transition `index` of `spec` fired in the run (0 if it does not match)."""
    if index not in overlay.edges:
        return 0
    source, target = overlay.edges[index]
    return overlay.traversals[index] if _edge_matches(spec, index, source, target) else 0


# -- labels shared by DOT and Mermaid -----------------------------------------------------------


def _condition(spec: WorkflowSpec, t: TransitionSpec) -> str:
    """The guard text, `else` for an unguarded fallback, "" for a source's only, unguarded edge."""
    if t.is_guarded:
        return t.label()
    siblings = spec.transitions_from(t.source)
    return "else" if any(other.is_guarded for _, other in siblings) else ""


def _order(spec: WorkflowSpec, index: int) -> int | None:
    """1-based position of transition `index` among its source's edges; None if it is alone."""
    siblings = [i for i, _ in spec.transitions_from(spec.transitions[index].source)]
    return siblings.index(index) + 1 if len(siblings) > 1 else None


def edge_label(spec: WorkflowSpec, index: int) -> str:
    """One line: `2. [malformed_output and not retries_exhausted]`, `[done_called] → done`."""
    t = spec.transitions[index]
    condition = _condition(spec, t)
    parts = []
    order = _order(spec, index)
    if order is not None:
        parts.append(f"{order}.")
    if condition:
        parts.append(f"[{condition}]")
    if spec.states[t.target].final:
        parts.append(f"→ {t.reason or 'final_answer'}")
    return " ".join(parts)


def _short(text: str, limit: int = _HINT_MAX) -> str:
    """`text` on one line, cut at a word boundary to at most `limit` characters."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.") + "…"


def _tools_hint(names: list[str]) -> str:
    """`tools: a, b +3`: as many names as fit, then how many more."""
    if not names:
        return "tools: none"
    shown: list[str] = []
    for name in names:
        if shown and len("tools: " + ", ".join([*shown, name])) > _HINT_MAX - 3:
            break
        shown.append(name)
    rest = len(names) - len(shown)
    return "tools: " + ", ".join(shown) + (f" +{rest}" if rest else "")


def _state_hints(spec: WorkflowSpec, sid: str) -> list[str]:
    """The lines under a state's id: its action, prompt and tools."""
    state = spec.states[sid]
    lines = []
    if state.action:
        lines.append(state.action)
    if state.prompt:
        lines.append(f'prompt: "{_short(state.prompt, _HINT_MAX - 10)}"')
    if state.tools is not None:
        lines.append(_tools_hint(state.tools))
    if not state.answer:
        lines.append("answer: false")
    return lines


def _end_color(overlay: RunOverlay) -> str:
    return _SUCCEEDED if overlay.reason in SUCCESS_REASONS else _FAILED


def _run_summary(overlay: RunOverlay) -> str:
    """`run 0190ab12: done after 7 transitions` (or why and where the kernel stopped it)."""
    steps = f"{len(overlay.path)} transition{'s' if len(overlay.path) != 1 else ''}"
    who = f"run {overlay.run_id}" if overlay.run_id else "run"  # a prefix is not unique
    if overlay.reason is None:
        return f"{who}: not terminated (in flight or killed) after {steps}, in {overlay.last_state}"
    if overlay.ended_by_kernel:
        where = f" in {overlay.last_state}" if overlay.last_state else ""
        return f"{who}: ended by the kernel{where}: {overlay.reason} after {steps}"
    return f"{who}: {overlay.reason} after {steps}"


# -- DOT ----------------------------------------------------------------------------------------


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def _font(text: str, *, size: int, color: str, bold: bool = False) -> str:
    inner = f"<B>{_esc(text)}</B>" if bold else _esc(text)
    return f'<FONT POINT-SIZE="{size}" COLOR="{color}">{inner}</FONT>'


def _state_label(spec: WorkflowSpec, sid: str, overlay: RunOverlay | None) -> str:
    visits = overlay.visits.get(sid, 0) if overlay is not None else 0
    dim = overlay is not None and visits == 0
    title = f"{sid}  ×{visits}" if visits else sid
    lines = [_font(title, size=12, color=_DIM if dim else _INK, bold=True)]
    lines += [_font(h, size=9, color=_DIM if dim else _SOFT) for h in _state_hints(spec, sid)]
    if overlay is not None and overlay.ended_by_kernel and overlay.last_state == sid:
        lines.append(
            _font(f"■ ended here: {overlay.reason}", size=9, color=_end_color(overlay), bold=True)
        )
    return "<" + "<BR/>".join(lines) + ">"


def _state_attrs(spec: WorkflowSpec, sid: str, overlay: RunOverlay | None) -> dict[str, str]:
    attrs = {"label": _state_label(spec, sid, overlay)}
    if spec.states[sid].final:
        attrs.update(peripheries="2", style="rounded,filled", fillcolor=_FINAL_FILL)
    if overlay is None:
        return attrs
    if overlay.visits.get(sid, 0) == 0:
        attrs["color"] = _DIM
    elif overlay.last_state == sid and overlay.reason is not None:
        attrs.update(color=_end_color(overlay), penwidth="2")
    else:
        attrs.update(color=_TAKEN, penwidth="1.5")
    return attrs


def _edge_groups(spec: WorkflowSpec) -> list[tuple[str, str, list[int]]]:
    """Transitions sharing a source and a target, drawn as one edge with a row per transition."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, t in enumerate(spec.transitions):
        groups.setdefault((t.source, t.target), []).append(index)
    return [(source, target, indexes) for (source, target), indexes in groups.items()]


def _ended_here(spec: WorkflowSpec, overlay: RunOverlay, index: int) -> str:
    """The mark on the edge that ended the run, with the run's reason when it is not the edge's
    (the kernel turned a cut-off final_answer into truncated)."""
    if overlay.reason == spec.transitions[index].reason:
        return "■ ended here"
    return f"■ ended here: {overlay.reason}"


def _edge_row(spec: WorkflowSpec, index: int, overlay: RunOverlay | None) -> tuple[str, str]:
    """(text, colour) of one transition's line on its edge."""
    text = edge_label(spec, index)
    if overlay is None:
        return text, _INK
    count = _fired(spec, overlay, index)
    if count == 0:
        return text, _DIM
    text = f"{text}  ×{count}".strip()
    if index == overlay.terminating:
        return f"{text}  {_ended_here(spec, overlay, index)}", _end_color(overlay)
    return text, _TAKEN


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


def _edge_attrs(
    spec: WorkflowSpec, indexes: list[int], overlay: RunOverlay | None
) -> dict[str, str]:
    attrs = _edge_label_attrs([_edge_row(spec, i, overlay) for i in indexes])
    if overlay is None:
        return attrs
    if overlay.terminating in indexes:
        attrs.update(color=_end_color(overlay), penwidth="3")
    elif any(_fired(spec, overlay, i) for i in indexes):
        attrs.update(color=_TAKEN, penwidth="2.5")
    else:
        attrs.update(color=_DIM)
    return attrs


def _legend_rows(spec: WorkflowSpec, overlay: RunOverlay | None) -> list[str]:
    rows = [
        "● → the initial state; a double border marks a final state",
        "[guard] edges out of a state are tried in number order; the first that passes fires",
        "[else]: taken when no other edge of its state passes",
        "[guard] → reason: the run ends with that termination reason",
        "the kernel may end any run with: " + ", ".join(KERNEL_REASONS),
    ]
    if overlay is not None:
        rows += [
            "×n: times a state was entered / an edge fired; grey: not reached",
            "■ where the run ended: green for final_answer or done, red for any other reason",
        ]
        if overlay.error:
            rows.append("error: " + _short(overlay.error, 90))
    elif spec.limits.max_iterations:
        n = spec.limits.max_iterations
        rows.append(f"max_iterations: {n} model call{'s' if n != 1 else ''} in this workflow")
    return rows


def _legend_label(spec: WorkflowSpec, overlay: RunOverlay | None) -> str:
    cells = "".join(
        f'<TR><TD ALIGN="LEFT">{_font(row, size=9, color=_SOFT)}</TD></TR>'
        for row in _legend_rows(spec, overlay)
    )
    head = f'<TR><TD ALIGN="LEFT">{_font("legend", size=10, color=_INK, bold=True)}</TD></TR>'
    return (
        f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">{head}{cells}</TABLE>>'
    )


def _title(spec: WorkflowSpec, overlay: RunOverlay | None) -> str:
    lines = [_font(spec.name, size=14, color=_INK, bold=True)]
    if spec.description:
        lines.append(_font(_short(spec.description, 90), size=10, color=_SOFT))
    if overlay is not None:
        color = _TAKEN if overlay.reason is None else _end_color(overlay)
        lines.append(_font(_run_summary(overlay), size=10, color=color, bold=True))
    return "<" + "<BR/>".join(lines) + ">"


def _new_digraph(spec: WorkflowSpec, overlay: RunOverlay | None) -> graphviz.Digraph:
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
            "color": _INK,
            "margin": "0.18,0.07",
        },
        edge_attr={
            "fontname": _FONT,
            "fontsize": "9",
            "color": _SOFT,
            "fontcolor": _INK,
            "arrowsize": "0.7",
        },
    )


def to_dot(spec: WorkflowSpec, *, overlay: RunOverlay | None = None) -> str:
    """The workflow as Graphviz DOT text; the same spec (and overlay) gives the same bytes."""
    g = _new_digraph(spec, overlay)
    g.node(
        _START,
        label="",
        shape="circle",
        style="filled",
        fillcolor=_INK,
        width="0.16",
        fixedsize="true",
    )
    for sid in spec.states:
        g.node(sid, **_state_attrs(spec, sid, overlay))
    entry = {"color": _TAKEN, "penwidth": "2.5"} if overlay is not None and overlay.visits else {}
    g.edge(_START, spec.initial, **entry)
    for source, target, indexes in _edge_groups(spec):
        g.edge(source, target, **_edge_attrs(spec, indexes, overlay))
    with g.subgraph(name="cluster_legend") as legend:
        legend.attr(style="rounded,dashed", color=_DIM, label="", margin="6")
        legend.node(_LEGEND, label=_legend_label(spec, overlay), shape="plaintext")
    for final in spec.final_states():  # keep the legend under the diagram, not beside it
        g.edge(final, _LEGEND, style="invis")
    return str(g.source)


# -- Mermaid ------------------------------------------------------------------------------------

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


def _mermaid_states(spec: WorkflowSpec, overlay: RunOverlay | None) -> list[str]:
    lines = []
    for sid in spec.states:
        parts = _state_hints(spec, sid)
        if overlay is not None and overlay.visits.get(sid):
            parts.append(f"×{overlay.visits[sid]}")
        # one `id : text` line per description line; hint-less states come with their edges
        lines += [f"    {_mid(sid)} : {_mermaid_text(part)}" for part in parts]
    return lines


def _mermaid_edges(spec: WorkflowSpec, overlay: RunOverlay | None) -> list[str]:
    lines = [f"    [*] --> {_mid(spec.initial)}"]
    for index, t in enumerate(spec.transitions):
        label = edge_label(spec, index)
        if overlay is not None and _fired(spec, overlay, index):
            label = f"{label} ×{_fired(spec, overlay, index)}".strip()
            if index == overlay.terminating:
                label += " " + _ended_here(spec, overlay, index)
        arrow = f"    {_mid(t.source)} --> {_mid(t.target)}"
        lines.append(f"{arrow} : {_mermaid_text(label)}" if label else arrow)
    lines += [f"    {_mid(sid)} --> [*]" for sid in spec.final_states()]
    return lines


def _mermaid_overlay(spec: WorkflowSpec, overlay: RunOverlay) -> list[str]:
    lines = [
        "    classDef visited stroke:" + _TAKEN + ",stroke-width:2px",
        "    classDef unvisited stroke:" + _DIM + ",color:" + _DIM,
        "    classDef ended stroke:" + _end_color(overlay) + ",stroke-width:3px",
    ]
    for sid in spec.states:
        if overlay.reason is not None and sid == overlay.last_state:
            kind = "ended"
        else:
            kind = "visited" if overlay.visits.get(sid) else "unvisited"
        lines.append(f"    class {_mid(sid)} {kind}")
    if overlay.last_state in spec.states:
        lines.append(
            f"    note right of {_mid(overlay.last_state)} : {_mermaid_text(_run_summary(overlay))}"
        )
    return lines


def to_mermaid(spec: WorkflowSpec, *, overlay: RunOverlay | None = None) -> str:
    """The workflow as a Mermaid stateDiagram-v2 (deterministic, like `to_dot`)."""
    lines = ["stateDiagram-v2", f"    %% {spec.name}: {_mermaid_text(spec.description)}".rstrip()]
    lines += _mermaid_states(spec, overlay)
    lines += _mermaid_edges(spec, overlay)
    if overlay is not None:
        lines += _mermaid_overlay(spec, overlay)
    lines.append("    %% the kernel may end any run with: " + ", ".join(KERNEL_REASONS))
    return "\n".join(lines) + "\n"


# -- rendering ----------------------------------------------------------------------------------


def render(dot_source: str, fmt: str, out_path: Path) -> Path:
    """Write `dot_source` rendered as `fmt` (svg or png) to `out_path` with the `dot` program.

    Raises:
        ConfigError: an unknown format, no `dot` on PATH, or `dot` failed.
    """
    if fmt not in RENDER_FORMATS:
        raise ConfigError(f"cannot render {fmt!r}: choose one of {', '.join(RENDER_FORMATS)}")
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(DOT_MISSING)
    out_path = Path(out_path)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(  # a fixed program; the DOT text goes to stdin
            [exe, f"-T{fmt}", "-o", str(out_path)],
            input=dot_source.encode("utf-8"),
            capture_output=True,
            check=False,
        )
    except OSError as exc:
        raise ConfigError(f"cannot run dot: {exc}") from exc
    if proc.returncode != 0:
        raise ConfigError(f"dot failed: {_first_line(proc.stderr)}")
    logger.debug("rendered %s", out_path)
    return out_path


def _first_line(stderr: bytes) -> str:
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines()]
    return next((line for line in lines if line), "no error message")
