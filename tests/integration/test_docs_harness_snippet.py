"""The testing guide's harness example runs as written from any folder: the test reads the
code block out of docs/how-to/testing.md, so the two cannot drift apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "## One transition at a time"
PAGE = REPO / "docs" / "how-to" / "testing.md"


def guide_snippet() -> str:
    """The first Python block of the testing guide's section on the harness."""
    page = PAGE.read_text(encoding="utf-8")
    section = page[page.index(SECTION) :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"no python block under {SECTION!r}"
    return block.group(1)


def test_the_guide_harness_example_passes_outside_the_repository(tmp_path: Path) -> None:
    snippet = guide_snippet()
    assert "WorkflowHarness(" in snippet
    (tmp_path / "test_my_workflow.py").write_text(snippet, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_my_workflow.py", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,  # no workflows/ folder here: only what the package ships
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b3 passed\b", proc.stdout), proc.stdout
