"""Guard expressions (`when:`, `assign:`) behaviours that mutation testing found unpinned: the
static type of each operator on each pair of types (what `fsm-kernel validate` accepts and
refuses), where inside an expression each kind of problem is placed (line and column, which
validate adds to the expression's own file:line:col), how macros bind their loop variable,
syntax errors naming the token, and the evaluator's reason when an expression fails in a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness
from fsm_kernel.workflow.expressions import (
    ExpressionError,
    Problem,
    check,
    evaluate,
    parse,
    schema_type,
    value_fits,
)

TYPES = {
    "i": "int", "u": "uint", "f": "double", "n": "number", "s": "string", "y": "bytes",
    "b": "bool", "l": "list", "m": "map", "z": "null", "d": "dyn",
}  # fmt: skip
"""Declared variables of every type the checker knows (schema_type's results)."""


def kind_and_problems(text: str) -> tuple[str, list[str]]:
    checked = check(text, TYPES)
    return checked.kind, [p.message for p in checked.problems]


@pytest.mark.parametrize(
    ("text", "kind", "problems"),
    [
        # arithmetic: two numbers of one type, or a JSON `number` with any number
        ("vars.i + vars.i", "int", []),
        ("vars.i % vars.i", "int", []),
        ("vars.f / vars.f", "double", []),
        ("vars.i + vars.n", "number", []),
        ("vars.n + vars.i", "number", []),
        ("vars.f + vars.i", "dyn", ["no + for double and int"]),
        ("vars.u + vars.i", "dyn", ["no + for uint and int"]),
        ("vars.n + vars.s", "dyn", ["no + for number and string"]),
        # + joins two strings, lists or bytes of one type; nothing else
        ("vars.s + vars.s", "string", []),
        ("vars.l + vars.l", "list", []),
        ("vars.y + vars.y", "bytes", []),
        ("vars.s + vars.l", "dyn", ["no + for string and list"]),
        ("vars.b + vars.b", "dyn", ["no + for bool and bool"]),
        ("vars.m + vars.m", "dyn", ["no + for map and map"]),
        ("vars.s - vars.s", "dyn", ["no - for string and string"]),
        ("vars + 1", "dyn", ["no + for map and int"]),  # `vars` itself is a map
        # a value of unknown type passes every operator
        ("vars.d + vars.s", "dyn", []),
        ("vars.d < vars.s", "bool", []),
        # in: a list or a map on the right
        ("vars.i in vars.l", "bool", []),
        ("vars.i in vars.m", "bool", []),
        ("vars.i in vars.s", "dyn", ["no in for int and string"]),
        # == and !=: the same type, two numbers, or null on either side
        ("vars.i == vars.f", "bool", []),
        ("vars.n != vars.i", "bool", []),
        ("vars.l == vars.l", "bool", []),
        ("null == vars.s", "bool", []),
        ("vars.s == null", "bool", []),
        ("vars.s != null", "bool", []),
        ("vars.i == vars.s", "dyn", ["no == for int and string"]),
        ("vars.s != vars.b", "dyn", ["no != for string and bool"]),
        # < > <= >=: numbers, or two strings, bytes or bools
        ("vars.i < vars.f", "bool", []),
        ("vars.s >= vars.s", "bool", []),
        ("vars.y <= vars.y", "bool", []),
        ("vars.b > vars.b", "bool", []),
        ("vars.l < vars.l", "dyn", ["no < for list and list"]),
        ("vars.s < vars.y", "dyn", ["no < for string and bytes"]),
        ("vars.i < vars.s", "dyn", ["no < for int and string"]),
        # && || ! ?: want bools; - wants a number
        ("vars.b && vars.d", "bool", []),
        ("vars.b || vars.i", "bool", ["&& and || need bool operands, not int"]),
        ("!vars.b", "bool", []),
        ("!vars.d", "bool", []),
        ("!vars.i", "bool", ["! needs a bool, not int"]),
        ("-vars.i", "int", []),
        ("-vars.n", "number", []),
        ("-vars.d", "dyn", []),
        ("-vars.s", "string", ["- needs a number, not string"]),
        ("vars.b ? vars.s : vars.s", "string", []),
        ("vars.d ? 1 : 2", "int", []),
        ("vars.b ? 1 : 'a'", "dyn", []),
        ("vars.s ? 1 : 2", "int", ["a ? b : c needs a bool condition, not string"]),
        # literals, indexing, fields, functions and methods
        ("[iteration]", "list", []),
        ("{'a': iteration}", "map", []),
        ("vars.l[0]", "dyn", []),
        ("vars.m['k']", "dyn", []),
        ("vars['i']", "dyn", []),
        ("vars.l[iteration]", "dyn", []),
        ("output[0] + event['k']", "dyn", []),  # values of unknown type may be indexed
        ("vars.i[0]", "dyn", ["int cannot be indexed"]),
        (".iteration + 1", "dyn", []),  # a form it does not type is dyn
        ("vars.m.k", "dyn", []),
        ("event.data", "dyn", []),
        ("iteration.count", "dyn", ["int has no field 'count'"]),
        ("size(vars.l)", "int", []),
        ("vars.s.startsWith('a')", "bool", []),
        ("vars.l.map(x, x + 1)", "list", []),
        ("vars.l.first()", "dyn", []),  # a method it does not know: not refused, of type dyn
        ("shout(1)", "dyn", ["unknown function shout()"]),
        ("shout()", "dyn", ["unknown function shout()"]),
    ],
)
def test_the_checker_types_each_operator_as_cel_overloads_it(
    text: str, kind: str, problems: list[str]
) -> None:
    assert kind_and_problems(text) == (kind, problems)


def test_an_unknown_variable_when_none_are_declared_says_so() -> None:
    assert check("vars.x", {}).problems == [Problem("unknown variable 'x' (none declared)", 1, 6)]


def test_an_expression_that_does_not_parse_has_the_unknown_type() -> None:
    assert check("1 +", TYPES).kind == "dyn"


@pytest.mark.parametrize(
    ("schema", "kind"),
    [
        ({"type": "integer"}, "int"),
        ({"type": "number"}, "number"),
        ({"type": "array"}, "list"),
        ({"type": "null"}, "null"),
        ({"type": "date"}, "dyn"),  # not a JSON Schema type: nothing is known
        ({"type": ["string", "null"]}, "dyn"),  # a union
        ({}, "dyn"),
    ],
)
def test_a_variables_type_comes_from_its_schema(schema: dict[str, object], kind: str) -> None:
    assert schema_type(schema) == kind


@pytest.mark.parametrize(
    ("kind", "want", "fits"),
    [
        ("int", "int", True),
        ("dyn", "string", True),
        ("string", "dyn", True),
        ("int", "number", True),  # a JSON number takes any number
        ("double", "number", True),
        ("string", "number", False),
        ("number", "int", True),  # and may go where a number is wanted
        ("number", "string", False),
        ("int", "double", False),
        ("list", "map", False),
    ],
)
def test_an_assigned_value_fits_a_variable_of_its_own_or_a_wider_number_type(
    kind: str, want: str, fits: bool
) -> None:
    assert value_fits(kind, want) is fits


UNKNOWN = "(known: event, iteration, last_tool, output, tool_failures, vars)"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("vars.b &&\n  vars.i", Problem("&& and || need bool operands, not int", 2, 3)),
        ("\n  vars.i ? 1 : 2", Problem("a ? b : c needs a bool condition, not int", 2, 3)),
        ("true &&\n  !vars.i", Problem("! needs a bool, not int", 2, 4)),
        ("vars.b ==\n  vars.i[0]", Problem("int cannot be indexed", 2, 3)),
        ("vars.b ==\n  shout(1)", Problem("unknown function shout()", 2, 3)),
        ("vars.b ==\n  iteration.count", Problem("int has no field 'count'", 2, 3)),
        ("vars.b ==\n  (vars.i + vars.s)", Problem("no + for int and string", 2, 4)),
        ("vars.b ==\n  tries", Problem(f"unknown name 'tries' {UNKNOWN}", 2, 3)),
        (
            "vars.b ==\n  vars.zz",
            Problem("unknown variable 'zz' (b, d, f, i, l, m, n, s, u, y, z)", 2, 8),
        ),
    ],
)
def test_a_problem_is_placed_at_the_line_and_column_of_the_part_at_fault(
    text: str, problem: Problem
) -> None:
    assert check(text, TYPES).problems == [problem]


