"""Semantic checks of a parsed workflow, each error with the file:line:col of the culprit.

Structure (states, targets, reachability, final states), names (reserved by
python-statemachine, clashing with the machine's one event; the workflow's own termination
reasons: snake_case, never a built-in's), references (actions, guards, termination reasons), and
`answer: false` only where the action calls the model. Tool names are checked by the kernel,
which owns the registry.
"""

from __future__ import annotations

import re
from collections import deque

from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.workflow.actions import RefError, resolve_action, resolve_guard
from fsm_kernel.workflow.spec import TERMINATION_REASONS, WorkflowSpec

__all__ = ["EVENT_NAME", "RESERVED_NAMES", "validate_workflow"]

EVENT_NAME = "next"
"""The one event the kernel sends; a state may not share its name."""

IDENT = re.compile(r"^[a-z][a-z0-9_]*$")

# Attributes of python-statemachine's StateChart a state id would shadow (checked against
# 3.2.2's dir(StateChart); a test keeps this list honest).
RESERVED_NAMES = frozenset(
    {
        "send", "model", "states", "configuration", "configuration_values", "events",
        "is_terminated", "name", "step", "current_state", "current_state_value", "final_states",
        "allowed_events", "enabled_events", "add_listener", "listeners", "states_map",
        "active_listeners", "cancel_event", "raise_", "error", "state", "initial_state",
        "id", "value", "history", "machine", "source", "target", "event", "transition",
        "prepare", "catch_errors_as_events", "start_configuration_values",
        "allow_event_without_transition", "activate_initial_state",
        "atomic_configuration_update", "bind_events_to", "enable_self_transition_entries",
        EVENT_NAME,
    }
)  # fmt: skip


def _fail(spec: WorkflowSpec, message: str, *keys: object) -> WorkflowValidationError:
    return WorkflowValidationError(message, location=spec.location(*keys) or spec.path)


def _check_names(spec: WorkflowSpec) -> None:
    for sid in spec.states:
        if not IDENT.match(sid):
            raise _fail(spec, f"state id {sid!r} must be snake_case", "states", sid, "<key>")
        if sid in RESERVED_NAMES:
            what = "the kernel's event" if sid == EVENT_NAME else "a python-statemachine name"
            raise _fail(spec, f"state id {sid!r} is reserved ({what})", "states", sid, "<key>")
    if spec.initial not in spec.states:
        raise _fail(spec, f"initial state {spec.initial!r} is not a declared state", "initial")
    if spec.states[spec.initial].final:
        raise _fail(spec, f"initial state {spec.initial!r} cannot be final", "initial")
    if not spec.final_states():
        raise _fail(spec, "no final state: add a state with 'final: true'", "states")


def _check_reasons(spec: WorkflowSpec) -> None:
    """The workflow's own reasons: snake_case, and never a built-in's name (whose meaning and
    exit code the kernel fixes)."""
    for name in spec.reasons:
        where = ("reasons", name, "<key>")
        if not IDENT.match(name):
            raise _fail(spec, f"termination reason {name!r} must be snake_case", *where)
        if name in TERMINATION_REASONS:
            raise _fail(
                spec,
                f"termination reason {name!r} shadows the built-in reason of that name; "
                "choose another name",
                *where,
            )


def _check_refs(spec: WorkflowSpec) -> None:
    for sid, state in spec.states.items():
        if state.final and state.action:
            raise _fail(spec, f"final state {sid!r} cannot have an action", "states", sid, "action")
        if state.action:
            try:
                resolve_action(state.action)
            except RefError as exc:
                raise _fail(spec, exc.message, "states", sid, "action") from None
    for i, t in enumerate(spec.transitions):
        for key in ("guard", "unless"):
            for j, name in enumerate(getattr(t, key)):
                try:
                    resolve_guard(name)
                except RefError as exc:
                    raise _fail(spec, exc.message, "transitions", i, key, j) from None


