"""Many synthetic runs written fast through the store's own append (one batch per chunk of
runs): the run viewer's paging test and its benchmark fill a store with 100,000 of them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import AnyEventStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
WORKFLOWS = ("default", "react", "plan_execute", "reflect", "single_shot")
REASONS = ("final_answer", "done", "max_iterations", "tool_failures")
CHUNK = 5_000


def run_id(i: int) -> str:
    """Ids sort like their start times: run i starts i seconds after T0."""
    return f"{i:08x}-0000-7000-8000-000000000000"


def run_events(i: int) -> list[Event]:
    """Run i: started, one model answer, and (three runs in four) its end."""
    rid = run_id(i)
    ts = T0 + timedelta(seconds=i)
    workflow = WORKFLOWS[i % len(WORKFLOWS)]
    usage = {"prompt_tokens": 100 + i % 7, "completion_tokens": 20}
    events = [
        Event(run_id=rid, seq=1, type=EventType.RUN_STARTED, timestamp=ts,
              data={"workflow": workflow, "goal": f"task number {i}"}),
        Event(run_id=rid, seq=2, type=EventType.MODEL_RESPONDED, timestamp=ts, iteration=1,
              state="think", data={"completion": {"message": {"role": "assistant",
                                   "content": "ok"}, "usage": usage}}),
    ]  # fmt: skip
    if i % 4:
        events.append(
            Event(run_id=rid, seq=3, type=EventType.RUN_TERMINATED, iteration=1,
                  timestamp=ts + timedelta(seconds=2), data={"reason": REASONS[i % 4]})
        )  # fmt: skip
    return events


def chunks(count: int) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for i in range(count):
        batch += run_events(i)
        if (i + 1) % CHUNK == 0:
            yield batch
            batch = []
    if batch:
        yield batch


def write_runs(store: AnyEventStore, count: int) -> None:
    """Runs 0..count-1 (see run_events), appended CHUNK runs per batch without a sync each."""
    for batch in chunks(count):
        store.append(batch, durable=False)
    store.append([], durable=True)
