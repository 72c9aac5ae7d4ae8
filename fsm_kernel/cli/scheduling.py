"""What `fsm-kernel schedule`, `worker` and `dispatches` do (registered in schedule_cmd.py), and
the runner that turns one dispatch into one kernel run."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from fsm_kernel.api import Agent
from fsm_kernel.bootstrap import RunOptions, load_spec, resolve_workflow
from fsm_kernel.cli import heap
from fsm_kernel.cli.output import cut
from fsm_kernel.cli.timer_wake import recorded_spec, timer_waker
from fsm_kernel.errors import ScheduleError, StoreConflictError
from fsm_kernel.kernel import RunResult
from fsm_kernel.scheduler import (
    AgentSpec,
    CycleResult,
    Dispatch,
    DispatchQueue,
    DispatchStatus,
    RunOutcome,
    Scheduler,
    SchedulerConfig,
    SkippedAgent,
    Worker,
    load_scheduler_config,
    open_queue,
    state_tools,
)
from fsm_kernel.telemetry import dispatch_span
from fsm_kernel.tools.mcp_client import McpServers
from fsm_kernel.workflow.spec import WorkflowSpec

EXIT_OK, EXIT_FAIL = 0, 1
_DISPATCH_ID = re.compile(r"[0-9A-Fa-f-]{1,36}")

logger = logging.getLogger(__name__)


class DispatchRunner:
    """One dispatch = one kernel run of the agent's workflow, recorded in the config's store,
    with the STATE.md tools added; a woken dispatch (`resume=` its run, whose timer is due)
    resumes that run on the definition it recorded, with the same tools, store and hooks. A
    dispatch that cannot even start (its workflow does not load, the store is down) fails in
    the executor with one WARNING line (traceback at -v). Each workflow's MCP servers start once
    for the process (`aclose` stops them)."""

    def __init__(self, config: SchedulerConfig, config_path: Path, options: RunOptions) -> None:
        self.config, self.config_path, self.options = config, config_path, options
        self.mcp: dict[str, McpServers] = {}

    async def __call__(
        self, agent: AgentSpec, prompt: str, /, *, resume: str | None = None
    ) -> RunOutcome:
        if resume is not None:
            return await _resume_agent(self, agent, resume)
        return await _run_agent(self, agent, prompt)

    async def aclose(self) -> None:
        servers, self.mcp = list(self.mcp.values()), {}
        for each in servers:
            await each.aclose()


def make_runner(config: SchedulerConfig, config_path: Path, options: RunOptions) -> DispatchRunner:
    """The runner of the config's dispatches (see DispatchRunner)."""
    return DispatchRunner(config, config_path, options)


async def _run_agent(runner: DispatchRunner, agent: AgentSpec, prompt: str) -> RunOutcome:
    # The same public API as `fsm-kernel run` and users' Python code: the workflow's folder is
    # importable (its own `package.module:function` code), the store and client are closed.
    path = str(_agent_workflow(agent.workflow, runner.config_path))
    workflow = _agent(runner, load_spec(path), path)
    async with workflow:
        with dispatch_span(agent.agent_id):  # the run joins the dispatch's trace
            result = await workflow.run(prompt)
    return _outcome(result)


async def _resume_agent(runner: DispatchRunner, agent: AgentSpec, run_id: str) -> RunOutcome:
    """Continue the run of a woken dispatch (as `fsm-kernel resume RUN_ID` would: its timer
    fires), on the definition it recorded, with the settings it recorded; the worker's --model
    and --base-url, when given, override them (and are recorded), as for a new run."""
    spec, path = await asyncio.to_thread(recorded_spec, runner.config.store, run_id)
    options = runner.options
    given: dict[str, Any] = {"model": options.model, "base_url": options.base_url}
    workflow = _agent(runner, spec, path)
    async with workflow:
        with dispatch_span(agent.agent_id):
            result = await workflow.resume(
                run_id, **{name: value for name, value in given.items() if value is not None}
            )
    return _outcome(result)


