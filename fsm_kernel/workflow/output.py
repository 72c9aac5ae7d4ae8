"""Structured output: the `output:` of a workflow or a state, a JSON Schema (a mapping) or a
`package.module:Model` reference to a pydantic model, resolved and checked, and the check of
each model reply against it.

Imports protocol, errors, the workflow's spec and its reference resolver (actions.resolve_ref),
plus jsonschema and pydantic; never the kernel or a model client.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jsonschema.validators
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from pydantic.errors import PydanticUserError

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import Completion, ResponseFormat
from fsm_kernel.tools import DONE_TOOL
from fsm_kernel.workflow.actions import RefError, resolve_ref
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "OutputError",
    "OutputSchema",
    "ReplyCheck",
    "as_json",
    "output_value",
    "resolve_outputs",
]

_SCHEMA_DRAFTS = (
    jsonschema.validators.Draft202012Validator,
    jsonschema.validators.Draft201909Validator,
    jsonschema.validators.Draft7Validator,
    jsonschema.validators.Draft6Validator,
    jsonschema.validators.Draft4Validator,
)
_KNOWN_DRAFTS = {
    str(v.META_SCHEMA.get("$id", v.META_SCHEMA.get("id", ""))).rstrip("#"): v
    for v in _SCHEMA_DRAFTS
}
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?```\Z", re.DOTALL)
_MAX_ERRORS = 5
"""Validation errors quoted back to the model; more only make its reply longer."""
_ERROR_CHARS = 200


class OutputError(FsmKernelError):
    """An `output:` that cannot be used; `path` is where in its value the problem is."""

    def __init__(self, message: str, path: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class ReplyCheck:
    """A reply checked against an output schema: its value, or why it is not acceptable."""

    value: Any = None
    """The validated value: a pydantic model's instance, or the parsed JSON."""
    problem: str | None = None
    """Why the reply fails the schema (the text sent back to the model), None when it passes."""
    checked: bool = False
    """The reply carried an answer to check (a text reply, or a `done` call)."""


@dataclass(frozen=True, eq=False)
class OutputSchema:
    """A resolved `output:`: the JSON Schema, and the pydantic model it came from, if any."""

    schema: dict[str, Any]
    model: type[BaseModel] | None = None
    name: str = "output"

    @classmethod
    def resolve(cls, value: Mapping[str, Any] | str) -> OutputSchema:
        """The schema of an `output:` value.

        Raises:
            OutputError: the reference does not import or is not a pydantic model, or the
                mapping is not a usable JSON Schema (`path`: where in it).
        """
        if isinstance(value, str):
            return cls._of_model(value)
        schema = dict(value)
        _check_schema(schema)
        title = schema.get("title")
        return cls(schema, None, _schema_name(title if isinstance(title, str) else "output"))

    @classmethod
    def _of_model(cls, ref: str) -> OutputSchema:
        try:
            target = resolve_ref(ref)
        except RefError as exc:
            raise OutputError(exc.message) from None
        if not (isinstance(target, type) and issubclass(target, BaseModel)):
            raise OutputError(
                f"{ref!r} is not a pydantic model (a class derived from pydantic.BaseModel)"
            )
        try:
            schema = target.model_json_schema()
        except PydanticUserError as exc:
            raise OutputError(f"{ref!r} has no JSON Schema: {exc.message}") from None
        return cls(schema, target, _schema_name(target.__name__))

    def response_format(self) -> ResponseFormat:
        """What a model is given to honour this schema."""
        return ResponseFormat(name=self.name, schema=self.schema, strict=_is_strict(self.schema))

    def check_reply(self, completion: Completion) -> ReplyCheck:
        """Check a reply's answer: its text, or the `answer` of a `done` call. A reply of other
        tool calls has no answer to check (it passes, unchecked)."""
        calls = completion.message.tool_calls
        done = next((c for c in calls if c.name == DONE_TOOL and c.arguments_error is None), None)
        if done is not None:
            answer = done.arguments.get("answer")
            text = answer if isinstance(answer, str) else json.dumps(answer)
            check = self.check_text(text)
            if check.problem is None:
                return check
            return replace(check, problem=f"the answer given to {DONE_TOOL} {check.problem}")
        if calls:
            return ReplyCheck()
        check = self.check_text(completion.message.content)
        return (
            check if check.problem is None else replace(check, problem=f"the reply {check.problem}")
        )

    def check_text(self, text: str) -> ReplyCheck:
        """Parse `text` (one surrounding code fence allowed) as JSON and validate it; a problem
        reads as a predicate ("is not JSON (...)", "does not match the output schema: ...")."""
        body = text.strip()
        fenced = _FENCE.match(body)
        if fenced is not None:
            body = fenced.group(1).strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            return ReplyCheck(problem=f"is not JSON ({exc})", checked=True)
        value, errors = self._validate(body, data)
        if errors:
            shown = "; ".join(errors[:_MAX_ERRORS])
            more = f" (and {len(errors) - _MAX_ERRORS} more)" if len(errors) > _MAX_ERRORS else ""
            return ReplyCheck(
                problem=f"does not match the output schema: {shown}{more}", checked=True
            )
        return ReplyCheck(value=value, checked=True)

    def _validate(self, body: str, data: Any) -> tuple[Any, list[str]]:
        """The validated value and, when it fails, the errors, each at its path in the value."""
        if self.model is not None:
            try:
                return self.model.model_validate_json(body), []
            except PydanticValidationError as exc:
                found = exc.errors(include_url=False, include_context=False)
                return None, [_cut(f"at {_where(e['loc'])}: {e['msg']}") for e in found]
        errors = sorted(_validator(self.schema).iter_errors(data), key=lambda e: _where(e.path))
        return data, [_cut(f"at {_where(e.absolute_path)}: {e.message}") for e in errors]


