"""Labels and colours the DOT and Mermaid renderers share: edge labels, state hints, the run
summary and the kernel's own termination reasons. Pure text; no graphviz.
"""

from __future__ import annotations

from dataclasses import replace

from fsm_kernel.diagram._overlay import RunOverlay
from fsm_kernel.workflow.children import DEFAULT_CONCURRENCY
from fsm_kernel.workflow.spec import (
    SUCCESS_REASONS,
    RetrySpec,
    StateSpec,
    TransitionSpec,
    WorkflowSpec,
)

__all__ = [
    "CAUGHT",
    "DIM",
    "FAILED",
    "HINT_MAX",
    "INK",
    "KERNEL_REASONS",
    "SOFT",
    "SUCCEEDED",
    "TAKEN",
    "edge_end",
    "edge_label",
    "end_color",
    "ended_here",
    "run_summary",
    "short",
    "state_hints",
]

KERNEL_REASONS: tuple[str, ...] = (
    "max_iterations",
    "budget_exceeded",
    "tool_failures",
    "no_progress",
    "fatal_tool_error",
    "malformed_output",
    "timeout",
    "cancelled",
    "agent_error",
    "error",
    "truncated",
)
"""Reasons the kernel itself may end any run with, whatever the transitions say: the limits
(max_iterations, budget_exceeded, tool_failures, no_progress (also limits.max_transitions),
fatal_tool_error, malformed_output), which a workflow's own edge may end the run for first;
the clock, the user, the server and bugs; and truncated: an edge ending with a success reason
fired while the last model reply was cut off by its length limit."""

INK = "#1f2933"
SOFT = "#52606d"
DIM = "#b8c2cc"
TAKEN = "#1d4ed8"
FAILED = "#c0392b"
SUCCEEDED = "#15803d"
CAUGHT = "#b45309"
"""Catch edges: drawn dashed in this colour."""
HINT_MAX = 40


def edge_end(spec: WorkflowSpec, index: int) -> tuple[str, str, str | None]:
    """(source, target, reason) of edge `index`: a declared transition or a catch edge."""
    edge = spec.catch_edge(index)
    if edge is not None:
        return edge.source, edge.target, edge.reason
    t = spec.transitions[index]
    return t.source, t.target, t.reason


def _condition(spec: WorkflowSpec, t: TransitionSpec) -> str:
    """The guard text, `else` for an unguarded fallback, "" for a source's only, unguarded edge."""
    if t.is_guarded:
        return t.label()
    siblings = spec.transitions_from(t.source)
    return "else" if any(other.is_guarded for _, other in siblings) else ""


def _order(spec: WorkflowSpec, index: int) -> int | None:
    """The number of transition `index`: its 1-based place in the workflow's `transitions:`,
    so no two edges share one (numbered per state, `execute → replan` and `replan → execute`
    were both "3. [else]") and a state's edges, tried in file order, still read in number
    order; None when it is its state's only edge (there is no order to tell)."""
    siblings = spec.transitions_from(spec.transitions[index].source)
    return index + 1 if len(siblings) > 1 else None


def edge_label(spec: WorkflowSpec, index: int) -> str:
    """One line: `3. [malformed_output and not retries_exhausted]`, `[done_called] → done`;
    `catch agent_error` for a catch edge (tried before the others, when the action failed)."""
    edge = spec.catch_edge(index)
    if edge is not None:
        end = f" → {edge.reason}" if edge.reason else ""
        return f"{edge.label()}{end}"
    t = spec.transitions[index]
    condition = _condition(spec, t)
    parts = []
    order = _order(spec, index)
    if order is not None:
        parts.append(f"{order}.")
    if t.choice is not None:  # the model's pick: its text, then the guards it is offered under
        parts.append(f"“{t.choice}”")
        condition = t.model_copy(update={"choice": None}).label()
    if condition:
        parts.append(f"[{condition}]")
    if spec.ends_run(t.target):
        parts.append(f"→ {t.reason or 'final_answer'}")
    if t.assign:  # UML's effect: [guard] / what taking the edge does
        parts.append(f"/ {_assign_hint(t.assign)}")
    return " ".join(parts)


