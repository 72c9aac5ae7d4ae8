"""WorkflowSpec -> python-statemachine class, compiled once per workflow content.

The ONLY module that imports statemachine. The machine decides; it does not act: every
transition fires on the one event `next`, guards read the RunContext (the machine's model), and
the kernel runs each state's action before sending `next`. So the machine stays synchronous,
pure and cheap to test, and the kernel owns async work, time and cancellation.

Compound states are compiled flat: the engine has one state per state without children (and
per top-level final state), and each gets the edges of the compound states it is inside first,
outermost first, then its own (see workflow/compound.py). python-statemachine's own compound
states follow SCXML, where the innermost state's enabled edge wins; the workflow language
follows STATEMATE, where a parent's edge (a limit, an escalation, a cancel) wins from every state
inside it, which nesting in the engine cannot express. Flat, the run is always in exactly one
engine state, so the decision cache, resume and replay work as for a flat workflow; history is
the last state the run was in inside each compound state, kept by the Machine and rebuilt when a
resume or a replay re-drives the run from its start. Events carry the full path (research.think).

Every check the engine calls notes itself and its value in the step's trace as it is called, so
`transition.taken` says why the edge fired (`FiredTransition.tried`): the engine stops at an
edge's first false check, and the trace holds exactly what it evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from statemachine import StateChart
from statemachine.exceptions import StateMachineError, TransitionNotAllowed
from statemachine.io import create_machine_class_from_definition

from fsm_kernel.errors import NoTransitionError, WorkflowValidationError
from fsm_kernel.redact import Redacted
from fsm_kernel.workflow.actions import ActionDef, in_thread, resolve_action, resolve_guard
from fsm_kernel.workflow.compound import edges_tried, final_child_of, history_entry, leaves
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.deadlines import deadline_edges
from fsm_kernel.workflow.decide import Choice, compile_choices
from fsm_kernel.workflow.output import OutputSchema, resolve_outputs
from fsm_kernel.workflow.recovery import catch_matches, take_failure
from fsm_kernel.workflow.spec import COMPLETED, CatchEdge, StateSpec, TransitionSpec, WorkflowSpec
from fsm_kernel.workflow.validate import EVENT_NAME
from fsm_kernel.workflow.variables import apply_assign, initial_vars, when_guard

__all__ = ["CompiledWorkflow", "FiredTransition", "Machine", "Waits", "compile_workflow"]

Guard = Callable[[RunContext], bool]
Tried = tuple[dict[str, Any], ...]
"""The edges a step tried and their checks (see `FiredTransition.tried`)."""


@dataclass(frozen=True)
class FiredTransition:
    """The transition a step took."""

    index: int
    """Its position in the workflow's `transitions` list; a catch edge's number follows them
    (see `WorkflowSpec.catch_edges`)."""
    source: str
    target: str
    guard: str
    """The guard label ("has_tool_calls and not retries_exhausted"), "" when unguarded;
    "catch agent_error" for a catch edge."""
    reason: str | None
    final: bool
    catch: str | None = None
    """For a catch edge: the error kind of its `catch:` entry (agent_error, error, any)."""
    path_from: str | None = None
    """In a workflow with compound states: the full path of the state the run left
    (research.think), whichever state inside it the edge was declared on."""
    path_to: str | None = None
    """... and of the state it entered (research.think when the edge targets research)."""
    choice: str | None = None
    """For a `choice:` edge: its text, the model's pick (out of an agent.decide state)."""
    tried: Tried = field(default=(), compare=False)
    """Why it fired: the edges the step tried, in the order tried (those of the compound
    states the run is inside first), the last the edge taken; each
    {"edge": index, "target": declared target, "checks": [{"check": label, "value": bool}],
    "passed": bool} with the checks evaluated, up to the first false one. Empty when built
    from a log written before it was recorded. Not part of a step's identity (replay, resume
    compare the edge)."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "source": self.source,
            "target": self.target,
            "guard": self.guard,
            "reason": self.reason,
        }
        if self.catch is not None:
            data["catch"] = self.catch
        if self.path_to is not None:
            data["from"], data["to"] = self.path_from, self.path_to
        if self.choice is not None:
            data["choice"] = self.choice
        if self.tried:
            data["tried"] = list(self.tried)
        return data

    @cached_property
    def recorded(self) -> Redacted:
        """`to_dict()` as `transition.taken` records it, redacted once: a decision taken
        again reuses its FiredTransition (see `Machine.step`), so its data is built and
        redacted once per decision, not at every step."""
        return Redacted(self.to_dict())


class Machine:
    """One run's state machine: where it is, and one `step()` at a time.

    The engine (the python-statemachine instance) is built the first time a step needs it:
    a run whose every situation the engine has decided before (see `step`) never pays for one,
    which costs more than all of a short run's steps."""

    def __init__(self, compiled: CompiledWorkflow, ctx: RunContext, *, start: str | None) -> None:
        self.compiled = compiled
        self.ctx = ctx
        for name, value in initial_vars(compiled.spec.variables).items():
            ctx.vars.setdefault(name, value)  # a resume re-drives a fresh context from here
        self._sm: StateChart[Any] | None = None
        self._where: tuple[str, bool]
        self.last_inside: dict[str, str] = {}
        """Each compound state → the state the run was last in inside it (its history)."""
        self._arrive(compiled.spec.entry(start or compiled.spec.initial))

    def _arrive(self, state: str) -> None:
        compiled = self.compiled
        self._where = (state, compiled.ends_run[state])
        self.ctx.current_state = state
        for compound in compiled.ancestors[state]:
            self.last_inside[compound] = state

    def entered_data(self) -> dict[str, Any]:
        """The data of the `state.entered` event for the current state: its full path in a
        workflow with compound states ({"path": "research.think"}), else nothing."""
        return dict(self.compiled.entered[self.state].value)

    def entered_recorded(self) -> Redacted:
        """`entered_data()`, made once per state and redacted once (see `Redacted`)."""
        return self.compiled.entered[self.state]

    def _landing(self, index: int) -> str:
        """The state an edge leads to: its target, or inside a compound target its initial
        entry, or with `enter: history` where the run last was in it."""
        landing = self.compiled.landings.get(index)
        if landing is not None:
            return landing
        spec = self.compiled.spec
        edge = spec.catch_edge(index)
        if edge is not None:
            return spec.entry(edge.target)
        t = spec.transitions[index]
        if t.enter == "history":
            return history_entry(spec, t.target, self.last_inside)
        return spec.entry(t.target)

    def _engine(self) -> StateChart[Any]:
        """The engine, at the current state (built on first use)."""
        if self._sm is None:
            # The library keeps the configuration on the model (ctx.state); clear it so a
            # context reused across machines (tests, resume) starts where it is told to.
            self.ctx.__dict__.pop("state", None)
            self._sm = self.compiled.machine_class(model=self.ctx, start_value=self.state)
        return self._sm

    @property
    def state(self) -> str:
        return self._where[0]

    @property
    def is_final(self) -> bool:
        return self._where[1]

    async def advance(self) -> FiredTransition:
        """`step()`, in a thread when a user's guard may run (so it cannot block the loop)."""
        if self.compiled.user_guards:
            fired: FiredTransition = await in_thread(self.step)
        else:
            fired = self.step()
        self._assign(fired)
        return fired

    def _assign(self, fired: FiredTransition) -> None:
        """The `assign:` of the declared transition just taken (on the loop, recorded)."""
        spec = self.compiled.spec
        if fired.catch is None and spec.transitions[fired.index].assign:
            assign = spec.transitions[fired.index].assign
            apply_assign(self.ctx, assign, spec.variables, {"transition": fired.index})

    def step(self) -> FiredTransition:
        """Fire the first transition out of the current state whose guards pass.

        The engine decides each situation once: a state whose guards are all built-in (pure
        functions of the context) is decided by the values they have now, so when the same
        values come again the engine's earlier decision is taken at once (its `on` callback
        run, the state set) instead of sending the event through the engine again, and with
        it the checks the engine evaluated then (`FiredTransition.tried`), which the same
        values make the same. Users' guards always go through the engine."""
        source = self.state
        notes = self.ctx.notes
        notes.fired, notes.tried = None, []
        guards = self.compiled.pure_guards.get(source)
        key = (source, _guard_values(guards, self.ctx)) if guards is not None else None
        decided = self.compiled.decisions.get(key) if key is not None else None
        if decided is not None:
            index = decided.index
            self.compiled.on_fire[index](self.ctx)
            notes.tried = list(decided.tried)  # the same values: the same checks, in order
        else:
            index = self._send(source)
            if key is not None:
                decided = self.compiled.decisions[key] = Decision(index, tuple(notes.tried))
        target = self._landing(index)
        if self._sm is not None and self._sm.current_state_value != target:
            self._sm.current_state_value = target  # the engine went to the static target
        self._arrive(target)
        if decided is None:
            return self._fired(index, source)
        # The same decision landing in the same state is the same transition: built once.
        fired = decided.fired.get(target)
        if fired is None:
            fired = decided.fired[target] = self._fired(index, source)
        return fired

    def _fired(self, index: int, source: str) -> FiredTransition:
        spec = self.compiled.spec
        paths: dict[str, Any] = {}
        if spec.has_compound:
            paths = {"path_from": spec.state_path(source), "path_to": spec.state_path(self.state)}
        edge = spec.catch_edge(index)
        tried = tuple(self.ctx.notes.tried)
        if edge is not None:
            return FiredTransition(
                index,
                edge.source,
                edge.target,
                edge.label(),
                edge.reason,
                self.is_final,
                catch=edge.error,
                **paths,
                tried=tried,
            )
        t = spec.transitions[index]
        return FiredTransition(
            index,
            t.source,
            t.target,
            t.label(),
            t.reason,
            self.is_final,
            **paths,
            choice=t.choice,
            tried=tried,
        )

    def _send(self, source: str) -> int:
        try:
            self._engine().send(EVENT_NAME)
        except TransitionNotAllowed:
            raise NoTransitionError(
                f"no transition out of {source!r} had its guards pass", run_id=self.ctx.run_id
            ) from None
        finally:  # where the engine is, even when a guard raised (history: see `step`)
            here = str(next(iter(self._engine().configuration_values)))
            self._where = (here, self.compiled.spec.ends_run(here))
            self.ctx.current_state = here
        index = self.ctx.notes.fired
        assert index is not None, "a fired transition always marks itself"
        return index


