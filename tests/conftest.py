"""Shared test setup: no test may reach a real model server or the internet."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.pg", "tests.lockkit"]


@pytest.fixture(autouse=True)
def _isolated_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A dead port: a test that forgot its fake server fails fast instead of calling a provider.
    monkeypatch.setenv("FSM_KERNEL_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("FSM_KERNEL_MAX_RETRIES", "0")
    for name in ("FSM_KERNEL_MODEL", "FSM_KERNEL_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    store = tmp_path_factory.mktemp("store") / "runs.db"
    monkeypatch.setenv("FSM_KERNEL_STORE", str(store))


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # main() configures the fsm_kernel logger for the terminal; undo it for the other tests.
    logger = logging.getLogger("fsm_kernel")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


@pytest.fixture(autouse=True)
def _built_afresh() -> None:
    """Each test builds its compiled workflows and SQL statements itself. The compile cache
    also holds what the engine decided (CompiledWorkflow.decisions), which must not carry over
    from one test to the next; and a mutation tester that forks after a first pass must run
    the compiler and the statement builders it mutated, not what the first pass left."""
    from fsm_kernel import recorder
    from fsm_kernel.store import _sql
    from fsm_kernel.workflow import compiler

    compiler._CACHE.clear()
    recorder._has_durable_keyword_cached.cache_clear()  # which stores' append take durable=
    for dialect in (_sql.SQLITE, _sql.POSTGRES):
        dialect.__dict__.pop("sql", None)  # a cached_property: built again on first use
