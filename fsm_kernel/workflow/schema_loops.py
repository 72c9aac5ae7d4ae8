"""`$ref`s in an output schema that loop without end, found before any run starts.

A schema that refers back to itself without descending into the value (`{$ref: "#"}`, `$defs`
a → b → a, `allOf: [{$ref: "#"}]`) sends every check of a reply round the loop until Python's
recursion limit: the value never gets smaller. A reference back from below `properties`,
`items` or another keyword that looks inside the value is a recursive schema, and fine: a
tree's `children: {type: array, items: {$ref: "#/$defs/node"}}` recurses once per level of
the (finite) value, as jsonschema checks it.

So the walk keeps, for each subschema, the subschemas that apply to the same value (its
`$ref`s, resolved as jsonschema resolves them, and `allOf`/`anyOf`/`oneOf`/`not`/`if`/`then`/
`else`/`dependentSchemas`) and reports every cycle among those. References are resolved with
`referencing`, jsonschema's own resolver, so `$id`, anchors and escaped pointers mean what they
mean to the validator. Iterative throughout: a schema of thousands of nodes never meets
Python's recursion limit here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from referencing import Registry, Specification
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

if TYPE_CHECKING:
    from referencing._core import Resolver

__all__ = ["SchemaPath", "ref_loop_errors"]

SchemaPath = tuple[str | int, ...]
"""Where a node is inside the schema (keys and list indexes), as OutputError.path."""

_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas", "dependencies")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
_DESCEND_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
)
_DESCEND_LIST = ("prefixItems", "items")
_DEFS_MAP = ("properties", "patternProperties", "$defs", "definitions")


@dataclass
class _Node:
    schema: dict[str, Any]
    path: SchemaPath
    resolver: Resolver[Any]


def ref_loop_errors(schema: dict[str, Any]) -> list[tuple[SchemaPath, str]]:
    """Every `$ref` of `schema` that closes a loop applying to the same value, and every
    `$ref` that points to nothing in it: (where the `$ref` is, what is wrong)."""
    return _Graph(schema).loops()


def _pointer(path: SchemaPath) -> str:
    """A node's place as a JSON pointer fragment: `#/$defs/a`."""
    return "#" + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in path)


def _subschemas(node: dict[str, Any], path: SchemaPath) -> Iterator[tuple[Any, SchemaPath]]:
    """The subschemas written inside `node` (every keyword that holds schemas), with paths."""
    for key in (*_IN_PLACE_ONE, *_DESCEND_ONE):
        if isinstance(node.get(key), dict):
            yield node[key], (*path, key)
    for key in (*_IN_PLACE_LIST, *_DESCEND_LIST):
        if isinstance(node.get(key), list):
            for i, item in enumerate(node[key]):
                yield item, (*path, key, i)
    for key in (*_IN_PLACE_MAP, *_DEFS_MAP):
        if isinstance(node.get(key), dict):
            for name, item in node[key].items():
                yield item, (*path, key, name)


def _in_place(node: dict[str, Any], path: SchemaPath) -> Iterator[tuple[Any, SchemaPath]]:
    """The subschemas written inside `node` that apply to the same value as `node` itself."""
    for key in _IN_PLACE_ONE:
        if isinstance(node.get(key), dict):
            yield node[key], (*path, key)
    for key in _IN_PLACE_LIST:
        if isinstance(node.get(key), list):
            for i, item in enumerate(node[key]):
                yield item, (*path, key, i)
    for key in _IN_PLACE_MAP:
        if isinstance(node.get(key), dict):
            for name, item in node[key].items():
                yield item, (*path, key, name)


class _Graph:
    """The subschemas of one schema and, lazily, the edges between those that apply to the
    same value."""

    def __init__(self, schema: dict[str, Any]) -> None:
        dialect = schema.get("$schema")
        self.spec: Specification[Any] = specification_with(
            str(dialect) if dialect is not None else "", default=DRAFT202012
        )
        root = self.spec.create_resource(schema)
        resolver = Registry().with_resource("", root).resolver()
        self.nodes: dict[int, _Node] = {}
        self.order: list[_Node] = []
        self.errors: list[tuple[SchemaPath, str]] = []
        self._add(schema, (), resolver)

    def _add(self, schema: dict[str, Any], path: SchemaPath, resolver: Resolver[Any]) -> None:
        """Record `schema` and every subschema written inside it (each with the resolver its
        `$ref`s resolve with: a subschema with an `$id` is a resource of its own)."""
        todo: list[tuple[Any, SchemaPath, Resolver[Any]]] = [(schema, path, resolver)]
        while todo:
            node, where, outer = todo.pop()
            if not isinstance(node, dict) or id(node) in self.nodes:
                continue
            scoped = outer.in_subresource(self.spec.create_resource(node))
            self.nodes[id(node)] = entry = _Node(node, where, scoped)
            self.order.append(entry)
            inside = [(child, at, scoped) for child, at in _subschemas(node, where)]
            todo.extend(reversed(inside))  # popped in the order they are written

    def _edges(self, node: _Node) -> Iterator[tuple[_Node, str | None]]:
        """The nodes that apply to the same value as `node`, each with the `$ref` that leads
        there (None for a subschema written inside it)."""
        for child, _ in _in_place(node.schema, node.path):
            if isinstance(child, dict):
                yield self.nodes[id(child)], None
        for key in _REFS:
            ref = node.schema.get(key)
            if isinstance(ref, str):
                target = self._resolve(node, key, ref)
                if target is not None:
                    yield target, key

    def _resolve(self, node: _Node, key: str, ref: str) -> _Node | None:
        try:
            resolved = node.resolver.lookup(ref)
        except Unresolvable:
            if key == "$ref":  # dynamic references fall back to their static meaning
                problem = f"$ref {ref!r} points to nothing in the schema"
                self.errors.append(((*node.path, key), problem))
            return None
        if not isinstance(resolved.contents, dict):
            return None
        if id(resolved.contents) not in self.nodes:  # a subschema in an odd place: walk it too
            self._add(resolved.contents, node.path, resolved.resolver)
        return self.nodes[id(resolved.contents)]

    def loops(self) -> list[tuple[SchemaPath, str]]:
        """Depth-first over the same-value edges from every node; an edge back to a node on
        the current path closes a loop, reported at the `$ref` that closes it."""
        done: set[int] = set()
        for start in self.order:  # grows while references are resolved
            if id(start.schema) in done:
                continue
            self._walk_from(start, done)
        return self.errors

    def _walk_from(self, start: _Node, done: set[int]) -> None:
        path: list[_Node] = [start]
        on_path = {id(start.schema)}
        edges = [self._edges(start)]
        while edges:
            step = next(edges[-1], None)
            if step is None:
                finished = path.pop()
                on_path.discard(id(finished.schema))
                done.add(id(finished.schema))
                edges.pop()
                continue
            target, key = step
            if id(target.schema) in on_path and key is not None:
                self._report(path, target, key)
            elif id(target.schema) not in done and id(target.schema) not in on_path:
                path.append(target)
                on_path.add(id(target.schema))
                edges.append(self._edges(target))

    def _report(self, path: list[_Node], target: _Node, key: str) -> None:
        here = path[-1]
        loop = path[next(i for i, n in enumerate(path) if n is target) :]
        chain = " → ".join(_pointer(n.path) for n in (*loop, target))
        ref = here.schema[key]
        self.errors.append(
            (
                (*here.path, key),
                f"{key} {ref!r} loops back to a schema it is part of without descending into "
                f"the value ({chain}), so checking any reply would never end; a schema may "
                "refer back to itself only from below properties, items or another keyword "
                "that looks inside the value",
            )
        )