@dataclass
class Decision:
    """What the engine decided in one situation (a state and its guards' values): the
    transition it fired, the checks it evaluated on the way (`FiredTransition.tried`), and
    the FiredTransition of each state the decision landed in (one, unless the edge enters a
    compound state's history), reused when the decision is taken again."""

    index: int
    tried: Tried
    fired: dict[str, FiredTransition] = field(default_factory=dict)


@dataclass(frozen=True)
class Waits:
    """What a waiting state waits for: its events (file order) and timers (edge index,
    seconds), and whether it has guarded edges to try before it waits."""

    events: tuple[str, ...]
    timers: tuple[tuple[int, float], ...]
    guarded: bool


def _waits(spec: WorkflowSpec) -> dict[str, Waits]:
    out: dict[str, Waits] = {}
    for sid, state in spec.states.items():
        edges = [(i, t) for i, t in enumerate(spec.transitions) if t.source == sid]
        if state.action or state.is_compound or not any(t.waits for _, t in edges):
            continue  # a compound state's `after:` is a deadline (deadlines.py), not a wait
        events = tuple(dict.fromkeys(t.event for _, t in edges if t.event is not None))
        timers = tuple((i, t.after_seconds) for i, t in edges if t.after_seconds is not None)
        outer = set(spec.ancestors(sid))  # the compound states around it: their edges first
        inherited = any(t.source in outer for t in spec.transitions)
        out[sid] = Waits(events, timers, inherited or any(not t.waits for _, t in edges))
    return out


