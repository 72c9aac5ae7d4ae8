"""pytest fixtures for testing workflows with fsm_kernel.testing; it only wires the kit to
pytest. Enable it in your conftest.py::

    pytest_plugins = ["fsm_kernel.pytest_plugin"]

Fixtures:

* `workflow_harness` — a factory: `workflow_harness("workflows/react.yaml")` (a path, a stock
  name or a WorkflowSpec) returns a WorkflowHarness whose steps and runs are recorded in
  `transition_coverage`.
* `scripted_model` — a factory: `scripted_model(["hi", call("datetime")])` returns a
  ScriptedChatModel; when the test passes, every reply must have been used (pass
  `allow_leftovers=True` to allow otherwise).
* `transition_coverage` — one TransitionCoverage per test module. A last test in the module
  calls `transition_coverage.assert_all_covered("workflows/react.yaml")` (or with no argument:
  every workflow harnessed in the module); it sees the tests that ran before it, so it is
  skipped when only part of the module runs (-k, -m, --lf, file::test).

Example (single_shot has two transitions, so two cases cover it)::

    from fsm_kernel.testing import call

    CASES = [({"last_reply": "Bonjour."}, "final_answer"),
             ({"last_reply": call("datetime"), "malformed_reason": "not offered"},
              "malformed_output")]

    @pytest.mark.parametrize(("ctx", "reason"), CASES)
    def test_answer_step(workflow_harness, ctx, reason):
        assert workflow_harness("single_shot").step("answer", **ctx).reason == reason

    def test_all_transitions_covered(transition_coverage):
        transition_coverage.assert_all_covered()
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fsm_kernel.testing import ScriptedChatModel, ScriptItem, TransitionCoverage, WorkflowHarness
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "ModuleTransitionCoverage",
    "scripted_model",
    "transition_coverage",
    "workflow_harness",
]

_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_DESELECTED = pytest.StashKey[set[str]]()

HarnessFactory = Callable[[str | Path | WorkflowSpec], WorkflowHarness]
ModelFactory = Callable[..., ScriptedChatModel]


class ModuleTransitionCoverage(TransitionCoverage):
    """A TransitionCoverage for one test module; its check is skipped on a partial run."""

    def __init__(self, module: pytest.Module) -> None:
        super().__init__()
        self._module = module

    def assert_all_covered(
        self, workflow: str | Path | WorkflowSpec | WorkflowHarness | None = None
    ) -> None:
        __tracebackhide__ = True
        if _is_partial_run(self._module):
            pytest.skip("only part of this module ran: transition coverage is not checked")
        super().assert_all_covered(workflow)


def _is_partial_run(module: pytest.Module) -> bool:
    """Tests of `module` were deselected, or the command line named single tests in it."""
    config = module.config
    prefix = f"{module.nodeid}::"
    if any(nodeid.startswith(prefix) for nodeid in config.stash.get(_DESELECTED, set())):
        return True
    here = config.invocation_params.dir
    for arg in config.args:
        path, sep, _ = str(arg).partition("::")
        if sep and (here / path).resolve() == module.path.resolve():
            return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so fixtures can tell whether the test passed."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


def pytest_deselected(items: Iterable[pytest.Item]) -> None:
    """Remember deselected tests: a module missing some cannot judge its coverage."""
    for item in items:
        item.config.stash.setdefault(_DESELECTED, set()).add(item.nodeid)


@pytest.fixture(scope="module")
def transition_coverage(request: pytest.FixtureRequest) -> ModuleTransitionCoverage:
    """The transitions this test module's harnesses fired (see the module docstring)."""
    module = request.node
    assert isinstance(module, pytest.Module)
    return ModuleTransitionCoverage(module)


@pytest.fixture
def workflow_harness(transition_coverage: ModuleTransitionCoverage) -> HarnessFactory:
    """A factory of WorkflowHarness objects recorded in `transition_coverage`."""

    def make(workflow: str | Path | WorkflowSpec) -> WorkflowHarness:
        return transition_coverage.watch(WorkflowHarness(workflow))

    return make


