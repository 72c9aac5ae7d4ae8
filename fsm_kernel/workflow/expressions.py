"""CEL expressions in workflow files: `when:` on a transition, the values of `assign:`.

Parsing and evaluation are cel-python's (`celpy`: pure Python, a lark parser whose tree keeps
line and column, a safe non-Turing-complete evaluator); this module writes no evaluator. celpy
has no type checker, so `check` is a small one over the parsed tree: it knows the names a
workflow's expressions may use (NAMES, the declared variables' types from their JSON Schemas)
and reports an unknown name, an unknown variable or an operator applied to types it cannot take
(`vars.attempts + "x"`, `vars.plan > 3`). Types it cannot know statically are `dyn` and pass.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lark import Token, Tree

if TYPE_CHECKING:
    import celpy

__all__ = [
    "NAMES",
    "Checked",
    "ExpressionError",
    "Problem",
    "check",
    "evaluate",
    "parse",
    "schema_type",
    "value_fits",
]

NAMES: dict[str, tuple[str, str]] = {
    "iteration": ("int", "model calls made so far in this run"),
    "vars": ("map", "the declared variables (`variables:`), each typed by its schema"),
    "output": ("dyn", "the last structured output (null before any)"),
    "event": ("dyn", "the last delivered event, {name, data} (null before any)"),
    "tool_failures": ("int", "tool calls that failed in a row (reset by a success)"),
    "last_tool": ("dyn", "the name of the last tool called (string), null before any"),
}
"""The names an expression may use: name -> (CEL type, meaning), listed in the table of
docs/how-to/expressions.md."""

_NUMERIC = {"int", "uint", "double", "number"}
_FUNCTIONS = {
    "size": "int", "int": "int", "uint": "uint", "double": "double", "string": "string",
    "bool": "bool", "has": "bool", "matches": "bool", "type": "dyn", "dyn": "dyn",
    "duration": "dyn", "timestamp": "dyn", "bytes": "bytes",
}  # fmt: skip
_METHODS = {
    "size": "int", "contains": "bool", "startsWith": "bool", "endsWith": "bool",
    "matches": "bool", "exists": "bool", "all": "bool", "exists_one": "bool", "map": "list",
    "filter": "list",
}  # fmt: skip
_MACROS = {"exists", "all", "exists_one", "map", "filter"}
_LITERALS = {
    "INT_LIT": "int", "UINT_LIT": "uint", "FLOAT_LIT": "double", "STRING_LIT": "string",
    "MLSTRING_LIT": "string", "BYTES_LIT": "bytes", "MLBYTES_LIT": "bytes", "BOOL_LIT": "bool",
    "NULL_LIT": "null",
}  # fmt: skip
_JSON_TYPES = {
    "integer": "int", "number": "number", "string": "string", "boolean": "bool",
    "array": "list", "object": "map", "null": "null",
}  # fmt: skip


@functools.cache
def _env() -> celpy.Environment:
    """cel-python's environment, made when the first expression is parsed: importing celpy and
    building its parser take over 0.1 s, which a workflow without expressions (and `fsm-kernel
    validate` of one) need not pay."""
    import celpy

    return celpy.Environment()


class ExpressionError(Exception):
    """An expression failed to evaluate (a missing key, no overload for its operands...)."""


@dataclass(frozen=True)
class Problem:
    """What is wrong with an expression, at a 1-based line and column inside its text."""

    message: str
    line: int = 1
    col: int = 1


def parse(text: str) -> Tree[Any] | Problem:
    """The parse tree of `text`, or the syntax error where it is."""
    from celpy.celparser import CELParseError

    try:
        return _env().compile(text)
    except CELParseError as exc:
        return Problem(_syntax_message(exc), exc.line or 1, exc.column or 1)


def _syntax_message(exc: BaseException) -> str:
    """`syntax error: unexpected '*'` (or `unexpected end`) from lark's long message."""
    match = re.search(r"Token\('([^']+)', '([^']*)'\)", str(exc.__context__ or ""))
    if match is None:
        return "syntax error"
    return (
        f"syntax error: unexpected {match.group(2)!r}"
        if match.group(2)
        else ("syntax error: unexpected end of expression")
    )


