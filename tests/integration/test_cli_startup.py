"""What `fsm-kernel --help` (and every command's `--help`, and a usage error) imports.

Start-up time is measured by benchmarks/compare.py (`--parts startup`), not here: timed
assertions fail on a busy machine. These tests pin its cause instead: building and printing
the parsers imports argparse, the CLI's own modules, errors and redaction, and nothing that
only running a command needs (the event loop, logging, the models, the clients, the stores);
`fsm-kernel --help` imports none of the command modules (fsm_kernel.cli.COMMANDS has its
list), and a command's parser is the same whether it is built at once or when chosen.
Each check runs in a fresh interpreter and counts only the modules that `main` added.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_kernel.cli import COMMANDS, UsageError, build_parser

HEAVY = (
    # the standard library's costlier corners, each needed by some command, not by its help
    "asyncio",
    "concurrent",
    "dataclasses",
    "datetime",
    "inspect",
    "logging",
    "sqlite3",
    "ssl",
    "socket",
    "subprocess",
    "xml",
    # third-party packages
    "celpy",
    "httpx",
    "jsonschema",
    "pydantic",
    "statemachine",
    "yaml",
    # fsm-kernel beyond its CLI, errors and redaction
    "fsm_kernel.api",
    "fsm_kernel.bootstrap",
    "fsm_kernel.config",
    "fsm_kernel.kernel",
    "fsm_kernel.protocol",
    "fsm_kernel.scheduler",
    "fsm_kernel.store",
    "fsm_kernel.streaming",
    "fsm_kernel.workflow",
)
"""Modules (and packages, with everything under them) no `--help` may import."""

_PROBE = """
import contextlib, io, json, sys
before = set(sys.modules)
from fsm_kernel.cli import main
codes = {}
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            codes[" ".join(argv)] = main(argv)
        except SystemExit as exc:
            codes[" ".join(argv)] = exc.code
print(json.dumps({"codes": codes, "added": sorted(set(sys.modules) - before)}))
"""


def _probe(*argvs: list[str]) -> tuple[dict[str, int], set[str]]:
    """Run `main(argv)` for each argv in one fresh interpreter: the exit codes and the names
    of the modules that were not loaded before `fsm_kernel.cli` was imported."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(done.stdout)
    return found["codes"], set(found["added"])


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY))


def _commands() -> list[list[str]]:
    """Every command path the parser knows (`run`, `runs list`, `schedule worker`...)."""

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        found = [path] if path else []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found += walk(child, [*path, name])
        return found

    return walk(build_parser(), [])


COMMAND_MODULES = {f"fsm_kernel.cli.{module}" for _, module, _ in COMMANDS}
GLOBAL_FLAGS = {"-h", "--help", "--debug", "-v", "--verbose"}


def test_help_imports_no_command_module() -> None:
    codes, added = _probe(["--help"])

    assert codes == {"--help": 0}
    assert _heavy(added) == []
    assert "fsm_kernel.cli" in added  # the probe does see what main imports
    assert added & COMMAND_MODULES == set()


def test_a_command_s_help_imports_its_module_only() -> None:
    codes, added = _probe(["test", "--help"])

    assert codes == {"test --help": 0}
    assert added & COMMAND_MODULES == {"fsm_kernel.cli.test_cmd"}


def test_commands_lists_every_command_in_order_with_its_help() -> None:
    """The list `fsm-kernel --help` shows without the modules is the one they register."""
    names: list[str] = []
    helps: dict[str, str | None] = {}

    class Recorder:
        def add_parser(self, name: str, **kwargs: str) -> argparse.ArgumentParser:
            names.append(name)
            helps[name] = kwargs.get("help")
            return argparse.ArgumentParser(prog=name)

    for module in dict.fromkeys(module for _, module, _ in COMMANDS):
        importlib.import_module(f"fsm_kernel.cli.{module}").register(Recorder())

    assert sorted(names) == sorted(name for name, _, _ in COMMANDS)
    assert set(helps.values()) == {None}  # each line is in COMMANDS only
    assert all(line and not line.endswith(".") for _, _, line in COMMANDS)


