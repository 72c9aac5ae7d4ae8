"""Transition coverage: which declared transitions of a workflow the tests exercised, checked by
`assert_all_transitions_covered` for one list of cases or by TransitionCoverage across harnesses.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fsm_kernel.bootstrap import resolve_workflow
from fsm_kernel.testing._harness import DeclaredTransition, WorkflowHarness, declared_transitions
from fsm_kernel.workflow.compiler import FiredTransition
from fsm_kernel.workflow.loader import load_workflow
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "CoverageCase",
    "TransitionCoverage",
    "assert_all_transitions_covered",
    "uncovered_transitions",
]

CoverageCase = FiredTransition | DeclaredTransition | tuple[str, str, str]
"""A transition a test exercised: what `step()` returned, or (source, target, guard label)."""


def _spec_of(workflow: WorkflowHarness | WorkflowSpec) -> WorkflowSpec:
    return workflow.spec if isinstance(workflow, WorkflowHarness) else workflow


def _case_indexes(spec: WorkflowSpec, case: CoverageCase) -> set[int]:
    """The declared transitions (or catch edges) a case stands for; ValueError if it matches
    none."""
    declared = declared_transitions(spec)
    if isinstance(case, FiredTransition | DeclaredTransition):
        index, source, target = case.index, case.source, case.target
        if 0 <= index < len(declared):
            if (declared[index].source, declared[index].target) == (source, target):
                return {index}
        raise ValueError(f"transition #{index} {source} -> {target} is not from {spec.path}")
    source, target, guard = case
    found = {t.index for t in declared if (t.source, t.target, t.guard) == (source, target, guard)}
    if not found:
        raise ValueError(f"case {case!r} matches no declared transition of {spec.path}")
    return found


def uncovered_transitions(
    workflow: WorkflowHarness | WorkflowSpec, cases: Iterable[CoverageCase]
) -> list[DeclaredTransition]:
    """The declared transitions (and catch edges) none of `cases` exercised."""
    spec = _spec_of(workflow)
    covered: set[int] = set()
    for case in cases:
        covered |= _case_indexes(spec, case)
    return [t for t in declared_transitions(spec) if t.index not in covered]


def _describe(t: DeclaredTransition) -> str:
    guard = f" [{t.guard}]" if t.guard else ""
    reason = f" ({t.reason})" if t.reason else ""
    return f"  #{t.index} {t.source} -> {t.target}{guard}{reason}"


def assert_all_transitions_covered(
    workflow: WorkflowHarness | WorkflowSpec, cases: Iterable[CoverageCase]
) -> None:
    """Fail listing every declared transition that no case exercised.

    `cases` are the FiredTransitions your tests observed (`harness.fired`, or what `step()`
    returned) or (source, target, guard label) triples; a triple that matches no declared
    transition is a ValueError, so a typo cannot pass unnoticed::

        assert_all_transitions_covered(harness, [harness.step(s, **ctx) for s, ctx in CASES])
    """
    __tracebackhide__ = True
    missing = uncovered_transitions(workflow, cases)
    if missing:
        spec = _spec_of(workflow)
        lines = "\n".join(_describe(t) for t in missing)
        raise AssertionError(
            f"{len(missing)} of {len(declared_transitions(spec))} declared transition(s) of "
            f"{spec.path} never exercised:\n{lines}"
        )


class TransitionCoverage:
    """Collects the transitions that watched harnesses fire, per workflow, and checks that each
    workflow had all of its declared transitions exercised (the pytest plugin keeps one per test
    module)::

        coverage = TransitionCoverage()
        harness = coverage.watch(WorkflowHarness("react"))
        ...                                    # steps and runs
        coverage.assert_all_covered()          # every watched workflow
    """

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str, str], WorkflowSpec] = {}
        self._fired: dict[tuple[str, str, str], list[FiredTransition]] = {}

    def watch(self, harness: WorkflowHarness) -> WorkflowHarness:
        """Record what `harness` fires from now on; returns it."""
        self._entry(harness.spec)
        harness.add_listener(self.record)
        return harness

    def record(self, harness: WorkflowHarness, fired: FiredTransition) -> None:
        self._fired[self._entry(harness.spec)].append(fired)

    def _entry(self, spec: WorkflowSpec) -> tuple[str, str, str]:
        key = _workflow_key(spec)
        self._specs.setdefault(key, spec)
        self._fired.setdefault(key, [])
        return key

    def fired(self, workflow: str | Path | WorkflowSpec | WorkflowHarness) -> list[FiredTransition]:
        """The transitions recorded for one workflow."""
        return list(self._fired.get(_workflow_key(_as_spec(workflow)), []))

    def assert_all_covered(
        self, workflow: str | Path | WorkflowSpec | WorkflowHarness | None = None
    ) -> None:
        """Fail listing uncovered transitions of `workflow` (default: every watched one)."""
        __tracebackhide__ = True
        if workflow is not None:
            spec = _as_spec(workflow)
            assert_all_transitions_covered(spec, self._fired.get(_workflow_key(spec), []))
            return
        if not self._specs:
            raise AssertionError("no workflow was watched: nothing to check")
        problems = []
        for key, spec in self._specs.items():
            try:
                assert_all_transitions_covered(spec, self._fired[key])
            except AssertionError as exc:
                problems.append(str(exc))
        if problems:
            raise AssertionError("\n".join(problems))


def _workflow_key(spec: WorkflowSpec) -> tuple[str, str, str]:
    return (
        spec.name,
        str(Path(spec.path).resolve()) if spec.path != "<string>" else "",
        spec.content_hash,
    )


def _as_spec(workflow: str | Path | WorkflowSpec | WorkflowHarness) -> WorkflowSpec:
    if isinstance(workflow, WorkflowHarness):
        return workflow.spec
    if isinstance(workflow, WorkflowSpec):
        return workflow
    return load_workflow(resolve_workflow(workflow))
