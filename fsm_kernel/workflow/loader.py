"""Workflow YAML -> WorkflowSpec, keeping the line and column of every node so each error reads
`path:line:col: message`.

The loader is YAML 1.2-ish on purpose: only true/false are booleans, so `on`, `off`, `yes` and
`no` stay strings (PyYAML's default turns the key `on` into True).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fsm_kernel.errors import WorkflowSyntaxError, WorkflowValidationError
from fsm_kernel.workflow.spec import SourceLocation, WorkflowSpec

__all__ = [
    "StrictBoolLoader",
    "load_workflow",
    "load_workflow_text",
    "parse_yaml_with_locations",
]

Locations = dict[tuple[Any, ...], SourceLocation]


class StrictBoolLoader(yaml.SafeLoader):
    """SafeLoader whose booleans are only true/false (`on`, `off`, `yes`, `no` stay strings)."""


StrictBoolLoader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
}
StrictBoolLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def _loc(path: str, node: yaml.Node) -> SourceLocation:
    return SourceLocation(path, node.start_mark.line + 1, node.start_mark.column + 1)


def _to_data(node: yaml.Node, path: str, keys: tuple[Any, ...], locs: Locations) -> Any:
    locs[keys] = _loc(path, node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = StrictBoolLoader(" ").construct_object(key_node)  # a scalar key
            if not isinstance(key, str | int | float | bool) or key is None:
                raise WorkflowValidationError(
                    "keys must be plain names", location=_loc(path, key_node)
                )
            if key in out:
                raise WorkflowValidationError(
                    f"duplicate key {key!r}", location=_loc(path, key_node)
                )
            out[key] = _to_data(value_node, path, (*keys, key), locs)
            locs[(*keys, key, "<key>")] = _loc(path, key_node)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_data(item, path, (*keys, i), locs) for i, item in enumerate(node.value)]
    return StrictBoolLoader(" ").construct_object(node)


def parse_yaml_with_locations(text: str, path: str) -> tuple[Any, Locations]:
    """Parse YAML text; returns plain data and a map from key paths to locations."""
    try:
        root = yaml.compose(text, Loader=StrictBoolLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = SourceLocation(path, mark.line + 1, mark.column + 1) if mark else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise WorkflowSyntaxError(f"YAML syntax error: {problem}", location=where) from exc
    except yaml.YAMLError as exc:
        raise WorkflowSyntaxError(f"YAML syntax error: {exc}", location=path) from exc
    locs: Locations = {}
    if root is None:
        return None, locs
    return _to_data(root, path, (), locs), locs


def _pydantic_message(err: Any) -> str:
    loc = err["loc"]
    kind = err["type"]
    field = str(loc[-1]) if loc else "workflow"
    if kind == "extra_forbidden":
        hint = "; guards are written 'guard:'" if field in {"on", "when", "cond"} else ""
        return f"unknown key {field!r}{hint}"
    if kind == "missing":
        return f"missing required key {field!r}"
    return f"{field}: {err['msg']}"


def _error_location(err: Any, locs: Locations, path: str) -> SourceLocation | str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden" and (*loc, "<key>") in locs:
        return locs[(*loc, "<key>")]
    for n in range(len(loc), -1, -1):
        if loc[:n] in locs:
            return locs[loc[:n]]
    return path


def load_workflow_text(text: str, *, path: str = "<string>") -> WorkflowSpec:
    """Parse and validate a workflow from text (see load_workflow)."""
    from fsm_kernel.workflow.validate import validate_workflow

    data, locs = parse_yaml_with_locations(text, path)
    if not isinstance(data, dict):
        where = locs.get((), SourceLocation(path, 1, 1))
        raise WorkflowValidationError("a workflow must be a mapping of keys", location=where)
    try:
        spec = WorkflowSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise WorkflowValidationError(
            _pydantic_message(first), location=_error_location(first, locs, path)
        ) from None
    spec._path = path
    spec._content_hash = hashlib.sha256(text.encode()).hexdigest()
    spec._locations = locs
    validate_workflow(spec)
    return spec


def load_workflow(path: str | Path) -> WorkflowSpec:
    """Load, parse and validate a workflow file.

    Raises:
        WorkflowSyntaxError: the file is not YAML.
        WorkflowValidationError: the file is not a valid workflow (or cannot be read).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkflowValidationError(f"{p}: no such workflow file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkflowValidationError(f"{p}: cannot read: {exc}") from None
    return load_workflow_text(text, path=str(path))
