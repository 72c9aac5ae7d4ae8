"""What `fsm-kernel --help` (and every command's `--help`, and a usage error) imports.

Start-up time is measured by benchmarks/compare.py (`--parts startup`), not here: timed
assertions fail on a busy machine. These tests pin its cause instead: building and printing
the parsers imports argparse, the CLI's own modules, errors and redaction, and nothing that
only running a command needs (the event loop, logging, the models, the clients, the stores).
Each check runs in a fresh interpreter and counts only the modules that `main` added.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    import argparse

    from fsm_kernel.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        found = [path] if path else []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found += walk(child, [*path, name])
        return found

    return walk(build_parser(), [])


def test_help_imports_only_the_parsers() -> None:
    codes, added = _probe(["--help"])

    assert codes == {"--help": 0}
    assert _heavy(added) == []
    assert "fsm_kernel.cli.runs" in added  # the probe does see what main imports


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
