"""Static analysis of a workflow's graph: the edges a run can take, shortest paths, the
termination reasons it can reach, and the cycles that could repeat forever.

The graph is the machine as the compiler builds it (see compound.py): its nodes are the states
a run can be in, the leaves (no children, not a top-level final state) and the top-level final
states; from each leaf, an `Edge` for every declared transition tried there (those of the
compound states it is inside first, then its own) and for each of its `catch:` entries, in the
order the kernel tries them, without the edges that can never fire there (after one that always
fires, or guarded by a `completed` that cannot hold there). An edge into a compound state lands
in its initial entry; with `enter: history`, also anywhere its history may return to.

Guards are not evaluated: every edge is taken as possibly firing. So a path here is a sequence
of declared edges a run may follow when the guards on the way hold, and "reachable" means
reachable by some path, whatever the guards' values.

Cycles (`unbounded_cycles`): every cycle a run can follow must consume something bounded, or a
run could spin through it, making no model call and waiting for nothing, until
`limits.max_transitions` stops it. What bounds a cycle:

- a state whose action calls the model (agent.think, agent.decide, a user's action marked
  `calls_model`): each call is an iteration (`limits.max_iterations`), uses tokens
  (`limits.max_tokens`) and is checked against the limits before it is made;
- a state that starts child runs (workflow.call, workflow.map): the kernel checks the run's
  iteration and token limits before starting them, as before a model call, each child is a run
  under its own limits (its workflow passes this check too), and the children's model calls
  count toward the parent's `max_iterations`;
- a state that asks a person (human.input), or an edge that waits for an `event:` or a timer
  (`after:`): the run suspends there until someone or the clock answers;
- an edge whose `when:` stops it once a declared variable reaches a bound (`vars.attempts < 3`),
  when every cycle through it adds a positive number to that variable (`assign: {attempts:
  vars.attempts + 1}`, on an edge or a state of the cycle) and nothing on those cycles sets it
  otherwise.

The built-in limit guards (iteration_limit, budget_exceeded, retries_exhausted) read counters
only model calls move, so a cycle they guard is bounded when it has a model call and not
otherwise; the tool counters (no_progress, tool_failures) move only when tools run, which they
need not do. A state's `retry:` restarts its count each time the state is entered: it bounds
the attempts inside one visit, not a cycle. `workflow_errors` (validate.py) reports each cycle
that is not bounded, at one of its edges.

Imports spec, compound, decide and actions (for what an action does) only.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.actions import BUILTIN_ACTIONS, RefError, resolve_action
from fsm_kernel.workflow.compound import edges_tried, final_child_of, leaves
from fsm_kernel.workflow.decide import decides
from fsm_kernel.workflow.spec import (
    COMPLETED,
    SourceLocation,
    TerminationReason,
    TransitionSpec,
    WorkflowSpec,
)

__all__ = [
    "Cycle",
    "Edge",
    "Explanation",
    "Graph",
    "ReasonPath",
    "bounding_states",
    "cycle_errors",
    "edge_graph",
    "explain",
    "kernel_reasons",
    "reason_paths",
    "shortest_path",
    "shortest_paths",
    "unbounded_cycles",
    "unreached_reasons",
]

WAITING_ACTIONS = frozenset({"human.input"})
"""Built-in actions that wait for a person's answer (the run suspends until it comes)."""


