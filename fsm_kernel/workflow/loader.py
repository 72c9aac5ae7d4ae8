"""Workflow YAML -> WorkflowSpec, keeping the line and column of every node so each error reads
`path:line:col: message`.

The loader is YAML 1.2-ish on purpose: only true/false are booleans, so `on`, `off`, `yes` and
`no` stay strings (PyYAML's default turns the key `on` into True).

Every YAML file fsm-kernel reads (workflows here, the scheduler config too) is composed by
`compose_yaml`, which refuses documents that would cost far more to load than their size
suggests: huge files, deep nesting (PyYAML's composer recurses once per level) and alias bombs
("billion laughs": a few hundred bytes whose aliases expand to billions of nodes).

`check_workflow` finds every problem of a file, as a compiler does (duplicate keys, every
schema error pydantic reports, every semantic one, the workflows it calls), in file order;
`load_workflow` raises the first with all of them attached (`WorkflowError.errors`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from pydantic import ValidationError
from yaml.events import AliasEvent, CollectionStartEvent

from fsm_kernel.config import package_data_dir
from fsm_kernel.errors import WorkflowError, WorkflowSyntaxError, WorkflowValidationError
from fsm_kernel.workflow.spec import SourceLocation, WorkflowSpec

__all__ = [
    "MAX_YAML_ALIASES",
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "Locations",
    "StrictBoolLoader",
    "WorkflowCheck",
    "YamlLimitError",
    "check_workflow",
    "check_workflow_text",
    "compose_yaml",
    "find_workflow",
    "load_workflow",
    "load_workflow_text",
    "parse_yaml_with_locations",
    "pydantic_errors",
    "read_yaml_file",
    "stock_workflow_names",
]

Locations = dict[tuple[Any, ...], SourceLocation]

MAX_YAML_BYTES = 1024 * 1024
"""Largest YAML file read (1 MiB): workflows and scheduler configs are a few KiB; the cap keeps
a huge or endless file (a FIFO, /dev/zero) from being read into memory at all."""

MAX_YAML_DEPTH = 64
"""Deepest nesting of sequences and mappings. Real files nest under 10 levels; the composer,
the constructor and `_to_data` each recurse once per level, so this keeps all of them far from
Python's recursion limit."""

MAX_YAML_ALIASES = 100
"""Most aliases (`*name`) in one document: a few reused anchors is normal, hundreds is not."""

MAX_YAML_NODES = 10_000
"""Most nodes a document may hold once every alias is replaced by a copy of what it refers to
(as loading it into Python data does). A billion-laughs bomb of 90 aliases expands to 10**9
nodes; a workflow has a few hundred."""


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


