"""Running the CLI in process from tests: `cli(capsys, ...)` calls `fsm_kernel.cli.main` as the
console script would and returns what it printed, failing on any traceback."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from fsm_kernel.cli import main

__all__ = ["Outcome", "cli"]


@dataclass
class Outcome:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        """The one JSON object on stdout (fails if there is anything else)."""
        lines = self.out.splitlines()
        assert len(lines) == 1, f"expected one line of JSON on stdout, got {self.out!r}"
        value = json.loads(lines[0])
        assert isinstance(value, dict)
        return value


def cli(capsys: pytest.CaptureFixture[str], *args: str | Sequence[str]) -> Outcome:
    """`cli(capsys, "runs", "list")` or `cli(capsys, ["runs", "list"])`."""
    argv = list(args[0]) if len(args) == 1 and not isinstance(args[0], str) else list(args)
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's --help and --version
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "Traceback" not in captured.out
    return Outcome(code, captured.out, captured.err)
