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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.scheduler.config import AgentSpec, SchedulerConfig
from fsm_kernel.scheduler.queue import Dispatch, DispatchQueue, DispatchStatus

__all__ = [
    "AgentRunner",
    "DispatchDetail",
    "DispatchExecutor",
    "ExecutionStatus",
    "RunOutcome",
    "default_worker_id",
    "one_line_error",
]

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What the injected runner reports about one kernel run."""

    ok: bool
    """True when the run ended the way the agent intended (done, final answer)."""
    run_id: str | None = None
    termination_reason: str | None = None
    error: str | None = None


AgentRunner = Callable[[AgentSpec, str], Awaitable[RunOutcome]]
"""Runs one agent's workflow with the final prompt (STATE.md already injected)."""


class ExecutionStatus(StrEnum):
    DONE = "done"
    FAILED = "failed"
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

    async def execute(
        self, dispatch: Dispatch, *, abandon: asyncio.Event | None = None
    ) -> DispatchDetail:
        """Run a dispatch this worker has claimed and record its outcome.

        Never raises for a failing run: a raised exception or a timeout becomes a failed
        dispatch. If `abandon` is set mid-run, or this task is cancelled, the run is cancelled
        and the dispatch left running for its lease to expire.
        """
        agent = self.config.agent(dispatch.agent_id)
        if agent is None:
            error = f"agent {dispatch.agent_id!r} is not in the scheduler config"
            return await self._finish(dispatch, RunOutcome(ok=False, error=error))
        run = asyncio.create_task(self._run(agent, dispatch))
        beat = asyncio.create_task(self._heartbeats(dispatch))
        stop = asyncio.create_task((abandon or asyncio.Event()).wait())
        try:
            await asyncio.wait({run, beat, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(run, beat, stop)
        if run.done() and not run.cancelled():
            return await self._finish(dispatch, run.result())
        if beat.done() and not beat.cancelled():
            return _detail(dispatch, ExecutionStatus.LOST, error=beat.result())
        logger.warning("dispatch %s (%s) abandoned mid-run", dispatch.dispatch_id, agent.agent_id)
        return _detail(dispatch, ExecutionStatus.ABANDONED)

    async def _run(self, agent: AgentSpec, dispatch: Dispatch) -> RunOutcome:
        timeout = self.config.timeout_seconds
        try:
            outcome = await asyncio.wait_for(self.runner(agent, dispatch.prompt), timeout)
        except TimeoutError:
            logger.warning("dispatch %s (%s) timed out", dispatch.dispatch_id, agent.agent_id)
            return RunOutcome(
                ok=False, termination_reason="timeout", error=f"timed out after {timeout:g} s"
            )
        except Exception as exc:  # one failing run must never take the others down
            logger.warning(
                "dispatch %s (%s) failed: %s",
                dispatch.dispatch_id,
                agent.agent_id,
                one_line_error(exc),
            )
            logger.debug("dispatch %s failed", dispatch.dispatch_id, exc_info=True)
            return RunOutcome(ok=False, error=one_line_error(exc))
        if not isinstance(outcome, RunOutcome):
            return RunOutcome(ok=False, error=f"runner returned {type(outcome).__name__}")
        return outcome

    async def _heartbeats(self, dispatch: Dispatch) -> str:
        """Renew the lease every lease/3 seconds; returns why the lease was lost."""
        lease = self.config.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            try:
                await asyncio.to_thread(
                    self.queue.heartbeat,
                    dispatch.dispatch_id,
                    self.worker_id,
                    lease,
                    attempt=dispatch.attempts,
                )
            except StoreConflictError as exc:
                logger.warning("dispatch %s: lease lost: %s", dispatch.dispatch_id, exc)
                return str(exc)
            except StoreError as exc:  # transient: keep running, retry at the next beat
                logger.warning("dispatch %s: heartbeat failed: %s", dispatch.dispatch_id, exc)

    async def _finish(self, dispatch: Dispatch, outcome: RunOutcome) -> DispatchDetail:
        status = ExecutionStatus.DONE if outcome.ok else ExecutionStatus.FAILED
        try:
            await asyncio.to_thread(
                self.queue.complete,
                dispatch.dispatch_id,
                self.worker_id,
                status=DispatchStatus(status.value),
                run_id=outcome.run_id,
                termination_reason=outcome.termination_reason,
                error=outcome.error,
                attempt=dispatch.attempts,
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
        return _detail(dispatch, status, outcome=outcome)


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