class CompiledWorkflow:
    """A workflow ready to run: its machine class, its resolved actions and output schemas."""

    def __init__(self, spec: WorkflowSpec) -> None:
        self.spec = spec
        self.actions: dict[str, ActionDef] = {
            sid: _assigning(resolve_action(s.action), spec, sid)
            for sid, s in spec.states.items()
            if s.action
        }
        self.outputs: dict[str, OutputSchema] = resolve_outputs(
            spec, [sid for sid, a in self.actions.items() if a.calls_model]
        )
        states = _state_definitions(spec)
        self.choices: dict[str, tuple[Choice, ...]] = compile_choices(spec, states)
        """Each agent.decide state's choices (its choice edges now pass when picked)."""
        self.user_guards = any(t.has_user_guard for t in spec.transitions)
        self.on_fire: dict[int, Callable[[RunContext], None]] = {}
        """Each transition's `on` callback (by index), run when a decision is taken again."""
        self.targets: dict[int, str] = {}
        self.pure_guards: dict[str, tuple[tuple[tuple[Guard, ...], tuple[Guard, ...]], ...]] = {}
        """The (cond, unless) guards of each edge tried in a state whose guards are all
        built-in, in the engine's order."""
        for sid, sdef in states.items():
            defs = sdef.get("transitions", [])
            for td in defs:
                index = td["on"].fired_index
                self.on_fire[index], self.targets[index] = td["on"], td["target"]
            tried = edges_tried(spec, sid) if sid in spec.states else []
            if not any(spec.transitions[i].has_user_guard for i in tried):
                self.pure_guards[sid] = tuple(
                    (tuple(td.get("cond", ())), tuple(td.get("unless", ()))) for td in defs
                )
            for td in defs:  # after: the decision cache's key is of the guards themselves
                _trace(td, spec)
        self.waits: dict[str, Waits] = _waits(spec)
        """The waiting states (no action; edges on events or timers) and what they wait for."""
        self.deadlines = deadline_edges(spec)
        """The compound states with `after:` edges, and those edges (see deadlines.py)."""
        self.decisions: dict[tuple[str, tuple[bool | None, ...]], Decision] = {}
        """(state, its guards' values) → the transition the engine fired for them, and the
        checks it evaluated on the way (`FiredTransition.tried`)."""
        # Per-state facts the machine reads at every step, as plain dicts (the spec's
        # methods read pydantic private attributes and build lists each time).
        self.ancestors: dict[str, tuple[str, ...]] = {
            sid: tuple(spec.ancestors(sid)) for sid in spec.states
        }
        self.ends_run: dict[str, bool] = {sid: spec.ends_run(sid) for sid in spec.states}
        self.entered: dict[str, Redacted] = {
            sid: Redacted({"path": spec.state_path(sid)} if spec.has_compound else {})
            for sid in spec.states
        }
        """Each state's `state.entered` data (see `Machine.entered_data`)."""
        self.landings: dict[int, str] = _static_landings(spec)
        """The state each edge leads to, for the edges that lead to the same one every
        time (all but those entering a compound state's history)."""
        self.machine_class = _build_class(spec, states)  # after: the factory consumes `states`

    def instantiate(self, ctx: RunContext, *, start: str | None = None) -> Machine:
        """A machine for one run, at `start` (default: the initial state)."""
        if start is not None and start not in self.spec.states:
            raise NoTransitionError(f"unknown state {start!r}")
        return Machine(self, ctx, start=start)


