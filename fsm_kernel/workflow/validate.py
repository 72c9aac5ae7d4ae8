"""Semantic checks of a parsed workflow, each error with the file:line:col of the culprit.

Structure (states, targets, reachability, final states), names (reserved by
python-statemachine, clashing with the machine's one event; the workflow's own termination
reasons: snake_case, never a built-in's), references (actions, guards, termination reasons),
`answer: false`, `output:` and `agent:` only where the action calls the model, every `output:`
a valid JSON Schema or an importable pydantic model, and `retry:`/`catch:` only where there is
an action (catch targets checked like transition targets). Tool names are checked by the
kernel, which owns the registry.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.tools.mcp_client import parse_ref
from fsm_kernel.workflow.actions import RefError, resolve_action, resolve_guard
from fsm_kernel.workflow.children import CALL_ACTIONS, MAP_NAMES, TEMPLATE_NAMES, template_names
from fsm_kernel.workflow.output import OutputError, OutputSchema
from fsm_kernel.workflow.spec import MCP_NAME, TERMINATION_REASONS, StateSpec, WorkflowSpec

__all__ = ["EVENT_NAME", "RESERVED_NAMES", "check_calls", "validate_workflow"]

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
        if state.answer or state.action == "workflow.call":
            continue
        if state.action and resolve_action(state.action).calls_model:
            continue
        raise _fail(
            spec,
            f"'answer: false' does nothing on state {sid!r}: only a state whose action calls "
            "the model (agent.think) or a workflow (workflow.call) replies with an answer",
            "states",
            sid,
            "answer",
        )


_CALL_KEYS = ("workflow", "input")
_MAP_KEYS = ("items", "max_concurrency", "fail_fast", "max_items")


def _check_children(spec: WorkflowSpec) -> None:
    """`workflow:`/`input:` only on workflow.call/map states, which need a `workflow:`; the map
    keys only on workflow.map states, which need `items:`; templates name known values."""
    for sid, state in spec.states.items():
        calls = state.action in CALL_ACTIONS
        is_map = state.action == "workflow.map"
        for key in (*_CALL_KEYS, *_MAP_KEYS):
            if getattr(state, key) is None or (is_map if key in _MAP_KEYS else calls):
                continue
            needs = "workflow.map" if key in _MAP_KEYS else "workflow.call or workflow.map"
            raise _fail(
                spec,
                f"'{key}' does nothing on state {sid!r}: only a {needs} state uses it",
                "states",
                sid,
                key,
            )
        if calls and not state.workflow:
            raise _fail(
                spec,
                f"state {sid!r} runs {state.action} but names no workflow: add e.g. "
                "'workflow: react'",
                "states",
                sid,
            )
        if is_map and not state.items:
            raise _fail(
                spec,
                f"state {sid!r} runs workflow.map but says nothing of its items: add e.g. "
                "'items: output.steps'",
                "states",
                sid,
            )
        known = TEMPLATE_NAMES | (MAP_NAMES if is_map else frozenset())
        places = [("input", template_names(state.input or ""))]
        if state.items:
            places.append(("items", [state.items.strip().strip("{}").split(".")[0]]))
        for key, names in places:
            for name in names:
                if name not in known or (key == "items" and name in MAP_NAMES):
                    shown = ", ".join(sorted(known - (MAP_NAMES if key == "items" else set())))
                    raise _fail(
                        spec,
                        f"{key} of state {sid!r} names {name!r}, which the run does not have "
                        f"(known: {shown})",
                        "states",
                        sid,
                        key,
                    )


def _check_mcp(spec: WorkflowSpec) -> None:
    """`mcp:NAME` tool entries name a declared server; server names are identifiers."""
    for name in spec.mcp_servers:
        if not re.match(MCP_NAME, name):
            raise _fail(
                spec,
                f"MCP server name {name!r} must start with a letter and hold only letters, "
                "digits, _ and -",
                "mcp_servers",
                name,
                "<key>",
            )
    for i, entry in enumerate(spec.tools):
        ref = parse_ref(entry.name)
        if ref is None:
            continue
        if not ref.server or ref.server not in spec.mcp_servers:
            declared = ", ".join(spec.mcp_servers) or "none"
            raise _fail(
                spec,
                f"tool entry {entry.name!r} names MCP server {ref.server!r}, which "
                f"mcp_servers does not declare (declared: {declared})",
                "tools",
                i,
            )


def check_calls(spec: WorkflowSpec) -> None:
    """Every workflow a `workflow.call`/`workflow.map` state names exists, is valid, and never
    calls back a workflow on the way to it (directly or through a cycle of files): reported at
    the state of `spec` the cycle starts from."""
    _check_calls(spec, [Path(spec.path).resolve()], None)


def _check_calls(
    spec: WorkflowSpec, stack: list[Path], origin: tuple[WorkflowSpec, str] | None
) -> None:
    from fsm_kernel.workflow.loader import find_workflow, load_workflow

    for sid, state in spec.states.items():
        if state.action not in CALL_ACTIONS or not state.workflow:
            continue
        where = ("states", sid, "workflow")
        try:
            path = find_workflow(state.workflow, relative_to=spec.path)
        except WorkflowValidationError as exc:
            raise _fail(spec, exc.message, *where) from None
        resolved = path.resolve()
        first, first_sid = origin or (spec, sid)
        if resolved in stack:
            chain = [p.name for p in stack[stack.index(resolved) :]] + [resolved.name]
            raise _fail(
                first,
                f"state {first_sid!r} starts a cycle of workflow calls that would never end: "
                f"{' → '.join(chain)}",
                "states",
                first_sid,
                "workflow",
            )
        child = load_workflow(path, import_code=False, calls=False)
        _check_calls(child, [*stack, resolved], (first, first_sid))


def _check_parallel_flags(spec: WorkflowSpec) -> None:
    """A state's `parallel_tool_calls` only means something where tools.execute runs."""
    for sid, state in spec.states.items():
        if state.parallel_tool_calls is None or state.action == "tools.execute":
            continue
        raise _fail(
            spec,
            f"'parallel_tool_calls' does nothing on state {sid!r}: only a state whose action "
            "is tools.execute runs tool calls",
            "states",
            sid,
            "parallel_tool_calls",
        )


