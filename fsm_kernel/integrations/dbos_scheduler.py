"""The scheduler on DBOS: `fsm-kernel schedule CONFIG --engine dbos`, `worker --engine dbos` and
`dispatches CONFIG --engine dbos`, from the same config as the own queue's.

- A cron tick is a DBOS scheduled workflow (`fsm-kernel.KERNEL.tick`, each tick once per fleet):
  it reads STATE.md (a step) and enqueues each enabled agent's run on the DBOS queue
  `fsm-kernel.KERNEL`, in priority order. The run's id is derived from the tick and the agent,
  so the same tick never dispatches an agent twice; an agent whose previous run is still queued
  or running is skipped (the queue's deduplication id is the agent's id).
- A dispatch is the agent's run as a DBOSAgent workflow (see dbos.py): its model calls, tool
  calls and child runs are DBOS steps, recorded in the config's store as every run is.
- The queue's global concurrency is `max_concurrent` (across every process on the system
  database), a worker's `--concurrency` its per-process limit, and `max_attempts` the
  workflows' `max_recovery_attempts`. `dispatches --cancel` cancels the run's workflow.
- DBOS's system database: FSM_KERNEL_DBOS_URL, else DBOS_SYSTEM_DATABASE_URL, else the config's
  store when it is PostgreSQL (DBOS's tables go in their own schema, `dbos`), else a SQLite
  file beside the store (`runs.db` → `runs.dbos.sqlite`).
- Each process is one DBOS executor: DBOS__VMID names it (default HOST-PID). A process that
  starts recovers the runs its executor id left unfinished, so give each worker a stable
  DBOS__VMID (worker-1, worker-2, ...): a restarted worker then recovers its killed runs.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSClient, SetEnqueueOptions, SetWorkflowID
from dbos._error import DBOSQueueDeduplicatedError

from fsm_kernel.api import Agent
from fsm_kernel.bootstrap import RunOptions, load_spec, resolve_workflow
from fsm_kernel.integrations.dbos import DBOSAgent, cancel_run
from fsm_kernel.kernel import RunResult
from fsm_kernel.protocol import EventType
from fsm_kernel.scheduler import AgentSpec, SchedulerConfig, StateFile, state_tools
from fsm_kernel.scheduler.planner import render_prompt
from fsm_kernel.store import open_store, parse_store_location

__all__ = ["DBOSFleet", "Outcome", "TickResult", "system_database"]

APP_NAME = "fsm-kernel"
_ENDED = {"SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"}
_RUN_IDS = uuid.UUID("5c1e7d2a-4f0b-4d1e-9a57-6b0f0c8e2d11")
"""The namespace of the runs' ids (uuid5 of kernel, agent and tick)."""


def system_database(config: SchedulerConfig) -> str:
    """DBOS's system database for `config` (see the module's docstring)."""
    given = os.environ.get("FSM_KERNEL_DBOS_URL") or os.environ.get("DBOS_SYSTEM_DATABASE_URL")
    if given:
        return given
    where = parse_store_location(config.store)
    if where.backend == "postgres":
        return where.target
    path = Path(where.target)
    return f"sqlite:///{path.with_suffix('.dbos.sqlite')}"


