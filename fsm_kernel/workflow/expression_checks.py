"""What `validate` reports about expressions and declared variables (see workflow/validate.py).

Every `when:` and `assign:` value is parsed and type-checked (workflow/expressions.py) against
the names an expression may use and the declared variables' types; a problem is reported at
its place inside the expression (`file:line:col`). Also: a variable's schema or default that is
not valid, an `assign:` to an undeclared variable or of a value whose type cannot fit, and a
variable read (by an expression or a `@reads` declaration) that nothing writes and that has no
default.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.actions import RefError, resolve_ref
from fsm_kernel.workflow.expressions import Problem, check, schema_type, value_fits
from fsm_kernel.workflow.spec import SourceLocation, WorkflowSpec
from fsm_kernel.workflow.variables import declared_io

__all__ = ["expression_errors"]

Keys = tuple[Any, ...]


def expression_errors(spec: WorkflowSpec, *, import_code: bool = True) -> list[WorkflowError]:
    """Every problem with the workflow's expressions and variables."""
    out: list[WorkflowError] = []
    _check_schemas(spec, out)
    types = {name: schema_type(schema) for name, schema in spec.variables.items()}
    reads: set[str] = set()
    writes: set[str] = set()
    for keys, text in _whens(spec):
        checked = check(text, types)
        reads |= checked.reads
        _report(spec, keys, checked.problems, out)
        if not checked.problems and checked.kind not in ("bool", "dyn"):
            out.append(_at(spec, keys, f"when: must be a bool expression, not {checked.kind}"))
    for keys, name, text in _assigns(spec):
        writes.add(name)
        checked = check(text, types)
        reads |= checked.reads
        _report(spec, keys, checked.problems, out)
        _check_target(spec, keys, name, checked.kind, types, out)
    if import_code:
        _declared(spec, reads, writes)
    _check_unwritten(spec, reads - writes, out)
    return out


def _whens(spec: WorkflowSpec) -> Iterator[tuple[Keys, str]]:
    for i, t in enumerate(spec.transitions):
        if t.when is not None:
            yield ("transitions", i, "when"), t.when


def _assigns(spec: WorkflowSpec) -> Iterator[tuple[Keys, str, str]]:
    for sid, state in spec.states.items():
        for name, text in state.assign.items():
            yield ("states", sid, "assign", name), name, text
    for i, t in enumerate(spec.transitions):
        for name, text in t.assign.items():
            yield ("transitions", i, "assign", name), name, text


def _check_schemas(spec: WorkflowSpec, out: list[WorkflowError]) -> None:
    for name, schema in spec.variables.items():
        keys = ("variables", name)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            out.append(
                _at(spec, keys, f"variable {name!r}: not a valid JSON Schema: {exc.message}")
            )
            continue
        if "default" in schema:
            errors = jsonschema.Draft202012Validator(schema).iter_errors(schema["default"])
            error = jsonschema.exceptions.best_match(errors)
            if error is not None:
                message = f"variable {name!r}: its default does not fit its schema: {error.message}"
                out.append(_at(spec, (*keys, "default"), message))
    for sid, state in spec.states.items():
        if state.assign and not state.action:
            message = (
                f"state {sid!r} has assign: but no action (a state's assign: runs after its "
                "action); put it on a transition"
            )
            out.append(_at(spec, ("states", sid, "assign"), message))


def _check_target(
    spec: WorkflowSpec,
    keys: Keys,
    name: str,
    kind: str,
    types: dict[str, str],
    out: list[WorkflowError],
) -> None:
    if name not in types:
        declared = ", ".join(sorted(types)) or "none declared"
        message = f"assign: unknown variable {name!r} (declare it under variables:; {declared})"
        out.append(_at(spec, (*keys, "<key>"), message))
    elif not value_fits(kind, types[name]):
        message = f"assign {name}: the expression is {kind}, the variable is {types[name]}"
        out.append(_at(spec, keys, message))


def _declared(spec: WorkflowSpec, reads: set[str], writes: set[str]) -> None:
    """Add what the workflow's Python actions and guards declare (@reads, @writes)."""
    refs: list[Any] = []
    names = [s.action for s in spec.states.values() if s.action]
    names += [name for t in spec.transitions for name in (*t.guard, *t.unless)]
    for name in names:
        if ":" not in name:  # a built-in: reads and writes no variable
            continue
        try:
            refs.append(resolve_ref(name))
        except RefError:  # reported by validate's own check
            continue
    for fn in refs:
        read, written = declared_io(fn)
        reads.update(read)
        writes.update(written)


def _check_unwritten(spec: WorkflowSpec, unwritten: set[str], out: list[WorkflowError]) -> None:
    for name in sorted(unwritten):
        schema = spec.variables.get(name)
        if schema is None or "default" in schema:
            continue
        message = (
            f"variable {name!r} is read but never written (no assign: or @writes sets it) and "
            "has no default: it is always null"
        )
        out.append(_at(spec, ("variables", name), message))


def _report(spec: WorkflowSpec, keys: Keys, problems: list[Problem], out: list[Any]) -> None:
    for problem in problems:
        out.append(WorkflowValidationError(problem.message, location=_inside(spec, keys, problem)))


def _at(spec: WorkflowSpec, keys: Keys, message: str) -> WorkflowValidationError:
    return WorkflowValidationError(message, location=spec.location(*keys) or spec.path)


def _inside(spec: WorkflowSpec, keys: Keys, problem: Problem) -> SourceLocation | str:
    """Where `problem` is in the file: the expression's place plus its line and column
    inside it (past the opening quote of a quoted scalar)."""
    loc = spec.location(*keys)
    if loc is None:
        return spec.path
    if problem.line > 1:  # a multi-line scalar: its own lines
        return SourceLocation(loc.path, loc.line + problem.line - 1, problem.col)
    quote = 1 if _char_at(loc) in ("'", '"') else 0
    return SourceLocation(loc.path, loc.line, loc.col + quote + problem.col - 1)


def _char_at(loc: SourceLocation) -> str:
    try:
        with open(loc.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if number == loc.line:
                    return line[loc.col - 1 : loc.col]
    except OSError:
        return ""
    return ""