def _static_landings(spec: WorkflowSpec) -> dict[int, str]:
    """Edge index → the state a run is in once it takes the edge (`WorkflowSpec.entry` of
    its target), for every edge but those with `enter: history`."""
    targets = {i: t.target for i, t in enumerate(spec.transitions) if t.enter != "history"}
    targets.update((edge.index, edge.target) for edge in spec.catch_edges())
    return {i: spec.entry(target) for i, target in targets.items() if target in spec.states}


def _guard_values(
    edges: tuple[tuple[tuple[Guard, ...], tuple[Guard, ...]], ...], ctx: RunContext
) -> tuple[bool | None, ...]:
    """The decision cache's key: each edge's guard values as the engine reads them, in order,
    each edge's ending at the first that rules it out (a later one is never evaluated there: an
    event edge's `when:` reading `event.data` is not, while a timer wakes the state)."""
    values: list[bool | None] = []
    for conds, unless in edges:
        for cond in conds:
            values.append(bool(cond(ctx)))
            if not values[-1]:
                break
        else:
            for guard in unless:
                values.append(bool(guard(ctx)))
                if values[-1]:
                    break
        values.append(None)  # the next edge's values
    return tuple(values)


def _labelled(fn: Guard, label: str) -> Guard:
    """`fn`, named as a step's trace names the check (`FiredTransition.tried`)."""
    fn.check_label = label  # type: ignore[attr-defined]
    return fn


