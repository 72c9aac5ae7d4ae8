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
        self._pending: list[tuple[Completion, asyncio.Future[None]]] = []
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

    async def complete(self, completion: Completion) -> None:
        """Once the outcome is recorded. StoreConflictError if the lease was lost, StoreError
        if the store failed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((completion, future))
        if not self._carried:
            self._start_flush()
        elif self._fallback is None:
            loop = asyncio.get_running_loop()
            self._fallback = loop.call_later(CARRY_SECONDS, self._carry_timed_out)
        return await future

    def take(self) -> list[tuple[Completion, asyncio.Future[None]]]:
        """The waiting outcomes (at most MAX_COMPLETION_BATCH), for the caller to record and
        then `settle`."""
        batch = self._pending[:MAX_COMPLETION_BATCH]
        del self._pending[:MAX_COMPLETION_BATCH]
        if not self._pending:
            self._cancel_fallback()
        return batch

    def give_back(self, batch: list[tuple[Completion, asyncio.Future[None]]]) -> None:
        """A taken batch the caller could not record: it is flushed on its own now."""
        if batch:
            self._pending[:0] = batch
            self._start_flush()

    @staticmethod
    def settle(
        batch: list[tuple[Completion, asyncio.Future[None]]],
        results: Sequence[object] | Exception,
    ) -> None:
        """Hand each run of a taken batch its result: recorded (any value that is not an
        exception: None, or complete_batch's row), its lease conflict, or the store's failure
        (one exception for the whole batch)."""
        outcomes = [results] * len(batch) if isinstance(results, Exception) else results
        for (_, future), result in zip(batch, outcomes, strict=True):
            if future.done():  # its run was cancelled meanwhile
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(None)

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


class _Running:
    """One dispatch whose run is in flight in this executor: what may stop it, and when its
    timeout and next heartbeat are due (on the event loop's clock)."""

    __slots__ = (
        "abandoned",
        "beat_due",
        "beating",
        "cancel_requested",
        "deadline",
        "dispatch",
        "lease_lost",
        "stopped",
        "task",
        "timed_out",
    )

    def __init__(self, dispatch: Dispatch, task: asyncio.Task[Any]) -> None:
        self.dispatch = dispatch
        self.task = task
        """The task awaiting the runner (the run is awaited in it, not in a task of its own)."""
        self.deadline = 0.0
        self.beat_due = 0.0
        self.beating = False
        """A heartbeat of it is in flight (no second one starts meanwhile)."""
        self.cancel_requested = False
        self.timed_out = False
        self.lease_lost: str | None = None
        self.abandoned = False
        self.stopped = False
        """Its task was cancelled by the executor (once: the first cause stops it)."""

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.task.cancel()


class _Ticker:
    """Times the timeouts and heartbeats of all the runs of one executor with one timer, armed
    for the earliest thing due, instead of two timers and a heartbeat task per run. All runs
    share one timeout and one heartbeat interval, so a run claimed later is never due earlier:
    a start arms the timer only when none is armed, an end cancels nothing (the timer, when it
    fires, finds the ended run gone and re-arms for what is still running, or for nothing).
    Heartbeats due together are renewed in one thread hop."""

    def __init__(
        self,
        running: dict[str, _Running],
        timeout: float,
        interval: float,
        renew: Callable[[list[_Running]], Coroutine[Any, Any, None]],
    ) -> None:
        self._running = running
        self.timeout = timeout
        self.interval = interval
        self._renew = renew
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = 0.0
        self._beats: set[asyncio.Task[None]] = set()

    def start(self, run: _Running) -> None:
        """A run began now: its timeout and its first heartbeat are counted from now."""
        now = asyncio.get_running_loop().time()
        run.deadline = now + self.timeout
        run.beat_due = now + self.interval
        self.arm(min(run.deadline, run.beat_due))

    def arm(self, when: float) -> None:
        """Fire at `when` unless the timer already fires earlier."""
        if self._timer is not None:
            if self._armed_at <= when:
                return
            self._timer.cancel()
        self._armed_at = when
        self._timer = asyncio.get_running_loop().call_at(when, self._fire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        """Stop the runs past their timeout, renew the leases due, re-arm for the next."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time() + _TIMER_SLACK  # a timer may fire a hair before its time
        due: list[_Running] = []
        later = float("inf")
        for run in self._running.values():
            if run.stopped:
                continue
            if run.deadline <= now:
                run.timed_out = True
                run.stop()
                continue
            if not run.beating and run.beat_due <= now:
                run.beating = True
                due.append(run)
            later = min(later, run.deadline, float("inf") if run.beating else run.beat_due)
        if due:
            task = loop.create_task(self._beat(due))
            self._beats.add(task)
            task.add_done_callback(self._beats.discard)
        if later != float("inf"):
            self.arm(later)

    async def _beat(self, due: list[_Running]) -> None:
        try:
            await self._renew(due)
        finally:
            next_due = asyncio.get_running_loop().time() + self.interval
            for run in due:
                run.beating = False
                run.beat_due = next_due
            if any(self._running.get(run.dispatch.dispatch_id) is run for run in due):
                self.arm(next_due)  # those still running beat again then


_TIMER_SLACK = 0.001
"""Seconds a timeout may be judged early: asyncio runs a timer up to its clock's resolution
before its time."""


class DispatchExecutor:
    """Runs claimed dispatches for one worker id.

    A run is awaited in the task that called `execute` (one task per dispatch, not two); a
    timeout, a cancel request, a lost lease or abandon_all stop it by cancelling that task, and
    `execute` tells its own cancellation from its caller's (`Task.uncancel`). One timer for all
    the runs (`_Ticker`) times their timeouts and heartbeats."""

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
        self._running: dict[str, _Running] = {}
        self._ticker = _Ticker(
            self._running, config.timeout_seconds, config.heartbeat_interval, self._heartbeat
        )
        self.completions = CompletionBuffer(queue, config.max_concurrent)
        """Where outcomes wait to be recorded (a Worker's claims carry them)."""
        self.notifier = DispatchNotifier(config.notify, config.store) if config.notify else None
        """Tells the config's `notify:` webhooks about failed dispatches."""

    async def settle(self) -> None:
        """Wait a little for the webhooks still being told (before the process exits)."""
        self._ticker.close()
        if self.notifier is not None:
            await self.notifier.aclose()

    def request_cancel(self, dispatch_id: str) -> bool:
        """Stop the run of a dispatch this executor is running (a cancel was requested); False
        if it runs none by that id."""
        run = self._running.get(dispatch_id)
        if run is not None:
            run.cancel_requested = True
            run.stop()
        return run is not None

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
        one. On a cancel request or the timeout the runner is cancelled, which the kernel
        records as the end of the run with the reason `cancelled`; the run id is kept from what
        the runner then returns. If `abandon` is set mid-run, or this task is cancelled, the run
        is cancelled and the dispatch left running for its lease to expire. `ran` is called when
        the run has ended, before its outcome is recorded (the worker's slot is free then).
        """
        agent = self.config.agent(dispatch.agent_id)
        if agent is None:
            error = f"agent {dispatch.agent_id!r} is not in the scheduler config"
            return await self._finish(dispatch, RunOutcome(ok=False, error=error), False)
        if abandon is not None and abandon.is_set():
            if ran is not None:
                ran()
            return self._abandoned(dispatch)
        run = self._running[dispatch.dispatch_id] = _Running(dispatch, _current_task())
        self._ticker.start(run)
        try:
            returned, failure = await self._await_run(run, agent)
        finally:  # only its own entry: the same dispatch, reclaimed by this worker after
            # its lease ran out (heartbeats late on a stalled machine), may be running again
            if self._running.get(dispatch.dispatch_id) is run:
                del self._running[dispatch.dispatch_id]
            if ran is not None:
                ran()
        return await self._conclude(run, returned, failure)

    async def _await_run(
        self, run: _Running, agent: AgentSpec
    ) -> tuple[RunOutcome | None, BaseException | None]:
        """What the runner returned or raised. A cancellation the executor caused (timeout,
        cancel request, lost lease, abandon) is taken back; the caller's propagates."""
        returned: RunOutcome | None = None
        failure: BaseException | None = None
        try:
            returned = await _invoke(self.runner, agent, run.dispatch)
        except asyncio.CancelledError as exc:
            if not run.stopped:
                raise
            failure = exc
        except Exception as exc:  # one failing run must never take the others down
            failure = exc
        # Cancellations of this task other than the executor's own belong to the caller.
        if (run.task.uncancel() if run.stopped else run.task.cancelling()) > 0:
            raise asyncio.CancelledError
        return returned, failure

    async def _conclude(
        self, run: _Running, returned: RunOutcome | None, failure: BaseException | None
    ) -> DispatchDetail:
        """The dispatch's fate once its run has ended or was stopped, recorded if it ended."""
        dispatch = run.dispatch
        if run.cancel_requested or run.timed_out:
            outcome = _interrupted(
                returned, dispatch, cancelled=run.cancel_requested, timeout=self._ticker.timeout
            )
            return await self._finish(dispatch, outcome, run.cancel_requested)
        if run.lease_lost is not None:
            return _detail(dispatch, ExecutionStatus.LOST, error=run.lease_lost)
        if run.abandoned:
            return self._abandoned(dispatch)
        return await self._finish(dispatch, _outcome(returned, failure, dispatch), False)

    @staticmethod
    def _abandoned(dispatch: Dispatch) -> DispatchDetail:
        logger.warning(
            "dispatch %s (%s) abandoned mid-run", dispatch.dispatch_id, dispatch.agent_id
        )
        return _detail(dispatch, ExecutionStatus.ABANDONED)

    def abandon_all(self) -> None:
        """Stop every run: the `abandon` event given to execute() has been set."""
        for run in list(self._running.values()):
            run.abandoned = True
            run.stop()

    async def _heartbeat(self, due: list[_Running]) -> None:
        """Renew the leases of these runs (one thread hop for all), and notice a cancel request
        or a lost lease there. A run that ended meanwhile is left alone."""
        renewed = await asyncio.to_thread(self._renew, [run.dispatch for run in due])
        for run, result in zip(due, renewed, strict=True):
            if self._running.get(run.dispatch.dispatch_id) is not run or run.stopped:
                continue
            dispatch_id = run.dispatch.dispatch_id
            if isinstance(result, StoreConflictError):
                logger.warning("dispatch %s: lease lost: %s", dispatch_id, result)
                run.lease_lost = str(result)
                run.stop()
            elif isinstance(result, Exception):  # transient: keep running, retry at the next beat
                logger.warning("dispatch %s: heartbeat failed: %s", dispatch_id, result)
            elif result.cancel_requested_at is not None:
                logger.info("dispatch %s: cancel requested, stopping it", dispatch_id)
                run.cancel_requested = True
                run.stop()

    def _renew(self, dispatches: list[Dispatch]) -> list[Dispatch | Exception]:
        """Each dispatch's heartbeat: its row, or why it failed (in the thread)."""
        renewed: list[Dispatch | Exception] = []
        for dispatch in dispatches:
            try:
                renewed.append(
                    self.queue.heartbeat(
                        dispatch.dispatch_id,
                        self.worker_id,
                        self.config.lease_seconds,
                        attempt=dispatch.attempts,
                    )
                )
            except StoreError as exc:  # StoreConflictError: the lease is lost
                renewed.append(exc)
            except Exception as exc:  # a lease we cannot renew is as good as lost
                renewed.append(StoreConflictError(one_line_error(exc)))
        return renewed

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
    """The runner's awaitable: a new run, or the dispatch's own run resumed (a woken dispatch:
    see DispatchQueue.wake_waiting)."""
    if dispatch.run_id is None:
        return await runner(agent, dispatch.prompt)
    logger.info(
        "dispatch %s (%s): resuming its run %s",
        dispatch.dispatch_id,
        agent.agent_id,
        dispatch.run_id,
    )
    return await runner(agent, dispatch.prompt, resume=dispatch.run_id)


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:  # execute() is a coroutine: it always runs in a task
        raise RuntimeError("DispatchExecutor.execute must run in an asyncio task")
    return task


def _outcome(
    returned: RunOutcome | None, failure: BaseException | None, dispatch: Dispatch
) -> RunOutcome:
    """What a runner that ended by itself reports; a raised exception is a failed run."""
    if isinstance(failure, asyncio.CancelledError):
        return RunOutcome(ok=False, error="the runner was cancelled")
    if failure is not None:  # one failing run must never take the others down
        logger.warning(
            "dispatch %s (%s) failed: %s",
            dispatch.dispatch_id,
            dispatch.agent_id,
            one_line_error(failure),
        )
        logger.debug("dispatch %s failed", dispatch.dispatch_id, exc_info=failure)
        return RunOutcome(ok=False, error=one_line_error(failure))
    if not isinstance(returned, RunOutcome):
        return RunOutcome(ok=False, error=f"runner returned {type(returned).__name__}")
    return returned


def _interrupted(
    returned: RunOutcome | None, dispatch: Dispatch, *, cancelled: bool, timeout: float
) -> RunOutcome:
    """A run stopped by a cancel request or by the timeout, with the run id it reported."""
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