def _parser_at(root: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    parser = root
    for name in path:
        (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", [["run"], ["runs", "show"], ["resume"], ["worker"], ["signal"]])
def test_a_command_filled_when_chosen_is_the_one_built_at_once(path: list[str]) -> None:
    eager, lazy = build_parser(), build_parser(lazy=True)
    assert lazy.format_help() == eager.format_help()
    assert set(_parser_at(lazy, path[:1])._option_string_actions) == GLOBAL_FLAGS  # not yet

    with pytest.raises(UsageError):  # choosing it fills it; each needs an argument given
        lazy.parse_args(path)

    chosen, built = _parser_at(lazy, path), _parser_at(eager, path)
    assert chosen.format_help() == built.format_help()
    assert chosen._option_string_actions.keys() == built._option_string_actions.keys()
    assert chosen._defaults.keys() == built._defaults.keys()


def test_every_command_s_help_imports_only_the_parsers() -> None:
    commands = _commands()
    assert ["runs", "list"] in commands
    assert ["run"] in commands

    codes, added = _probe(*([*c, "--help"] for c in commands))

    assert set(codes.values()) == {0}
    assert len(codes) == len(commands)
    assert _heavy(added) == []


@pytest.mark.parametrize(
    "argv", [[], ["fly"], ["--bogus", "run"], ["runs", "list", "--limit", "0"]]
)
def test_a_usage_error_imports_only_the_parsers(argv: list[str]) -> None:
    codes, added = _probe(argv)

    assert codes == {" ".join(argv): 2}
    assert _heavy(added) == []


def test_the_probe_catches_a_heavy_import() -> None:
    """The check can fail: a command that runs imports what its help does not."""
    codes, added = _probe(["workflows", "--json"])

    assert codes == {"workflows --json": 0}
    assert {"fsm_kernel.bootstrap", "pydantic"} <= set(_heavy(added))


def test_validate_loads_the_workflow_code_but_no_run_machinery() -> None:
    """`validate` compiles the workflow as a run would, without building one: no model client
    (httpx), kernel, recorder, replay or store; and a workflow without CEL expressions (the
    stock default: named guards) does not load the expression engine either."""
    default = str(Path(__file__).resolve().parents[2] / "workflows" / "default.yaml")

    codes, added = _probe(["validate", default])

    assert codes == {f"validate {default}": 0}
    assert {"fsm_kernel.workflow.compiler", "pydantic", "statemachine", "yaml"} <= added
    run_machinery = {
        "celpy",
        "httpx",
        "fsm_kernel.agent",
        "fsm_kernel.kernel",
        "fsm_kernel.recorder",
        "fsm_kernel.replay",
        "fsm_kernel.store",
        "sqlite3",
    }
    assert added & run_machinery == set()


def test_the_library_loads_no_diagram_code_until_asked() -> None:
    """`import fsm_kernel.api` (what an application embedding Agent pays) leaves the diagrams
    and graphviz out; folding a workflow's coverage, which draws on them, loads them then."""
    root = Path(__file__).resolve().parents[2]
    probe = (
        "import sys, fsm_kernel.api\n"
        "before = {'graphviz', 'fsm_kernel.diagram'} & set(sys.modules)\n"
        "from fsm_kernel.regression import workflow_coverage\n"
        "from fsm_kernel.store import SqliteEventStore\n"
        "from fsm_kernel.workflow.loader import load_workflow\n"
        f"spec = load_workflow({str(root / 'workflows' / 'default.yaml')!r})\n"
        "heat = workflow_coverage(SqliteEventStore(':memory:'), spec)\n"
        "after = {'graphviz', 'fsm_kernel.diagram'} & set(sys.modules)\n"
        "print(sorted(before), sorted(after), type(heat).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "['fsm_kernel.diagram',", "'graphviz']", "HeatOverlay"]
