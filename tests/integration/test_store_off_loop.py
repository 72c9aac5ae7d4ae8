"""Blocking store appends never run on the event loop: a store that offers no idle append (a
wrapper, PostgreSQL) is written in batches from a thread, in order, and many runs on one
PostgreSQL store go on concurrently while each waits on a slow model. (Where a local store's
commits go, and what each holds: test_commit_placement.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, Event, EventType, Message, Tool, ToolCall
from fsm_kernel.store import PostgresEventStore, SqliteEventStore
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow

DEFAULT = Path(__file__).resolve().parents[2] / "workflows" / "default.yaml"


class WatchedStore:
    """Wraps a store: records which thread each append ran on and the batches' sizes."""

    def __init__(self, inner: SqliteEventStore | PostgresEventStore) -> None:
        self.inner = inner
        self.threads: list[int] = []
        self.batches: list[list[Event]] = []

    def append(self, events: Sequence[Event]) -> None:
        self.threads.append(threading.get_ident())
        self.batches.append(list(events))
        self.inner.append(events)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class SlowModel:
    """A clock call, then an answer; each reply after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        await asyncio.sleep(self.delay)
        if messages[-1].role.value == "user":
            call = ToolCall(id=f"c{id(messages)}", name="datetime", arguments={})
            return Completion(message=Message.assistant("", [call]))
        return Completion(message=Message.assistant("It is noon."))


def kernel(store: WatchedStore, delay: float) -> Kernel:
    return Kernel(
        compile_workflow(load_workflow(DEFAULT)),
        model=SlowModel(delay),
        tools=builtin_registry("."),
        store=store,  # type: ignore[arg-type]
    )


def test_appends_run_off_the_event_loop_in_step_batches(tmp_path: Path) -> None:
    store = WatchedStore(SqliteEventStore(tmp_path / "r.db"))
    loop_thread: list[int] = []

    async def main() -> str:
        loop_thread.append(threading.get_ident())
        result = await kernel(store, 0.0).run("What time is it?")
        return result.run_id

    run_id = asyncio.run(main())

    assert store.threads
    assert loop_thread[0] not in store.threads
    written = [e for batch in store.batches for e in batch]
    assert [e.seq for e in written] == list(range(1, len(written) + 1))  # in order, no gap
    assert len(store.batches) < len(written)  # batched per step, not one append per event
    assert store.inner.read(run_id) == written
    # A tool's start is durable before the tool runs; the model's request before it is asked.
    for kind in (EventType.TOOL_STARTED, EventType.MODEL_REQUESTED):
        assert any(batch[-1].type == kind for batch in store.batches)
    store.inner.close()


@pytest.mark.postgres
def test_fifty_concurrent_runs_share_a_postgres_store_without_stalling(pg_dsn: str) -> None:
    store = WatchedStore(PostgresEventStore(pg_dsn))
    loop_thread: list[int] = []

    async def main() -> list[str]:
        loop_thread.append(threading.get_ident())
        k = kernel(store, 0.2)
        results = await asyncio.gather(*(k.run(f"task {i}") for i in range(50)))
        return [r.termination_reason for r in results]

    reasons = asyncio.run(main())

    assert reasons == ["final_answer"] * 50
    assert loop_thread[0] not in store.threads
    runs = store.inner.list_runs(limit=100)
    assert len(runs) == 50
    assert {r.termination_reason for r in runs} == {"final_answer"}
    assert all(store.inner.read(r.run_id)[-1].type == EventType.RUN_TERMINATED for r in runs)
    store.inner.close()
