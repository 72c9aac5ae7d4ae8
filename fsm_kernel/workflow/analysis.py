"""Static analysis of a workflow's graph: the proofs `validate` makes before the first run.

The graph is the one a run moves on: its nodes are the *leaves* (states without children), each
with the edges it tries (its compound ancestors' first, then its catch entries, then its own; see
compound.py); an edge into a compound state lands on the leaves it can enter (its initial entry,
or with `enter: history` any leaf inside it).

- **Every cycle consumes something bounded.** A run may go round a cycle many times, but each
  round must spend something a limit or the outside world bounds: a model call (or a child
  run's, which count against the caller's `max_iterations`), a person's answer, an event or a
  timer, or a declared counter: a variable a `when:` on the cycle reads and an `assign:` on it
  writes. A cycle with none of these can repeat without end (`a → b → a`), burning transitions
  until `limits.max_transitions` stops it: `cycle_errors` reports it.
- **Which termination reasons a run can reach**, with the shortest path to each, and which it
  declares but can never reach (`explain`): the answer to "how can this workflow end?".

Pure functions of the WorkflowSpec (and of which actions call the model, from validate).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.compound import edges_tried
from fsm_kernel.workflow.spec import TransitionSpec, WorkflowSpec

__all__ = [
    "Edge",
    "Explanation",
    "ReasonPath",
    "cycle_errors",
    "explain",
    "graph",
]

KERNEL_REASONS = ("max_iterations", "timeout", "cancelled", "agent_error", "error", "truncated")
"""Reasons the kernel may end any run with, whatever its edges say (limits, failures)."""

WAITING_ACTIONS = frozenset({"human.input"})
"""Built-in actions that wait for a person: a round through them is bounded by that person."""

_VARS = re.compile(r"\bvars\.([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Edge:
    """One way out of a leaf: the declared transition (or catch entry) `index`, from `leaf`
    to the leaf `to` it lands on."""

    index: int
    leaf: str
    to: str
    label: str
    reason: str | None
    final: bool
    """It enters a top-level final state: the run ends (with `reason`)."""
    catch: bool = False


def graph(spec: WorkflowSpec) -> dict[str, list[Edge]]:
    """Each leaf's edges, in the order a run tries them."""
    out: dict[str, list[Edge]] = {}
    for leaf in _leaves(spec):
        edges: list[Edge] = []
        for index in edges_tried(spec, leaf):
            t = spec.transitions[index]
            for to in _landings(spec, t.target, t.enter == "history"):
                edges.append(_edge(spec, index, leaf, to, t.label(), t.reason))
        for c in spec.catch_edges():
            if c.source == leaf:
                for to in _landings(spec, c.target, False):
                    edges.append(_edge(spec, c.index, leaf, to, c.label(), c.reason, catch=True))
        out[leaf] = edges
    return out


def _leaves(spec: WorkflowSpec) -> list[str]:
    """States a run can be in: no children, and not a top-level final state."""
    return [sid for sid, s in spec.states.items() if not s.is_compound and not spec.ends_run(sid)]


def _landings(spec: WorkflowSpec, target: str, history: bool) -> list[str]:
    """The leaves (or the final state) an edge into `target` can land on."""
    if target not in spec.states:
        return []
    if not spec.states[target].is_compound or not history:
        return [spec.entry(target)]
    return [s for s in spec.states if not spec.states[s].is_compound and spec.inside(s, target)]


def _edge(
    spec: WorkflowSpec,
    index: int,
    leaf: str,
    to: str,
    label: str,
    reason: str | None,
    *,
    catch: bool = False,
) -> Edge:
    return Edge(index, leaf, to, label, reason, spec.ends_run(to), catch)


# -- every cycle consumes something ------------------------------------------------------------