def _check_outputs(spec: WorkflowSpec) -> None:
    """Each `output:` resolves (at the node the problem is in) and applies somewhere: a state's
    own needs an action that calls the model, the workflow's a state whose reply is the answer."""
    calls_model = {
        sid: bool(s.action) and resolve_action(str(s.action)).calls_model
        for sid, s in spec.states.items()
    }
    places: list[tuple[tuple[str, ...], object]] = [(("output",), spec.output)]
    places += [(("states", sid, "output"), s.output) for sid, s in spec.states.items()]
    for where, value in places:
        if not isinstance(value, dict | str):
            continue
        try:
            OutputSchema.resolve(value)
        except OutputError as exc:
            raise _fail(spec, f"output: {exc.message}", *where, *exc.path) from None
    for sid, state in spec.states.items():
        if state.output is not None and not calls_model[sid]:
            raise _fail(
                spec,
                f"'output' does nothing on state {sid!r}: only a state whose action calls the "
                "model (agent.think) replies with an answer",
                "states",
                sid,
                "output",
            )
    if spec.output is not None and not any(
        calls_model[sid] and s.answer and s.output is None for sid, s in spec.states.items()
    ):
        raise _fail(
            spec,
            "'output' applies to no state: no state whose action calls the model has "
            "'answer: true' without an 'output' of its own",
            "output",
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


def _check_edge_end(spec: WorkflowSpec, target: str, reason: str | None, *where: object) -> None:
    """A catch entry's target and reason, checked as a transition's are."""
    if target not in spec.states:
        raise _fail(spec, f"unknown catch target state {target!r}", *where, "target")
    into_final = spec.states[target].final
    if into_final and not reason:
        raise _fail(spec, f"catch into final state {target!r} needs a 'reason'", *where)
    if reason and not into_final:
        raise _fail(spec, "'reason' is only for a catch into a final state", *where, "reason")
    if reason and reason not in TERMINATION_REASONS and reason not in spec.reasons:
        raise _fail(
            spec,
            f"unknown termination reason {reason!r} (declare your own under 'reasons:')",
            *where,
            "reason",
        )


def _check_catches(spec: WorkflowSpec, sid: str, state: StateSpec) -> None:
    handled: list[str] = []
    for k, entry in enumerate(state.catch):
        where = ("states", sid, "catch", k)
        _check_edge_end(spec, entry.target, entry.reason, *where)
        earlier = next((e for e in handled if e in ("any", entry.error)), None)
        if earlier is not None:
            raise _fail(
                spec,
                f"catch entry never fires: an earlier entry of state {sid!r} already catches "
                f"{earlier!r}",
                *where,
                "error",
            )
        handled.append(entry.error)


def _check_recovery(spec: WorkflowSpec) -> None:
    """`retry:`, `catch:` and `agent:` only where they can act: on a state with an action (one
    that calls the model, for `agent:`); catch targets and reasons as for transitions."""
    for sid, state in spec.states.items():
        for key in ("retry", "catch"):
            if getattr(state, key) and not state.action:
                raise _fail(
                    spec,
                    f"'{key}:' does nothing on state {sid!r}: it has no action to fail",
                    "states",
                    sid,
                    key,
                )
        if state.agent is not None and not (
            state.action and resolve_action(state.action).calls_model
        ):
            raise _fail(
                spec,
                f"'agent:' does nothing on state {sid!r}: only a state whose action calls the "
                "model (agent.think) makes model calls",
                "states",
                sid,
                "agent",
            )
        _check_catches(spec, sid, state)


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
    """States reachable from `start` (or that reach it) through transitions and catch edges."""
    edges = [(t.source, t.target) for t in spec.transitions]
    edges += [(c.source, c.target) for c in spec.catch_edges()]
    seen, queue = {start}, deque([start])
    while queue:
        here = queue.popleft()
        for source, target in edges:
            src, dst = (source, target) if forward else (target, source)
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
    _check_parallel_flags(spec)
    _check_children(spec)
    _check_mcp(spec)
    if import_code:
        _check_refs(spec)
        _check_answer_flags(spec)
        _check_recovery(spec)
        _check_outputs(spec)
    _check_fallbacks(spec)
    _check_graph(spec)