def _agent(runner: DispatchRunner, spec: WorkflowSpec, path: str) -> Agent:
    """An Agent for one dispatch: the config's store, timeout, hooks and STATE.md tools, the
    worker's model flags, and the process's MCP servers for this workflow's declaration."""
    config, options = runner.config, runner.options
    declared = {name: server.model_dump(mode="json") for name, server in spec.mcp_servers.items()}
    key = f"{path}\n{json.dumps(declared, sort_keys=True)}"  # a pinned older text: its own
    return Agent(
        spec,
        model=options.model,
        base_url=options.base_url,
        timeout=float(config.timeout_seconds),
        tools=state_tools(config.state_file),
        store=config.store,
        notify=config.run_hooks(),
        mcp_servers=runner.mcp.setdefault(key, McpServers(spec.mcp_servers)),
    )


def _outcome(result: RunResult) -> RunOutcome:
    return RunOutcome(
        ok=result.ok,
        run_id=result.run_id,
        termination_reason=None
        if result.termination_reason is None
        else str(result.termination_reason),
        error=result.error,
        waiting=result.status == "waiting",
    )


def _agent_workflow(name: str, config_path: Path) -> Path:
    """A workflow path relative to the config file wins; then the usual lookup."""
    beside = config_path.parent / name
    return beside if beside.is_file() else resolve_workflow(name)


def _setup(args: argparse.Namespace) -> tuple[SchedulerConfig, Any, DispatchRunner]:
    path = Path(args.config)
    config = load_scheduler_config(path)
    for agent in config.agents:  # fail before the first tick, with the agent named
        _agent_workflow(agent.workflow, path)
    options = RunOptions(model=args.model, base_url=args.base_url)
    return config, open_queue(config.store), make_runner(config, path, options)


def _print_cycle(result: CycleResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), ensure_ascii=False), flush=True)
        return
    if result.tick_skipped:
        print(f"tick {result.tick.isoformat()}: skipped ({result.tick_skipped})", flush=True)
        return
    print(
        f"tick {result.tick.isoformat()}: dispatched {result.dispatched}, succeeded "
        f"{result.succeeded}, failed {result.failed}, skipped {result.skipped}"
        + (f", waiting {result.waiting}" if result.waiting else "")
    )
    for d in result.details:
        outcome = d.termination_reason or ""
        if d.status == "waiting":
            outcome = f"waits for a person: fsm-kernel resume {d.run_id}"
        error = f" — {cut(d.error, 120)}" if d.error else ""
        print(f"  {d.status:9} {d.agent_id:16} run {d.run_id or '-'} {outcome}{error}")
    sys.stdout.flush()
    for skip in result.skipped_agents:
        print(_skip_line(skip, result.tick), file=sys.stderr, flush=True)


def _print_start(dispatch: Dispatch) -> None:
    """On stderr as each dispatch's run starts: a cycle prints its outcomes only once every
    run ended, which a slow model makes minutes."""
    if dispatch.run_id:
        line = (
            f"resuming {dispatch.agent_id} (run {dispatch.run_id}, dispatch {dispatch.dispatch_id})"
        )
    else:
        line = f"running {dispatch.agent_id} (dispatch {dispatch.dispatch_id})"
    print(line, file=sys.stderr, flush=True)


def _skip_line(skip: SkippedAgent, tick: datetime) -> str:
    """Why an agent was not dispatched, on one line; for a running dispatch the worker and the
    lease expiry, since a killed scheduler's dispatch blocks its agent until then."""
    head = f"skipped {skip.agent_id}: {skip.reason}"
    if skip.reason == "disabled":
        return f"{head} (enabled: false in the config)"
    if skip.reason == "duplicate":
        return f"{head} (this tick's dispatch already exists: another scheduler fired it)"
    if skip.reason == "pending":
        return f"{head}: dispatch {skip.dispatch_id} is still queued, waiting for a worker"
    if skip.lease_expires_at is None:
        return f"{head}: dispatch {skip.dispatch_id}"
    expiry = skip.lease_expires_at.isoformat(timespec="seconds")
    if skip.lease_expires_at <= tick:
        return (
            f"{head}: dispatch {skip.dispatch_id} of worker {skip.worker_id}, whose lease "
            f"expired at {expiry}; any worker may reclaim it now"
        )
    return (
        f"{head}: dispatch {skip.dispatch_id} is held by worker {skip.worker_id}, lease "
        f"expires at {expiry} (in {_duration(skip.lease_expires_at - tick)}); if that worker "
        "is dead, the dispatch is reclaimed then"
    )


