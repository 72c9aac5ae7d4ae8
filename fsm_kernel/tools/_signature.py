"""A tool's JSON schema and argument validator, derived from its function: the typed signature
gives a pydantic model (and from it the JSON schema), the Google-style docstring gives the
description and each argument's. Knows nothing of the registry or of running tools.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import pydantic

from fsm_kernel.errors import ConfigError

__all__ = ["ToolSignature", "describe_validation", "read_signature"]

_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?|See Also):\s*$"
)
_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")
_ARG_LINE_RE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_SCHEMA_DATA = frozenset({"default", "const", "enum", "examples"})
_INPUT_PREVIEW = 60


@dataclass(frozen=True, kw_only=True)
class ToolSignature:
    """What a function's signature and docstring say about it as a tool."""

    summary: str
    """The docstring's first paragraph, lines joined."""
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""
    arguments_model: type[pydantic.BaseModel]
    """Validates the arguments; field i is parameter i, aliased to the parameter's name."""
    parameter_names: tuple[str, ...]


def read_signature(name: str, func: Callable[..., Any]) -> ToolSignature:
    """The schema, validator and description of `func` as the tool `name`.

    Raises:
        ConfigError: a parameter kind, annotation or type that cannot make a JSON schema.
    """
    summary, arg_docs = _parse_docstring(inspect.getdoc(_unwrap_partial(func)) or "")
    params = _parameters(name, func)
    model = _arguments_model(name, func, params, arg_docs)
    return ToolSignature(
        summary=summary,
        parameters=_json_schema(name, model),
        arguments_model=model,
        parameter_names=tuple(p.name for p in params),
    )


def _parameters(name: str, func: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tool {name!r}: cannot read its signature: {exc}") from exc
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ConfigError(
                f"tool {name!r}: parameter {p.name!r} must be a plain or keyword-only "
                "parameter (no *args, **kwargs or positional-only)"
            )
    return params


def _arguments_model(
    name: str,
    func: Callable[..., Any],
    params: list[inspect.Parameter],
    arg_docs: dict[str, str],
) -> type[pydantic.BaseModel]:
    hints = _type_hints(name, func)
    fields: dict[str, Any] = {}
    for i, p in enumerate(params):
        default = ... if p.default is inspect.Parameter.empty else p.default
        # Fields are named p0, p1, ... and aliased to the parameter names, so a parameter may
        # be called `json`, `copy` or `_x` without clashing with BaseModel's own attributes.
        field = pydantic.Field(default, alias=p.name, description=arg_docs.get(p.name))
        fields[f"p{i}"] = (hints.get(p.name, Any), field)
    try:
        return pydantic.create_model(
            f"{name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as exc:
        raise ConfigError(f"tool {name!r}: unsupported parameter type: {exc}") from exc


def _type_hints(name: str, func: Callable[..., Any]) -> dict[str, Any]:
    target = _unwrap_partial(func)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__  # a callable object
    try:
        return get_type_hints(target, include_extras=True)
    except (NameError, TypeError, AttributeError) as exc:
        raise ConfigError(f"tool {name!r}: cannot resolve its type annotations: {exc}") from exc


def _unwrap_partial(func: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def _json_schema(name: str, model: type[pydantic.BaseModel]) -> dict[str, Any]:
    try:
        schema = model.model_json_schema()
    except pydantic.PydanticUserError as exc:
        raise ConfigError(f"tool {name!r}: no JSON schema for its parameters: {exc}") from exc
    stripped: dict[str, Any] = _strip_titles(schema)
    stripped.setdefault("properties", {})
    return stripped


def _strip_titles(node: Any) -> Any:
    """Drop pydantic's generated `title`s, but not properties that happen to be named title."""
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _strip_titles(v) for k, v in value.items()}
        elif key in _SCHEMA_DATA:
            out[key] = value
        else:
            out[key] = _strip_titles(value)
    return out


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph (lines joined) and the Google-style `Args:` descriptions."""
    lines = doc.splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line.strip()):
            break
        summary.append(line.strip())
    return " ".join(summary), _parse_args_section(lines)


def _parse_args_section(lines: list[str]) -> dict[str, str]:
    start = next((i for i, line in enumerate(lines) if line.strip() in _ARGS_HEADERS), None)
    if start is None:
        return {}
    header_indent = _indent(lines[start])
    docs: dict[str, str] = {}
    entry_indent: int | None = None
    current: str | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= header_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        match = _ARG_LINE_RE.match(line.strip()) if indent == entry_indent else None
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current is not None:
            docs[current] = f"{docs[current]} {line.strip()}".strip()
    return docs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def describe_validation(exc: pydantic.ValidationError) -> str:
    problems = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"]) or "arguments"
        text = f"{where}: {err['msg']}"
        if err["type"] not in ("missing", "extra_forbidden") and err["loc"]:
            preview = repr(err.get("input"))
            if len(preview) > _INPUT_PREVIEW:
                preview = preview[: _INPUT_PREVIEW - 3] + "..."
            text += f" (got {preview})"
        problems.append(text)
    return "; ".join(problems)