def cycle_errors(spec: WorkflowSpec, spends: Mapping[str, bool]) -> list[WorkflowError]:
    """A cycle of leaves that can repeat without consuming anything bounded (see the module
    docstring), reported once per strongly connected part, at its first edge in the file.
    `spends`: whether each state's action calls the model or starts child runs."""
    g = graph(spec)
    free = {leaf: [e for e in edges if _free_edge(spec, e)] for leaf, edges in g.items()}
    free = {leaf: edges for leaf, edges in free.items() if not _consuming_state(spec, leaf, spends)}
    errors: list[WorkflowError] = []
    reported: set[str] = set()
    for leaf in free:  # file order; one report per cycle (its leaves are not started from again)
        if leaf in reported:
            continue
        cycle = _shortest_cycle(free, leaf)
        if cycle is None or _counted(spec, cycle):
            continue
        reported |= {e.leaf for e in cycle}
        first = min(cycle, key=lambda e: e.index)
        names = " → ".join(
            [*(spec.state_path(e.leaf) for e in cycle), spec.state_path(cycle[0].leaf)]
        )
        keys: tuple[Any, ...] = ("transitions", first.index)
        if first.catch:
            catch = spec.catch_edge(first.index)
            keys = ("states", first.leaf, "catch", catch.position if catch else 0)
        errors.append(
            WorkflowValidationError(
                f"{names} can repeat without a model call, a person, an event or a timer "
                "(nothing bounds it but limits.max_transitions): make a state on it call the "
                "model, wait, or count rounds in a variable a `when:` on it checks",
                location=spec.location(*keys) or spec.path,
            )
        )
    return errors


def _consuming_state(spec: WorkflowSpec, leaf: str, spends: Mapping[str, bool]) -> bool:
    """A round through `leaf` spends a model call, a child run or a person's answer, or waits
    (a state without an action whose edges wait for an event or a timer)."""
    state = spec.states[leaf]
    if spends.get(leaf, True) or state.action in WAITING_ACTIONS:
        return True
    if state.action == "tools.execute" and any(t.approval == "required" for t in spec.tools):
        return True  # each call waits for a person's approval
    return not state.action and any(
        t.waits for t in spec.transitions if t.source in (leaf, *spec.ancestors(leaf))
    )


def _free_edge(spec: WorkflowSpec, e: Edge) -> bool:
    """An edge between leaves that costs nothing bounded to take."""
    if e.final or e.to not in spec.states or spec.ends_run(e.to):
        return False
    return not (not e.catch and spec.transitions[e.index].waits)


def _counted(spec: WorkflowSpec, cycle: list[Edge]) -> bool:
    """A `when:` on the cycle reads a variable an `assign:` on it writes: a declared counter
    (`vars.rounds < 3`, `rounds: vars.rounds + 1`) bounds it."""
    read: set[str] = set()
    written: set[str] = set()
    for e in cycle:
        written |= set(spec.states[e.leaf].assign)
        if not e.catch:
            t = spec.transitions[e.index]
            written |= set(t.assign)
            read |= set(_VARS.findall(t.when or ""))
            read |= _reads_of_leaving(spec, e.leaf)
    return bool(read & written)


def _reads_of_leaving(spec: WorkflowSpec, leaf: str) -> set[str]:
    """The variables the `when:`s of every edge `leaf` tries read (an edge that leaves the cycle
    once a counter is high bounds it as well as one on it)."""
    return {
        name
        for i in edges_tried(spec, leaf)
        for name in _VARS.findall(spec.transitions[i].when or "")
    }


def _shortest_cycle(g: Mapping[str, list[Edge]], start: str) -> list[Edge] | None:
    """A shortest cycle through `start` in `g` (breadth first), or None."""
    queue: deque[tuple[str, list[Edge]]] = deque([(start, [])])
    seen = {start}
    while queue:
        node, path = queue.popleft()
        for e in g.get(node, ()):
            if e.to not in g:
                continue
            if e.to == start:
                return [*path, e]
            if e.to not in seen:
                seen.add(e.to)
                queue.append((e.to, [*path, e]))
    return None


# -- how a workflow can end --------------------------------------------------------------------


