"""The generated Reference pages (docs/hooks.py) leave nothing out and describe nothing stale.

The pages are built from the code at `mkdocs build` time; these tests fail when something is
added to the code without a description the page can show (a workflow key, a guard, an event
type, a CLI flag, an environment variable), and when a description in docs/hooks.py names
something that no longer exists.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def test_every_workflow_key_has_an_example_from_a_tested_page(hooks: ModuleType) -> None:
    examples = hooks.schema_examples()
    keys = [f"{m}.{k}" for m, k, _, _ in hooks.schema_keys()]
    missing = [k for k in keys if k not in examples]
    assert not missing, f"workflow keys no stock workflow or guide shows: {missing}"
    assert examples["Limits.max_iterations"] == "max_iterations: 10"  # the stock workflows'
    assert examples["NotifySpec.on"].startswith("'on': [")  # read as a key, not as true


def test_every_workflow_key_has_a_description(hooks: ModuleType) -> None:
    keys = hooks.schema_keys()
    missing = [f"{m}.{k}" for m, k, node, _ in keys if not hooks.schema_description(m, k, node)]
    assert not missing, f"workflow keys without a description: {missing}"
    known = {f"{m}.{k}" for m, k, _, _ in keys}
    assert set(hooks.SCHEMA_DESCRIPTIONS) <= known, "SCHEMA_DESCRIPTIONS names unknown keys"


def test_the_workflow_page_lists_every_key_with_its_default(hooks: ModuleType) -> None:
    page = hooks.workflow_page()
    assert "| `max_iterations` | integer ≥ 0 | `10` |" in page
    for model, key, _, _ in hooks.schema_keys():
        assert f"`{key}`" in page, f"{model}.{key} is not on the page"


def test_every_guard_and_action_has_a_description(hooks: ModuleType) -> None:
    from fsm_kernel.workflow.actions import BUILTIN_ACTIONS

    guards = hooks.guards()
    assert not [n for n, fn in guards.items() if not hooks.guard_description(n, fn)]
    assert set(hooks.GUARD_DESCRIPTIONS) <= set(guards), "GUARD_DESCRIPTIONS names no guard"
    assert not [n for n, a in BUILTIN_ACTIONS.items() if not hooks._doc(a.fn)]
    page = hooks.builtins_page()
    for name in [*guards, *BUILTIN_ACTIONS, "datetime", "read_file", "list_directory", "done"]:
        assert f"`{name}`" in page


def test_every_event_type_is_described_with_its_fields(hooks: ModuleType) -> None:
    from fsm_kernel.protocol import EventType

    kinds = {k.value for k in EventType}
    assert not [k for k in kinds if not hooks.event_description(k)]
    assert set(hooks.EVENT_DESCRIPTIONS) <= kinds
    samples = hooks.sample_events()
    unobserved = kinds - set(samples)
    assert unobserved == set(hooks.EVENT_FIELDS_UNOBSERVED), (
        "events the sample runs do not record must have their fields listed, and only those: "
        f"{sorted(unobserved ^ set(hooks.EVENT_FIELDS_UNOBSERVED))}"
    )
    source = "".join(p.read_text("utf-8") for p in (ROOT / "fsm_kernel").rglob("*.py"))
    for kind, fields in hooks.EVENT_FIELDS_UNOBSERVED.items():
        for name in fields:
            assert re.search(rf"[\"']{name}[\"']|\b{name}=", source), f"{kind}: {name}?"
    page = hooks.events_page()
    assert "## `tool.finished`" in page
    assert "`duration_ms`" in page


def test_every_flag_of_every_command_is_documented(hooks: ModuleType) -> None:
    missing = [
        hooks.flag_key(words, action)
        for words, parser, _ in hooks.commands()
        for action in hooks.arguments(parser)
        if not hooks.flag_help(words, action)
    ]
    assert not missing, f"flags without help: {missing} (add help= or FLAG_DESCRIPTIONS)"
    keys = {hooks.flag_key(w, a) for w, p, _ in hooks.commands() for a in hooks.arguments(p)}
    assert set(hooks.FLAG_DESCRIPTIONS) <= keys, "FLAG_DESCRIPTIONS names unknown flags"
    page = hooks.cli_page()
    for words, parser, _ in hooks.commands():
        assert f"## `fsm-kernel {words}`" in page
        for action in hooks.arguments(parser):
            for option in action.option_strings:
                assert f"`{option}`" in page, f"{words} {option}"


def test_every_environment_variable_is_documented(hooks: ModuleType) -> None:
    names = hooks.environment_names()
    assert "FSM_KERNEL_STORE" in names
    assert not names - set(hooks.ENVIRONMENT), "add them to ENVIRONMENT in docs/hooks.py"
    assert set(hooks.ENVIRONMENT) - names <= {"OPENAI_API_KEY"}, "ENVIRONMENT names stale ones"


def test_the_exit_codes_page_quotes_the_help(hooks: ModuleType) -> None:
    from fsm_kernel.cli import EXIT_CODES_HELP

    assert EXIT_CODES_HELP in hooks.exit_codes_page()


def test_every_stock_workflow_is_drawn(hooks: ModuleType) -> None:
    drawn = hooks.stock_diagrams()
    assert set(drawn) == {p.stem for p in (ROOT / "workflows").glob("*.yaml")}
    assert all(svg.lstrip().startswith("<?xml") or "<svg" in svg[:500] for svg in drawn.values())