@dataclass(frozen=True)
class Edge:
    """One way out of a leaf: a declared transition or catch entry, as tried in `source`."""

    index: int
    """The edge's number as `transition.taken` records it: declared transitions first, then
    catch entries (see WorkflowSpec.catch_edges)."""
    kind: Literal["transition", "catch"]
    source: str
    """The leaf the run is in when it takes the edge."""
    target: str
    """Where the run lands: a leaf, or a top-level final state."""
    declared_source: str
    """The state the edge is declared on: `source`, or a compound state it is inside."""
    declared_target: str
    """The edge's `target:` as written (a compound state's entry is `target`)."""
    label: str
    """Its conditions as the diagram shows them (`has_tool_calls`, `catch error`, `after 1h`)."""
    reason: str | None = None
    """The termination reason, on an edge into a top-level final state."""
    waits: bool = False
    """It fires on a named event or a timer (its source is a waiting state)."""
    history: bool = False
    """A landing through `enter: history` other than the target's initial entry."""
    location: SourceLocation | None = None
    """Where the edge is declared (the transition, or the catch entry)."""

    def to_dict(self, spec: WorkflowSpec) -> dict[str, Any]:
        """The edge as `validate --explain --json` gives it (states by their full paths)."""
        loc = self.location
        return {
            "index": self.index,
            "kind": self.kind,
            "from": spec.state_path(self.source),
            "to": spec.state_path(self.target),
            "source": self.declared_source,
            "target": self.declared_target,
            "history": self.history,
            "label": self.label,
            "reason": self.reason,
            "line": loc.line if loc is not None else None,
            "col": loc.col if loc is not None else None,
        }