@dataclass(frozen=True)
class ReasonPath:
    """A shortest way to end a run with `reason`: the states on the way and the edges taken."""

    reason: str
    states: list[str]
    edges: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "path": self.states, "edges": self.edges}


@dataclass
class Explanation:
    """How a workflow's runs can end."""

    workflow: str
    reachable: list[ReasonPath] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    """Reasons the workflow declares (under `reasons:` or on an edge) that no path reaches."""
    unreachable_why: dict[str, str] = field(default_factory=dict)
    kernel: list[str] = field(default_factory=lambda: list(KERNEL_REASONS))

    def to_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "reachable": [r.to_dict() for r in self.reachable],
            "unreachable": [
                {"reason": r, "why": self.unreachable_why.get(r, "")} for r in self.unreachable
            ],
            "kernel": self.kernel,
        }

    def lines(self) -> Iterable[str]:
        yield f"{self.workflow}: how its runs can end"
        for r in self.reachable:
            last = r.edges[-1]
            guard = last[last.index(" [") :] if " [" in last else ""
            yield f"  {r.reason}: {' → '.join(r.states)}{guard}"
        for reason in self.unreachable:
            yield f"  never: {reason} ({self.unreachable_why.get(reason, '')})"
        kernel = ", ".join(self.kernel)
        yield f"  and, whatever its edges say, the kernel may end a run with: {kernel}"


def explain(spec: WorkflowSpec) -> Explanation:
    """Every reason a run of `spec` can end with (its edges into final states), each with a
    shortest path from the initial state; the reasons it declares that no path reaches."""
    g = graph(spec)
    start = spec.entry(spec.initial)
    previous: dict[str, tuple[str, Edge] | None] = {start: None}
    queue: deque[str] = deque([start])
    found: dict[str, ReasonPath] = {}
    while queue:
        leaf = queue.popleft()
        for e in g.get(leaf, ()):
            if e.final:
                reason = e.reason or "final_answer"
                if reason not in found:
                    found[reason] = _path_to(spec, previous, leaf, e)
            elif e.to in g and e.to not in previous:
                previous[e.to] = (leaf, e)
                queue.append(e.to)
    named = _named_reasons(spec)
    out = Explanation(spec.path, list(found.values()))
    for reason in named:
        if reason not in found:
            out.unreachable.append(reason)
            out.unreachable_why[reason] = _why_unreached(spec, reason)
    return out


def _path_to(
    spec: WorkflowSpec, previous: Mapping[str, tuple[str, Edge] | None], leaf: str, last: Edge
) -> ReasonPath:
    edges = [last]
    here = leaf
    while (step := previous.get(here)) is not None:
        here, e = step
        edges.append(e)
    edges.reverse()
    states = [spec.state_path(edges[0].leaf), *(spec.state_path(e.to) for e in edges)]
    labels = [_label(spec, e) for e in edges]
    return ReasonPath(last.reason or "final_answer", states, labels)


def _label(spec: WorkflowSpec, e: Edge) -> str:
    guard = f" [{e.label}]" if e.label else ""
    return f"{spec.state_path(e.leaf)} → {spec.state_path(e.to)}{guard}"


def _named_reasons(spec: WorkflowSpec) -> list[str]:
    """The reasons the workflow names: its edges' and catch entries', then `reasons:`."""
    named = [t.reason for t in spec.transitions if t.reason]
    named += [c.reason for c in spec.catch_edges() if c.reason]
    named += list(spec.reasons)
    return list(dict.fromkeys(str(r) for r in named))


def _why_unreached(spec: WorkflowSpec, reason: str) -> str:
    edges: list[TransitionSpec] = [t for t in spec.transitions if t.reason == reason]
    if not edges and reason in spec.reasons:
        return "declared under reasons:, but no edge ends a run with it"
    sources = ", ".join(dict.fromkeys(t.source for t in edges))
    return f"its edges leave {sources}, which no run reaches"
