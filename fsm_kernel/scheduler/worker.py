"""A dispatch worker: claims and executes dispatches of one kernel, never ticks. Run several
(on several hosts, with a PostgreSQL store) to spread the load; the queue keeps the fleet under
`max_concurrent` and reclaims the dispatches of a worker that died once their lease expires.

A worker's claim records the outcomes of its runs that ended since the previous claim, in the
same statement (`complete_and_claim`): one round trip and one commit per batch, awaited in the
worker's event loop (`complete_and_claim_async`: PostgreSQL's on an asyncio connection, no
thread hop; SQLite's in a thread).
A run learns its outcome is recorded only once that statement committed; until then the
dispatch runs under the worker's lease, so a worker that dies with outcomes waiting has
recorded none of them and their dispatches run again once the leases expire (as a run cut off
mid-way does); one reported recorded never runs again. Outcomes no claim takes within
`CARRY_SECONDS` (0.1 s), and those left when the worker stops, are recorded on their own.

An idle worker looks at the queue every `poll_seconds`; on PostgreSQL it also LISTENs, so an
enqueue or the end of a dispatch elsewhere (a free slot) wakes it at once, and a cancel request
reaches the run it concerns at once instead of at the next heartbeat. A worker whose claim came
back short waits for one of those (or its own runs' ends), never polling faster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler.config import SchedulerConfig
from fsm_kernel.scheduler.engine import Sleep, sleep_or_event
from fsm_kernel.scheduler.executor import (
    AgentRunner,
    DispatchDetail,
    DispatchExecutor,
    default_worker_id,
)
from fsm_kernel.scheduler.queue import Dispatch, DispatchListener, DispatchQueue

__all__ = ["Worker"]

logger = logging.getLogger(__name__)


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
        poll_seconds: float | None = None,
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
            poll_seconds: Wait between claims when there was nothing to claim (default:
                config.poll_seconds); a notification ends the wait early.
            sleep: Awaited for that wait; inject a fake in tests.
            on_result: Called with the fate of every dispatch this worker executed.
        """
        self.config = config
        self.queue = queue
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = min(concurrency or config.max_concurrent, config.max_concurrent)
        self.poll_seconds = poll_seconds if poll_seconds is not None else config.poll_seconds
        self._sleep = sleep
        self._on_result = on_result
        self._executor = DispatchExecutor(config, queue, runner, worker_id=self.worker_id)
        self._stop_requested = asyncio.Event()
        self._abandon = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()
        """The dispatches whose runs have not ended: the slots taken (an ended run's outcome
        may still be being recorded, in a batch, while the slot is claimed again)."""
        self._changed = asyncio.Event()
        """Set when it is worth looking at the queue again: a run ended, a notification came,
        or stop() was called."""
        self.listening = asyncio.Event()
        """Set once the queue's listener is LISTENing (PostgreSQL); never on a polling-only
        queue."""
        self._pump_task: asyncio.Task[None] | None = None
        self._started = False

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def stop(self, *, abandon: bool = False) -> None:
        """Stop claiming. Idempotent. In-flight dispatches finish, unless `abandon`: then they
        are cancelled and left for their lease to expire. A worker started but not yet run
        stops listening (its listener's connection closes)."""
        self._stop_requested.set()
        self._changed.set()
        if self._pump_task is not None:  # start()ed, and run() has not taken it over (run()
            self._pump_task.cancel()  # still waits for it to end, should it come next)
        if abandon:
            self._abandon.set()
            self._executor.abandon_all()

    async def start(self, *, listen_timeout: float = 5.0) -> None:
        """Connect before the first claim, then return: the queue's claim connection is open
        and, on PostgreSQL, the listener LISTENs (waited for up to `listen_timeout` seconds;
        past that a warning, and it goes on connecting while the worker polls). The point
        where a worker is ready: `fsm-kernel worker` says so then, and a fleet started
        together begins its work without connecting first. Optional (run() starts a worker
        that was not started, connecting at its first claim) and idempotent; call run() next,
        in the same event loop.

        Raises:
            StoreError: the queue cannot be reached (nothing was claimed).
        """
        if self._started:
            return
        await self.queue.connect_async()
        self._started = True
        self._listen()
        if self._pump_task is None:
            return  # a polling-only queue
        waits = {asyncio.ensure_future(self.listening.wait()),
                 asyncio.ensure_future(self._stop_requested.wait())}  # fmt: skip
        done, pending = await asyncio.wait(
            waits, timeout=listen_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for wait in pending:
            wait.cancel()
        if not done:
            logger.warning(
                "worker %s: not listening for wake-ups after %gs; polling meanwhile",
                self.worker_id,
                listen_timeout,
            )

    def _listen(self) -> None:
        """Start relaying the queue's signals (once; run() stops it)."""
        if self._pump_task is not None:
            return
        listener = self.queue.listener(self.config.kernel_id)
        if listener is not None:
            self._pump_task = asyncio.create_task(self._pump(listener))

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Claim and execute until `stop_event` is set or stop() is called (see start())."""
        logger.info("worker %s started (kernel %s)", self.worker_id, self.config.kernel_id)
        watcher = asyncio.create_task(self._watch(stop_event)) if stop_event else None
        if not self.stopping:  # stopped already (during start(), say): no listening
            self._listen()
        pump, self._pump_task = self._pump_task, None
        try:
            await self._loop()
        except asyncio.CancelledError:
            self.stop(abandon=True)
            for task in self._in_flight:
                task.cancel()
            raise
        finally:
            for helper in (watcher, pump):
                if helper is not None:
                    helper.cancel()
                    await asyncio.gather(helper, return_exceptions=True)
            await self._executor.settle()
            logger.info("worker %s stopped", self.worker_id)

    async def _loop(self) -> None:
        self._executor.completions.carry(True)  # each claim records the outcomes before it
        try:
            await self._claim_until_stopped()
        finally:
            self._executor.completions.carry(False)  # the last ones: no claim comes for them
        await asyncio.gather(*self._in_flight)

    async def _claim_until_stopped(self) -> None:
        while not self.stopping:
            self._changed.clear()  # from now on, a change means: look again
            free = self.concurrency - len(self._busy)
            if free <= 0:
                await self._changed.wait()  # busy: only the end of a run frees a slot here
                continue
            claimed = await self._claim(free)
            for dispatch in claimed:
                self._start(dispatch)
            if len(claimed) < free:  # the queue (or the fleet's cap) had no more for now
                await self._wait()

    async def _pump(self, listener: DispatchListener) -> None:
        """Turn the listener's signals into wake-ups and cancel requests."""
        async with listener:
            while True:
                signal = await listener.get()
                if signal.kind == "cancel":
                    self._executor.request_cancel(signal.dispatch_id)
                    continue
                if signal.kind == "reconnected":  # notifications may have been missed
                    self.listening.set()
                self._changed.set()  # enqueued, ended (a slot may be free), reconnected

    async def _claim(self, free: int) -> list[Dispatch]:
        """As many dispatches as there are free slots (fewer if the fleet's cap or the queue
        has fewer), in one call that first records the outcomes waiting to be: one awaited
        statement per batch. If the call fails (nothing recorded), those outcomes are
        given back to be recorded on their own."""
        config = self.config
        carried = self._executor.completions.take()
        try:
            results, claimed = await self.queue.complete_and_claim_async(
                [completion for completion, _ in carried],
                config.kernel_id,
                self.worker_id,
                config.lease_seconds,
                config.max_concurrent,
                free,
            )
        except StoreError as exc:
            logger.warning("worker %s: claim failed, retrying: %s", self.worker_id, exc)
            self._executor.completions.give_back(carried)
            return []
        except BaseException:
            self._executor.completions.give_back(carried)
            raise
        self._executor.completions.settle(carried, results)
        return claimed

    def _start(self, dispatch: Dispatch) -> None:
        self._busy.add(dispatch.dispatch_id)
        task = asyncio.create_task(self._execute(dispatch))
        self._in_flight.add(task)
        task.add_done_callback(lambda done: self._finished(done, dispatch.dispatch_id))

    def _free(self, dispatch_id: str) -> None:
        if dispatch_id in self._busy:
            self._busy.discard(dispatch_id)
            self._changed.set()

    def _finished(self, task: asyncio.Task[None], dispatch_id: str) -> None:
        self._in_flight.discard(task)
        self._free(dispatch_id)
        self._changed.set()

    async def _execute(self, dispatch: Dispatch) -> None:
        detail = await self._executor.execute(
            dispatch, abandon=self._abandon, ran=lambda: self._free(dispatch.dispatch_id)
        )
        if self._on_result is not None:
            self._on_result(detail)

    async def _wait(self) -> None:
        """Idle: until the poll interval passes or something changes (see _changed)."""
        await sleep_or_event(self._sleep(self.poll_seconds), self._changed)

    async def _watch(self, stop_event: asyncio.Event) -> None:
        await stop_event.wait()
        self.stop()