@dataclass(frozen=True)
class Graph:
    """The machine's states a run can be in and the edges between them (see the module
    docstring)."""

    spec: WorkflowSpec
    initial: str
    """The leaf a run starts in (the entry of the workflow's `initial`)."""
    nodes: tuple[str, ...]
    """Leaves, then top-level final states, in file order."""
    edges: tuple[Edge, ...]
    """Every edge, by source in file order, each source's in the order the kernel tries them."""
    _out: dict[str, list[Edge]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for edge in self.edges:
            self._out.setdefault(edge.source, []).append(edge)

    def out_edges(self, node: str) -> list[Edge]:
        """The edges out of `node`, in the order the kernel tries them."""
        return list(self._out.get(node, []))


def edge_graph(spec: WorkflowSpec) -> Graph:
    """The graph of `spec`, whose states and edge targets must all be declared (what
    validate's structural checks ensure; unknown targets are left out)."""
    catches: dict[str, list[Edge]] = {}
    for c in spec.catch_edges():
        if c.target in spec.states:
            where = spec.location("states", c.source, "catch", c.position)
            catches.setdefault(c.source, []).append(
                Edge(
                    c.index, "catch", c.source, spec.entry(c.target), c.source, c.target,
                    c.label(), c.reason, location=where,
                )
            )  # fmt: skip
    edges: list[Edge] = []
    for leaf in leaves(spec):
        edges += _leaf_edges(spec, leaf, catches.get(leaf, []))
    nodes = (*leaves(spec), *spec.final_states())
    return Graph(spec, spec.entry(spec.initial), nodes, tuple(edges))


def _leaf_edges(spec: WorkflowSpec, leaf: str, catches: list[Edge]) -> list[Edge]:
    """The edges that can fire in `leaf`, in the order it tries them (catch entries before its
    own transitions), up to the first that always fires."""
    out: list[Edge] = []
    tried = [i for i in edges_tried(spec, leaf) if spec.transitions[i].target in spec.states]
    own = [i for i in tried if spec.transitions[i].source == leaf]
    for i in tried:
        if own and i == own[0]:
            out += catches
            catches = []
        t = spec.transitions[i]
        if _never(spec, t, leaf):
            continue
        out += _landings(spec, leaf, i, t)
        if _always(spec, t, leaf):
            return out
    return out + catches


def _always(spec: WorkflowSpec, t: TransitionSpec, leaf: str) -> bool:
    """The edge fires whenever it is tried in `leaf` (as compound.py judges it)."""
    if not t.is_guarded:
        return not decides(spec, t.source)
    return t.guard == [COMPLETED] and not t.unless and final_child_of(spec, leaf, t.source)


def _never(spec: WorkflowSpec, t: TransitionSpec, leaf: str) -> bool:
    """The edge cannot fire in `leaf`: its `completed` cannot hold there, or one name is both
    its guard and its unless."""
    done = final_child_of(spec, leaf, t.source)
    completed = (COMPLETED in t.guard and not done) or (COMPLETED in t.unless and done)
    return completed or bool(set(t.guard) & set(t.unless))


def _landings(spec: WorkflowSpec, leaf: str, i: int, t: TransitionSpec) -> list[Edge]:
    """Declared edge `i` out of `leaf`, once per state it may land in."""
    where = spec.location("transitions", i)
    first = spec.entry(t.target)
    out = [
        Edge(
            i, "transition", leaf, first, t.source, t.target, t.label(), t.reason, t.waits,
            location=where,
        )
    ]  # fmt: skip
    for other in _history_landings(spec, t):
        if other != first:
            out.append(
                Edge(
                    i, "transition", leaf, other, t.source, t.target, t.label(), t.reason,
                    t.waits, history=True, location=where,
                )
            )  # fmt: skip
    return out


def _history_landings(spec: WorkflowSpec, t: TransitionSpec) -> list[str]:
    """Where `enter: history` into `t.target` may return: with `deep`, any leaf inside it;
    with `shallow`, the entry of any of its children."""
    target = spec.states[t.target]
    if t.enter != "history" or target.history is None:
        return []
    inside = [sid for sid in spec.states if sid != t.target and spec.inside(sid, t.target)]
    if target.history == "deep":
        return [sid for sid in inside if not spec.states[sid].is_compound]
    return [spec.entry(sid) for sid in inside if spec.parent(sid) == t.target]


# --- paths --------------------------------------------------------------------------------


def shortest_paths(graph: Graph, start: str | None = None) -> dict[str, list[Edge]]:
    """For every node reachable from `start` (default: the initial leaf), the shortest list of
    edges that leads there (breadth first, edges in the order they are tried; [] for `start`).
    """
    begin = graph.initial if start is None else start
    paths: dict[str, list[Edge]] = {begin: []}
    queue = deque([begin])
    while queue:
        here = queue.popleft()
        for edge in graph.out_edges(here):
            if edge.target not in paths:
                paths[edge.target] = [*paths[here], edge]
                queue.append(edge.target)
    return paths


def shortest_path(
    graph: Graph, goal: Callable[[Edge], bool], start: str | None = None
) -> list[Edge] | None:
    """The shortest path from `start` (default: the initial leaf) whose last edge satisfies
    `goal` (e.g. `lambda e: e.index == 7`: a path that takes edge 7), or None when no edge
    that satisfies it is reachable. Of equally short ones, the first found (edges in the order
    they are tried)."""
    paths = shortest_paths(graph, start)
    best: list[Edge] | None = None
    for node in graph.nodes:
        if node not in paths:
            continue
        for edge in graph.out_edges(node):
            if goal(edge) and (best is None or len(paths[node]) + 1 < len(best)):
                best = [*paths[node], edge]
    return best


@dataclass(frozen=True)
class ReasonPath:
    """A termination reason a run can end for, with the shortest path that ends for it."""

    reason: str
    success: bool
    edges: tuple[Edge, ...]

    def states(self, spec: WorkflowSpec) -> list[str]:
        """The states the path goes through, by their full paths, its first and last included."""
        if not self.edges:
            return []
        return [spec.state_path(self.edges[0].source)] + [
            spec.state_path(e.target) for e in self.edges
        ]

    def to_dict(self, spec: WorkflowSpec) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "success": self.success,
            "states": self.states(spec),
            "edges": [e.to_dict(spec) for e in self.edges],
        }


def reason_paths(graph: Graph) -> list[ReasonPath]:
    """Every termination reason some reachable edge ends the run with, each with its shortest
    path, in order of the first edge (in file order) that names it."""
    spec = graph.spec
    named: dict[str, int] = {}
    for edge in sorted(graph.edges, key=lambda e: e.index):
        if edge.reason is not None:
            named.setdefault(edge.reason, edge.index)
    out: list[ReasonPath] = []
    for reason in named:
        path = shortest_path(graph, _ends_for(reason))
        if path is not None:
            out.append(ReasonPath(reason, spec.is_success(reason), tuple(path)))
    return out


