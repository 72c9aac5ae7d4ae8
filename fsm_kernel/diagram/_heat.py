"""How the heat overlay (many runs of a workflow, added up) is drawn in DOT: each edge as thick
and as warm as it is often taken, states with their visits and tokens, never-taken edges grey.
Attributes only; _dot builds the graph.
"""

from __future__ import annotations

from fsm_kernel.diagram._labels import DIM, INK, edge_label
from fsm_kernel.diagram._overlay import NOT_ENDED, HeatOverlay
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["edge_row", "edges_attrs", "legend_rows", "state_attrs", "state_lines", "title_line"]

_COOL = (0x93, 0xC5, 0xFD)
"""The colour of an edge taken once in a long while (light blue)."""
_WARM = (0xDC, 0x26, 0x26)
"""The colour of the edge taken most (red)."""


def color(heat: float) -> str:
    """The colour between cool (heat 0) and warm (heat 1)."""
    mix = [round(c + (w - c) * heat) for c, w in zip(_COOL, _WARM, strict=True)]
    return "#" + "".join(f"{v:02x}" for v in mix)


def _pen(heat: float) -> str:
    return f"{1.2 + 4.0 * heat:.1f}"


def edge_row(spec: WorkflowSpec, index: int, heat: HeatOverlay) -> tuple[str, str]:
    """(text, colour) of one edge's line: its label, `×n` when taken."""
    count = heat.traversals.get(index, 0)
    text = edge_label(spec, index)
    if not count:
        return text, DIM
    return f"{text}  ×{count}".strip(), color(heat.heat(index))


def edges_attrs(indexes: list[int], heat: HeatOverlay) -> dict[str, str]:
    """The line of the edges drawn as one: as warm and thick as the most taken of them."""
    hottest = max(heat.heat(i) for i in indexes)
    if not any(heat.traversals.get(i) for i in indexes):
        return {"color": DIM, "style": "dashed"}
    return {"color": color(hottest), "penwidth": _pen(hottest)}


def state_lines(sid: str, heat: HeatOverlay) -> tuple[str, list[str]]:
    """(title, extra lines) of a state: `think  ×12`, `4,210 tokens`."""
    visits = heat.visits.get(sid, 0)
    lines = [f"{heat.tokens[sid]:,} tokens"] if heat.tokens.get(sid) else []
    return (f"{sid}  ×{visits}" if visits else sid), lines


def state_attrs(sid: str, heat: HeatOverlay) -> dict[str, str]:
    if not heat.visits.get(sid):
        return {"color": DIM}
    return {"color": INK, "penwidth": "1.5"}


def title_line(heat: HeatOverlay) -> str:
    """`12 runs: final_answer 10, max_iterations 1, (not ended) 1`."""
    ended = sorted(heat.reasons.items(), key=lambda kv: (-kv[1], kv[0] == NOT_ENDED, kv[0]))
    reasons = ", ".join(f"{reason} {n}" for reason, n in ended)
    runs = f"{heat.runs} run{'s' if heat.runs != 1 else ''}"
    return f"{runs}: {reasons}" if reasons else runs


def legend_rows(heat: HeatOverlay) -> list[str]:
    rows = [
        "×n: times a state was entered / an edge fired, over all the runs",
        f"colour and width: how often an edge fired, from light blue (rarely) to red (most, "
        f"×{max(heat.traversals.values(), default=0)})",
        "grey, dashed: an edge no run took; grey state: never entered",
        "tokens: what the model used in the state (prompt + completion)",
    ]
    if heat.unmatched:
        rows.append(
            f"{heat.unmatched} recorded transitions match no edge here (another version): not drawn"
        )
    return rows
