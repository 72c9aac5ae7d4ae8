"""Edges the model chooses: the `choice:` edges out of an `agent.decide` state.

The state's action (`agent.decide`, in actions.py) offers the model the choices whose edges'
guards hold (`guard`, `unless`, `when`: whatever the compiler tests for an edge), as one tool,
`choose`, whose only argument is an `enum` of those texts, and forces the call. The model's
pick is `ctx.choice`; in the machine, a choice edge then passes exactly when it was picked (its
own guards were tested before asking), and the state's unguarded edge without a choice, its
fallback, only when no choice was offered (the model was not asked). An illegal pick is
malformed output. The pick is derived from the recorded reply, so a resume or a replay, served
the same reply, takes the same edge without asking.

Here: the choices as the compiler builds them, the tool, reading a pick from a reply, and the
checks `validate` makes. Imports protocol, errors, spec and context only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.protocol import Completion, Tool
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "CHOOSE",
    "DECIDE",
    "Choice",
    "choose_tool",
    "compile_choices",
    "decide_errors",
    "decides",
    "legal_choices",
    "pick_of",
    "undecided",
]

DECIDE = "agent.decide"
"""The built-in action whose state's edges the model chooses."""
CHOOSE = "choose"
"""The one tool an agent.decide request offers (and forces)."""

Guard = Callable[[RunContext], bool]


@dataclass(frozen=True)
class Choice:
    """A `choice:` edge as the compiler built it: its text, and whether its guards hold."""

    index: int
    """The edge's place in the workflow's `transitions:`."""
    text: str
    target: str
    holds: Guard
    """The edge's own guards (guard, unless, when), all of them: whether it may be offered."""
    user_code: bool = False
    """Its guards include a user's (`package.module:function`): tested off the event loop."""


def decides(spec: WorkflowSpec, sid: str) -> bool:
    """`sid` is a state whose action is agent.decide."""
    state = spec.states.get(sid)
    return state is not None and state.action == DECIDE


def legal_choices(ctx: RunContext) -> tuple[str, ...]:
    """The texts of the current state's choices whose guards hold now, in file order."""
    return tuple(c.text for c in ctx.choices.get(ctx.current_state, ()) if c.holds(ctx))


def choose_tool(offered: Sequence[str]) -> Tool:
    """The tool the model picks with: one string argument, one of `offered` (an `enum`, which
    a server's or llama.cpp's constrained decoding keeps the model to)."""
    listed = "; ".join(json.dumps(text, ensure_ascii=False) for text in offered)
    return Tool(
        name=CHOOSE,
        description=f"Choose what happens next: call this once with exactly one of: {listed}.",
        parameters={
            "type": "object",
            "properties": {
                "choice": {
                    "type": "string",
                    "enum": list(offered),
                    "description": "The choice, exactly as offered",
                }
            },
            "required": ["choice"],
            "additionalProperties": False,
        },
    )


def pick_of(completion: Completion, offered: Sequence[str]) -> tuple[str | None, str | None]:
    """(the choice picked, None) from a reply, or (None, why the reply is malformed): it must
    be exactly one call of `choose` whose `choice` is one of `offered`."""
    calls = completion.message.tool_calls
    if not calls:
        return None, f"the reply did not call {CHOOSE} (it answered in text)"
    if len(calls) > 1:
        return None, f"the reply made {len(calls)} tool calls; call {CHOOSE} once"
    call = calls[0]
    if call.name != CHOOSE:
        return None, f"tool {call.name!r} was not offered (offered: {CHOOSE})"
    if call.arguments_error is not None:
        return None, f"tool call {CHOOSE!r} has arguments that are not JSON: {call.arguments_error}"
    picked = call.arguments.get("choice")
    text = picked.strip() if isinstance(picked, str) else None
    if text in offered:
        return text, None
    shown = json.dumps(picked, ensure_ascii=False)[:200]
    listed = ", ".join(json.dumps(t, ensure_ascii=False) for t in offered)
    return None, f"{shown} is not one of the offered choices ({listed})"


def undecided(spec: WorkflowSpec, sid: str, ctx: RunContext) -> bool:
    """`sid` is an agent.decide state that offered choices and got no legal pick: its replies
    were malformed until the retries ran out, or a limit stopped them."""
    return decides(spec, sid) and bool(ctx.offered_choices) and ctx.choice is None


# --- the compiler's part ------------------------------------------------------------------