def _ends_for(reason: str) -> Callable[[Edge], bool]:
    return lambda edge: edge.reason == reason


def unreached_reasons(graph: Graph) -> dict[str, list[tuple[int, SourceLocation | None]]]:
    """The reasons the workflow declares (`reasons:`) or its edges name that no run can end
    for through an edge, each with the edges that name it (index and place; none for a
    declared reason no edge names), in file order."""
    spec = graph.spec
    reached = {r.reason for r in reason_paths(graph)}
    naming: dict[str, list[tuple[int, SourceLocation | None]]] = {}
    for i, t in enumerate(spec.transitions):
        if t.reason is not None:
            naming.setdefault(t.reason, []).append((i, spec.location("transitions", i)))
    for c in spec.catch_edges():
        if c.reason is not None:
            where = spec.location("states", c.source, "catch", c.position)
            naming.setdefault(c.reason, []).append((c.index, where))
    for name in spec.reasons:
        naming.setdefault(name, [])
    return {name: edges for name, edges in naming.items() if name not in reached}


def kernel_reasons(graph: Graph, *, import_code: bool = True) -> dict[str, str]:
    """The built-in reasons the kernel itself may end a run of this workflow with, whatever its
    edges say, with when, by name (`import_code`: as for `bounding_states`)."""
    spec = graph.spec
    reachable = [s for s in shortest_paths(graph) if s in spec.states]
    actions = {spec.states[s].action for s in reachable}
    thinks = any(_calls_model(spec, s, import_code) for s in reachable)
    limits = spec.limits
    R = TerminationReason
    out: dict[str, str] = {
        R.CANCELLED: "the run is cancelled (Ctrl-C, runs cancel)",
        R.ERROR: "an action raises (a bug) where no catch: handles it",
        R.NO_PROGRESS: f"after {limits.max_transitions} transitions (limits.max_transitions)",
    }
    if limits.timeout_seconds:
        out[R.TIMEOUT] = f"the run takes longer than {limits.timeout_seconds:g}s (limits)"
    if not thinks:
        return dict(sorted(out.items()))
    out[R.AGENT_ERROR] = "the model server fails after retries, where no catch: handles it"
    out[R.MALFORMED_OUTPUT] = (
        f"before a model call, after {limits.max_malformed_outputs} malformed replies in a row "
        "(limits.max_malformed_outputs)"
    )
    if limits.max_iterations:
        out[R.MAX_ITERATIONS] = (
            f"before a model call, once limits.max_iterations ({limits.max_iterations}) is reached"
        )
    if limits.max_tokens:
        out[R.BUDGET_EXCEEDED] = f"once model calls used {limits.max_tokens} tokens (limits)"
    if "tools.execute" in actions:
        out[R.TOOL_FAILURES] = (
            f"before a model call, after {limits.max_tool_failures} failed tool calls in a row "
            "(limits.max_tool_failures)"
        )
        out[R.NO_PROGRESS] += (
            f", or before a model call, after one tool call {limits.no_progress_repeats} times "
            "in a row (limits.no_progress_repeats)"
        )
        out[R.FATAL_TOOL_ERROR] = "before a model call, once a tool failed fatally"
    if spec.success_reasons() & {r.reason for r in reason_paths(graph)}:
        out[R.TRUNCATED] = "instead of a success reason, when the last reply was cut off"
    return dict(sorted(out.items()))


# --- cycles -------------------------------------------------------------------------------


def _calls_model(spec: WorkflowSpec, sid: str, import_code: bool = True) -> bool:
    action = spec.states[sid].action
    if action is None:
        return False
    if action in BUILTIN_ACTIONS:
        return BUILTIN_ACTIONS[action].calls_model
    if not import_code:
        return True  # not imported: taken at its word (a run imports and checks it)
    try:
        return resolve_action(action).calls_model
    except RefError:
        return True  # reported by validate's reference check