def _duration(delta: timedelta) -> str:
    """A short human duration: 1h 5m, 29m 59s, 45s."""
    seconds = max(int(delta.total_seconds()), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {seconds}s" if minutes else f"{seconds}s"


def _install_stop(stop: Any) -> None:
    loop = asyncio.get_running_loop()
    presses = {"n": 0}

    def on_signal() -> None:
        presses["n"] += 1
        stop(abandon=presses["n"] > 1)  # a second Ctrl-C abandons in-flight dispatches

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


def cmd_schedule(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "local") == "dbos":
        from fsm_kernel.cli import dbos_engine

        return dbos_engine.cmd_schedule(args)
    config, queue, runner = _setup(args)

    async def go() -> CycleResult | None:
        scheduler = Scheduler(config, queue, runner, wake=timer_waker(config, queue=queue),
                              on_cycle=lambda r: _print_cycle(r, args.json),
                              on_start=None if args.json else _print_start)  # fmt: skip
        _install_stop(scheduler.stop)
        heap.settle()
        try:
            if args.once:
                result = await scheduler.run_cycle()
                await scheduler.settle()
                return result
            print(
                f"scheduler {config.kernel_id}: schedule '{config.schedule}', "
                f"state {config.state_file}",
                file=sys.stderr,
            )
            await scheduler.run_forever()
            return None
        finally:
            await runner.aclose()

    try:
        result = asyncio.run(go())
    finally:
        queue.close()
    if result is not None and args.once:
        if not args.json:
            _print_cycle(result, False)
        else:
            print(json.dumps(result.to_dict(), ensure_ascii=False))
        return EXIT_OK if result.failed == 0 else EXIT_FAIL
    return EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "local") == "dbos":
        from fsm_kernel.cli import dbos_engine

        return dbos_engine.cmd_worker(args)
    config, queue, runner = _setup(args)

    async def go() -> None:
        worker = Worker(config, queue, runner, concurrency=args.concurrency,
                        on_result=lambda d: print(f"{d.status:9} {d.agent_id:16} run "
                                                  f"{d.run_id or '-'} {d.termination_reason or ''}",
                                                  flush=True))  # fmt: skip
        _install_stop(worker.stop)
        try:
            await worker.start()  # connected (and listening, on PostgreSQL): ready
            heap.settle()
            wakes = ("listening for new dispatches" if worker.listening.is_set()
                     else f"looking for dispatches every {worker.poll_seconds:g}s")  # fmt: skip
            if not worker.stopping:  # Ctrl-C while it connected: not ready, stopping
                print(f"worker for {config.kernel_id} ready: connected, {wakes} "
                      "(Ctrl-C to stop)", file=sys.stderr)  # fmt: skip
            await worker.run()
        finally:
            await runner.aclose()

    try:
        asyncio.run(go())
    finally:
        queue.close()
    return EXIT_OK


def cmd_dispatches(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "local") == "dbos":
        from fsm_kernel.cli import dbos_engine

        return dbos_engine.cmd_dispatches(args)
    config = load_scheduler_config(Path(args.config))
    queue = open_queue(config.store)
    try:
        if args.cancel is not None:
            return _cancel(config, queue, args.cancel, as_json=args.json)
        rows = queue.list(config.kernel_id, limit=args.limit)
    finally:
        queue.close()
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], ensure_ascii=False))
        return EXIT_OK
    if not rows:
        print(f"no dispatches for {config.kernel_id} yet", file=sys.stderr)
        return EXIT_OK
    print(
        f"{'DISPATCH':36}  {'AGENT':14}  {'STATUS':9}  {'ATTEMPTS':8}  {'CREATED':19}  "
        "REASON / ERROR"
    )
    for r in rows:
        print(
            f"{r.dispatch_id:36}  {cut(r.agent_id, 14):14}  {r.status.value:9}  "
            f"{f'{r.attempts}/{r.max_attempts}':8}  {r.created_at.isoformat()[:19]:19}  "
            f"{_row_detail(r)}"
        )
    return EXIT_OK