def compile_choices(
    spec: WorkflowSpec, states: Mapping[str, Mapping[str, Any]]
) -> dict[str, tuple[Choice, ...]]:
    """The choices of every agent.decide state, taken from the engine's state definitions
    (python-statemachine's factory form, changed in place): a choice edge's conditions become
    the choice's `holds`, and the edge itself passes when the model picked it; the state's
    unguarded edges without a choice pass only when no choice was offered."""
    out: dict[str, tuple[Choice, ...]] = {}
    for sid, sdef in states.items():
        if not decides(spec, sid):
            continue
        choices = []
        for td in sdef.get("transitions", ()):
            index = td["on"].fired_index
            t = spec.transitions[index] if index < len(spec.transitions) else None
            if t is None or t.source != sid:  # a catch edge, or the edge of a state it is inside
                continue
            if t.choice is not None:
                holds = _all_hold(td.get("cond", ()), td.get("unless", ()))
                choices.append(Choice(index, t.choice, t.target, holds, t.has_user_guard))
                td["cond"] = [_picked(index, t.choice)]
                td.pop("unless", None)
            elif not t.is_guarded:
                td["cond"] = [_none_offered(index)]
        out[sid] = tuple(choices)
    return out


def _all_hold(conds: Iterable[Guard], unless: Iterable[Guard]) -> Guard:
    conds, unless = tuple(conds), tuple(unless)

    def holds(ctx: RunContext) -> bool:
        return all(c(ctx) for c in conds) and not any(u(ctx) for u in unless)

    return holds


def _picked(index: int, text: str) -> Guard:
    def picked(model: RunContext) -> bool:
        return model.choice == text

    picked.__name__ = f"choice_{index}"
    return picked


def _none_offered(index: int) -> Guard:
    def none_offered(model: RunContext) -> bool:
        return not model.offered_choices

    none_offered.__name__ = f"no_choice_{index}"
    return none_offered


# --- validate's part ----------------------------------------------------------------------

_MODEL_KEYS = ("tools", "tool_choice", "output")
"""State keys that shape what agent.think offers: agent.decide offers its choices alone."""


def decide_errors(spec: WorkflowSpec) -> list[WorkflowError]:
    """An agent.decide state has choices (unique, non-empty texts), keeps no keys that only
    agent.think uses, and has a fallback when its every choice is guarded; `choice:` only on
    edges out of an agent.decide state."""
    out: list[WorkflowError] = []
    seen: dict[tuple[str, str], int] = {}
    for i, t in enumerate(spec.transitions):
        if t.choice is None:
            continue
        where = ("transitions", i, "choice")
        state = spec.states.get(t.source)
        if state is not None and state.action != DECIDE:
            runs = f"runs {state.action}" if state.action else "has no action"
            message = f"'choice:' only on edges out of an {DECIDE} state; {t.source!r} {runs}"
            out.append(_fail(spec, message, *where))
            continue
        text = t.choice.strip()
        if not text or text != t.choice:
            out.append(_fail(spec, _bad_text(t.choice), *where))
        earlier = seen.setdefault((t.source, text), i)
        if earlier != i:
            message = (
                f"choice {text!r} is offered twice out of {t.source!r} (transitions[{earlier}] "
                "has it): each choice names one edge"
            )
            out.append(_fail(spec, message, *where))
    for sid, state in spec.states.items():
        if state.action == DECIDE:
            out += _state_errors(spec, sid)
    return out


def _bad_text(text: str) -> str:
    if not text.strip():
        return "a choice needs a text: what the model is offered (e.g. 'look something up')"
    return f"choice {text!r} starts or ends with spaces; the model is offered it as written"


def _state_errors(spec: WorkflowSpec, sid: str) -> list[WorkflowError]:
    state = spec.states[sid]
    out: list[WorkflowError] = [
        _fail(
            spec,
            f"'{key}' does nothing on state {sid!r}: {DECIDE} offers the model its choices "
            f"alone (the {CHOOSE} tool)",
            "states",
            sid,
            key,
        )
        for key in _MODEL_KEYS
        if getattr(state, key) is not None
    ]
    edges = spec.transitions_from(sid)
    choices = [t for _, t in edges if t.is_choice]
    if not choices:
        message = (
            f"state {sid!r} runs {DECIDE} but no transition out of it has a 'choice:': add "
            "one edge per choice the model may make"
        )
        return [*out, _fail(spec, message, "states", sid, "action")]
    fallbacks = [i for i, t in edges if not t.is_guarded]
    for i in fallbacks[1:]:
        message = (
            f"transition never fires: the unguarded transition from {sid!r} above it is taken "
            "whenever no choice is offered"
        )
        out.append(_fail(spec, message, "transitions", i))
    if not fallbacks and all(t.guard or t.unless or t.when for t in choices):
        message = (
            f"every choice out of {sid!r} is guarded, so at times none is offered: add an "
            "unguarded transition without 'choice:' (last), taken then without asking the model"
        )
        out.append(_fail(spec, message, "transitions", edges[-1][0]))
    return out


def _fail(spec: WorkflowSpec, message: str, *keys: object) -> WorkflowValidationError:
    return WorkflowValidationError(message, location=spec.location(*keys) or spec.path)