def bounding_states(spec: WorkflowSpec, *, import_code: bool = True) -> dict[str, str]:
    """The states that bound any cycle through them, each with what bounds it: `model call`,
    `child runs` or `a person's answer`. Without `import_code`, a user's action is not
    imported and is taken to call the model (as validate does not check it then either)."""
    out: dict[str, str] = {}
    for sid, state in spec.states.items():
        action = BUILTIN_ACTIONS.get(state.action or "")
        if _calls_model(spec, sid, import_code):
            out[sid] = "model call"
        elif action is not None and action.starts_children:
            out[sid] = "child runs"
        elif state.action in WAITING_ACTIONS:
            out[sid] = "a person's answer"
    return out


@dataclass(frozen=True)
class Cycle:
    """A cycle of the graph nothing bounds: its edges in order, the last back to the first's
    source."""

    edges: tuple[Edge, ...]

    def states(self, spec: WorkflowSpec) -> list[str]:
        """The states it goes through by their full paths, the first again at the end."""
        return [spec.state_path(self.edges[0].source)] + [
            spec.state_path(e.target) for e in self.edges
        ]

    def text(self, spec: WorkflowSpec) -> str:
        """`a → b → a`."""
        return " → ".join(self.states(spec))


_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_BOUND = re.compile(
    rf"^\s*vars\.([A-Za-z_]\w*)\s*<=?\s*{_NUMBER}\s*$|^\s*{_NUMBER}\s*>=?\s*vars\.([A-Za-z_]\w*)\s*$"
)
_STEP = r"^\s*vars\.{name}\s*\+\s*[0-9]*[1-9][0-9]*(\.[0-9]+)?\s*$"


def unbounded_cycles(
    graph: Graph, bounding: Iterable[str] | None = None, *, import_code: bool = True
) -> list[Cycle]:
    """One shortest cycle for each strongly connected part of the graph, reachable from the
    initial leaf, whose cycles are not all bounded (see the module docstring), in file order of
    their first edge. `bounding`: the states that bound a cycle (default `bounding_states`)."""
    spec = graph.spec
    stops = set(bounding_states(spec, import_code=import_code) if bounding is None else bounding)
    reachable = set(shortest_paths(graph))
    edges = [
        e
        for e in graph.edges
        if e.source in reachable and not e.waits
        if e.source not in stops and e.target not in stops
    ]
    edges = _drop_counted(spec, edges)
    out = [
        _shortest_cycle(spec, part, edges) for part in _components(edges) if _cyclic(part, edges)
    ]
    return sorted(out, key=lambda c: min(e.index for e in c.edges))


def _drop_counted(spec: WorkflowSpec, edges: list[Edge]) -> list[Edge]:
    """`edges` without those a counter bounds: a `when:` that bounds a variable from above, on
    an edge every cycle through which adds to that variable and sets it no other way. Repeated
    until nothing changes (dropping one may break the cycles that kept another)."""
    while True:
        kept = [e for e in edges if not _counted(spec, e, edges)]
        if len(kept) == len(edges):
            return edges
        edges = kept


def _counted(spec: WorkflowSpec, edge: Edge, edges: list[Edge]) -> bool:
    """Every cycle through `edge` (of those `edges` make) adds to the variable its `when:`
    bounds, and none sets it another way."""
    name = _counter(spec, edge)
    if name is None:
        return False
    part = next(p for p in _components(edges) if edge.source in p)
    adds = _adders(spec, name, part, edges)
    if adds is None:
        return False
    steps, states = adds
    if id(edge) in steps or edge.source in states or edge.target in states:
        return True  # the edge itself, or a state every cycle through it enters, adds
    rest = [e for e in edges if id(e) not in steps and not {e.source, e.target} & states]
    return edge.source not in _reach(edge.target, rest)


def _counter(spec: WorkflowSpec, edge: Edge) -> str | None:
    """The variable `edge`'s `when:` bounds from above by a number (`vars.attempts < 3`),
    when that is all its `when:` says."""
    when = spec.transitions[edge.index].when if edge.kind == "transition" else None
    match = _BOUND.match(when or "")
    return None if match is None else match.group(1) or match.group(2)


