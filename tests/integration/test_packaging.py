"""The built wheel ships the stock workflows and memory, so a pip-installed fsm-kernel finds
them without the repository."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_stock_workflows_memory_and_plugin(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("fsm_kernel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for workflow in (ROOT / "workflows").glob("*.yaml"):
        assert f"fsm_kernel/data/workflows/{workflow.name}" in names
    for memory in (ROOT / "memory").glob("*.md"):
        assert f"fsm_kernel/data/memory/{memory.name}" in names
    assert "fsm_kernel/py.typed" in names
    ui = ROOT / "fsm_kernel" / "ui"
    for asset in [*ui.glob("templates/*.html"), *ui.glob("static/*")]:  # the viewer's, no build
        assert f"fsm_kernel/ui/{asset.relative_to(ui)}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "fsm-kernel = fsm_kernel.cli:main" in text
    assert "fsm_kernel.pytest_plugin" in text