@dataclass(frozen=True)
class TickResult:
    """What one tick enqueued (agent id and run id) and which agents it skipped, and why."""

    tick: str
    enqueued: tuple[tuple[str, str], ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Outcome:
    """How a dispatched run stands: ended (its reason), waiting for a person, or failed."""

    agent_id: str
    run_id: str
    status: str
    """done, failed, waiting or cancelled."""
    termination_reason: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class DBOSFleet:
    """A scheduler config on DBOS: its queue, one DBOSAgent per agent, the tick workflow.
    Build it before `launch` (DBOS registers the workflows then)."""

    config: SchedulerConfig
    config_path: Path
    options: RunOptions = field(default_factory=RunOptions)
    on_result: Callable[[str, RunResult], None] | None = None
    """Told (agent id, result) when a dispatched run's workflow ends in this process."""
    on_tick: Callable[[TickResult], None] | None = None
    """Told what a tick did, in the process that ran it."""

    def __post_init__(self) -> None:
        self.store = open_store(self.config.store)
        """The agents' event log, one connection for all of them (closed by `aclose`)."""
        self.queue_name = f"fsm-kernel.{self.config.kernel_id}"
        self.schedule_name = f"fsm-kernel.{self.config.kernel_id}"
        self.agents = {a.agent_id: self._agent(a) for a in self.config.agents}
        self.tick_workflow = DBOS.workflow(name=f"fsm-kernel.{self.config.kernel_id}.tick")(
            self._tick_fn()
        )

    # -- building ---------------------------------------------------------------------------

    def _agent(self, spec: AgentSpec) -> DBOSAgent:
        """The agent's DBOSAgent, over an Agent built as the own queue's runner builds one (the
        workflow beside the config first, the STATE.md tools, the fleet's store)."""
        url = system_database(self.config)

        def told(result: RunResult) -> None:
            if self.on_result is not None:
                self.on_result(spec.agent_id, result)

        return DBOSAgent(
            self._build(spec),
            name=f"{self.config.kernel_id}.{spec.agent_id}",
            system_database_url=url,
            max_recovery_attempts=self.config.max_attempts,
            on_result=told,
        )

    def _build(self, spec: AgentSpec) -> Agent:
        path = self.config_path.parent / spec.workflow
        workflow = str(path if path.is_file() else resolve_workflow(spec.workflow))
        loaded = load_spec(workflow)
        return Agent(
            loaded,
            model=self.options.model,
            base_url=self.options.base_url,
            timeout=float(self.config.timeout_seconds),
            tools=state_tools(self.config.state_file),
            store=self.store,
            notify=self.config.run_hooks(),
        )

    def _tick_fn(self) -> Callable[[datetime, Any], Any]:
        async def tick(scheduled: datetime, context: Any) -> TickResult:
            result = await self._tick(scheduled)
            if self.on_tick is not None:
                self.on_tick(result)
            return result

        return tick

    # -- running ----------------------------------------------------------------------------

    async def launch(self, *, worker_concurrency: int | None = None) -> None:
        """Launch DBOS in this process (an executor of the fleet) and declare the queue."""
        DBOS(config={"name": APP_NAME, "system_database_url": system_database(self.config),
                     "application_version": _version(), "executor_id": _executor_id(),
                     "log_level": "WARNING", "scheduler_polling_interval_sec": 1.0})  # fmt: skip
        DBOS.launch()
        await DBOS.register_queue_async(
            self.queue_name,
            global_concurrency=self.config.max_concurrent,
            worker_concurrency=worker_concurrency,
            polling_interval_sec=min(self.config.poll_seconds, 1.0),
            on_conflict="always_update",
        )

    async def schedule(self) -> None:
        """Declare the cron schedule (DBOS fires each tick once across the fleet)."""
        await DBOS.apply_schedules_async(
            [
                {
                    "schedule_name": self.schedule_name,
                    "workflow_fn": self.tick_workflow,
                    "schedule": self.config.schedule,
                }
            ]
        )

    async def unschedule(self) -> None:
        await DBOS.delete_schedule_async(self.schedule_name)

    async def tick_now(self) -> TickResult:
        """Run one tick now (`schedule --once`)."""
        now = datetime.now(UTC).replace(microsecond=0)
        with SetWorkflowID(f"{self.schedule_name}.once.{now.isoformat()}"):
            handle = await DBOS.start_workflow_async(self.tick_workflow, now, None)
        result: TickResult = await handle.get_result()
        return result

    async def _tick(self, scheduled: datetime) -> TickResult:
        """The tick workflow: STATE.md read once (a step), each enabled agent enqueued."""
        state = await DBOS.run_step_async({"name": "fsm-kernel.read_state"}, self._read_state)
        queue = await DBOS.retrieve_queue_async(self.queue_name)
        assert queue is not None
        tick = scheduled.isoformat()
        enqueued: list[tuple[str, str]] = []
        skipped: list[tuple[str, str]] = []
        agents = sorted(self.config.agents, key=lambda a: -a.priority)
        for spec in agents:
            if not spec.enabled:
                skipped.append((spec.agent_id, "disabled"))
                continue
            run_id = str(uuid.uuid5(_RUN_IDS, f"{self.config.kernel_id}/{spec.agent_id}/{tick}"))
            prompt = render_prompt(spec.prompt, state)
            try:
                with SetEnqueueOptions(deduplication_id=spec.agent_id), SetWorkflowID(run_id):
                    await queue.enqueue_async(self.agents[spec.agent_id].workflow, run_id, prompt)
            except DBOSQueueDeduplicatedError:
                skipped.append((spec.agent_id, "running: its previous run is queued or running"))
                continue
            enqueued.append((spec.agent_id, run_id))
        return TickResult(tick, tuple(enqueued), tuple(skipped))

    def _read_state(self) -> str:
        state = StateFile(self.config.state_file)
        if self.config.seed_state is not None:
            state.seed(self.config.seed_state)
        return state.read()

    async def outcome(self, agent_id: str, run_id: str, *, poll: float = 0.2) -> Outcome:
        """Wait until the run ended or waits for a person, and say how it stands."""
        agent = self.agents[agent_id]
        while True:
            status = await DBOS.get_workflow_status_async(run_id)
            if status is not None and status.status in _ENDED:
                return await self._ended(agent, agent_id, run_id, status.status)
            events = agent.store.read(run_id)
            if events and events[-1].type == EventType.RUN_SUSPENDED:
                return Outcome(agent_id, run_id, "waiting")
            await asyncio.sleep(poll)

    async def _ended(self, agent: DBOSAgent, agent_id: str, run_id: str, status: str) -> Outcome:
        if status != "SUCCESS":
            state = "cancelled" if status == "CANCELLED" else "failed"
            return Outcome(agent_id, run_id, state, error=f"DBOS workflow {status}")
        result = await agent.result(run_id)
        reason = None if result.termination_reason is None else str(result.termination_reason)
        return Outcome(agent_id, run_id, "done" if result.ok else "failed", reason, result.error)

    async def aclose(self) -> None:
        for agent in self.agents.values():
            await agent.agent.aclose()
        self.store.close()


def list_dispatches(config: SchedulerConfig, *, limit: int) -> list[dict[str, Any]]:
    """The most recent runs on the config's DBOS queue (from any process, DBOS not launched)."""
    client = DBOSClient(system_database_url=system_database(config))
    try:
        rows = client.list_workflows(
            queue_name=f"fsm-kernel.{config.kernel_id}", limit=limit, sort_desc=True
        )
    finally:
        client.destroy()
    prefix = f"fsm-kernel.{config.kernel_id}."
    return [
        {
            "run_id": w.workflow_id,
            "agent_id": str(w.name).removeprefix(prefix),
            "status": w.status,
            "created_at": _iso(w.created_at),
            "attempts": w.recovery_attempts,
        }
        for w in rows
    ]


def cancel_dispatch(config: SchedulerConfig, run_id: str) -> str:
    """Cancel the run's workflow so that its log and DBOS agree (`cancel_run`): a queued one
    never starts, a waiting one ends `cancelled` now, a running one at its next step; returns
    that, in one line.

    Raises:
        ResumeError: the run already ended in its log: nothing is cancelled.
    """
    client = DBOSClient(system_database_url=system_database(config))
    store = open_store(config.store)
    try:
        return cancel_run(store, run_id, client)
    finally:
        store.close()
        client.destroy()


def _iso(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="seconds")


def _version() -> str:
    """One application version for every process of a fleet (DBOS recovers and dequeues only
    the workflows of its own version): fsm-kernel's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"fsm-kernel-{version('fsm-kernel')}"
    except PackageNotFoundError:
        return "fsm-kernel"


def _executor_id() -> str:
    return os.environ.get("DBOS__VMID") or f"{socket.gethostname()}-{os.getpid()}"


def outcomes_line(outcomes: Sequence[Outcome], tick: TickResult) -> str:
    """The one-line summary `schedule --once` prints, as the own queue's cycle line."""
    count = {s: sum(o.status == s for o in outcomes) for s in ("done", "failed", "waiting")}
    line = (
        f"tick {tick.tick}: dispatched {len(tick.enqueued)}, succeeded {count['done']}, "
        f"failed {count['failed']}, skipped {len(tick.skipped)}"
    )
    return line + (f", waiting {count['waiting']}" if count["waiting"] else "")