def _assign_hint(assign: dict[str, str]) -> str:
    """`attempts = vars.attempts + 1; plan = output.steps`, shortened to one hint line."""
    return short("; ".join(f"{name} = {text}" for name, text in assign.items()), HINT_MAX)


def short(text: str, limit: int = HINT_MAX) -> str:
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
        if shown and len("tools: " + ", ".join([*shown, name])) > HINT_MAX - 3:
            break
        shown.append(name)
    rest = len(names) - len(shown)
    return "tools: " + ", ".join(shown) + (f" +{rest}" if rest else "")


def state_hints(spec: WorkflowSpec, sid: str) -> list[str]:
    """The lines under a state's id: its action, prompt and tools."""
    state = spec.states[sid]
    lines = []
    if state.action:
        lines.append(state.action)
    if state.workflow:
        lines.append(_call_hint(state))
    if state.prompt:
        lines.append(f'prompt: "{short(state.prompt, HINT_MAX - 10)}"')
    if state.tools is not None:
        lines.append(_tools_hint(state.tools))
    if not state.answer:
        lines.append("answer: false")
    if state.agent is not None and state.agent.model:
        lines.append(f"model: {short(state.agent.model, HINT_MAX - 7)}")
    if state.retry is not None:
        lines.append(_retry_hint(state.retry))
    if state.assign:
        lines.append(f"/ {_assign_hint(state.assign)}")
    return lines


def _call_hint(state: StateSpec) -> str:
    """`⇢ react` (a call), `⇢ react × output.steps, 3 at once` (a map)."""
    if state.action != "workflow.map":
        return f"⇢ {short(str(state.workflow), HINT_MAX - 2)}"
    at_once = state.max_concurrency or DEFAULT_CONCURRENCY
    text = f"⇢ {state.workflow} × {state.items}, {at_once} at once"
    if state.fail_fast:
        text += ", fail fast"
    return short(text, HINT_MAX)


def _retry_hint(retry: RetrySpec) -> str:
    """`retry agent_error: 3×, backoff 1s` (up to 3 retries, the first after 1 s)."""
    what = "" if retry.error == "any" else f" {retry.error}"
    return f"retry{what}: {retry.max_attempts}×, backoff {retry.backoff_seconds:g}s"


def end_color(overlay: RunOverlay) -> str:
    return SUCCEEDED if overlay.reason in SUCCESS_REASONS else FAILED


def run_summary(overlay: RunOverlay) -> str:
    """`run 0190ab12: done after 7 transitions` (or why and where the kernel stopped it)."""
    steps = f"{len(overlay.path)} transition{'s' if len(overlay.path) != 1 else ''}"
    who = f"run {overlay.run_id}" if overlay.run_id else "run"  # a prefix is not unique
    overlay = replace(overlay, last_state=overlay.last_path or overlay.last_state)  # full path
    if overlay.waiting:
        return f"{who}: waiting for a person in {overlay.last_state} after {steps}"
    if overlay.reason is None:
        return f"{who}: not terminated (in flight or killed) after {steps}, in {overlay.last_state}"
    if overlay.ended_by_kernel:
        where = f" in {overlay.last_state}" if overlay.last_state else ""
        return f"{who}: ended by the kernel{where}: {overlay.reason} after {steps}"
    return f"{who}: {overlay.reason} after {steps}"


def ended_here(spec: WorkflowSpec, overlay: RunOverlay, index: int) -> str:
    """The mark on the edge that ended the run, with the run's reason when it is not the edge's
    (the kernel turned a cut-off final_answer into truncated)."""
    if overlay.reason == edge_end(spec, index)[2]:
        return "■ ended here"
    return f"■ ended here: {overlay.reason}"
