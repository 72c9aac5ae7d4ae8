"""Executing one claimed dispatch: the injected agent runner under a timeout, lease heartbeats
while it runs, and the fenced completion. Shared by the Scheduler and the Worker.

The runner is injected (`AgentRunner`): this package never imports the kernel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.notify import DispatchNotifier
from fsm_kernel.scheduler.config import AgentSpec, SchedulerConfig
from fsm_kernel.scheduler.queue import (
    CANCELLED_RUNNING,
    Completion,
    Dispatch,
    DispatchQueue,
    DispatchStatus,
)

__all__ = [
    "AgentRunner",
    "CompletionBuffer",
    "DispatchDetail",
    "DispatchExecutor",
    "ExecutionStatus",
    "RunOutcome",
    "default_worker_id",
    "one_line_error",
]

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500
MAX_COMPLETION_BATCH = 100
"""Outcomes recorded by one statement at most."""
CARRY_SECONDS = 0.1
"""How long an outcome waits for a claim to carry it before it is recorded on its own."""


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What the injected runner reports about one kernel run."""

    ok: bool
    """True when the run ended the way the agent intended (done, final answer)."""
    run_id: str | None = None
    termination_reason: str | None = None
    error: str | None = None
    waiting: bool = False
    """The run suspended until a person answers or an event or timer comes (`fsm-kernel
    resume` completes it; the scheduler wakes it when its timer is due)."""


class AgentRunner(Protocol):
    """Runs one agent's workflow with the final prompt (STATE.md already injected); called as
    `runner(agent, prompt)`. A dispatch that already has a run (woken when that run's timer was
    due) is called as `runner(agent, prompt, resume=run_id)`: continue the recorded run rather
    than start one, and report it the same way (a runner that never meets woken dispatches may
    take just the two arguments)."""

    def __call__(
        self, agent: AgentSpec, prompt: str, /, *, resume: str | None = None
    ) -> Awaitable[RunOutcome]: ...


class ExecutionStatus(StrEnum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    """Stopped on request (`dispatches --cancel`); the run ends with the reason `cancelled`."""
    WAITING = "waiting"
    """The run waits for a person, an event or a timer; the worker is free and `fsm-kernel
    resume` completes it (the scheduler wakes it once its timer is due)."""
    ABANDONED = "abandoned"
    """Stopped mid-run on purpose; the lease is left to expire so another worker reclaims it."""
    LOST = "lost"
    """The lease went to another worker (or the store failed) before the outcome was recorded."""


@dataclass(frozen=True, kw_only=True)
class DispatchDetail:
    """The fate of one dispatch executed by this process."""

    dispatch_id: str
    agent_id: str
    status: ExecutionStatus
    attempt: int
    run_id: str | None = None
    termination_reason: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dispatch_id": self.dispatch_id,
            "agent_id": self.agent_id,
            "status": self.status.value,
            "attempt": self.attempt,
            "run_id": self.run_id,
            "termination_reason": self.termination_reason,
            "error": self.error,
        }


def default_worker_id() -> str:
    """host:pid:random, unique per process (and per Scheduler/Worker instance)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def one_line_error(exc: BaseException) -> str:
    """`Type: first line of the message`, capped, for the dispatch row."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line[:_MAX_ERROR_CHARS]