def schema_type(schema: Mapping[str, Any]) -> str:
    """A variable's CEL type from its JSON Schema's `type` (dyn when absent or a union)."""
    kind = schema.get("type")
    return _JSON_TYPES.get(kind, "dyn") if isinstance(kind, str) else "dyn"


def value_fits(kind: str, want: str) -> bool:
    """Whether a value of static type `kind` may be assigned to a variable of type `want`."""
    if "dyn" in (kind, want) or kind == want:
        return True
    if want == "number":
        return kind in _NUMERIC
    return kind == "number" and want in _NUMERIC


@dataclass(frozen=True)
class Checked:
    """What `check` found: the expression's static type, its problems, the variables it reads."""

    kind: str
    problems: list[Problem]
    reads: frozenset[str]


def check(text: str, variables: Mapping[str, str]) -> Checked:
    """Type-check `text`; `variables` maps each declared variable to its type (schema_type)."""
    tree = parse(text)
    if isinstance(tree, Problem):
        return Checked("dyn", [tree], frozenset())
    checker = _Checker(variables)
    kind = checker.type_of(tree, frozenset())
    return Checked(kind, checker.problems, frozenset(checker.reads))


def evaluate(text: str, names: Mapping[str, Any]) -> Any:
    """The value of `text` with `names` bound (plain JSON-like values), as plain Python.

    Raises:
        ExpressionError: it does not parse, or evaluating it fails.
    """
    tree = parse(text)
    if isinstance(tree, Problem):
        raise ExpressionError(tree.message)
    from celpy.adapter import json_to_cel
    from celpy.evaluation import CELEvalError

    activation = {name: json_to_cel(value) for name, value in names.items()}
    try:
        result = _env().program(tree).evaluate(activation)
    except (CELEvalError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ExpressionError(_eval_message(exc)) from exc
    if isinstance(result, CELEvalError):
        raise ExpressionError(_eval_message(result))
    return json.loads(json.dumps(result, cls=_encoder()))


@functools.cache
def _encoder() -> type[json.JSONEncoder]:
    """celpy's JSON encoder, except that a failure kept as a value inside a map (celpy keeps
    the error of `{"ratio": 1 / vars.n}` as the entry's value) raises ExpressionError, with the
    evaluator's reason, as a failure of the whole expression does: not json's TypeError."""
    from celpy.adapter import CELJSONEncoder
    from celpy.evaluation import CELEvalError

    class Encoder(CELJSONEncoder):
        def default(self, cel_object: Any) -> Any:
            if isinstance(cel_object, CELEvalError):
                raise ExpressionError(_eval_message(cel_object))
            return super().default(cel_object)

    return Encoder


def _eval_message(exc: BaseException) -> str:
    args = getattr(exc, "args", ())
    return str(args[0]) if args else str(exc)


def _where(node: Tree[Any] | Token) -> tuple[int, int]:
    if isinstance(node, Token):
        return node.line or 1, node.column or 1
    meta = node.meta
    return getattr(meta, "line", 1), getattr(meta, "column", 1)


class _Checker:
    """Types a celpy parse tree bottom-up, collecting problems (a checker, not an evaluator)."""

    def __init__(self, variables: Mapping[str, str]) -> None:
        self.variables = variables
        self.problems: list[Problem] = []
        self.reads: set[str] = set()

    def report(self, node: Tree[Any] | Token, message: str) -> str:
        self.problems.append(Problem(message, *_where(node)))
        return "dyn"

    def type_of(self, node: Tree[Any] | Token, bound: frozenset[str]) -> str:
        if isinstance(node, Token):
            return "dyn"
        kids = node.children
        rule = str(node.data)
        if len(kids) == 1 and rule in _PASS_THROUGH:
            return self.type_of(kids[0], bound)
        handler = _HANDLERS.get(rule)
        if handler is None:
            for kid in kids:
                self.type_of(kid, bound)
            return "dyn"
        kind: str = handler(self, node, bound)
        return kind

    def ident(self, node: Tree[Any], bound: frozenset[str]) -> str:
        name = str(node.children[0])
        if name in bound:
            return "dyn"
        if name not in NAMES:
            known = ", ".join(sorted(NAMES))
            return self.report(node, f"unknown name {name!r} (known: {known})")
        return "vars" if name == "vars" else NAMES[name][0]

    def literal(self, node: Tree[Any], bound: frozenset[str]) -> str:
        token = node.children[0]
        return _LITERALS.get(token.type, "dyn") if isinstance(token, Token) else "dyn"

    def member_dot(self, node: Tree[Any], bound: frozenset[str]) -> str:
        base, field = node.children[0], str(node.children[1])
        kind = self.type_of(base, bound)
        if kind == "vars":
            if field not in self.variables:
                declared = ", ".join(sorted(self.variables)) or "none declared"
                return self.report(node.children[1], f"unknown variable {field!r} ({declared})")
            self.reads.add(field)
            return self.variables[field]
        if kind in ("map", "dyn"):
            return "dyn"
        return self.report(node, f"{kind} has no field {field!r}")

    def member_dot_arg(self, node: Tree[Any], bound: frozenset[str]) -> str:
        base, method = node.children[0], str(node.children[1])
        self.type_of(base, bound)
        args = _args(node.children[2] if len(node.children) > 2 else None)
        inner = bound
        if method in _MACROS and args and _ident_name(args[0]) is not None:
            inner = bound | {_ident_name(args[0]) or ""}
            args = args[1:]
        for arg in args:
            self.type_of(arg, inner)
        return _METHODS.get(method, "dyn")

    def ident_arg(self, node: Tree[Any], bound: frozenset[str]) -> str:
        name = str(node.children[0])
        for arg in _args(node.children[1] if len(node.children) > 1 else None):
            self.type_of(arg, bound)
        if name not in _FUNCTIONS:
            return self.report(node, f"unknown function {name}()")
        return _FUNCTIONS[name]

    def member_index(self, node: Tree[Any], bound: frozenset[str]) -> str:
        kind = self.type_of(node.children[0], bound)
        self.type_of(node.children[1], bound)
        if kind not in ("list", "map", "dyn", "vars"):
            return self.report(node, f"{kind} cannot be indexed")
        return "dyn"

    def literal_of(self, node: Tree[Any], bound: frozenset[str]) -> str:
        """A list or map literal: its elements are checked, its type is list or map."""
        for kid in node.children:
            self.type_of(kid, bound)
        return "list" if node.data == "list_lit" else "map"

    def logic(self, node: Tree[Any], bound: frozenset[str]) -> str:
        for kid in node.children:
            kind = self.type_of(kid, bound)
            if kind not in ("bool", "dyn"):
                self.report(kid, f"&& and || need bool operands, not {kind}")
        return "bool"

    def ternary(self, node: Tree[Any], bound: frozenset[str]) -> str:
        kinds = [self.type_of(kid, bound) for kid in node.children]
        if kinds[0] not in ("bool", "dyn"):
            self.report(node.children[0], f"a ? b : c needs a bool condition, not {kinds[0]}")
        return kinds[1] if kinds[1] == kinds[2] else "dyn"

    def unary(self, node: Tree[Any], bound: frozenset[str]) -> str:
        op = node.children[0]
        operand = node.children[-1]
        kind = self.type_of(operand, bound)
        if isinstance(op, Tree) and op.data == "unary_not":
            if kind not in ("bool", "dyn"):
                self.report(operand, f"! needs a bool, not {kind}")
            return "bool"
        if kind not in _NUMERIC | {"dyn"}:
            self.report(operand, f"- needs a number, not {kind}")
        return kind

    def binary(self, node: Tree[Any], bound: frozenset[str]) -> str:
        op_node, right = node.children[0], node.children[1]
        if not isinstance(op_node, Tree):
            return "dyn"
        op = str(op_node.data)
        left_kind = self.type_of(op_node.children[0], bound)
        right_kind = self.type_of(right, bound)
        kind, ok = _combine(op, _plain(left_kind), _plain(right_kind))
        if not ok:
            symbol = _SYMBOLS.get(op, op)
            return self.report(
                node, f"no {symbol} for {_plain(left_kind)} and {_plain(right_kind)}"
            )
        return kind


_PASS_THROUGH = {
    "expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication",
    "unary", "member", "primary", "paren_expr",
}  # fmt: skip
_SYMBOLS = {
    "relation_lt": "<", "relation_le": "<=", "relation_gt": ">", "relation_ge": ">=",
    "relation_eq": "==", "relation_ne": "!=", "relation_in": "in", "addition_add": "+",
    "addition_sub": "-", "multiplication_mul": "*", "multiplication_div": "/",
    "multiplication_mod": "%",
}  # fmt: skip


def _plain(kind: str) -> str:
    return "map" if kind == "vars" else kind


def _numeric_pair(left: str, right: str) -> str | None:
    """The result type of arithmetic on two numbers; None when CEL has no such overload."""
    if left == right:
        return left
    if "number" in (left, right):
        return "number"
    return None


def _combine(op: str, left: str, right: str) -> tuple[str, bool]:
    """The type of `left op right` and whether CEL has that overload (dyn always may)."""
    if op.startswith("relation_"):
        return "bool", _relation_ok(op, left, right)
    if "dyn" in (left, right):
        return "dyn", True
    if left in _NUMERIC and right in _NUMERIC:
        result = _numeric_pair(left, right)
        return (result or "dyn"), result is not None
    if op == "addition_add" and left == right and left in ("string", "list", "bytes"):
        return left, True
    return "dyn", False


def _relation_ok(op: str, left: str, right: str) -> bool:
    if "dyn" in (left, right):
        return True
    if op == "relation_in":
        return right in ("list", "map")
    if op in ("relation_eq", "relation_ne"):
        numbers = left in _NUMERIC and right in _NUMERIC
        return left == right or numbers or "null" in (left, right)
    if left in _NUMERIC and right in _NUMERIC:
        return True
    return left == right and left in ("string", "bytes", "bool")


def _args(exprlist: Any) -> list[Tree[Any]]:
    if isinstance(exprlist, Tree) and exprlist.data == "exprlist":
        return [kid for kid in exprlist.children if isinstance(kid, Tree)]
    return [exprlist] if isinstance(exprlist, Tree) else []


def _ident_name(node: Tree[Any]) -> str | None:
    """The name when `node` is a bare identifier (a macro's loop variable), else None."""
    while isinstance(node, Tree) and len(node.children) == 1 and node.data != "ident":
        child = node.children[0]
        if not isinstance(child, Tree):
            return None
        node = child
    if isinstance(node, Tree) and node.data == "ident":
        return str(node.children[0])
    return None


_HANDLERS: dict[str, Any] = {
    "ident": _Checker.ident,
    "literal": _Checker.literal,
    "list_lit": _Checker.literal_of,
    "map_lit": _Checker.literal_of,
    "member_dot": _Checker.member_dot,
    "member_dot_arg": _Checker.member_dot_arg,
    "ident_arg": _Checker.ident_arg,
    "member_index": _Checker.member_index,
    "conditionalor": _Checker.logic,
    "conditionaland": _Checker.logic,
    "expr": _Checker.ternary,
    "unary": _Checker.unary,
    "relation": _Checker.binary,
    "addition": _Checker.binary,
    "multiplication": _Checker.binary,
}
