"""The two checks every stock workflow's transition table gets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_kernel.testing import WorkflowHarness, assert_all_transitions_covered


def check_case(
    harness: WorkflowHarness, state: str, ctx: dict[str, Any], target: str, reason: str | None
) -> None:
    """One step from `state` with `ctx` takes the edge to `target` (ending with `reason`)."""
    fired = harness.step(state, **ctx)
    assert (fired.target, fired.reason) == (target, reason)


def check_coverage(workflow: Path, cases: Sequence[Any]) -> None:
    """Every declared transition of `workflow` is taken by some case (pytest.param rows)."""
    harness = WorkflowHarness(workflow)
    observed = [harness.step(p.values[0], **p.values[1]) for p in cases]
    assert_all_transitions_covered(harness, observed)