def _adders(
    spec: WorkflowSpec, name: str, part: set[str], edges: Sequence[Edge]
) -> tuple[set[int], set[str]] | None:
    """The edges (by id) and states inside `part` that add a positive number to variable
    `name`; None when something inside `part` sets it another way."""
    step = re.compile(_STEP.format(name=re.escape(name)))
    found: set[int] = set()
    for e in edges:
        value = _assigns(spec, e, name) if e.source in part and e.target in part else None
        if value is not None and not step.match(value):
            return None
        if value is not None:
            found.add(id(e))
    states = {s for s in part if name in spec.states[s].assign}
    if any(not step.match(spec.states[s].assign[name]) for s in states):
        return None
    return found, states


def _assigns(spec: WorkflowSpec, edge: Edge, name: str) -> str | None:
    """What `edge` assigns to `name`, if anything (catch edges assign nothing)."""
    if edge.kind != "transition":
        return None
    return spec.transitions[edge.index].assign.get(name)


def _reach(start: str, edges: Sequence[Edge]) -> set[str]:
    seen, queue = {start}, deque([start])
    while queue:
        here = queue.popleft()
        for e in edges:
            if e.source == here and e.target not in seen:
                seen.add(e.target)
                queue.append(e.target)
    return seen


def _components(edges: Sequence[Edge]) -> list[set[str]]:
    """The strongly connected parts of the graph `edges` make (each node with a part of its
    own when on no cycle), by mutual reachability: the graphs are a workflow's, small."""
    nodes = list(dict.fromkeys(n for e in edges for n in (e.source, e.target)))
    forward = {n: _reach(n, edges) for n in nodes}
    parts: list[set[str]] = []
    for n in nodes:
        if not any(n in p for p in parts):
            parts.append({m for m in forward[n] if n in forward[m]})
    return parts


def _cyclic(part: set[str], edges: Sequence[Edge]) -> bool:
    return len(part) > 1 or any(e.source == e.target and e.source in part for e in edges)


def _shortest_cycle(spec: WorkflowSpec, part: set[str], edges: Sequence[Edge]) -> Cycle:
    """A shortest cycle inside `part` that no counter bounds: through each edge in file order,
    the shortest way back (through a counter's edge, avoiding what adds to the counter); the
    shortest of those found when each is bounded (of equally short ones, the first found)."""
    inside = [e for e in edges if e.source in part and e.target in part]
    best: list[Edge] | None = None
    fallback: list[Edge] | None = None
    for first in sorted(inside, key=lambda e: e.index):
        name = _counter(spec, first)
        adds = _adders(spec, name, part, inside) if name is not None else None
        skip = adds[0] if adds is not None else set()
        back = _path(first.target, first.source, [e for e in inside if id(e) not in skip])
        if back is None:
            continue
        cycle = [first, *back]
        if fallback is None or len(cycle) < len(fallback):
            fallback = cycle
        if not _counts(spec, cycle) and (best is None or len(cycle) < len(best)):
            best = cycle
    chosen = best or fallback
    assert chosen is not None  # a cyclic part has a cycle
    return Cycle(tuple(chosen))


def _counts(spec: WorkflowSpec, cycle: Sequence[Edge]) -> bool:
    """Some edge of `cycle` bounds a variable an edge or a state of the cycle adds to."""
    for edge in cycle:
        name = _counter(spec, edge)
        if name is None:
            continue
        step = re.compile(_STEP.format(name=re.escape(name)))
        values = [_assigns(spec, e, name) for e in cycle]
        values += [spec.states[e.target].assign.get(name) for e in cycle]
        if any(v is not None and step.match(v) for v in values):
            return True
    return False


def _path(start: str, goal: str, edges: Sequence[Edge]) -> list[Edge] | None:
    paths: dict[str, list[Edge]] = {start: []}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            return paths[here]
        for e in edges:
            if e.source == here and e.target not in paths:
                paths[e.target] = [*paths[here], e]
                queue.append(e.target)
    return None


