"""Structured output: the `output:` of a workflow or a state, a JSON Schema (a mapping) or a
`package.module:Model` reference to a pydantic model, resolved and checked, and the check of
each model reply against it.

Imports protocol, errors, the workflow's spec and its reference resolver (actions.resolve_ref),
plus jsonschema and pydantic; never the kernel or a model client.

Whatever a reply holds, checking it is bounded work and never raises: JSON nested deeper than
MAX_OUTPUT_DEPTH is malformed output, and a schema with `pattern`s (the author's regular
expressions, matched against the model's text by Python's backtracking `re`) is checked in a
process of its own under a PATTERN_CHECK_SECONDS deadline (`_schema_check.py`). A schema whose
`$ref`s loop without descending into the value is refused when it is resolved.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jsonschema.validators
import referencing
import referencing.jsonschema
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from pydantic.errors import PydanticUserError
from referencing.exceptions import Unresolvable

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import Completion, ResponseFormat
from fsm_kernel.tools import DONE_TOOL
from fsm_kernel.workflow.actions import RefError, resolve_ref
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "MAX_OUTPUT_DEPTH",
    "PATTERN_CHECK_SECONDS",
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
MAX_OUTPUT_DEPTH = 64
"""The deepest a structured answer may nest (arrays and objects); deeper is malformed output."""
PATTERN_CHECK_SECONDS = 2.0
"""How long checking one reply against a schema with `pattern`s may take; longer is malformed
output (the check runs in a process of its own, so it can be stopped)."""
_WORKER_START_SECONDS = 10.0
"""What the checking process may take to start and answer besides PATTERN_CHECK_SECONDS (it
stops itself at the deadline; this bounds a process that does not)."""
_WORKER = Path(__file__).with_name("_schema_check.py")
_TOO_DEEP = f"nests deeper than {MAX_OUTPUT_DEPTH} levels of arrays and objects"
_UNCHECKABLE = "the value nests too deeply to be checked"


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
    patterns: bool = field(default=False, repr=False)
    """The schema has `pattern`s: replies are checked against it in a process of its own."""

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
        name = _schema_name(title if isinstance(title, str) else "output")
        return cls(schema, None, name, patterns=_has_patterns(schema))

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
            text = answer if isinstance(answer, str) else _dumped(answer)
            check = self.check_text(text) if text is not None else _deep()
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
        except (
            RecursionError
        ):  # the parser's own limit, below MAX_OUTPUT_DEPTH when the stack is deep
            return _deep()
        if _depth(data) > MAX_OUTPUT_DEPTH:
            return _deep()
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
        if self.patterns:
            return data, _checked_apart(self.schema, data)
        try:
            errors = [
                (list(e.absolute_path), e.message)
                for e in _validator(self.schema).iter_errors(data)
            ]
        except RecursionError:  # the value nests too deeply for the stack left: never a crash
            return data, [_UNCHECKABLE]
        return data, _shown_errors(errors)


def _deep() -> ReplyCheck:
    return ReplyCheck(problem=_TOO_DEEP, checked=True)


def _dumped(value: Any) -> str | None:
    """`value` (a `done` call's answer that is not a string) as JSON text; None when it nests
    too deeply to be JSON at all."""
    if _depth(value) > MAX_OUTPUT_DEPTH:
        return None
    return json.dumps(value)


def _depth(value: Any) -> int:
    """How deep `value` nests lists and dicts (a scalar: 0); iterative, so any depth is fine."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, level + 1)
            stack.extend((item, level + 1) for item in node if isinstance(item, dict | list))
    return deepest


def _shown_errors(errors: Iterable[tuple[list[Any], str]]) -> list[str]:
    """Validation errors as quoted back to the model, in the order of where they are."""
    ordered = sorted(errors, key=lambda e: _where(e[0]))
    return [_cut(f"at {_where(path)}: {message}") for path, message in ordered]


def _checked_apart(schema: dict[str, Any], data: Any) -> list[str]:
    """Validate `data` in a process of its own, which stops at PATTERN_CHECK_SECONDS: a
    pattern that backtracks without end costs that long, never the run's whole time."""
    request = {
        "validator": type(_validator(schema)).__name__,
        "schema": schema,
        "data": data,
        "seconds": PATTERN_CHECK_SECONDS,
    }
    slow = (
        f"could not be checked against the output schema's patterns within "
        f"{PATTERN_CHECK_SECONDS:g} s (a string too long or too repetitive for them)"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-P", str(_WORKER)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=PATTERN_CHECK_SECONDS + _WORKER_START_SECONDS,
            check=False,
        )
        answer = json.loads(done.stdout)
    except subprocess.TimeoutExpired:
        return [slow]
    except (OSError, ValueError) as exc:
        return [_cut(f"could not be checked against the output schema ({exc})")]
    stopped = answer.get("stopped")
    if stopped is not None:
        return [slow if stopped == "timeout" else _UNCHECKABLE]
    return _shown_errors((list(path), str(message)) for path, message in answer["errors"])


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
    _check_ref_loops(schema)


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


_IN_PLACE_ONE = ("not", "if", "then", "else")
"""Keywords whose schema applies to the value itself (not to a part of it)."""
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas", "dependencies")
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_Path = tuple[str | int, ...]
_Resolver = Any
"""A `referencing` resolver: where a `$ref` is looked up from (its scope's base URI)."""
_Step = tuple[Any, _Resolver, _Path, str]
"""A schema the value is checked against next: node, its resolver, its path, how it got there."""


def _has_patterns(node: Any) -> bool:
    """Whether a schema (or any schema in it) has `pattern` or `patternProperties`."""
    if isinstance(node, list):
        return any(_has_patterns(v) for v in node)
    if not isinstance(node, dict):
        return False
    if isinstance(node.get("pattern"), str) or isinstance(node.get("patternProperties"), dict):
        return True
    return any(_has_patterns(v) for v in node.values())


def _check_ref_loops(schema: dict[str, Any]) -> None:
    """Raise OutputError for a `$ref` that leads back to itself without descending into the
    value (`$ref: "#"` at the top, or $defs a → b → a): checking any value against it would
    never end. A loop through `properties` or `items` is a recursive schema, and fine."""
    cls = type(_validator(schema))
    dialect = str(cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id", "")))
    spec = referencing.jsonschema.specification_with(dialect)
    registry: referencing.Registry[Any] = referencing.Registry().with_resource(
        "", spec.create_resource(schema)
    )
    nodes = list(_schemas(schema, registry.crawl().resolver(""), spec, ()))
    paths = {id(node): path for node, _, path in reversed(nodes)}  # the first place of each
    done: set[int] = set()
    for node, resolver, _ in nodes:
        if id(node) not in done:
            _follow(node, resolver, paths, done)


def _schemas(
    node: Any, resolver: _Resolver, spec: Any, path: _Path
) -> Iterator[tuple[dict[str, Any], _Resolver, _Path]]:
    """Every mapping in the schema, with the resolver of its scope and its path."""
    if isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schemas(value, resolver, spec, (*path, i))
        return
    if not isinstance(node, dict):
        return
    if path and isinstance(node.get("$id", node.get("id")), str):
        resolver = resolver.in_subresource(spec.create_resource(node))
    yield node, resolver, path
    for key, value in node.items():
        yield from _schemas(value, resolver, spec, (*path, key))


def _follow(
    node: dict[str, Any], resolver: _Resolver, paths: dict[int, _Path], done: set[int]
) -> None:
    """Depth first along the schemas applied to the same value, from `node`; a schema met
    again on the way is a loop. Iterative: a long chain of $defs costs no stack."""
    trail: list[tuple[int, str]] = [(id(node), "")]
    on_trail = {id(node)}
    pending: list[Iterator[_Step]] = [_in_place(node, resolver, paths[id(node)])]
    while pending:
        step = next(pending[-1], None)
        if step is None:
            pending.pop()
            finished, _ = trail.pop()
            on_trail.discard(finished)
            done.add(finished)
            continue
        target, target_resolver, where, how = step
        if id(target) in on_trail:
            start = [i for i, _ in trail].index(id(target))
            chain = " → ".join([how for _, how in trail[start + 1 :]] + [how])
            raise OutputError(
                f"{chain} loops back without descending into the value: checking any value "
                "against it would never end",
                where,
            )
        if id(target) in done:
            continue
        trail.append((id(target), how))
        on_trail.add(id(target))
        pending.append(_in_place(target, target_resolver, paths.get(id(target), where)))


def _in_place(node: dict[str, Any], resolver: _Resolver, path: _Path) -> Iterator[_Step]:
    """The schemas a value checked against `node` is checked against too, as it is."""
    yield from _referenced(node, resolver, path)
    for key in _IN_PLACE_ONE:
        if isinstance(node.get(key), dict):
            yield node[key], resolver, (*path, key), key
    for key in _IN_PLACE_LIST:
        values = node.get(key)
        for i, value in enumerate(values if isinstance(values, list) else ()):
            if isinstance(value, dict):
                yield value, resolver, (*path, key, i), f"{key}[{i}]"
    for key in _IN_PLACE_MAP:
        values = node.get(key)
        for name, value in values.items() if isinstance(values, dict) else ():
            if isinstance(value, dict):
                yield value, resolver, (*path, key, name), f"{key}.{name}"


def _referenced(node: dict[str, Any], resolver: _Resolver, path: _Path) -> Iterator[_Step]:
    """The schemas `node`'s references name (a `$ref` to nothing is an OutputError)."""
    for key in _REF_KEYS:
        ref = node.get(key)
        if not isinstance(ref, str):
            continue
        try:
            resolved = resolver.lookup(ref)
        except Unresolvable:
            if key != "$ref":  # a dynamic reference may resolve only at run time
                continue
            raise OutputError(
                f"$ref {ref!r} points at nothing in the schema", (*path, key)
            ) from None
        if isinstance(resolved.contents, dict):
            yield resolved.contents, resolved.resolver, (*path, key), f"{key} {ref!r}"


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