def _row_detail(row: Dispatch) -> str:
    if row.status is DispatchStatus.WAITING:
        return f"waiting for a person: fsm-kernel resume {row.run_id}"
    if row.status is DispatchStatus.PENDING and row.run_id is not None:
        return f"woken (its run's timer is due): the next worker resumes run {row.run_id}"
    if row.status is DispatchStatus.RUNNING and row.cancel_requested_at is not None:
        return "cancel requested"
    if row.termination_reason and row.error and row.status is not DispatchStatus.DONE:
        return f"{row.termination_reason}: {cut(row.error, 60)}"
    return row.termination_reason or cut(row.error or "", 60)


def _cancel(config: SchedulerConfig, queue: DispatchQueue, wanted: str, *, as_json: bool) -> int:
    """`dispatches --cancel`: one line on stdout saying what happened and what comes next."""
    dispatch_id = _resolve_dispatch(config, queue, wanted)
    try:
        row = queue.cancel(config.kernel_id, dispatch_id)
    except StoreConflictError as exc:  # finished meanwhile, or before
        raise ScheduleError(f"cannot cancel: {exc}") from None
    if row is None:  # deleted under our feet; reported like an unknown id
        raise ScheduleError(f"cannot cancel: no dispatch {dispatch_id} in {config.kernel_id}")
    if as_json:
        print(json.dumps(row.to_dict(), ensure_ascii=False))
    elif row.status is DispatchStatus.CANCELLED and row.started_at is None:
        print(f"cancelled {row.dispatch_id} ({row.agent_id}): it was pending and never ran")
    elif row.status is DispatchStatus.CANCELLED and row.worker_id is None:
        print(
            f"cancelled {row.dispatch_id} ({row.agent_id}): it was pending after its run's timer "
            f"woke it; run {row.run_id} was not resumed and still waits (fsm-kernel resume "
            f"{row.run_id} fires its timer)"
        )
    elif row.status is DispatchStatus.CANCELLED:
        print(
            f"cancelled {row.dispatch_id} ({row.agent_id}): the lease of worker "
            f"{row.worker_id} had expired (the worker is gone), so no run is going on"
        )
    else:
        print(
            f"cancel requested for {row.dispatch_id} ({row.agent_id}), running on worker "
            f"{row.worker_id}: it stops the run within {config.heartbeat_interval:g} s (one "
            "heartbeat) and the run ends 'cancelled'; if that worker is dead, the dispatch is "
            f"marked cancelled when its lease expires at {_when(row.lease_expires_at)}"
        )
    return EXIT_OK


def _resolve_dispatch(config: SchedulerConfig, queue: DispatchQueue, wanted: str) -> str:
    """The full id of the dispatch `wanted` names (the id or a unique prefix of it)."""
    hint = "(see 'fsm-kernel dispatches CONFIG')"
    if not _DISPATCH_ID.fullmatch(wanted):
        raise ScheduleError(f"cannot cancel: {wanted!r} is not a dispatch id {hint}")
    matches = queue.find(config.kernel_id, wanted.lower())
    if not matches:
        raise ScheduleError(
            f"cannot cancel: no dispatch {wanted} in kernel {config.kernel_id} {hint}"
        )
    if len(matches) > 1:
        raise ScheduleError(f"cannot cancel: {wanted} is the start of several dispatch ids {hint}")
    return matches[0].dispatch_id


def _when(moment: datetime | None) -> str:
    return moment.isoformat(timespec="seconds") if moment is not None else "-"
