"""pyproject.toml's [tool.mutmut] mutates exactly the nine core modules CONTRIBUTING names, and
runs tests that exist. mutmut 3.3 copies the whole package and excludes the rest by fnmatch
patterns (`*` crosses `/`), so a new module, or a pattern written one character too wide,
silently changes what a mutation run measures: this test says so instead."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = {
    "fsm_kernel/kernel.py",
    "fsm_kernel/recorder.py",
    "fsm_kernel/session.py",
    "fsm_kernel/scheduler/worker.py",
    "fsm_kernel/agent/wire.py",
    "fsm_kernel/workflow/actions.py",
    "fsm_kernel/workflow/compound.py",
    "fsm_kernel/workflow/decide.py",
    "fsm_kernel/workflow/expressions.py",
}


def _config() -> dict[str, list[str]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        config: dict[str, list[str]] = tomllib.load(f)["tool"]["mutmut"]
    return config


def test_exactly_the_core_modules_are_mutated() -> None:
    config = _config()
    assert config["paths_to_mutate"] == ["fsm_kernel/"]
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fsm_kernel").rglob("*.py")}
    mutated = {
        m for m in modules if not any(fnmatch.fnmatch(m, pat) for pat in config["do_not_mutate"])
    }
    assert mutated == CORE


def test_every_test_file_it_runs_exists_and_postgres_is_left_out() -> None:
    args = _config()["tests_dir"]
    files = [a for a in args if a.startswith("tests/") and "::" not in a]
    assert files, args
    assert [f for f in files if not (ROOT / f).is_file()] == []
    deselected = [a.split("::")[0] for a in args if "::" in a]
    assert set(deselected) <= set(files)  # a deselect names a test the run would collect
    assert args[args.index("-m") + 1] == "not postgres"
