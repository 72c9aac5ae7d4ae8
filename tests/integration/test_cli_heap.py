"""The long-running commands (`worker`, `schedule`) freeze the heap they start with
(fsm_kernel.cli.heap): once set up, before the first dispatch runs, so the garbage collector
leaves the modules, the config and the workflow out of every later collection. Run in a
subprocess each: freezing is process-wide, and this test process must not be frozen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import gc, sys
from fsm_kernel.cli import main
from fsm_kernel.scheduler import Scheduler, Worker

async def report(self, *args, **kwargs):
    print("frozen", gc.get_freeze_count(), flush=True)
    raise SystemExit(0)

Worker.run = report
Scheduler.run_cycle = report
Scheduler.run_forever = report
print("before", gc.get_freeze_count(), flush=True)
sys.exit(main(sys.argv[1:]))
"""


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    document = {
        "kernel_id": "heap",
        "state_dir": str(tmp_path / "state"),
        "store": str(tmp_path / "runs.db"),
        "agents": [{"agent_id": "a", "prompt": "p"}],
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@pytest.mark.parametrize("command", [["worker"], ["schedule"], ["schedule", "--once"]])
def test_the_start_up_heap_is_frozen_before_the_first_dispatch(
    tmp_path: Path, command: list[str]
) -> None:
    argv = [*command, str(_config(tmp_path)), "--base-url", "http://127.0.0.1:9/v1"]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert counts["before"] == "0"
    assert int(counts["frozen"]) > 10_000  # the imported modules and the config, at least
