"""Compound states: which edges a state tries, in what order, and the checks that follow.

A state with `initial:` and `states:` is compound: the run is never in it alone but always in a
state without children inside it (a *leaf*). An edge whose source is a compound state applies in
every leaf inside it, and the edges of the states a leaf is inside are tried **before** its own:
outermost first, each state's in file order, then the leaf's catch edges, then its own edges.
That is the priority of Harel's STATEMATE semantics (the outer state's transition wins), not
UML's or SCXML's (the innermost state's wins): it is what lets one edge declared on a parent, a
limit, an escalation or a cancel, take effect from every state inside it, whatever the children
declare. The rule makes some edges unreachable; `fallback_errors` reports them.

The built-in guard `completed`, on an edge out of a compound state, holds when the run is in one
of that state's final children. So whether it holds in a leaf is known from the leaf alone.

Pure functions of the WorkflowSpec: validate.py and compiler.py both use them.
"""

from __future__ import annotations

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.decide import decides
from fsm_kernel.workflow.spec import COMPLETED, TransitionSpec, WorkflowSpec

__all__ = [
    "compound_errors",
    "containment_edges",
    "edges_tried",
    "fallback_errors",
    "final_child_of",
    "history_entry",
    "leaves",
]


def leaves(spec: WorkflowSpec) -> list[str]:
    """The states a run can be in and leave: no children, not a top-level final state."""
    return [sid for sid, s in spec.states.items() if not s.is_compound and not spec.ends_run(sid)]


def edges_tried(spec: WorkflowSpec, leaf: str) -> list[int]:
    """The declared transitions tried in `leaf`, in order: those of the compound states it is
    inside (outermost first, each in file order), then its own (see the module docstring)."""
    order = [*spec.ancestors(leaf), leaf]
    return [i for sid in order for i, t in enumerate(spec.transitions) if t.source == sid]


def final_child_of(spec: WorkflowSpec, leaf: str, compound: str) -> bool:
    """`leaf` is a final child of `compound`: there, `completed` holds for its edges."""
    return spec.states[leaf].final and spec.parent(leaf) == compound


def _always(spec: WorkflowSpec, t: TransitionSpec, leaf: str) -> bool:
    """The edge fires whenever it is tried in `leaf`."""
    if not t.is_guarded:  # but an agent.decide state's only when no choice is offered
        return not decides(spec, t.source)
    return t.guard == [COMPLETED] and not t.unless and final_child_of(spec, leaf, t.source)


def _never(spec: WorkflowSpec, t: TransitionSpec, leaf: str) -> bool:
    """The edge cannot fire in `leaf` (its `completed` is false there, or its unless true)."""
    done = final_child_of(spec, leaf, t.source)
    return (COMPLETED in t.guard and not done) or (COMPLETED in t.unless and done)


def containment_edges(spec: WorkflowSpec) -> list[tuple[str, str]]:
    """For the reachability checks: a compound state leads to its initial child (entering it)
    and each child to its parent (the parent's edges apply in it)."""
    out: list[tuple[str, str]] = []
    for sid, state in spec.states.items():
        if state.is_compound and state.initial in spec.states:
            out.append((sid, str(state.initial)))
        parent = spec.parent(sid)
        if parent is not None:
            out.append((sid, parent))
    return out


def _fail(spec: WorkflowSpec, message: str, *keys: object) -> WorkflowValidationError:
    return WorkflowValidationError(message, location=spec.location(*keys) or spec.path)


def compound_errors(spec: WorkflowSpec) -> list[WorkflowError]:
    """Ids unique at any depth; a compound state has children, an initial one among them (not
    final) and no action of its own; `history` only on one; the top-level `initial` is a
    top-level state; `enter: history` into a compound state that keeps its history;
    `completed` only on edges out of a compound state with a final child."""
    out: list[WorkflowError] = []
    for sid, where in spec.twins():
        out.append(
            WorkflowValidationError(
                f"state id {sid!r} is declared twice: state ids are unique across the whole "
                f"workflow, at any depth (the first is {spec.state_path(sid)!r})",
                location=where or spec.path,
            )
        )
    if spec.parent(spec.initial) is not None:
        out.append(
            _fail(
                spec,
                f"initial state {spec.initial!r} is inside {spec.parent(spec.initial)!r}: name "
                "a top-level state (a compound one enters its own initial child)",
                "initial",
            )
        )
    for sid in spec.states:
        out += _state_errors(spec, sid)
    for i, t in enumerate(spec.transitions):
        out += _edge_errors(spec, i, t)
    return out


def _state_errors(spec: WorkflowSpec, sid: str) -> list[WorkflowError]:
    state = spec.states[sid]
    out: list[WorkflowError] = []
    if state.history is not None and not state.is_compound:
        no_children = f"'history' on state {sid!r}, which has no children"
        out.append(_fail(spec, no_children, "states", sid, "history"))
    if (state.initial is None) != (state.states is None):
        has, lacks = ("initial", "states") if state.states is None else ("states", "initial")
        out.append(
            _fail(
                spec,
                f"state {sid!r} has '{has}' but no '{lacks}': a compound state needs both",
                "states",
                sid,
                has,
            )
        )
        return out
    if state.states is None:
        return out
    if not state.states:
        out.append(_fail(spec, f"compound state {sid!r} has no children", "states", sid))
    elif state.initial not in state.states:
        out.append(
            _fail(
                spec,
                f"initial state {state.initial!r} of {sid!r} is not one of its children "
                f"({', '.join(state.states)})",
                "states",
                sid,
                "initial",
            )
        )
    elif state.states[str(state.initial)].final:
        out.append(
            _fail(
                spec, f"initial state {state.initial!r} cannot be final", "states", sid, "initial"
            )
        )
    for key in ("action", "final"):
        if getattr(state, key):
            out.append(
                _fail(
                    spec,
                    f"compound state {sid!r} cannot have '{key}': its children act",
                    "states",
                    sid,
                    key,
                )
            )
    return out