class CompletionBuffer:
    """Records outcomes in batches, each awaited by the run it ends until it is committed.

    On its own it flushes the outcomes that arrive in one turn of the event loop, or while the
    previous batch is being written, together (`complete_batch`: one thread hop, one statement,
    one commit). While `carried` (a Worker's claim loop), the outcomes wait instead for the
    worker's next claim, which `take`s them and records them with the claim in one statement
    (`complete_and_claim`), then `settle`s them; should no claim take them within
    `CARRY_SECONDS` (the loop is never that slow unless something is wrong), they are flushed on
    their own. A lost lease fails only the outcome it concerns; a store failure fails the whole
    batch (nothing recorded)."""

    def __init__(self, queue: DispatchQueue, max_concurrent: int | None) -> None:
        self.queue = queue
        self.max_concurrent = max_concurrent
        self._pending: list[tuple[Completion, asyncio.Future[Dispatch]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._carried = False
        self._fallback: asyncio.TimerHandle | None = None

    def carry(self, carried: bool) -> None:
        """Let a claim loop carry the outcomes (True), or flush them alone again (False: what
        is waiting is flushed now)."""
        self._carried = carried
        if not carried:
            self._cancel_fallback()
            if self._pending:
                self._start_flush()

    async def complete(self, completion: Completion) -> Dispatch:
        """The finished row. StoreConflictError if the lease was lost, StoreError if the store
        failed."""
        future: asyncio.Future[Dispatch] = asyncio.get_running_loop().create_future()
        self._pending.append((completion, future))
        if not self._carried:
            self._start_flush()
        elif self._fallback is None:
            loop = asyncio.get_running_loop()
            self._fallback = loop.call_later(CARRY_SECONDS, self._carry_timed_out)
        return await future

    def take(self) -> list[tuple[Completion, asyncio.Future[Dispatch]]]:
        """The waiting outcomes (at most MAX_COMPLETION_BATCH), for the caller to record and
        then `settle`."""
        batch = self._pending[:MAX_COMPLETION_BATCH]
        del self._pending[:MAX_COMPLETION_BATCH]
        if not self._pending:
            self._cancel_fallback()
        return batch

    def give_back(self, batch: list[tuple[Completion, asyncio.Future[Dispatch]]]) -> None:
        """A taken batch the caller could not record: it is flushed on its own now."""
        if batch:
            self._pending[:0] = batch
            self._start_flush()

    @staticmethod
    def settle(
        batch: list[tuple[Completion, asyncio.Future[Dispatch]]],
        results: Sequence[Dispatch | Exception] | Exception,
    ) -> None:
        """Hand each run of a taken batch its result: its row, its lease conflict, or the
        store's failure (one exception for the whole batch)."""
        outcomes = [results] * len(batch) if isinstance(results, Exception) else results
        for (_, future), result in zip(batch, outcomes, strict=True):
            if future.done():  # its run was cancelled meanwhile
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _start_flush(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def _carry_timed_out(self) -> None:
        self._fallback = None
        if self._pending:
            self._start_flush()

    def _cancel_fallback(self) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
            self._fallback = None

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the outcomes of this turn of the loop join the batch
        while self._pending:
            batch = self.take()
            try:
                recorded = await asyncio.to_thread(
                    self.queue.complete_batch,
                    [completion for completion, _ in batch],
                    max_concurrent=self.max_concurrent,
                )
            except Exception as exc:  # handed to every run of the batch, which logs it
                self.settle(batch, exc)
            else:
                self.settle(batch, list(recorded))


class _CancelFlag:
    """A run's cancel request (an Event that also wakes the run's watch)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._set = False
        self._wake = wake

    def set(self) -> None:
        self._set = True
        self._wake()

    def is_set(self) -> bool:
        return self._set


class _Watch:
    """Waits for whatever ends a run's wait first (the run's end, a cancel request, the
    timeout, a lost lease, abandon_all) without a task per cause: each wakes one future.
    Heartbeats start one interval after the claim, so a run shorter than that costs no task
    for them."""

    def __init__(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.woken: asyncio.Future[None] = loop.create_future()
        self.timed_out = False
        self.lease_lost: str | None = None
        self._timer = loop.call_later(timeout, self._time_out)
        self._beat_timer: asyncio.TimerHandle | None = None
        self._beats: asyncio.Task[str] | None = None

    def wake(self, *_: object) -> None:
        if not self.woken.done():
            self.woken.set_result(None)

    def start_beats(self, interval: float, beats: Callable[[], Coroutine[Any, Any, str]]) -> None:
        loop = asyncio.get_running_loop()
        self._beat_timer = loop.call_later(interval, self._begin, beats)

    async def close(self, run: asyncio.Task[RunOutcome]) -> None:
        """Stop the timers and heartbeats, and the run if it still runs."""
        self._timer.cancel()
        if self._beat_timer is not None:
            self._beat_timer.cancel()
        tasks = [t for t in (run, self._beats) if t is not None and not t.done()]
        if tasks:
            await _cancel(*tasks)

    def _time_out(self) -> None:
        self.timed_out = True
        self.wake()

    def _begin(self, beats: Callable[[], Coroutine[Any, Any, str]]) -> None:
        self._beats = asyncio.get_running_loop().create_task(beats())
        self._beats.add_done_callback(self._beats_ended)

    def _beats_ended(self, task: asyncio.Task[str]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self.lease_lost = task.result() if exc is None else one_line_error(exc)
        self.wake()


class DispatchExecutor:
    """Runs claimed dispatches for one worker id."""

    def __init__(
        self,
        config: SchedulerConfig,
        queue: DispatchQueue,
        runner: AgentRunner,
        *,
        worker_id: str,
    ) -> None:
        self.config = config
        self.queue = queue
        self.runner = runner
        self.worker_id = worker_id
        self._cancels: dict[str, _CancelFlag] = {}
        self._watches: set[_Watch] = set()
        self.completions = CompletionBuffer(queue, config.max_concurrent)
        """Where outcomes wait to be recorded (a Worker's claims carry them)."""
        self.notifier = DispatchNotifier(config.notify, config.store) if config.notify else None
        """Tells the config's `notify:` webhooks about failed dispatches."""

    async def settle(self) -> None:
        """Wait a little for the webhooks still being told (before the process exits)."""
        if self.notifier is not None:
            await self.notifier.aclose()

    def request_cancel(self, dispatch_id: str) -> bool:
        """Stop the run of a dispatch this executor is running (a cancel was requested); False
        if it runs none by that id."""
        event = self._cancels.get(dispatch_id)
        if event is not None:
            event.set()
        return event is not None

    async def execute(
        self,
        dispatch: Dispatch,
        *,
        abandon: asyncio.Event | None = None,
        ran: Callable[[], None] | None = None,
    ) -> DispatchDetail:
        """Run a dispatch this worker has claimed and record its outcome.

        Never raises for a failing run: a raised exception or a timeout becomes a failed
        dispatch, a cancel request (seen at a heartbeat, or through request_cancel) a cancelled
        one. On a cancel request or the timeout the runner's task is cancelled, which the kernel
        records as the end of the run with the reason `cancelled`; the run id is kept from what
        the runner then returns. If `abandon` is set mid-run, or this task is cancelled, the run
        is cancelled and the dispatch left running for its lease to expire. `ran` is called when
        the run has ended, before its outcome is recorded (the worker's slot is free then).
        """
        agent = self.config.agent(dispatch.agent_id)
        if agent is None:
            error = f"agent {dispatch.agent_id!r} is not in the scheduler config"
            return await self._finish(dispatch, RunOutcome(ok=False, error=error), False)
        watch = _Watch(self.config.timeout_seconds)
        cancel = self._cancels[dispatch.dispatch_id] = _CancelFlag(watch.wake)
        self._watches.add(watch)
        run = asyncio.create_task(_invoke(self.runner, agent, dispatch))
        run.add_done_callback(watch.wake)
        watch.start_beats(
            self.config.heartbeat_interval, lambda: self._heartbeats(dispatch, cancel)
        )
        try:
            if not (abandon is not None and abandon.is_set()):
                await watch.woken
            ended = run.done()
            interrupted = not ended and (cancel.is_set() or watch.timed_out)
            if interrupted:  # a cancel request or the timeout: let the kernel record the end
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
        finally:
            self._watches.discard(watch)
            await watch.close(run)
            self._cancels.pop(dispatch.dispatch_id, None)
            if ran is not None:
                ran()
        if ended:
            return await self._finish(dispatch, _outcome(run, dispatch), cancel.is_set())
        if interrupted:
            outcome = _interrupted(run, dispatch, cancelled=cancel.is_set(), timeout=watch.timeout)
            return await self._finish(dispatch, outcome, cancel.is_set())
        if watch.lease_lost is not None:
            return _detail(dispatch, ExecutionStatus.LOST, error=watch.lease_lost)
        logger.warning("dispatch %s (%s) abandoned mid-run", dispatch.dispatch_id, agent.agent_id)
        return _detail(dispatch, ExecutionStatus.ABANDONED)

    def abandon_all(self) -> None:
        """Wake every run's wait: the `abandon` event given to execute() has been set."""
        for watch in list(self._watches):
            watch.wake()

    async def _heartbeats(self, dispatch: Dispatch, cancel: _CancelFlag) -> str:
        """Renew the lease every heartbeat interval (the first one interval after the claim),
        and notice a cancel request there; returns why the lease was lost."""
        while True:
            try:
                row = await asyncio.to_thread(
                    self.queue.heartbeat,
                    dispatch.dispatch_id,
                    self.worker_id,
                    self.config.lease_seconds,
                    attempt=dispatch.attempts,
                )
            except StoreConflictError as exc:
                logger.warning("dispatch %s: lease lost: %s", dispatch.dispatch_id, exc)
                return str(exc)
            except StoreError as exc:  # transient: keep running, retry at the next beat
                logger.warning("dispatch %s: heartbeat failed: %s", dispatch.dispatch_id, exc)
            else:
                if row.cancel_requested_at is not None and not cancel.is_set():
                    logger.info("dispatch %s: cancel requested, stopping it", dispatch.dispatch_id)
                    cancel.set()
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _finish(
        self, dispatch: Dispatch, outcome: RunOutcome, cancel_requested: bool
    ) -> DispatchDetail:
        if outcome.run_id is None and dispatch.run_id is not None:  # a resume that failed
            outcome = replace(outcome, run_id=dispatch.run_id)  # still the dispatch's run
        if outcome.ok:
            status = ExecutionStatus.DONE
        elif outcome.waiting and not cancel_requested:
            status = ExecutionStatus.WAITING
        elif cancel_requested:
            status = ExecutionStatus.CANCELLED
        else:
            status = ExecutionStatus.FAILED
        try:
            await self.completions.complete(
                Completion(
                    dispatch_id=dispatch.dispatch_id,
                    worker_id=self.worker_id,
                    attempt=dispatch.attempts,
                    status=DispatchStatus(status.value),
                    run_id=outcome.run_id,
                    termination_reason=outcome.termination_reason,
                    error=outcome.error,
                )
            )
        except StoreError as exc:
            logger.warning("dispatch %s: outcome not recorded: %s", dispatch.dispatch_id, exc)
            return _detail(dispatch, ExecutionStatus.LOST, outcome=outcome, error=str(exc))
        logger.info(
            "dispatch %s (%s) %s: %s",
            dispatch.dispatch_id,
            dispatch.agent_id,
            status.value,
            outcome.termination_reason or outcome.error or "",
        )
        if status is ExecutionStatus.FAILED and self.notifier is not None:
            agent = self.config.agent(dispatch.agent_id)
            self.notifier.failed(
                agent_id=dispatch.agent_id,
                dispatch_id=dispatch.dispatch_id,
                workflow=agent.workflow if agent is not None else "",
                run_id=outcome.run_id,
                reason=outcome.termination_reason,
                error=outcome.error,
            )
        return _detail(dispatch, status, outcome=outcome)


async def _invoke(runner: AgentRunner, agent: AgentSpec, dispatch: Dispatch) -> RunOutcome:
    """The runner's awaitable as a coroutine, which create_task needs: a new run, or the
    dispatch's own run resumed (a woken dispatch: see DispatchQueue.wake_waiting)."""
    if dispatch.run_id is None:
        return await runner(agent, dispatch.prompt)
    logger.info(
        "dispatch %s (%s): resuming its run %s",
        dispatch.dispatch_id,
        agent.agent_id,
        dispatch.run_id,
    )
    return await runner(agent, dispatch.prompt, resume=dispatch.run_id)


def _outcome(inner: asyncio.Task[RunOutcome], dispatch: Dispatch) -> RunOutcome:
    """What a runner that ended by itself reports; a raised exception is a failed run."""
    if inner.cancelled():
        return RunOutcome(ok=False, error="the runner was cancelled")
    exc = inner.exception()
    if exc is not None:  # one failing run must never take the others down
        logger.warning(
            "dispatch %s (%s) failed: %s",
            dispatch.dispatch_id,
            dispatch.agent_id,
            one_line_error(exc),
        )
        logger.debug("dispatch %s failed", dispatch.dispatch_id, exc_info=exc)
        return RunOutcome(ok=False, error=one_line_error(exc))
    outcome = inner.result()
    if not isinstance(outcome, RunOutcome):
        return RunOutcome(ok=False, error=f"runner returned {type(outcome).__name__}")
    return outcome


def _interrupted(
    inner: asyncio.Task[RunOutcome], dispatch: Dispatch, *, cancelled: bool, timeout: float
) -> RunOutcome:
    """A run stopped by a cancel request or by the timeout, with the run id it reported."""
    returned = None if inner.cancelled() or inner.exception() else inner.result()
    run_id = returned.run_id if isinstance(returned, RunOutcome) else None
    if cancelled:
        return RunOutcome(
            ok=False, run_id=run_id, termination_reason="cancelled", error=CANCELLED_RUNNING
        )
    logger.warning("dispatch %s (%s) timed out", dispatch.dispatch_id, dispatch.agent_id)
    return RunOutcome(
        ok=False,
        run_id=run_id,
        termination_reason="timeout",
        error=f"timed out after {timeout:g} s",
    )


def _detail(
    dispatch: Dispatch,
    status: ExecutionStatus,
    *,
    outcome: RunOutcome | None = None,
    error: str | None = None,
) -> DispatchDetail:
    return DispatchDetail(
        dispatch_id=dispatch.dispatch_id,
        agent_id=dispatch.agent_id,
        status=status,
        attempt=dispatch.attempts,
        run_id=outcome.run_id if outcome else None,
        termination_reason=outcome.termination_reason if outcome else None,
        error=error if error is not None else (outcome.error if outcome else None),
    )


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    # gather, not `await task` under suppress(CancelledError): a cancellation of *this* task
    # while waiting must still propagate.
    await asyncio.gather(*tasks, return_exceptions=True)
