"""CompletionBuffer: what a buffered outcome promises.

An outcome is awaited by the run it ends until its statement committed: a run that reports it
recorded (DONE, FAILED...) is in the store. On its own the buffer records each turn of the event
loop's outcomes together; while a worker's claim loop carries them (`carry(True)`), they wait
for its next claim (`take`, then `settle`), and are recorded on their own when none takes them
within CARRY_SECONDS, when a claim could not record them (`give_back`), or once the loop stops
(`carry(False)`). Until then the dispatch stays running under its lease: a worker that dies
with outcomes buffered has recorded none of them (see test_dispatch_batching.py for the crash).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreConflictError
from fsm_kernel.scheduler.executor import CARRY_SECONDS, CompletionBuffer
from fsm_kernel.scheduler.queue import Completion, Dispatch, DispatchStatus, SqliteDispatchQueue


class CountingQueue(SqliteDispatchQueue):
    """The real SQLite queue, recording each complete_batch call's size."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.alone: list[int] = []

    def complete_batch(self, completions: Any, **kwargs: Any) -> Any:
        self.alone.append(len(completions))
        return super().complete_batch(completions, **kwargs)


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[CountingQueue]:
    q = CountingQueue(tmp_path / "q.db")
    q.ensure_schema()
    yield q
    q.close()


def claimed(queue: CountingQueue, count: int) -> list[Dispatch]:
    for i in range(count):
        assert queue.enqueue("k", f"a{i}", "p", 0, None) is not None
    return queue.claim_batch("k", "w", 60, 10, count)


def outcome(dispatch: Dispatch, attempt: int = 1) -> Completion:
    return Completion(
        dispatch_id=dispatch.dispatch_id, worker_id="w", attempt=attempt, status="done"
    )


def status(queue: CountingQueue, dispatch: Dispatch) -> DispatchStatus:
    row = queue.get(dispatch.dispatch_id)
    assert row is not None
    return row.status


def test_alone_the_outcomes_of_one_turn_are_recorded_by_one_statement(
    queue: CountingQueue,
) -> None:
    a, b = claimed(queue, 2)

    async def scenario() -> list[None]:
        buffer = CompletionBuffer(queue, 10)
        return await asyncio.gather(buffer.complete(outcome(a)), buffer.complete(outcome(b)))

    assert asyncio.run(scenario()) == [None, None]
    assert [status(queue, d) for d in (a, b)] == [DispatchStatus.DONE] * 2
    assert queue.alone == [2]


def test_carried_outcomes_wait_for_the_claim_that_takes_them(queue: CountingQueue) -> None:
    a, b = claimed(queue, 2)

    async def scenario() -> None:
        buffer = CompletionBuffer(queue, 10)
        buffer.carry(True)
        waiting = [asyncio.ensure_future(buffer.complete(outcome(d))) for d in (a, b)]
        await asyncio.sleep(0)
        batch = buffer.take()
        assert [c.dispatch_id for c, _ in batch] == [a.dispatch_id, b.dispatch_id]
        assert not any(w.done() for w in waiting)  # not reported before they are recorded
        assert status(queue, a) is DispatchStatus.RUNNING
        results, _ = queue.complete_and_claim([c for c, _ in batch], "k", "w", 60, 10, 5)
        buffer.settle(batch, results)
        assert results == [None, None]
        assert [await w for w in waiting] == [None, None]
        assert [status(queue, d) for d in (a, b)] == [DispatchStatus.DONE] * 2
        await asyncio.sleep(CARRY_SECONDS * 2)  # taken: the fallback records nothing more

    asyncio.run(scenario())
    assert queue.alone == []
    assert status(queue, b) is DispatchStatus.DONE


def test_carried_outcomes_no_claim_takes_are_recorded_on_their_own(
    queue: CountingQueue,
) -> None:
    (a,) = claimed(queue, 1)

    async def scenario() -> float:
        buffer = CompletionBuffer(queue, 10)
        buffer.carry(True)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(buffer.complete(outcome(a)), 5)
        assert status(queue, a) is DispatchStatus.DONE
        return asyncio.get_running_loop().time() - started

    waited = asyncio.run(scenario())
    assert waited >= CARRY_SECONDS * 0.9  # it did wait for a claim first
    assert queue.alone == [1]


def test_outcomes_given_back_or_left_at_stop_are_recorded_and_fenced(
    queue: CountingQueue,
) -> None:
    a, b, c = claimed(queue, 3)

    async def scenario() -> list[Any]:
        buffer = CompletionBuffer(queue, 10)
        buffer.carry(True)
        first = [asyncio.ensure_future(buffer.complete(outcome(a)))]
        await asyncio.sleep(0)
        buffer.give_back(buffer.take())  # a claim that failed: recorded alone, at once
        await asyncio.wait_for(asyncio.shield(first[0]), 5)
        rest = [
            asyncio.ensure_future(buffer.complete(outcome(b))),
            asyncio.ensure_future(buffer.complete(outcome(c, attempt=2))),  # a lost lease
        ]
        await asyncio.sleep(0)
        buffer.carry(False)  # the loop stopped: no claim will come
        return await asyncio.gather(*first, *rest, return_exceptions=True)

    results = asyncio.run(scenario())
    assert results[:2] == [None, None]
    assert [status(queue, d) for d in (a, b)] == [DispatchStatus.DONE] * 2
    assert isinstance(results[2], StoreConflictError)
    assert status(queue, c) is DispatchStatus.RUNNING  # the fenced outcome was not recorded
    assert queue.alone == [1, 2]


def test_a_row_read_as_a_tuple_is_the_same_dispatch_as_read_by_name(queue: CountingQueue) -> None:
    """The PostgreSQL worker reads its claims as tuples of COLUMNS (Dispatch.from_tuple): the
    same object as from_row, times, status and integers converted alike; a short row fails."""
    from fsm_kernel.scheduler.queue import COLUMNS

    (a,) = claimed(queue, 1)
    row = {**a.to_dict(), "attempts": "1", "priority": 0}  # ISO times, status as text
    by_tuple = Dispatch.from_tuple(tuple(row[name] for name in COLUMNS))
    assert by_tuple == Dispatch.from_row(row) == a
    assert by_tuple.status is DispatchStatus.RUNNING
    assert by_tuple.attempts == 1
    with pytest.raises(ValueError, match="shorter"):
        Dispatch.from_tuple(tuple(row[name] for name in COLUMNS[:-1]))