def cycle_errors(spec: WorkflowSpec, *, import_code: bool = True) -> list[WorkflowError]:
    """Each unbounded cycle as a validate error, at the edge of the cycle first in the file:
    `a → b → a can repeat without a model call, a limit or a timer`."""
    out: list[WorkflowError] = []
    for cycle in unbounded_cycles(edge_graph(spec), import_code=import_code):
        first = min(range(len(cycle.edges)), key=lambda k: cycle.edges[k].index)
        turned = Cycle(cycle.edges[first:] + cycle.edges[:first])
        where = turned.edges[0].location
        out.append(
            WorkflowValidationError(
                f"{turned.text(spec)} can repeat without a model call, a limit or a timer: "
                "give the cycle a state that calls the model, an edge that waits (event: or "
                "after:), or a counter (when: vars.n < 3 with assign: {n: vars.n + 1})",
                location=where or spec.path,
            )
        )
    return out


# --- the explanation ----------------------------------------------------------------------


@dataclass(frozen=True)
class Explanation:
    """What `validate --explain` says of a valid workflow."""

    spec: WorkflowSpec
    reached: tuple[ReasonPath, ...]
    """Every reason an edge can end a run with, with its shortest path."""
    unreached: dict[str, list[tuple[int, SourceLocation | None]]]
    """Reasons declared or named on edges that no edge can end a run with."""
    kernel: dict[str, str]
    """Built-in reasons the kernel may end a run with whatever the edges say, with when."""

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "initial": spec.state_path(spec.entry(spec.initial)),
            "reached": [r.to_dict(spec) for r in self.reached],
            "unreached": [
                {
                    "reason": name,
                    "declared": name in spec.reasons,
                    "edges": [_edge_ref(i, loc) for i, loc in edges],
                }
                for name, edges in self.unreached.items()
            ],
            "kernel": [{"reason": r, "when": when} for r, when in self.kernel.items()],
        }

    def lines(self) -> list[str]:
        """The explanation as the terminal shows it."""
        spec = self.spec
        start = spec.state_path(spec.entry(spec.initial))
        out = [f"termination reasons reached (shortest path from {start}):"]
        width = max((len(r.reason) for r in self.reached), default=0)
        for r in self.reached:
            mark = "success" if r.success else "failure"
            out.append(f"  {r.reason:<{width}}  {mark}  {_path_text(spec, r.edges)}")
        if self.unreached:
            out.append("never reached:")
        for name, edges in self.unreached.items():
            what = "declared under reasons:" if name in spec.reasons else "built-in"
            named = ", ".join(str(loc) if loc else f"edge {i}" for i, loc in edges)
            out.append(f"  {name}  ({what}; " + (f"named at {named})" if named else "no edge)"))
        out.append("the kernel may also end a run, whatever the edges say, with:")
        width = max(len(r) for r in self.kernel)
        out += [f"  {r:<{width}}  {when}" for r, when in self.kernel.items()]
        return out


def _edge_ref(index: int, loc: SourceLocation | None) -> dict[str, Any]:
    return {
        "index": index,
        "line": loc.line if loc is not None else None,
        "col": loc.col if loc is not None else None,
    }


def _path_text(spec: WorkflowSpec, edges: Sequence[Edge]) -> str:
    """`observe → think →[has_tool_calls] act`: the states, each edge's conditions in brackets."""
    if not edges:
        return ""
    parts = [spec.state_path(edges[0].source)]
    for e in edges:
        arrow = f"→[{e.label}]" if e.label else "→"
        parts.append(f"{arrow} {spec.state_path(e.target)}")
    return " ".join(parts)


def explain(spec: WorkflowSpec, *, import_code: bool = True) -> Explanation:
    """The termination reasons of a valid workflow: those its edges reach, each by its
    shortest path; those it declares or names but never reaches; those the kernel may end any
    run with."""
    graph = edge_graph(spec)
    return Explanation(
        spec,
        tuple(reason_paths(graph)),
        unreached_reasons(graph),
        kernel_reasons(graph, import_code=import_code),
    )