def _check_answer_flags(spec: WorkflowSpec) -> None:
    """`answer: false` only means something where the action calls the model (actions resolve)."""
    for sid, state in spec.states.items():
        if state.answer or (state.action and resolve_action(state.action).calls_model):
            continue
        raise _fail(
            spec,
            f"'answer: false' does nothing on state {sid!r}: only a state whose action calls "
            "the model (agent.think) replies with an answer",
            "states",
            sid,
            "answer",
        )


def _check_transitions(spec: WorkflowSpec) -> None:
    for i, t in enumerate(spec.transitions):
        for key in ("source", "target"):
            name = getattr(t, key)
            if name not in spec.states:
                raise _fail(spec, f"unknown {key} state {name!r}", "transitions", i, key)
        if spec.states[t.source].final:
            raise _fail(
                spec,
                f"final state {t.source!r} cannot have transitions out of it",
                "transitions",
                i,
                "source",
            )
        into_final = spec.states[t.target].final
        if into_final and not t.reason:
            raise _fail(
                spec, f"transition into final state {t.target!r} needs a 'reason'", "transitions", i
            )
        if t.reason and not into_final:
            raise _fail(
                spec,
                "'reason' is only for transitions into a final state",
                "transitions",
                i,
                "reason",
            )
        if t.reason and t.reason not in TERMINATION_REASONS and t.reason not in spec.reasons:
            known = ", ".join([*TERMINATION_REASONS, *spec.reasons])
            raise _fail(
                spec,
                f"unknown termination reason {t.reason!r} (known: {known}; declare your own "
                "under 'reasons:')",
                "transitions",
                i,
                "reason",
            )


def _check_fallbacks(spec: WorkflowSpec) -> None:
    for sid, state in spec.states.items():
        if state.final:
            continue
        outgoing = spec.transitions_from(sid)
        if not outgoing:
            raise _fail(spec, f"state {sid!r} has no transition out of it", "states", sid, "<key>")
        for pos, (_, t) in enumerate(outgoing):
            if not t.is_guarded and pos != len(outgoing) - 1:
                later = outgoing[pos + 1][0]
                raise _fail(
                    spec,
                    f"transition never fires: the unguarded transition from "
                    f"{sid!r} above it always fires first",
                    "transitions",
                    later,
                )
        if outgoing[-1][1].is_guarded:
            raise _fail(
                spec,
                f"state {sid!r} needs an unguarded fallback transition last, so "
                "some transition always fires",
                "transitions",
                outgoing[-1][0],
            )


def _reachable(spec: WorkflowSpec, start: str, forward: bool = True) -> set[str]:
    seen, queue = {start}, deque([start])
    while queue:
        here = queue.popleft()
        for t in spec.transitions:
            src, dst = (t.source, t.target) if forward else (t.target, t.source)
            if src == here and dst not in seen:
                seen.add(dst)
                queue.append(dst)
    return seen


def _check_graph(spec: WorkflowSpec) -> None:
    reachable = _reachable(spec, spec.initial)
    for sid in spec.states:
        if sid not in reachable:
            raise _fail(
                spec, f"state {sid!r} is unreachable from {spec.initial!r}", "states", sid, "<key>"
            )
    can_finish: set[str] = set()
    for final in spec.final_states():
        can_finish |= _reachable(spec, final, forward=False)
    for sid in spec.states:
        if sid not in can_finish:
            raise _fail(spec, f"state {sid!r} has no path to a final state", "states", sid, "<key>")


def validate_workflow(spec: WorkflowSpec, *, import_code: bool = True) -> None:
    """Raise WorkflowValidationError for the first problem found, in file terms. Without
    `import_code`, the actions and guards it names are not resolved (nothing is imported)."""
    if not spec.states:
        raise _fail(spec, "a workflow needs at least one state", "states")
    _check_names(spec)
    _check_reasons(spec)
    _check_transitions(spec)
    if import_code:
        _check_refs(spec)
        _check_answer_flags(spec)
    _check_fallbacks(spec)
    _check_graph(spec)
