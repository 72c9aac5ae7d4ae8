"""RunRecorder: turns what a run does into events, appended to the store as they happen.

On resume it first *catches up*: the run is re-driven from its start with recorded answers, and
every event it would record is matched against the log instead of written again. When the log
runs out (the iteration that was in flight when the process died) recording goes live.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

from fsm_kernel.protocol import Clock, Event, EventStore, EventType, SystemClock
from fsm_kernel.redact import Redacted, redact_data
from fsm_kernel.streaming import StreamNotice, TextDelta

__all__ = ["RunRecorder"]

logger = logging.getLogger(__name__)

# A batch holding one of these is synced to disk: what follows it is a model call or a tool
# call (side effects a resume must not repeat needlessly), or nothing (the run ended or waits),
# or it holds a person's answer.
_SYNC_BEFORE = frozenset(
    {
        EventType.MODEL_REQUESTED,
        EventType.TOOL_STARTED,
        EventType.RUN_TERMINATED,
        EventType.HUMAN_ANSWERED,  # a person's answer is never asked for twice
        EventType.EVENT_DELIVERED,  # nor an event delivered, nor a timer fired
        EventType.TIMER_FIRED,
        EventType.RUN_SUSPENDED,
    }
)

# A step that recorded one of these is committed as soon as it ends: a tool call that finished
# must not be repeated by a resume (see RunRecorder.end_step).
_AT_STEP_END = frozenset({EventType.TOOL_FINISHED})

# Keys whose values must match for a recorded event to count as "the same step" during catch-up.
_IDENTITY: dict[EventType, tuple[str, ...]] = {
    EventType.TRANSITION_TAKEN: ("source", "target", "index"),
    EventType.TOOL_STARTED: ("call",),
    EventType.ITERATION_COMPLETED: ("step",),
    EventType.TIMER_SET: ("edge",),
    EventType.TIMER_FIRED: ("edge",),
    EventType.EVENT_DELIVERED: ("name",),
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
        self._soon: asyncio.Handle | None = None
        self._relaxable = _takes_durable(store)
        self._append_if_idle = _idle_append(store) if self._relaxable else None
        self._sync_if_idle = _idle_sync(self._append_if_idle)
        self._writer_of: tuple[asyncio.AbstractEventLoop, _Writer] | None = None

    @property
    def catching_up(self) -> bool:
        return self._cursor < len(self._expected)

    def __call__(self, type_: EventType, data: dict[str, Any]) -> None:
        self.record(type_, data)

    async def flush(self, *, durable: bool | None = None) -> None:
        """Commit every event recorded so far, in one batch, in order.

        Actions flush before each model call, tool call, person's question and child run,
        and the kernel ends each step with `end_step`, so everything a run recorded is
        committed before it waits on anything: a process killed at any point (SIGKILL
        included) loses only what the run recorded since it last waited (see `end_step`).
        `durable` says whether the commit must also reach the disk before this returns; by
        default it does when the batch precedes a model or tool call (model.requested,
        tool.started), holds a person's answer, or ends or suspends the run. A store whose
        `append` takes `durable` commits the other batches without waiting for the disk: the
        next synced commit, at the latest before the next model or tool call, takes them to
        disk with it. So a machine crash too loses nothing recorded before the last model or
        tool call started. Stores without the option sync every batch.

        Where the commit is made: while this run writes alone to the store (see
        `_Writer.alone`), a relaxed batch goes to the store's `append_if_idle` on the event
        loop when it has one (SQLite, JSONL: a local commit costs less than a thread
        hand-off), and a durable one too when the store's syncs are fast (the stores'
        SyncCost). Anything else, every batch of runs that write together included, goes to
        the thread of the `_Writer` that the runs sharing the store on this loop write
        through, which commits the batches that arrive together in one go (one transaction
        and one sync for many runs). A blocking append never runs on the loop: a PostgreSQL
        commit is a round trip.

        If the awaiting task is cancelled, the write still completes, and the next flush
        waits for it, so the log never has a gap or a reordering.
        """
        if not self._pending:
            # A put-off commit may have taken everything: wait for it, so that what this
            # flush promises (committed, and synced if it holds a sync point) holds when it
            # returns, and its failure is raised here.
            if not self._settled():
                assert self._inflight is not None
                await asyncio.shield(self._inflight)
            return
        if self._soon is not None:  # this commit takes the deferred events along
            self._soon.cancel()
            self._soon = None
        batch, self._pending = self._pending, []
        if durable is None:
            durable = _holds(batch, _SYNC_BEFORE)
        written = self._start(batch, durable)
        if written is not None:
            await asyncio.shield(written)

    def _start(self, batch: list[Event], durable: bool) -> asyncio.Future[None] | None:
        """Start writing `batch` after every earlier one; its future, or None when it was
        committed at once on the event loop: a run that writes alone commits there (a
        relaxed local commit, or a durable one to a store whose syncs are fast: no thread
        hand-off)."""
        writer = self._writer()
        alone = writer.alone(self.run_id)
        if self._settled():
            # Runs that write together send every batch to the writer's thread, which
            # commits what arrived meanwhile in one transaction: one commit for many runs'
            # relaxed batches too, rather than one each on the event loop.
            if not alone:
                at_once = None
            elif durable:
                at_once = self._sync_if_idle
            else:
                at_once = self._append_if_idle
            if at_once is not None and at_once(batch):
                return None
            self._inflight = writer.submit(batch, durable)  # the usual case: no task between
        else:
            self._inflight = asyncio.ensure_future(self._write(self._inflight, batch, durable))
        return self._inflight

    def _writer(self) -> _Writer:
        assert self.store is not None  # only then are events pending
        loop = asyncio.get_running_loop()
        if self._writer_of is None or self._writer_of[0] is not loop:
            self._writer_of = (loop, _Writer.of(self.store, loop))
        return self._writer_of[1]

    def _settled(self) -> bool:
        """No earlier write is still going (or failed unseen): this batch may go first."""
        previous = self._inflight
        return previous is None or (
            previous.done() and not previous.cancelled() and previous.exception() is None
        )

    async def end_step(self, *, at_once: bool = False) -> None:
        """What the kernel does at the end of each step: commit what the step recorded now
        when it holds a tool call's result (a resume must not repeat the call) or `at_once`
        (the step ran a user's action, which may have done what a resume must not redo);
        else when the run next commits or next waits, whichever comes first. A built-in step
        commits before it waits on the model, a tool, a person or a child run, so the step
        before it rides with that commit (one commit per wait rather than one per step); a
        run that waits on anything else (a sleep, a user's code in its thread, I/O) lets the
        put-off commit go first. So readers see every state a run waits in, and a process
        killed in between loses only what the run recorded since it last waited: a model's
        reply at most, which a resume asks for again."""
        if not self._pending:
            return
        if at_once or _holds(self._pending, _AT_STEP_END):
            await self.flush()
        elif self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._flush_deferred)

    def _flush_deferred(self) -> None:
        """The commit `end_step` put off, when nothing took it along meanwhile. A failure
        surfaces in the run's next flush, as a failed write's always does."""
        self._soon = None
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:  # synced if it holds a sync point (the run suspended meanwhile, say)
            written = self._start(batch, _holds(batch, _SYNC_BEFORE))
        except Exception as exc:  # the inline commit failed: the next flush raises it
            written = asyncio.get_running_loop().create_future()
            written.set_exception(exc)
            self._inflight = written
        if written is not None:
            written.add_done_callback(_seen)

    async def sync(self) -> None:
        """`flush(durable=True)`: commit and wait for the disk (before a side effect)."""
        await self.flush(durable=True)

    async def _write(
        self, previous: asyncio.Future[None] | None, batch: list[Event], durable: bool
    ) -> None:
        if previous is not None:
            await previous
        await self._writer().submit(batch, durable)

    def stream_sink(self, item: TextDelta | StreamNotice) -> None:
        """Where the run's model streams to: text goes to the watchers (never stored), a
        notice is recorded as a `model.notice` event."""
        if isinstance(item, StreamNotice):
            self.record(EventType.MODEL_NOTICE, {"kind": item.kind, **item.detail})
            return
        for watch in self.watchers:
            watch(item)

    def record(self, type_: EventType, data: dict[str, Any] | Redacted) -> Event | None:
        """Append an event (or, catching up with the log, take the recorded one it matches);
        None for an event that a log written by an older fsm-kernel lacks (`_added_later`).
        `data` may be a `Redacted` (data recorded again and again, redacted once)."""
        # nothing secret reaches the store, the log or a watcher
        payload: dict[str, Any] = data.get() if type(data) is Redacted else redact_data(data)
        if self._cursor < len(self._expected):  # catching up
            if _added_later(type_, payload) and not self._same(
                self._expected[self._cursor], type_, payload
            ):
                return None  # the history re-driven stays as it was written
            matched = self._match(type_, payload)
            if matched is not None:
                return matched
        event = Event(
            run_id=self.run_id,
            seq=self._seq,
            type=type_,
            timestamp=self.clock.now(),
            iteration=self.iteration,
            state=self.state,
            data=payload,
        )
        if self.store is not None:
            self._pending.append(event)
        self._seq += 1
        self.events.append(event)
        for watch in self.watchers:
            watch(event)
        if logger.isEnabledFor(logging.DEBUG):  # the arguments cost more than the check
            logger.debug("event %d %s %s", event.seq, type_.value, self.state or "")
        return event

    @staticmethod
    def _same(recorded: Event, type_: EventType, data: dict[str, Any]) -> bool:
        keys = _IDENTITY.get(type_, ())
        return recorded.type == type_ and all(recorded.data.get(k) == data.get(k) for k in keys)

    def _match(self, type_: EventType, data: dict[str, Any]) -> Event | None:
        recorded = self._expected[self._cursor]
        if not self._same(recorded, type_, data):
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


def _added_later(type_: EventType, data: dict[str, Any]) -> bool:
    """An event this fsm-kernel writes that a log written by an older one may lack where it
    would be: a context summary's `iteration.completed` (written since 0.1)."""
    return type_ is EventType.ITERATION_COMPLETED and data.get("decision") == "summarize"


def _holds(batch: Sequence[Event], types: frozenset[EventType]) -> bool:
    """Whether any event of `batch` is of one of `types`."""
    return any(e.type in types for e in batch)


def _seen(future: asyncio.Future[None]) -> None:
    """Mark a background write's failure as retrieved: the run's next flush raises it."""
    if not future.cancelled():
        future.exception()


def _takes_durable(store: EventStore | None) -> bool:
    """Whether `store.append` accepts `durable=` (the stores of fsm_kernel.store do)."""
    return store is not None and _durable_keyword(store.append)


def _durable_keyword(method: Callable[..., Any]) -> bool:
    """Whether `method` takes `durable=` as a keyword-only argument. Asked by every run's
    recorder of the same few store methods: the answer for a method is its function's, kept
    (`inspect.signature` takes about 9 µs, 30 with hundreds of runs at work, and 500 runs
    started together would ask it 1,000 times on the event loop)."""
    function = getattr(method, "__func__", None)
    if function is None:  # not a method: no function to key the answer on
        return _has_durable_keyword(method)
    try:
        return _has_durable_keyword_cached(function)
    except TypeError:  # an unhashable function object
        return _has_durable_keyword(method)


def _has_durable_keyword(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    durable = parameters.get("durable")
    return durable is not None and durable.kind is inspect.Parameter.KEYWORD_ONLY


_has_durable_keyword_cached = functools.lru_cache(maxsize=64)(_has_durable_keyword)


def _idle_append(store: EventStore | None) -> Callable[[Sequence[Event]], bool] | None:
    """The store's own `append_if_idle` (SQLite, JSONL), if it has one: only when the same
    object also provides `append`, so a wrapper that intercepts appends sees every batch."""
    append_if_idle = getattr(store, "append_if_idle", None)
    owner = getattr(append_if_idle, "__self__", None)
    if owner is None or owner is not getattr(getattr(store, "append", None), "__self__", None):
        return None
    return cast(Callable[[Sequence[Event]], bool], append_if_idle)


def _idle_sync(append_if_idle: Callable[..., bool] | None) -> Callable[[list[Event]], bool] | None:
    """`append_if_idle(batch, durable=True)`, when the store's `append_if_idle` takes it."""
    if append_if_idle is None or not _durable_keyword(append_if_idle):
        return None
    return functools.partial(append_if_idle, durable=True)


def _same_object(store: EventStore) -> EventStore:
    """`store` itself: a writer's reference to a store that cannot be weakly referenced."""
    return store


_LONE_WINDOW = 0.05
"""Seconds since another run's last write after which a run counts as writing alone."""


class _Writer:
    """Writes the batches of every run that shares one store on one event loop, from one
    thread at a time: the batches that arrive while a write is going wait together and go
    in the next one, through the store's `append_batches` (one transaction and at most one
    sync for all: SQLite, PostgreSQL) or one `append` after another. So a hundred concurrent
    runs cost a handful of thread hand-offs and syncs, not a hundred; a lone run, one each.
    Each batch still succeeds or fails on its own, and a run's batches stay in order (a run
    waits for each before it records the next)."""

    _instances: ClassVar[
        weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary[object, _Writer]]
    ] = weakref.WeakKeyDictionary()
    """Per store, per event loop; a writer refers to neither, so both can be collected."""

    def __init__(self, store: EventStore) -> None:
        self._store: Callable[[], EventStore | None]
        try:
            self._store = weakref.ref(store)
        except TypeError:  # cannot be weakly referenced: this writer is its recorder's alone
            self._store = functools.partial(_same_object, store)
        self._relaxable = _takes_durable(store)
        many = getattr(store, "append_batches", None)
        owned = getattr(many, "__self__", None) is getattr(store.append, "__self__", False)
        self._batches = owned and self._relaxable  # the store's own, taking durable= too
        self._waiting: list[tuple[list[Event], bool, asyncio.Future[None]]] = []
        self._busy = False
        self._last: tuple[str, float] = ("", -math.inf)
        """The run that wrote last, and when."""
        self._before: tuple[str, float] = ("", -math.inf)
        """The last write of any other run than that."""

    def alone(self, run_id: str) -> bool:
        """Note that `run_id` writes now; whether it writes alone: no write is queued or going
        here and no other run wrote in the last _LONE_WINDOW seconds. A lone run may make its
        durable commits on the event loop; runs that write together share the thread's
        commits and syncs instead (one sync for many beats many on the loop)."""
        now = time.monotonic()
        other = self._before if self._last[0] == run_id else self._last
        if self._last[0] != run_id:
            self._before = self._last
        self._last = (run_id, now)
        return not self._busy and not self._waiting and now - other[1] > _LONE_WINDOW

    @classmethod
    def of(cls, store: EventStore, loop: asyncio.AbstractEventLoop) -> _Writer:
        """The writer of `store` on `loop` (a new one each time for a store that cannot be
        weakly referenced: then nothing is shared)."""
        try:
            per_loop = cls._instances.get(store)
            if per_loop is None:
                per_loop = cls._instances[store] = weakref.WeakKeyDictionary()
        except TypeError:
            return cls(store)
        writer = per_loop.get(loop)
        if writer is None:
            writer = per_loop[loop] = cls(store)
        return writer

    def submit(self, batch: list[Event], durable: bool) -> asyncio.Future[None]:
        """Queue `batch` (on the running loop); the future is done once it is written (or
        failed to be)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((batch, durable, future))
        if not self._busy:
            self._start(loop)
        return future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        items, self._waiting = self._waiting, []
        self._busy = True
        work = loop.run_in_executor(None, self._write_all, items)
        work.add_done_callback(functools.partial(self._written, items))

    def _write_all(self, items: list[tuple[list[Event], bool, Any]]) -> list[Exception | None]:
        """In a thread: every item's outcome, in order."""
        store = self._store()
        if store is None:  # pragma: no cover - the runs waiting here hold it
            raise RuntimeError("the event store was garbage-collected while runs wrote to it")
        if self._batches and len(items) > 1:
            batches = [(batch, durable) for batch, durable, _ in items]
            outcomes: list[Exception | None] = cast(Any, store).append_batches(batches)
            return outcomes
        errors: list[Exception | None] = []
        for batch, durable, _ in items:
            try:
                if durable or not self._relaxable:
                    store.append(batch)
                else:
                    relaxed: Callable[..., None] = store.append  # takes durable= (checked)
                    relaxed(batch, durable=False)
            except Exception as exc:  # this batch's failure, reported to its run
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def _written(
        self,
        items: list[tuple[list[Event], bool, asyncio.Future[None]]],
        work: asyncio.Future[list[Exception | None]],
    ) -> None:
        """On the loop: settle each item's future, then start on what queued meanwhile."""
        self._busy = False
        failure = work.exception() if not work.cancelled() else asyncio.CancelledError()
        outcomes: list[BaseException | None] = (
            [failure] * len(items) if failure is not None else list(work.result())
        )
        for (_, _, future), error in zip(items, outcomes, strict=True):
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        if self._waiting:
            self._start(work.get_loop())