def _guard_fn(name: str) -> Guard:
    fn = resolve_guard(name)

    def guard(model: RunContext) -> bool:
        return bool(fn(model))

    guard.__name__ = name.replace(".", "_").replace(":", "_")
    return _labelled(guard, name)


def _entry(tried: list[dict[str, Any]], index: int, target: str) -> dict[str, Any]:
    """The trace's entry of edge `index`: the last one, or a new one when the engine moved on
    to this edge (it tries each edge once per step, its checks one after another)."""
    if not tried or tried[-1]["edge"] != index:
        tried.append({"edge": index, "target": target, "checks": [], "passed": False})
    return tried[-1]


def _traced(fn: Guard, index: int, target: str, label: str, negate: bool) -> Guard:
    """`fn` as the engine calls it, noting the check and its value in the step's trace
    (`KernelNotes.tried`); an `unless:` check's value is that of `not <name>`."""

    def check(model: RunContext) -> bool:
        value = fn(model)
        entry = _entry(model.notes.tried, index, target)
        entry["checks"].append({"check": label, "value": bool(value) is not negate})
        return value

    check.__name__ = getattr(fn, "__name__", "check")
    return check


def _trace(td: dict[str, Any], spec: WorkflowSpec) -> None:
    """Make the checks of transition definition `td` note themselves in the step's trace."""
    index = td["on"].fired_index
    t = spec.transitions[index] if index < len(spec.transitions) else None
    target = td["on"].declared_target
    for key, negate in (("cond", False), ("unless", True)):
        if key in td:
            td[key] = [
                _traced(fn, index, target, ("not " if negate else "") + _label(fn, t), negate)
                for fn in td[key]
            ]


def _label(fn: Guard, t: TransitionSpec | None) -> str:
    """The check's label: what the compiler gave it, or for the conditions agent.decide puts
    on its state's edges (workflow/decide.py) the pick, or that no choice was offered."""
    label = getattr(fn, "check_label", None)
    if label is not None:
        return str(label)
    if t is not None and t.choice is not None:
        return f"choice {t.choice}"
    return "no choice offered" if t is not None and not t.is_guarded else fn.__name__


def _mark(index: int, target: str) -> Callable[[RunContext], None]:
    def mark_fired(model: RunContext) -> None:
        model.notes.fired = index
        _entry(model.notes.tried, index, target)["passed"] = True

    mark_fired.fired_index = index  # type: ignore[attr-defined]
    mark_fired.declared_target = target  # type: ignore[attr-defined]
    return mark_fired


def _woken_by(index: int, t: TransitionSpec) -> Guard:
    """The condition of an `event:` / `after:` edge: the run is woken by that event, or by
    this edge's timer (see `KernelNotes.trigger`)."""
    wanted: tuple[str, str | int] = ("event", t.event) if t.event is not None else ("timer", index)

    def woken(model: RunContext) -> bool:
        return model.notes.trigger == wanted

    woken.__name__ = f"event_{t.event}" if t.event is not None else f"after_{index}"
    return _labelled(woken, f"event {t.event}" if t.event is not None else f"after {t.after}")


def _completed(holds: bool) -> Guard:
    """`completed` as tried in one state: whether it is a final child of the edge's source is
    known when compiling (see workflow/compound.py)."""

    def completed(model: RunContext) -> bool:
        return holds

    return _labelled(completed, COMPLETED)


def _transition_def(index: int, t: TransitionSpec, spec: WorkflowSpec, leaf: str) -> dict[str, Any]:
    """Edge `index` as tried in `leaf` (its source, or a state inside it); the engine's target
    is where the edge enters (`Machine._landing` moves it on to a state's history)."""
    td: dict[str, Any] = {
        "event": EVENT_NAME,
        "target": spec.entry(t.target),
        "on": _mark(index, t.target),
    }

    def guard(name: str) -> Guard:
        if name == COMPLETED:
            return _completed(final_child_of(spec, leaf, t.source))
        return _guard_fn(name)

    conds = [_woken_by(index, t)] if t.waits else []
    conds += [guard(g) for g in t.guard]
    if t.when is not None:
        conds.append(_labelled(when_guard(t.when), f"when: {t.when}"))
    if conds:
        td["cond"] = conds
    if t.unless:
        td["unless"] = [guard(g) for g in t.unless]
    return td