class YamlLimitError(yaml.MarkedYAMLError):
    """A document refused by one of the MAX_YAML_* limits; `problem_mark` is the offending node.

    A MarkedYAMLError, so callers that already report YAML errors at their mark report these
    too."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _LimitedLoader(StrictBoolLoader):
    """StrictBoolLoader whose composer enforces MAX_YAML_DEPTH, MAX_YAML_ALIASES and
    MAX_YAML_NODES while it composes, i.e. before anything expands or recurses deeply.

    The parser and scanner keep explicit stacks, so they do not recurse; the scanner checks
    flow nesting too, because it looks ahead up to 1024 characters for a possible `key:` after
    every `[` or `{`, which costs ~0.1 s on a long run of brackets before the composer sees any.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._aliases = 0
        self._expanded = 0
        self._anchor_sizes: dict[str, int] = {}

    def fetch_flow_collection_start(self, token_class: type[yaml.Token]) -> None:
        if self.flow_level >= MAX_YAML_DEPTH:
            raise YamlLimitError(f"nesting deeper than {MAX_YAML_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, AliasEvent):
            self._count_alias(event)
            return super().compose_node(parent, index)
        if isinstance(event, CollectionStartEvent) and self._depth >= MAX_YAML_DEPTH:
            raise YamlLimitError(f"nesting deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        before = self._expanded
        self._add_nodes(1, event.start_mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if event.anchor is not None:
            self._anchor_sizes[event.anchor] = self._expanded - before
        return node

    def _count_alias(self, event: AliasEvent) -> None:
        """An alias costs the expanded size of its anchor's node; an alias to an anchor still
        being composed would make a cycle, which `_to_data` would follow forever."""
        self._aliases += 1
        if self._aliases > MAX_YAML_ALIASES:
            raise YamlLimitError(f"more than {MAX_YAML_ALIASES} aliases", event.start_mark)
        if event.anchor in self.anchors and event.anchor not in self._anchor_sizes:
            raise YamlLimitError(
                f"alias *{event.anchor} refers to a node that contains it", event.start_mark
            )
        self._add_nodes(self._anchor_sizes.get(event.anchor or "", 0), event.start_mark)

    def _add_nodes(self, count: int, mark: Any) -> None:
        self._expanded += count
        if self._expanded > MAX_YAML_NODES:
            raise YamlLimitError(
                f"more than {MAX_YAML_NODES} nodes once aliases are expanded", mark
            )


def _size_error(name: str) -> YamlLimitError:
    mark = yaml.Mark(name, 0, 0, 0, cast(Any, None), cast(Any, None))  # no text to quote
    return YamlLimitError(f"file larger than {MAX_YAML_BYTES} bytes", mark)


def read_yaml_file(path: Path) -> str:
    """The text of a YAML file, reading at most MAX_YAML_BYTES + 1 bytes of it.

    Raises:
        YamlLimitError: the file is larger than MAX_YAML_BYTES (marked at 1:1).
        OSError, UnicodeDecodeError: the file cannot be read as UTF-8.
    """
    with path.open("rb") as stream:
        data = stream.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise _size_error(str(path))
    return data.decode("utf-8")


def compose_yaml(text: str) -> yaml.Node | None:
    """The node graph of a single YAML document (None when empty), within the MAX_YAML_*
    limits, with the strict booleans of StrictBoolLoader.

    Raises:
        YamlLimitError: the text breaks a limit; its mark is the offending node (1:1 for size).
        yaml.YAMLError: the text is not YAML.
    """
    if len(text) > MAX_YAML_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise _size_error("<text>")
    loader = _LimitedLoader(text)
    try:
        node: yaml.Node | None = loader.get_single_node()
    finally:
        loader.dispose()
    return node


def _loc(path: str, node: yaml.Node) -> SourceLocation:
    return SourceLocation(path, node.start_mark.line + 1, node.start_mark.column + 1)


def _to_data(
    node: yaml.Node, path: str, keys: tuple[Any, ...], locs: Locations, errors: list[WorkflowError]
) -> Any:
    """Plain data of `node`, recording each node's location; a key that is not a plain name or
    comes twice is an error in `errors`, and left out (the first of twin keys is kept)."""
    locs[keys] = _loc(path, node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = StrictBoolLoader(" ").construct_object(key_node)  # a scalar key
            problem = None
            if not isinstance(key, str | int | float | bool) or key is None:
                problem = "keys must be plain names"
            elif key in out:
                problem = f"duplicate key {key!r}"
            if problem is not None:
                errors.append(WorkflowValidationError(problem, location=_loc(path, key_node)))
                continue
            out[key] = _to_data(value_node, path, (*keys, key), locs, errors)
            locs[(*keys, key, "<key>")] = _loc(path, key_node)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_data(item, path, (*keys, i), locs, errors) for i, item in enumerate(node.value)]
    return StrictBoolLoader(" ").construct_object(node)


def parse_yaml_with_locations(text: str, path: str) -> tuple[Any, Locations]:
    """Parse YAML text; returns plain data and a map from key paths to locations.

    Raises:
        WorkflowSyntaxError: the text is not YAML or breaks a MAX_YAML_* limit.
        WorkflowValidationError: a key is not a plain name or comes twice (the first such).
    """
    errors: list[WorkflowError] = []
    data, locs = _parse(text, path, errors)
    if errors:
        raise errors[0]
    return data, locs


def _parse(text: str, path: str, errors: list[WorkflowError]) -> tuple[Any, Locations]:
    try:
        root = compose_yaml(text)
    except yaml.MarkedYAMLError as exc:
        raise _syntax_error(exc, path) from exc
    except yaml.YAMLError as exc:
        raise WorkflowSyntaxError(f"YAML syntax error: {exc}", location=path) from exc
    locs: Locations = {}
    if root is None:
        return None, locs
    return _to_data(root, path, (), locs, errors), locs


def _syntax_error(exc: yaml.MarkedYAMLError, path: str) -> WorkflowSyntaxError:
    mark = exc.problem_mark or exc.context_mark
    where = SourceLocation(path, mark.line + 1, mark.column + 1) if mark else None
    problem = exc.problem or exc.context or "invalid YAML"
    kind = "YAML limit exceeded" if isinstance(exc, YamlLimitError) else "YAML syntax error"
    error = WorkflowSyntaxError(f"{kind}: {problem}", location=where)
    error.__cause__ = exc
    return error


_EXTRA_KEY_HINTS = {
    "on": "; guards are written 'guard:'",
    "cond": "; guards are written 'guard:'",
    "when": "; 'when:' (a guard expression) goes on a transition, not on a state",
}
"""Keys people write by habit (python-statemachine's `cond`, XState's `on`) and what to write."""


def _pydantic_message(err: Any) -> str:
    loc = err["loc"]
    kind = err["type"]
    field = str(loc[-1]) if loc else "workflow"
    if kind == "extra_forbidden":
        return f"unknown key {field!r}{_EXTRA_KEY_HINTS.get(field, '')}"
    if kind == "missing":
        return f"missing required key {field!r}"
    if kind == "value_error" and loc and isinstance(loc[-1], int):  # an item of a list: the
        return str(err["msg"]).removeprefix("Value error, ")  # location says which one
    return f"{field}: {err['msg']}"


def _error_location(err: Any, locs: Locations, path: str) -> SourceLocation | str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden" and (*loc, "<key>") in locs:
        return locs[(*loc, "<key>")]
    for n in range(len(loc), -1, -1):
        if loc[:n] in locs:
            return locs[loc[:n]]
    return path


@dataclass
class WorkflowCheck:
    """What checking a workflow found: the spec (None when the file does not even parse into
    one) and every error, in file order (none: the workflow is valid)."""

    spec: WorkflowSpec | None
    errors: list[WorkflowError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_first(self) -> WorkflowSpec:
        """The spec of a valid workflow; else raise the first error, all of them attached."""
        from fsm_kernel.workflow.validate import raise_first

        raise_first(self.errors)
        assert self.spec is not None  # a check without errors has a spec
        return self.spec


def pydantic_errors(exc: ValidationError, locs: Locations, path: str) -> list[WorkflowError]:
    """A pydantic ValidationError of data parsed by `parse_yaml_with_locations`, as one error
    per problem, each at the `file:line:col` of its key or value."""
    return [
        WorkflowValidationError(_pydantic_message(err), location=_error_location(err, locs, path))
        for err in exc.errors()
    ]


def check_workflow_text(
    text: str,
    *,
    path: str = "<string>",
    import_code: bool = True,
    calls: bool = True,
    proofs: bool = True,
) -> WorkflowCheck:
    """Every problem of a workflow's text, in file order (see check_workflow; `proofs=False`
    skips the proof that every cycle is bounded, see load_workflow_text)."""
    from fsm_kernel.workflow.validate import in_file_order, workflow_errors

    errors: list[WorkflowError] = []
    try:
        data, locs = _parse(text, path, errors)
    except WorkflowSyntaxError as exc:
        return WorkflowCheck(None, [exc])
    if not isinstance(data, dict):
        where = locs.get((), SourceLocation(path, 1, 1))
        errors.append(
            WorkflowValidationError("a workflow must be a mapping of keys", location=where)
        )
        return WorkflowCheck(None, in_file_order(errors, path))
    try:
        spec = WorkflowSpec.model_validate(data)
    except ValidationError as exc:
        return WorkflowCheck(None, in_file_order(errors + pydantic_errors(exc, locs, path), path))
    spec._path = path
    spec._content_hash = hashlib.sha256(text.encode()).hexdigest()
    spec._text = text
    spec._locations = locs
    errors += workflow_errors(spec, import_code=import_code, proofs=proofs)
    if calls:
        from fsm_kernel.workflow.call_chain import call_errors

        errors += call_errors(spec)
    return WorkflowCheck(spec, in_file_order(errors, path))


def check_workflow(
    path: str | Path, *, import_code: bool = True, calls: bool = True
) -> WorkflowCheck:
    """Every problem of a workflow file, in file order, each at its `path:line:col`: what
    `fsm-kernel validate` reports. Arguments as load_workflow's."""
    p = Path(path)
    try:
        text = read_yaml_file(p)
    except YamlLimitError as exc:
        return WorkflowCheck(None, [_syntax_error(exc, str(path))])
    except FileNotFoundError:
        return WorkflowCheck(None, [WorkflowValidationError(f"{p}: no such workflow file")])
    except (OSError, UnicodeDecodeError) as exc:
        return WorkflowCheck(None, [WorkflowValidationError(f"{p}: cannot read: {exc}")])
    return check_workflow_text(text, path=str(path), import_code=import_code, calls=calls)


def load_workflow_text(
    text: str,
    *,
    path: str = "<string>",
    import_code: bool = True,
    calls: bool = True,
    proofs: bool = True,
) -> WorkflowSpec:
    """Parse and validate a workflow from text (see load_workflow; `calls`: check that the
    workflows its states call exist, are valid, never call it back and nest at most
    MAX_CALL_DEPTH deep; `proofs=False`: accept a cycle not proven bounded, as for a definition
    a run recorded before `validate` proved cycles — the kernel's limits still bound its run)."""
    return check_workflow_text(
        text, path=path, import_code=import_code, calls=calls, proofs=proofs
    ).raise_first()


def load_workflow(
    path: str | Path, *, import_code: bool = True, calls: bool = True
) -> WorkflowSpec:
    """Load, parse and validate a workflow file.

    With `import_code=False` the file is read as data only: the structure is checked, but the
    `package.module:function` actions and guards it names are neither imported nor checked (for
    drawing a workflow one does not mean to run, as the run viewer does).

    Raises:
        WorkflowSyntaxError: the file is not YAML, or breaks a MAX_YAML_* limit.
        WorkflowValidationError: the file is not a valid workflow (or cannot be read). The
            first problem in file order; `errors` holds every one found.
    """
    return check_workflow(path, import_code=import_code, calls=calls).raise_first()


def stock_workflow_names() -> list[str]:
    """The names of the stock workflows, sorted."""
    stock = package_data_dir("workflows")
    return sorted(p.stem for p in stock.glob("*.yaml")) if stock is not None else []


def find_workflow(ref: str | Path, *, relative_to: str | Path | None = None) -> Path:
    """The workflow file `ref` names: a path that exists (relative to the folder of the file
    `relative_to`, a calling workflow, first; then to the current directory), else a stock
    workflow by name ("react" or "react.yaml"). With `relative_to`, the path is absolute (a
    child run records it, and its replay may run elsewhere).

    Raises:
        WorkflowValidationError: no such file or stock workflow, or `ref` is a folder.
    """
    path = Path(ref)
    candidates = [path]
    if relative_to is not None and not path.is_absolute():
        candidates.insert(0, Path(relative_to).parent / path)
    for candidate in candidates:
        if candidate.is_file():  # a called workflow by its absolute path: replay finds it anywhere
            return candidate.resolve() if relative_to is not None else candidate
        if candidate.is_dir():
            raise WorkflowValidationError(f"{ref}: is a folder; give a workflow .yaml file")
    stock = package_data_dir("workflows")
    if stock is not None and "/" not in str(ref):
        candidate = stock / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
        if candidate.is_file():
            return candidate
    names = ", ".join(stock_workflow_names()) or "none"
    raise WorkflowValidationError(
        f"{ref}: no such workflow file or stock workflow (stock: {names})"
    )