def test_a_macro_binds_its_loop_variable_and_checks_its_other_arguments() -> None:
    assert check("vars.l.exists(p, p == 'a')", TYPES).problems == []
    assert check("vars.l.exists(p, zz)", TYPES).problems == [
        Problem(f"unknown name 'zz' {UNKNOWN}", 1, 18)
    ]
    # a first argument that is not a bare name binds nothing and is checked like the rest
    assert check("vars.l.exists(q + 1, true)", TYPES).problems == [
        Problem(f"unknown name 'q' {UNKNOWN}", 1, 15)
    ]


def test_a_method_call_checks_its_receiver_and_its_arguments() -> None:
    """Only the macros bind a name: a plain method's bare-name argument must be known."""
    assert check("zz.size()", TYPES).problems == [Problem(f"unknown name 'zz' {UNKNOWN}", 1, 1)]
    assert check("vars.s.contains(zz)", TYPES).problems == [
        Problem(f"unknown name 'zz' {UNKNOWN}", 1, 17)
    ]
    assert check("vars.s.contains(iteration)", TYPES).problems == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("1 * * 2", Problem("syntax error: unexpected '*'", 1, 5)),
        ("vars.a ==\n  * 3", Problem("syntax error: unexpected '*'", 2, 3)),
        ("1 +", Problem("syntax error: unexpected end of expression", 1, 3)),
        ('"abc', Problem("syntax error", 1, 1)),  # lark names no token: the bare message
    ],
)
def test_a_syntax_error_names_the_unexpected_token_where_it_is(text: str, problem: Problem) -> None:
    assert parse(text) == problem
    assert check(text, TYPES).problems == [problem]