def _edge_errors(spec: WorkflowSpec, i: int, t: TransitionSpec) -> list[WorkflowError]:
    out: list[WorkflowError] = []
    target = spec.states.get(t.target)
    if t.enter == "history" and target is not None and target.history is None:
        out.append(
            _fail(
                spec,
                f"'enter: history' needs {t.target!r} to be a compound state that keeps its "
                "history ('history: shallow' or 'history: deep')",
                "transitions",
                i,
                "enter",
            )
        )
    source = spec.states.get(t.source)
    if source is None or COMPLETED not in (*t.guard, *t.unless):
        return out
    finals = [c for c, s in (source.states or {}).items() if s.final]
    if not finals:
        key = "guard" if COMPLETED in t.guard else "unless"
        out.append(
            _fail(
                spec,
                f"'{COMPLETED}' holds once the run reaches a final child of the edge's source; "
                f"{t.source!r} has no final child",
                "transitions",
                i,
                key,
            )
        )
    return out


def fallback_errors(spec: WorkflowSpec) -> list[WorkflowError]:
    """In every leaf some edge always fires, and no edge is unreachable in every leaf it
    applies in: after an edge that always fires there (an unguarded one, or one guarded by
    `completed` alone in a final child of its source), or with a `completed` that cannot hold
    there. Each unreachable edge is reported once, at its place in the file."""
    out: list[WorkflowError] = []
    dead: dict[int, tuple[int, bool]] = {}  # edge → (the edge that shadows it, or -1), in all
    live: set[int] = set()
    for leaf in leaves(spec):
        tried = edges_tried(spec, leaf)
        out += _leaf_errors(spec, leaf, tried)
        first = next((i for i in tried if _always(spec, spec.transitions[i], leaf)), None)
        after = tried[tried.index(first) + 1 :] if first is not None else []
        for i in tried:
            if i in after:
                dead.setdefault(i, (first if first is not None else -1, True))
            elif _never(spec, spec.transitions[i], leaf):
                dead.setdefault(i, (-1, False))
            else:
                live.add(i)
    for i, (shadow, _) in sorted(dead.items()):
        if i not in live:
            out.append(_fail(spec, _dead_message(spec, i, shadow), "transitions", i))
    return out


def _leaf_errors(spec: WorkflowSpec, leaf: str, tried: list[int]) -> list[WorkflowError]:
    if not tried:
        hint = (
            f": add an edge out of {spec.parent(leaf)!r} guarded by '{COMPLETED}'"
            if spec.states[leaf].final
            else ""
        )
        return [
            _fail(
                spec, f"state {leaf!r} has no transition out of it{hint}", "states", leaf, "<key>"
            )
        ]
    if any(_always(spec, spec.transitions[i], leaf) for i in tried) or decides(spec, leaf):
        return []  # an agent.decide state needs no fallback while a choice is always offered
    if any(spec.transitions[i].waits for i in tried):  # a waiting state: it waits instead
        return []
    own = spec.transitions[tried[-1]].source == leaf
    return [
        _fail(
            spec,
            f"state {leaf!r} needs an unguarded fallback transition last"
            + ("" if own else " (its own, or out of a state it is inside)")
            + ", so some transition always fires",
            *(("transitions", tried[-1]) if own else ("states", leaf, "<key>")),
        )
    ]


def _dead_message(spec: WorkflowSpec, i: int, shadow: int) -> str:
    if shadow < 0:
        t = spec.transitions[i]
        return (
            f"transition never fires: '{COMPLETED}' holds only in a final child of "
            f"{t.source!r}, where this edge is not tried"
        )
    by = spec.transitions[shadow]
    if by.source == spec.transitions[i].source:
        return (
            f"transition never fires: the unguarded transition from {by.source!r} above it "
            "always fires first"
        )
    return (
        f"transition never fires: the transition out of {by.source!r} (line "
        f"{_line(spec, shadow)}) always fires first in every state it applies in (the edges of "
        "a compound state are tried before its children's)"
    )


def _line(spec: WorkflowSpec, i: int) -> str:
    loc = spec.location("transitions", i)
    return str(loc.line) if loc is not None else f"transitions[{i}]"


def history_entry(spec: WorkflowSpec, compound: str, last: dict[str, str]) -> str:
    """Where `enter: history` into `compound` lands: with `history: deep`, the state the run was
    last in inside it (`last`: compound → that state); with `shallow`, the entry of its child
    that state was in; its initial entry the first time."""
    leaf = last.get(compound)
    kind = spec.states[compound].history
    if leaf is None or kind is None:
        return spec.entry(compound)
    if kind == "deep":
        return leaf
    child = next(s for s in [*spec.ancestors(leaf), leaf] if spec.parent(s) == compound)
    return spec.entry(child)