@pytest.fixture
def scripted_model(request: pytest.FixtureRequest) -> Generator[ModelFactory, None, None]:
    """A factory of ScriptedChatModel objects, each checked for unused replies after a passing
    test."""
    strict: list[ScriptedChatModel] = []

    def make(
        replies: Iterable[ScriptItem] = (), *, allow_leftovers: bool = False
    ) -> ScriptedChatModel:
        model = ScriptedChatModel(replies)
        if not allow_leftovers:
            strict.append(model)
        return model

    yield make
    report = request.node.stash.get(_REPORTS, {}).get("call")
    if report is None or not report.passed:
        return  # the test failed already; leftover replies would only add noise
    problems = [
        f"scripted model #{i + 1}: {m.remaining} reply(ies) never requested"
        for i, m in enumerate(strict)
        if m.remaining
    ]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


# -- workflow test files ---------------------------------------------------------------------


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect workflow test files (`*.test.yaml`): one test item per case."""
    if file_path.name.endswith(".test.yaml"):
        collected: pytest.Collector = WorkflowTestFile.from_parent(parent, path=file_path)
        return collected
    return None


class WorkflowTestFile(pytest.File):
    """A `*.test.yaml` file: its cases, run as `fsm-kernel test` runs them."""

    def collect(self) -> Iterable[pytest.Item]:
        from fsm_kernel.errors import WorkflowError
        from fsm_kernel.testing._casefile import load_test_file

        try:
            loaded = load_test_file(self.path)
            harness = WorkflowHarness(loaded.workflow)
        except WorkflowError as exc:
            raise self.CollectError("; ".join(str(e) for e in exc.errors)) from None
        for name in loaded.spec.cases:
            yield WorkflowTestCase.from_parent(self, name=name, loaded=loaded, harness=harness)


class WorkflowTestCase(pytest.Item):
    """One case of a workflow test file."""

    def __init__(self, *, loaded: Any, harness: WorkflowHarness, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaded, self.harness = loaded, harness

    def runtest(self) -> None:
        from fsm_kernel.testing._cases import run_case

        result = run_case(self.loaded, self.harness, self.name, self.loaded.spec.cases[self.name])
        if not result.passed:
            raise WorkflowCaseFailed(f"{result.location}: {result.difference}")

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, WorkflowCaseFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        where = self.loaded.where(self.name)
        line = getattr(where, "line", None)
        return self.path, None if line is None else line - 1, f"case {self.name}"


class WorkflowCaseFailed(Exception):
    """A case did something its `expect:` does not say (the first difference)."""


# -- exploring workflows (property-based; needs Hypothesis) ------------------------------------

if TYPE_CHECKING:
    from fsm_kernel.testing._explore import ExploreReport

ExplorerFactory = Callable[..., "ExploreReport"]


@pytest.fixture
def workflow_explorer() -> ExplorerFactory:
    """A function that explores a workflow on random model replies, tool results and answers
    (fsm_kernel.testing's explorer, on Hypothesis): `workflow_explorer("react", examples=25)`
    fails the test with the shrunk counterexample when a run breaks an invariant, and returns
    the ExploreReport otherwise. The runs are the same every time unless `seed=` is given.
    Skips the test when Hypothesis is not installed."""

    def explore_workflow(
        workflow: str | Path | WorkflowSpec, *, examples: int = 25, seed: int | None = None
    ) -> ExploreReport:
        __tracebackhide__ = True
        pytest.importorskip("hypothesis", reason="the workflow explorer needs Hypothesis")
        from fsm_kernel.testing._explore import explore

        report = explore(workflow, examples=examples, seed=seed)
        if not report.passed:
            pytest.fail(f"{report.counterexample}\n{report.summary()}", pytrace=False)
        return report

    return explore_workflow