def as_json(value: Any) -> Any:
    """A validated output as JSON data: a model's instance dumped in JSON mode, parsed JSON as
    it is."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def output_value(
    spec: WorkflowSpec, state: str, calls_model: bool
) -> Mapping[str, Any] | str | None:
    """The `output:` that applies in `state`: its own, else the workflow's where a model reply
    is the run's answer (an action that calls the model, `answer: true`)."""
    own = spec.states[state].output
    if own is not None:
        return own
    if spec.output is not None and calls_model and spec.states[state].answer:
        return spec.output
    return None


def resolve_outputs(spec: WorkflowSpec, model_states: Iterable[str]) -> dict[str, OutputSchema]:
    """The output schema of every state that has one (`model_states`: the states whose action
    calls the model); the workflow's own is resolved once, for all the states it applies to."""
    shared = OutputSchema.resolve(spec.output) if spec.output is not None else None
    calls = set(model_states)
    out: dict[str, OutputSchema] = {}
    for sid, state in spec.states.items():
        value = output_value(spec, sid, sid in calls)
        if value is None:
            continue
        out[sid] = (
            shared if state.output is None and shared is not None else OutputSchema.resolve(value)
        )
    return out


# --- schemas -----------------------------------------------------------------------------------


def _validator(schema: dict[str, Any]) -> Any:
    cls = _KNOWN_DRAFTS.get(str(schema.get("$schema", "")).rstrip("#"), _SCHEMA_DRAFTS[0])
    return cls(schema)


def _check_schema(schema: dict[str, Any]) -> None:
    """Raise OutputError unless `schema` is a JSON Schema this module can check replies with."""
    odd = _not_json(schema, ())
    if odd is not None:
        path, value = odd
        raise OutputError(
            f"{value!r} is not a JSON value (a YAML date or timestamp? quote it)", path
        )
    dialect = schema.get("$schema")
    if dialect is not None and str(dialect).rstrip("#") not in _KNOWN_DRAFTS:
        known = ", ".join(sorted(_KNOWN_DRAFTS))
        raise OutputError(f"unknown $schema {dialect!r} (known: {known})", ("$schema",))
    try:
        _validator(schema).check_schema(schema)
    except SchemaError as exc:
        raise OutputError(
            f"not a valid JSON Schema: {_cut(exc.message)}", tuple(exc.absolute_path)
        ) from None
    _check_refs(schema, ())


def _not_json(node: Any, path: tuple[str | int, ...]) -> tuple[tuple[str | int, ...], Any] | None:
    """The first value in `node` that JSON cannot carry (YAML dates, infinities), and where."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                return (*path, key), key
            found = _not_json(value, (*path, key))
            if found is not None:
                return found
        return None
    if isinstance(node, list):
        for i, value in enumerate(node):
            found = _not_json(value, (*path, i))
            if found is not None:
                return found
        return None
    if isinstance(node, float) and not math.isfinite(node):
        return path, node
    if node is None or isinstance(node, str | int | float | bool):
        return None
    return path, node


def _check_refs(node: Any, path: tuple[str | int, ...]) -> None:
    """Only local references: a reply is never checked against a schema fetched from afar."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise OutputError(
                f"$ref {ref!r} points outside the schema; only local references "
                "(#/$defs/...) are supported",
                (*path, "$ref"),
            )
        for key, value in node.items():
            _check_refs(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_refs(value, (*path, i))


def _is_strict(node: Any) -> bool:
    """Whether `node` meets OpenAI's strict mode: every object closed, every property required."""
    if isinstance(node, list):
        return all(_is_strict(v) for v in node)
    if not isinstance(node, dict):
        return True
    properties = node.get("properties")
    if node.get("type") == "object" or isinstance(properties, dict):
        names = set(properties) if isinstance(properties, dict) else set()
        if (
            node.get("additionalProperties") is not False
            or set(node.get("required") or ()) != names
        ):
            return False
    return all(_is_strict(v) for k, v in node.items() if k not in ("enum", "const", "default"))


def _schema_name(name: str) -> str:
    cleaned = _NAME_CHARS.sub("_", name).strip("_")[:64]
    return cleaned or "output"


def _where(path: Iterable[Any]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _cut(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _ERROR_CHARS else flat[: _ERROR_CHARS - 1] + "…"
