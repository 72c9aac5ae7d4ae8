"""RunRecorder: turns what a run does into events, appended to the store as they happen.

On resume it first *catches up*: the run is re-driven from its start with recorded answers, and
every event it would record is matched against the log instead of written again. When the log
runs out (the iteration that was in flight when the process died) recording goes live.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fsm_kernel.protocol import Clock, Event, EventStore, EventType, SystemClock
from fsm_kernel.redact import redact_data
from fsm_kernel.streaming import StreamNotice, TextDelta

__all__ = ["RunRecorder"]

logger = logging.getLogger(__name__)

# Keys whose values must match for a recorded event to count as "the same step" during catch-up.
_IDENTITY: dict[EventType, tuple[str, ...]] = {
    EventType.TRANSITION_TAKEN: ("source", "target", "index"),
    EventType.TOOL_STARTED: ("call",),
    EventType.ITERATION_COMPLETED: ("step",),
}


class RunRecorder:
    """Appends a run's events; `events` keeps what this process recorded or matched."""

    def __init__(
        self,
        run_id: str,
        store: EventStore | None,
        *,
        clock: Clock | None = None,
        expected: Sequence[Event] = (),
        next_seq: int = 1,
        watchers: Sequence[Callable[[Event | TextDelta], None]] = (),
    ) -> None:
        self.watchers = tuple(watchers)
        self.run_id = run_id
        self.store = store
        self.clock = clock or SystemClock()
        self.events: list[Event] = []
        self._expected = list(expected)
        self._cursor = 0
        self._seq = next_seq
        self.iteration = 0
        self.state: str | None = None
        self.diverged_at: Event | None = None
        self._pending: list[Event] = []
        self._inflight: asyncio.Future[None] | None = None

    @property
    def catching_up(self) -> bool:
        return self._cursor < len(self._expected)

    def __call__(self, type_: EventType, data: dict[str, Any]) -> None:
        self.record(type_, data)

    async def flush(self) -> None:
        """Make every event recorded so far durable, in one batch, off the event loop (a
        store's append is blocking I/O: a network round trip for PostgreSQL), in order.

        The kernel flushes at the end of each step and before a tool runs, so what a step
        did is durable before the next one starts, as if each event had been appended alone.
        If the awaiting task is cancelled, the write still completes, and the next flush
        waits for it, so the log never has a gap or a reordering.
        """
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self._inflight = asyncio.ensure_future(self._write(self._inflight, batch))
        await asyncio.shield(self._inflight)

    async def _write(self, previous: asyncio.Future[None] | None, batch: list[Event]) -> None:
        if previous is not None:
            await previous
        assert self.store is not None  # only then are events pending
        await asyncio.to_thread(self.store.append, batch)

    def stream_sink(self, item: TextDelta | StreamNotice) -> None:
        """Where the run's model streams to: text goes to the watchers (never stored), a
        notice is recorded as a `model.notice` event."""
        if isinstance(item, StreamNotice):
            self.record(EventType.MODEL_NOTICE, {"kind": item.kind, **item.detail})
            return
        for watch in self.watchers:
            watch(item)

    def record(self, type_: EventType, data: dict[str, Any]) -> Event:
        data = redact_data(data)  # nothing secret reaches the store, the log or a watcher
        if self.catching_up:
            matched = self._match(type_, data)
            if matched is not None:
                return matched
        event = Event(
            run_id=self.run_id,
            seq=self._seq,
            type=type_,
            timestamp=self.clock.now(),
            iteration=self.iteration,
            state=self.state,
            data=data,
        )
        if self.store is not None:
            self._pending.append(event)
        self._seq += 1
        self.events.append(event)
        for watch in self.watchers:
            watch(event)
        logger.debug("event %d %s %s", event.seq, type_.value, self.state or "")
        return event

    def _match(self, type_: EventType, data: dict[str, Any]) -> Event | None:
        recorded = self._expected[self._cursor]
        keys = _IDENTITY.get(type_, ())
        same = recorded.type == type_ and all(recorded.data.get(k) == data.get(k) for k in keys)
        if not same:
            self.diverged_at = recorded
            logger.warning(
                "resume diverged from the log at seq %d (%s); recording live from here",
                recorded.seq,
                recorded.type.value,
            )
            self._cursor = len(self._expected)
            return None
        self._cursor += 1
        self.events.append(recorded)
        return recorded