def _catch_def(edge: CatchEdge, state: StateSpec) -> dict[str, Any]:
    """A catch entry as a transition: it passes only right after the state's action failed
    with an error this entry is the first to handle; firing it makes the failure `ctx.caught`."""

    def caught_here(model: RunContext) -> bool:
        return catch_matches(model, state, edge.position)

    def route(model: RunContext) -> None:
        model.notes.fired = edge.index
        _entry(model.notes.tried, edge.index, edge.target)["passed"] = True
        take_failure(model)

    route.fired_index = edge.index  # type: ignore[attr-defined]
    route.declared_target = edge.target  # type: ignore[attr-defined]

    caught_here.__name__ = f"catch_{edge.position}_{edge.error}"
    _labelled(caught_here, edge.label())
    return {"event": EVENT_NAME, "target": edge.target, "cond": [caught_here], "on": route}


def _state_definitions(spec: WorkflowSpec) -> dict[str, Any]:
    """The machine's states and their transitions, as python-statemachine's factory takes
    them: one per state without children and per top-level final state; in each, the edges of
    the compound states it is inside (outermost first), then its catch edges, then its own
    declared transitions, each in file order."""
    engine = [*leaves(spec), *spec.final_states()]
    first = spec.entry(spec.initial)
    states: dict[str, Any] = {
        sid: {"initial": sid == first, "final": spec.ends_run(sid), "transitions": []}
        for sid in engine
    }
    catches: dict[str, list[CatchEdge]] = {}
    for edge in spec.catch_edges():
        catches.setdefault(edge.source, []).append(edge)
    for leaf in leaves(spec):
        defs = states[leaf]["transitions"]
        tried = edges_tried(spec, leaf)
        own = [i for i in tried if spec.transitions[i].source == leaf]
        for i in tried:
            if i == (own[0] if own else None):  # catch edges: before the state's own edges
                defs += [_catch_def(e, spec.states[leaf]) for e in catches.pop(leaf, [])]
            defs.append(_transition_def(i, spec.transitions[i], spec, leaf))
        defs += [_catch_def(e, spec.states[leaf]) for e in catches.pop(leaf, [])]
    for sdef in states.values():
        if not sdef["transitions"]:
            del sdef["transitions"]
    return states


def _build_class(spec: WorkflowSpec, states: dict[str, Any]) -> type[StateChart[Any]]:
    try:
        cls: type[StateChart[Any]] = create_machine_class_from_definition(
            _class_name(spec),
            states=states,
            catch_errors_as_events=False,  # a raising guard must reach the kernel, not vanish
            allow_event_without_transition=False,
        )
    except (StateMachineError, KeyError, TypeError) as exc:
        raise WorkflowValidationError(
            f"cannot compile workflow: {exc}", location=spec.path
        ) from exc
    return cls


def _class_name(spec: WorkflowSpec) -> str:
    base = "".join(part.capitalize() for part in spec.name.replace("-", "_").split("_"))
    return f"{base or 'Workflow'}_{spec.content_hash[:12] or 'inline'}"


_CACHE: dict[tuple[str, str], CompiledWorkflow] = {}


def compile_workflow(spec: WorkflowSpec) -> CompiledWorkflow:
    """Compile once per workflow content: python-statemachine registers every class it creates
    globally, so recompiling per run would leak. Limits are not part of the machine: a run gets
    them from the Kernel (`Kernel(..., limits=)`)."""
    key = (spec.path, spec.content_hash or spec.model_dump_json())
    compiled = _CACHE.get(key)
    if compiled is None:
        compiled = _CACHE[key] = CompiledWorkflow(spec)
    return compiled


def _assigning(action: ActionDef, spec: WorkflowSpec, sid: str) -> ActionDef:
    """`action`, followed by its state's `assign:` (part of the action: a value that fails
    its schema is the action's failure, retried and caught as one). A model reply that was
    malformed output assigns nothing: there is no output to read, and the state's
    `malformed_output` edge (or the limit) decides what happens next, as without `assign:`."""
    assign = spec.states[sid].assign
    if not assign:
        return action

    async def act_then_assign(ctx: RunContext) -> None:
        await action(ctx)
        if action.calls_model and ctx.malformed_reason is not None:
            return
        apply_assign(ctx, assign, spec.variables, {"state": sid})

    return replace(action, fn=act_then_assign)