def test_evaluating_text_that_does_not_parse_fails_with_the_syntax_error() -> None:
    with pytest.raises(ExpressionError) as caught:
        evaluate("1 +", {})
    assert str(caught.value) == "syntax error: unexpected end of expression"


@pytest.mark.parametrize(
    ("text", "names", "reason"),
    [
        ("1 / vars.zero", {"vars": {"zero": 0}}, "modulus or divide by zero"),
        ("output.n", {"output": {}}, "no such member in mapping: 'n'"),
        ("output[3]", {"output": [1]}, "invalid_argument"),
        # an error kept as a value inside a map fails the whole expression, with its reason
        ('{"ratio": 1 / vars.zero}', {"vars": {"zero": 0}}, "modulus or divide by zero"),
        ('[{"ratio": 1 / vars.zero}]', {"vars": {"zero": 0}}, "modulus or divide by zero"),
    ],
)
def test_an_expression_that_fails_to_evaluate_says_why(
    text: str, names: dict[str, object], reason: str
) -> None:
    with pytest.raises(ExpressionError) as caught:
        evaluate(text, names)
    assert str(caught.value) == reason


def test_evaluation_gives_plain_json_values() -> None:
    assert evaluate('{"ok": vars.n > 1, "b": b"x"}', {"vars": {"n": 2}}) == {
        "ok": True,
        "b": "eA==",  # bytes as base64, as celpy's JSON encoder writes them
    }


ROUTER = """\
name: router
variables:
  zero: {{type: integer, default: 0}}
  ratio: {{type: object}}
initial: think
states:
  think: {{action: agent.think{assign}}}
  done: {{final: true}}
transitions:
  - {{source: think, target: done, when: "{when}", reason: final_answer}}
  - {{source: think, target: done, reason: final_answer}}
"""


@pytest.mark.parametrize(
    ("assign", "when", "error"),
    [
        ("", "output.n > 1", "when: output.n > 1: None with type: '<class 'NoneType'>' does "
         "not support field selection"),
        (
            ', assign: {ratio: \'{"r": 1 / vars.zero}\'}',
            "true",
            'assign ratio: {"r": 1 / vars.zero}: modulus or divide by zero',
        ),
    ],
)  # fmt: skip
def test_a_run_whose_expression_fails_ends_in_error_with_the_evaluators_reason(
    tmp_path: Path, assign: str, when: str, error: str
) -> None:
    """Before the fix, a map entry that failed (`{"r": 1 / vars.zero}`) ended the run with
    "TypeError: Object of type CELEvalError is not JSON serializable"."""
    path = tmp_path / "router.yaml"
    path.write_text(ROUTER.format(assign=assign, when=when))

    result = WorkflowHarness(path).run("go", model=ScriptedChatModel(["hi"]))

    assert (result.status, result.termination_reason, result.error) == ("ended", "error", error)
