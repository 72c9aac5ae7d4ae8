"""Declared variables (`variables:`) and the expressions that read and set them at run time.

A `when:` expression is one more guard of its transition (a pure function of the context, so
the machine's decision cache keys on its value like any built-in guard's). `assign:` sets
variables from expressions, all evaluated against the values before the assignment (as Step
Functions' `Assign` does); each result is checked against its variable's JSON Schema and
recorded as a `vars.assigned` event, so a resume's catch-up and a replay, which re-drive the run
from its start, compute and match the same assignments and rebuild `ctx.vars` exactly.

Python actions and guards read and write `ctx.vars` directly; `@reads(...)` and `@writes(...)`
declare which, so `validate` can report a variable read but never written.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jsonschema

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import EventType
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.expressions import ExpressionError, evaluate

__all__ = [
    "VariableError",
    "apply_assign",
    "declared_io",
    "expression_names",
    "initial_vars",
    "reads",
    "when_guard",
    "writes",
]

F = TypeVar("F", bound=Callable[..., Any])


class VariableError(FsmKernelError):
    """An `assign:` expression failed to evaluate, or its value fails the variable's schema: a
    failure of the state (retried and caught like an action's error)."""


def reads(*names: str) -> Callable[[F], F]:
    """Declare the variables a Python action or guard reads from `ctx.vars`."""

    def mark(fn: F) -> F:
        fn.__fsm_reads__ = (*getattr(fn, "__fsm_reads__", ()), *names)  # type: ignore[attr-defined]
        return fn

    return mark


def writes(*names: str) -> Callable[[F], F]:
    """Declare the variables a Python action or guard writes to `ctx.vars`."""

    def mark(fn: F) -> F:
        fn.__fsm_writes__ = (*getattr(fn, "__fsm_writes__", ()), *names)  # type: ignore[attr-defined]
        return fn

    return mark


def declared_io(fn: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The variables `fn` declares it reads and writes (see `reads`, `writes`)."""
    return tuple(getattr(fn, "__fsm_reads__", ())), tuple(getattr(fn, "__fsm_writes__", ()))


def initial_vars(variables: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each declared variable at its `default` (null without one)."""
    return {name: copy.deepcopy(schema.get("default")) for name, schema in variables.items()}


def expression_names(ctx: RunContext) -> dict[str, Any]:
    """The values of the names an expression may use (expressions.NAMES)."""
    output = ctx.last_output if ctx.last_output is not None else ctx.output
    if hasattr(output, "model_dump"):  # a pydantic output model's instance
        output = output.model_dump(mode="json")
    return {
        "iteration": ctx.iteration,
        "vars": ctx.vars,
        "output": output,
        "event": getattr(ctx, "event", None),  # set by `fsm-kernel signal` (named events)
        "tool_failures": ctx.failure_streak,
        "last_tool": ctx.tool_calls[-1].call.name if ctx.tool_calls else None,
    }


def when_guard(text: str) -> Callable[[RunContext], bool]:
    """The guard of a `when:` expression: true when it evaluates to true. An expression that
    fails to evaluate (a missing key; use has() for optional ones) fails the run, clearly."""

    def when(model: RunContext) -> bool:
        try:
            return evaluate(text, expression_names(model)) is True
        except ExpressionError as exc:
            raise VariableError(f"when: {text}: {exc}") from None

    when.__name__ = "when"
    return when


def apply_assign(
    ctx: RunContext,
    assign: Mapping[str, str],
    schemas: Mapping[str, Mapping[str, Any]],
    where: dict[str, Any],
) -> None:
    """Evaluate every expression of `assign` (against the values before it), check each value
    against its variable's schema, then set them and record one `vars.assigned` per variable
    (`where`: the state or transition). Nothing is set when one fails.

    Raises:
        VariableError: an expression failed, or a value does not fit its schema.
    """
    names = expression_names(ctx)
    values: dict[str, Any] = {}
    for name, text in assign.items():
        try:
            values[name] = evaluate(text, names)
        except ExpressionError as exc:
            raise VariableError(f"assign {name}: {text}: {exc}") from None
        _check_value(ctx, name, values[name], schemas.get(name, {}))
    for name, value in values.items():
        ctx.vars[name] = value
        ctx.record(EventType.VARS_ASSIGNED, {"name": name, "value": value, **where})


def _check_value(ctx: RunContext, name: str, value: Any, schema: Mapping[str, Any]) -> None:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(value)
    )
    if error is not None:
        raise VariableError(f"assign {name}: {value!r} does not fit its schema: {error.message}")
