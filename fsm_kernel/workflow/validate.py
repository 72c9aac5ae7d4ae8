"""Semantic checks of a parsed workflow, each error with the file:line:col of the culprit.

Every independent problem is reported, as a compiler does: each check appends what it finds
to a list and goes on; a check that needs what an earlier one found broken (the graph needs
known states) is skipped then, so one typo does not come back as a cascade of others.

Structure (states, targets, reachability, final states), names (reserved by
python-statemachine, clashing with the machine's one event; the workflow's own termination
reasons: snake_case, never a built-in's), references (actions, guards, termination reasons),
`answer: false`, `output:` and `agent:` only where the action calls the model, every `output:`
a valid JSON Schema (whose `$ref`s never loop without descending into the value) or an
importable pydantic model, `retry:`/`catch:` only where there is an action (catch targets
checked like transition targets), MCP servers that name a program, the workflows called
(they exist, are valid, never call back and nest at most MAX_CALL_DEPTH deep), and every
cycle bounded by a model call, a limit or a timer (see analysis.py). Tool names are
checked by the kernel, which owns the registry.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.tools.mcp_client import parse_ref
from fsm_kernel.workflow.actions import RefError, resolve_action, resolve_guard
from fsm_kernel.workflow.analysis import cycle_errors
from fsm_kernel.workflow.call_chain import call_errors
from fsm_kernel.workflow.children import CALL_ACTIONS, MAP_NAMES, TEMPLATE_NAMES, template_names
from fsm_kernel.workflow.compound import compound_errors, containment_edges, fallback_errors
from fsm_kernel.workflow.decide import decide_errors, decides
from fsm_kernel.workflow.expression_checks import expression_errors
from fsm_kernel.workflow.output import OutputError, OutputSchema
from fsm_kernel.workflow.spec import (
    COMPLETED,
    MCP_NAME,
    TERMINATION_REASONS,
    SourceLocation,
    StateSpec,
    WorkflowSpec,
)

__all__ = [
    "EVENT_NAME",
    "RESERVED_NAMES",
    "check_calls",
    "in_file_order",
    "raise_first",
    "validate_workflow",
    "workflow_errors",
]

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


Errors = list[WorkflowError]
"""What the checks append their findings to."""


def in_file_order(errors: Iterable[WorkflowError], path: str | None = None) -> Errors:
    """`errors` without repeats, sorted by where they are: the file at `path` first, then any
    other file (a called workflow's), each by line and column."""
    unique: dict[str, WorkflowError] = {}
    for error in errors:
        unique.setdefault(str(error), error)
    return sorted(unique.values(), key=lambda e: _position(e, path))


def _position(error: WorkflowError, path: str | None) -> tuple[bool, str, int, int]:
    loc = error.location
    if isinstance(loc, SourceLocation):
        return (loc.path != path, loc.path, loc.line, loc.col)
    where = str(loc) if loc is not None else (path or "")
    return (where != path, where, 0, 0)


def _check_names(spec: WorkflowSpec, out: Errors) -> None:
    for sid, state in spec.states.items():
        if not IDENT.match(sid):
            out.append(_fail(spec, f"state id {sid!r} must be snake_case", "states", sid, "<key>"))
        elif sid in RESERVED_NAMES:
            what = "the kernel's event" if sid == EVENT_NAME else "a python-statemachine name"
            out.append(
                _fail(spec, f"state id {sid!r} is reserved ({what})", "states", sid, "<key>")
            )
        if state.final and state.action:
            out.append(
                _fail(spec, f"final state {sid!r} cannot have an action", "states", sid, "action")
            )
    if spec.initial not in spec.states:
        out.append(
            _fail(spec, f"initial state {spec.initial!r} is not a declared state", "initial")
        )
    elif spec.states[spec.initial].final:
        out.append(_fail(spec, f"initial state {spec.initial!r} cannot be final", "initial"))
    if not spec.final_states():
        out.append(_fail(spec, "no final state: add a state with 'final: true'", "states"))


def _check_reasons(spec: WorkflowSpec, out: Errors) -> None:
    """The workflow's own reasons: snake_case, and never a built-in's name (whose meaning and
    exit code the kernel fixes)."""
    for name in spec.reasons:
        where = ("reasons", name, "<key>")
        if not IDENT.match(name):
            out.append(_fail(spec, f"termination reason {name!r} must be snake_case", *where))
        elif name in TERMINATION_REASONS:
            out.append(
                _fail(
                    spec,
                    f"termination reason {name!r} shadows the built-in reason of that name; "
                    "choose another name",
                    *where,
                )
            )


def _check_migrations(spec: WorkflowSpec, out: Errors) -> None:
    """`migrations:` need the file's `version:`, each from an older version, and rename old
    ids (no longer states here) to states of this file."""
    if spec.migrations and spec.version is None:
        out.append(_fail(spec, "migrations: need the workflow's own 'version:'", "migrations"))
    for i, entry in enumerate(spec.migrations):
        if spec.version is not None and entry.from_version >= spec.version:
            out.append(
                _fail(
                    spec,
                    f"a migration moves runs from an older version: from {entry.from_version} "
                    f"is not below this file's version {spec.version}",
                    "migrations", i, "from",
                )
            )  # fmt: skip
        for old, new in entry.rename_states.items():
            where = ("migrations", i, "rename_states", old)
            if new not in spec.states:
                message = f"rename_states: {old} -> {new}: no state {new!r} in this file"
                out.append(_fail(spec, message, *where))
            if old in spec.states:
                out.append(
                    _fail(
                        spec,
                        f"rename_states: {old!r} is still a state of this file; a renamed "
                        "state's old id must be gone",
                        *where,
                        "<key>",
                    )
                )


def _check_refs(spec: WorkflowSpec, out: Errors) -> dict[str, bool]:
    """Actions and guards resolve. Returns whether each state's action calls the model, for
    the states whose action resolved (False for a state without one)."""
    calls_model: dict[str, bool] = {}
    for sid, state in spec.states.items():
        if not state.action:
            calls_model[sid] = False
            continue
        try:
            calls_model[sid] = resolve_action(state.action).calls_model
        except RefError as exc:
            out.append(_fail(spec, exc.message, "states", sid, "action"))
    for i, t in enumerate(spec.transitions):
        for key in ("guard", "unless"):
            for j, name in enumerate(getattr(t, key)):
                if name == COMPLETED:  # the compiler's, given its source (see compound.py)
                    continue
                try:
                    resolve_guard(name)
                except RefError as exc:
                    out.append(_fail(spec, exc.message, "transitions", i, key, j))
    return calls_model


def _check_answer_flags(spec: WorkflowSpec, calls_model: dict[str, bool], out: Errors) -> None:
    """`answer: false` only means something where the action calls the model."""
    for sid, state in spec.states.items():
        if state.answer or state.action == "workflow.call" or calls_model.get(sid, True):
            continue
        out.append(
            _fail(
                spec,
                f"'answer: false' does nothing on state {sid!r}: only a state whose action calls "
                "the model (agent.think) or a workflow (workflow.call) replies with an answer",
                "states",
                sid,
                "answer",
            )
        )


_CALL_KEYS = ("workflow", "input")
_MAP_KEYS = ("items", "max_concurrency", "fail_fast", "max_items")


def _check_children(spec: WorkflowSpec, out: Errors) -> None:
    """`workflow:`/`input:` only on workflow.call/map states, which need a `workflow:`; the map
    keys only on workflow.map states, which need `items:`; templates name known values."""
    for sid, state in spec.states.items():
        _check_child_keys(spec, sid, state, out)
        _check_templates(spec, sid, state, out)


def _check_child_keys(spec: WorkflowSpec, sid: str, state: StateSpec, out: Errors) -> None:
    calls = state.action in CALL_ACTIONS
    is_map = state.action == "workflow.map"
    for key in (*_CALL_KEYS, *_MAP_KEYS):
        if getattr(state, key, None) is None or (is_map if key in _MAP_KEYS else calls):
            continue
        needs = "workflow.map" if key in _MAP_KEYS else "workflow.call or workflow.map"
        out.append(
            _fail(
                spec,
                f"'{key}' does nothing on state {sid!r}: only a {needs} state uses it",
                "states",
                sid,
                key,
            )
        )
    if calls and not state.workflow:
        out.append(
            _fail(
                spec,
                f"state {sid!r} runs {state.action} but names no workflow: add e.g. "
                "'workflow: react'",
                "states",
                sid,
            )
        )
    if is_map and not state.items:
        out.append(
            _fail(
                spec,
                f"state {sid!r} runs workflow.map but says nothing of its items: add e.g. "
                "'items: output.steps'",
                "states",
                sid,
            )
        )


def _check_templates(spec: WorkflowSpec, sid: str, state: StateSpec, out: Errors) -> None:
    """The names an `input:` template or an `items:` path starts with are the run's."""
    is_map = state.action == "workflow.map"
    known = TEMPLATE_NAMES | (MAP_NAMES if is_map else frozenset())
    places = [("input", template_names(state.input or ""))]
    if state.items:
        places.append(("items", [state.items.strip().strip("{}").split(".")[0]]))
    for key, names in places:
        allowed = known - MAP_NAMES if key == "items" else known
        for name in names:
            if name in allowed:
                continue
            out.append(
                _fail(
                    spec,
                    f"{key} of state {sid!r} names {name!r}, which the run does not have "
                    f"(known: {', '.join(sorted(allowed))})",
                    "states",
                    sid,
                    key,
                )
            )


def _check_mcp(spec: WorkflowSpec, out: Errors) -> None:
    """Server names are identifiers, a stdio server names a program, and `mcp:NAME` tool
    entries name a declared server."""
    for name, server in spec.mcp_servers.items():
        if not re.match(MCP_NAME, name):
            out.append(
                _fail(
                    spec,
                    f"MCP server name {name!r} must start with a letter and hold only letters, "
                    "digits, _ and -",
                    "mcp_servers",
                    name,
                    "<key>",
                )
            )
        if server.command is not None and not server.command.strip():
            out.append(
                _fail(
                    spec,
                    f"MCP server {name!r} has an empty command: name the program to start "
                    "(e.g. npx, uvx, python)",
                    "mcp_servers",
                    name,
                    "command",
                )
            )
    for i, entry in enumerate(spec.tools):
        ref = parse_ref(entry.name)
        if ref is None or (ref.server and ref.server in spec.mcp_servers):
            continue
        declared = ", ".join(spec.mcp_servers) or "none"
        out.append(
            _fail(
                spec,
                f"tool entry {entry.name!r} names MCP server {ref.server!r}, which "
                f"mcp_servers does not declare (declared: {declared})",
                "tools",
                i,
            )
        )


def check_calls(spec: WorkflowSpec) -> None:
    """Raise the first problem of the workflows `spec`'s states call (see call_chain): one
    that does not exist or is invalid, a cycle of calls, a chain deeper than MAX_CALL_DEPTH."""
    raise_first(in_file_order(call_errors(spec), spec.path))


def _check_parallel_flags(spec: WorkflowSpec, out: Errors) -> None:
    """A state's `parallel_tool_calls` only means something where tools.execute runs."""
    for sid, state in spec.states.items():
        if state.parallel_tool_calls is None or state.action == "tools.execute":
            continue
        out.append(
            _fail(
                spec,
                f"'parallel_tool_calls' does nothing on state {sid!r}: only a state whose "
                "action is tools.execute runs tool calls",
                "states",
                sid,
                "parallel_tool_calls",
            )
        )


def _check_schemas(spec: WorkflowSpec, out: Errors) -> None:
    """Each `output:` resolves (OutputSchema.resolve refuses, among others, `$ref`s that loop
    without descending into the value), reported at the node the problem is in."""
    places: list[tuple[tuple[str, ...], object]] = [(("output",), spec.output)]
    places += [(("states", sid, "output"), s.output) for sid, s in spec.states.items()]
    for where, value in places:
        if not isinstance(value, dict | str):
            continue
        try:
            OutputSchema.resolve(value)
        except OutputError as exc:
            out.append(_fail(spec, f"output: {exc.message}", *where, *exc.path))


def _check_outputs(spec: WorkflowSpec, calls_model: dict[str, bool], out: Errors) -> None:
    """Each `output:` applies somewhere: a state's own needs an action that calls the model,
    the workflow's a state whose reply is the answer (judged once every action resolved)."""
    _check_schemas(spec, out)
    for sid, state in spec.states.items():
        if state.output is not None and not calls_model.get(sid, True):
            out.append(
                _fail(
                    spec,
                    f"'output' does nothing on state {sid!r}: only a state whose action calls "
                    "the model (agent.think) replies with an answer",
                    "states",
                    sid,
                    "output",
                )
            )
    if spec.output is None or len(calls_model) < len(spec.states):
        return
    answering = [sid for sid, s in spec.states.items() if s.answer and s.output is None]
    if not any(calls_model[sid] for sid in answering):
        out.append(
            _fail(
                spec,
                "'output' applies to no state: no state whose action calls the model has "
                "'answer: true' without an 'output' of its own",
                "output",
            )
        )


def _check_transitions(spec: WorkflowSpec, out: Errors) -> None:
    for i, t in enumerate(spec.transitions):
        unknown = [key for key in ("source", "target") if getattr(t, key) not in spec.states]
        for key in unknown:
            out.append(
                _fail(spec, f"unknown {key} state {getattr(t, key)!r}", "transitions", i, key)
            )
        if unknown:
            continue
        if spec.states[t.source].final:
            out.append(
                _fail(
                    spec,
                    f"final state {t.source!r} cannot have transitions out of it",
                    "transitions",
                    i,
                    "source",
                )
            )
        _check_edge_end(spec, "transition", t.target, t.reason, out, "transitions", i)


def _check_waits(spec: WorkflowSpec, out: Errors) -> None:
    """`event:` and `after:` edges: a snake_case event name that is not reserved, a duration,
    not both on one edge, only out of a state without an action (a state acts or waits), and
    no unguarded plain edge beside them (it would fire at once: the state would never wait)."""
    waiting = {t.source for t in spec.transitions if t.waits}
    for i, t in enumerate(spec.transitions):
        if t.event is not None and (not IDENT.match(t.event) or t.event in RESERVED_NAMES):
            out.append(_fail(spec, _bad_event(t.event), "transitions", i, "event"))
        if t.after is not None and t.after_seconds is None:
            out.append(
                _fail(
                    spec,
                    f"'after: {t.after}' is not a duration: a positive number and a unit, s, m, "
                    "h or d (90s, 30m, 2h, 1d)",
                    "transitions",
                    i,
                    "after",
                )
            )
        if t.event is not None and t.after is not None:
            both = "an edge fires on an 'event' or 'after' a time, not both"
            out.append(_fail(spec, both, "transitions", i, "after"))
        state = spec.states.get(t.source)
        if state is None or t.source not in waiting:
            continue
        if state.is_compound:  # `after:` is its deadline (deadlines.py); it never waits itself
            if t.event is not None:
                out.append(_fail(spec, _compound_event(t.source), "transitions", i, "event"))
            continue
        if t.waits and state.action:
            key = "event" if t.event is not None else "after"
            out.append(_fail(spec, _acting_source(t.source, key), "transitions", i, key))
        elif not t.waits and not t.is_guarded and not state.action:
            out.append(
                _fail(
                    spec,
                    f"an unguarded transition out of waiting state {t.source!r} fires at once: "
                    "the state never waits (give it a guard, or an 'event' or 'after')",
                    "transitions",
                    i,
                )
            )


def _bad_event(name: str) -> str:
    if name in RESERVED_NAMES:
        return f"event name {name!r} is reserved (python-statemachine or the kernel use it)"
    return f"event name {name!r} must be snake_case: a lower-case letter, then a-z, 0-9 or _"


def _acting_source(source: str, key: str) -> str:
    return (
        f"'{key}:' only on edges out of a state without an action (a waiting state); state "
        f"{source!r} runs an action: wait in a state of its own"
    )


def _compound_event(source: str) -> str:
    return (  # a compound state acts through its children: only they wait for events
        f"'event:' only on edges out of a waiting state; {source!r} has children: put the "
        "event edge on the child that waits (an 'after:' on a compound state is its deadline)"
    )


def _check_edge_end(
    spec: WorkflowSpec, kind: str, target: str, reason: str | None, out: Errors, *where: object
) -> None:
    """A known target's reason (`kind`: transition or catch): needed into a final state, only
    there, and a known one. A final child of a compound state ends no run: no reason there."""
    into_final = spec.ends_run(target)
    if reason and spec.states[target].final and not into_final:
        out.append(
            _fail(
                spec,
                f"'reason' is only for edges into a top-level final state: {target!r} is a final "
                f"child of {spec.parent(target)!r} (it completes it; only top-level final states "
                "end a run)",
                *where,
                "reason",
            )
        )
        return
    if into_final and not reason:
        out.append(_fail(spec, f"{kind} into final state {target!r} needs a 'reason'", *where))
    elif reason and not into_final:
        edges = "transitions" if kind == "transition" else "a catch"
        out.append(
            _fail(spec, f"'reason' is only for {edges} into a final state", *where, "reason")
        )
    elif reason and reason not in TERMINATION_REASONS and reason not in spec.reasons:
        known = ", ".join([*TERMINATION_REASONS, *spec.reasons])
        listed = f"known: {known}; " if kind == "transition" else ""
        out.append(
            _fail(
                spec,
                f"unknown termination reason {reason!r} ({listed}declare your own under "
                "'reasons:')",
                *where,
                "reason",
            )
        )


def _check_catches(spec: WorkflowSpec, sid: str, state: StateSpec, out: Errors) -> None:
    """A state's catch entries: known targets and reasons as for transitions, and none that an
    earlier entry already catches."""
    handled: list[str] = []
    for k, entry in enumerate(state.catch):
        where = ("states", sid, "catch", k)
        if entry.target not in spec.states:
            out.append(
                _fail(spec, f"unknown catch target state {entry.target!r}", *where, "target")
            )
        else:
            _check_edge_end(spec, "catch", entry.target, entry.reason, out, *where)
        earlier = next((e for e in handled if e in ("any", entry.error)), None)
        if earlier is not None:
            out.append(
                _fail(
                    spec,
                    f"catch entry never fires: an earlier entry of state {sid!r} already "
                    f"catches {earlier!r}",
                    *where,
                    "error",
                )
            )
        handled.append(entry.error)


def _check_recovery(spec: WorkflowSpec, calls_model: dict[str, bool], out: Errors) -> None:
    """`retry:`, `catch:` and `agent:` only where they can act: on a state with an action (one
    that calls the model, for `agent:`)."""
    for sid, state in spec.states.items():
        for key in ("retry", "catch"):
            if getattr(state, key) and not state.action:
                out.append(
                    _fail(
                        spec,
                        f"'{key}:' does nothing on state {sid!r}: it has no action to fail",
                        "states",
                        sid,
                        key,
                    )
                )
        if state.agent is not None and not calls_model.get(sid, True):
            out.append(
                _fail(
                    spec,
                    f"'agent:' does nothing on state {sid!r}: only a state whose action calls "
                    "the model (agent.think) makes model calls",
                    "states",
                    sid,
                    "agent",
                )
            )


def _check_fallbacks(spec: WorkflowSpec, out: Errors) -> None:
    if spec.has_compound:  # edges of the states a state is inside are tried too
        out.extend(fallback_errors(spec))
        return
    for sid, state in spec.states.items():
        if state.final or decides(spec, sid):  # an agent.decide state's: see decide_errors
            continue
        outgoing = spec.transitions_from(sid)
        if not outgoing:
            out.append(
                _fail(spec, f"state {sid!r} has no transition out of it", "states", sid, "<key>")
            )
            continue
        for pos, (_, t) in enumerate(outgoing[:-1]):
            if not t.is_guarded:
                out.append(
                    _fail(
                        spec,
                        f"transition never fires: the unguarded transition from {sid!r} above "
                        "it always fires first",
                        "transitions",
                        outgoing[pos + 1][0],
                    )
                )
        if outgoing[-1][1].is_guarded and not any(t.waits for _, t in outgoing):
            out.append(
                _fail(
                    spec,
                    f"state {sid!r} needs an unguarded fallback transition last, so some "
                    "transition always fires",
                    "transitions",
                    outgoing[-1][0],
                )
            )


def _reachable(spec: WorkflowSpec, start: str, forward: bool = True) -> set[str]:
    """States reachable from `start` (or that reach it) through transitions and catch edges."""
    edges = [(t.source, t.target) for t in spec.transitions]
    edges += [(c.source, c.target) for c in spec.catch_edges()]
    edges += containment_edges(spec)
    seen, queue = {start}, deque([start])
    while queue:
        here = queue.popleft()
        for source, target in edges:
            src, dst = (source, target) if forward else (target, source)
            if src == here and dst not in seen:
                seen.add(dst)
                queue.append(dst)
    return seen


def _graph_known(spec: WorkflowSpec) -> bool:
    """Every edge of the machine joins declared states, from a declared initial one: what the
    graph checks need (else their findings would only echo an unknown name)."""
    ends = [name for t in spec.transitions for name in (t.source, t.target)]
    ends += [c.target for c in spec.catch_edges()]
    return spec.initial in spec.states and all(name in spec.states for name in ends)


def _check_graph(spec: WorkflowSpec, out: Errors) -> None:
    """Every state is reachable from the initial one, and every reachable one can finish."""
    reachable = _reachable(spec, spec.initial)
    can_finish: set[str] = set()
    for final in spec.final_states():
        can_finish |= _reachable(spec, final, forward=False)
    for sid in spec.states:
        if sid not in reachable:
            out.append(
                _fail(
                    spec,
                    f"state {sid!r} is unreachable from {spec.initial!r}",
                    "states",
                    sid,
                    "<key>",
                )
            )
        elif sid not in can_finish and spec.final_states():
            out.append(
                _fail(spec, f"state {sid!r} has no path to a final state", "states", sid, "<key>")
            )


def raise_first(errors: Sequence[WorkflowError]) -> None:
    """Raise the first of `errors` (in file order), with all of them attached; nothing when
    there are none."""
    if not errors:
        return
    first = errors[0]
    if len(errors) == 1:
        raise first
    raise type(first)(first.message, location=first.location, errors=errors) from first.__cause__


def workflow_errors(spec: WorkflowSpec, *, import_code: bool = True, proofs: bool = True) -> Errors:
    """Every problem found in `spec` itself (not the workflows it calls), in file order.
    Without `import_code`, the actions, guards and output models it names are not resolved
    (nothing is imported), nor the checks that need them; without `proofs`, cycles are not
    required to be bounded."""
    if not spec.states:
        return [_fail(spec, "a workflow needs at least one state", "states")]
    out: Errors = []
    _check_names(spec, out)
    _check_reasons(spec, out)
    _check_migrations(spec, out)
    out.extend(compound_errors(spec))
    out.extend(decide_errors(spec))
    _check_transitions(spec, out)
    _check_waits(spec, out)
    _check_parallel_flags(spec, out)
    _check_children(spec, out)
    _check_mcp(spec, out)
    out += expression_errors(spec, import_code=import_code)
    for sid, state in spec.states.items():
        _check_catches(spec, sid, state, out)
    calls_model: dict[str, bool] | None = None
    if import_code:
        calls_model = _check_refs(spec, out)
        _check_answer_flags(spec, calls_model, out)
        _check_recovery(spec, calls_model, out)
        _check_outputs(spec, calls_model, out)
    if _graph_known(spec):
        _check_fallbacks(spec, out)
        found = len(out)
        _check_graph(spec, out)
        if len(out) == found and proofs:  # a state that cannot finish loops: one error is enough
            out += cycle_errors(spec, import_code=import_code)
    return in_file_order(out, spec.path)


def validate_workflow(spec: WorkflowSpec, *, import_code: bool = True) -> None:
    """Raise WorkflowValidationError for the first problem found in file order, every problem
    in its `errors` (see workflow_errors)."""
    raise_first(workflow_errors(spec, import_code=import_code))
