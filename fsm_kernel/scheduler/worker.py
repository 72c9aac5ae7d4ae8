"""A dispatch worker: claims and executes dispatches of one kernel, never ticks. Run several
(on several hosts, with a PostgreSQL store) to spread the load; the queue keeps the fleet under
`max_concurrent` and reclaims the dispatches of a worker that died once their lease expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler.config import SchedulerConfig
from fsm_kernel.scheduler.engine import Sleep
from fsm_kernel.scheduler.executor import (
    AgentRunner,
    DispatchDetail,
    DispatchExecutor,
    default_worker_id,
)
from fsm_kernel.scheduler.queue import Dispatch, DispatchQueue

__all__ = ["DEFAULT_POLL_SECONDS", "Worker"]

logger = logging.getLogger(__name__)

DEFAULT_POLL_SECONDS = 1.0


class Worker:
    """Polls the queue and runs up to `concurrency` dispatches at a time in this process."""

    def __init__(
        self,
        config: SchedulerConfig,
        queue: DispatchQueue,
        runner: AgentRunner,
        *,
        worker_id: str | None = None,
        concurrency: int | None = None,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        sleep: Sleep = asyncio.sleep,
        on_result: Callable[[DispatchDetail], None] | None = None,
    ) -> None:
        """Nothing touches the store until run().

        Args:
            config: The validated scheduler config (kernel id, lease, limits, agents).
            queue: The dispatch queue shared with the scheduler.
            runner: Runs one agent's kernel run; see AgentRunner.
            worker_id: Lease owner name; unique per process by default.
            concurrency: Dispatches this process runs at once (default and upper bound:
                config.max_concurrent, which the queue enforces across the whole fleet).
            poll_seconds: Wait between claims when there was nothing to claim.
            sleep: Awaited for that wait; inject a fake in tests.
            on_result: Called with the fate of every dispatch this worker executed.
        """
        self.config = config
        self.queue = queue
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = min(concurrency or config.max_concurrent, config.max_concurrent)
        self.poll_seconds = poll_seconds
        self._sleep = sleep
        self._on_result = on_result
        self._executor = DispatchExecutor(config, queue, runner, worker_id=self.worker_id)
        self._stop_requested = asyncio.Event()
        self._abandon = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def stop(self, *, abandon: bool = False) -> None:
        """Stop claiming. Idempotent. In-flight dispatches finish, unless `abandon`: then they
        are cancelled and left for their lease to expire."""
        self._stop_requested.set()
        if abandon:
            self._abandon.set()

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Claim and execute until `stop_event` is set or stop() is called."""
        logger.info("worker %s started (kernel %s)", self.worker_id, self.config.kernel_id)
        watcher = asyncio.create_task(self._watch(stop_event)) if stop_event else None
        try:
            while not self.stopping:
                if len(self._in_flight) < self.concurrency:
                    dispatch = await self._claim()
                    if dispatch is not None:
                        self._start(dispatch)
                        continue
                await self._wait()
            await asyncio.gather(*self._in_flight)
        except asyncio.CancelledError:
            self.stop(abandon=True)
            for task in self._in_flight:
                task.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            logger.info("worker %s stopped", self.worker_id)

    async def _claim(self) -> Dispatch | None:
        config = self.config
        try:
            return await asyncio.to_thread(
                self.queue.claim,
                config.kernel_id,
                self.worker_id,
                config.lease_seconds,
                config.max_concurrent,
            )
        except StoreError as exc:
            logger.warning("worker %s: claim failed, retrying: %s", self.worker_id, exc)
            return None

    def _start(self, dispatch: Dispatch) -> None:
        task = asyncio.create_task(self._execute(dispatch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _execute(self, dispatch: Dispatch) -> None:
        detail = await self._executor.execute(dispatch, abandon=self._abandon)
        if self._on_result is not None:
            self._on_result(detail)

    async def _wait(self) -> None:
        """Until the poll interval passes, a dispatch finishes, or stop() is called."""
        sleeper = asyncio.create_task(self._sleep(self.poll_seconds))
        stopper = asyncio.create_task(self._stop_requested.wait())
        waiters = {sleeper, stopper, *self._in_flight}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, stopper):
                task.cancel()
            await asyncio.gather(sleeper, stopper, return_exceptions=True)

    async def _watch(self, stop_event: asyncio.Event) -> None:
        await stop_event.wait()
        self.stop()
