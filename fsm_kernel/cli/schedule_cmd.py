"""Subcommands of the persistent agent: schedule, worker, dispatches; and the runner that turns
one dispatch into one kernel run."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from fsm_kernel.bootstrap import RunOptions, build_kernel, resolve_workflow
from fsm_kernel.cli.commands import load_spec
from fsm_kernel.cli.output import cut
from fsm_kernel.scheduler import (
    AgentRunner,
    AgentSpec,
    CycleResult,
    RunOutcome,
    Scheduler,
    SchedulerConfig,
    SkippedAgent,
    Worker,
    load_scheduler_config,
    open_queue,
    state_tools,
)
from fsm_kernel.store import open_store

EXIT_OK, EXIT_FAIL = 0, 1

logger = logging.getLogger(__name__)


def register(sub: Any) -> None:
    """Add schedule, worker and dispatches."""
    p = sub.add_parser(
        "schedule",
        help="run the persistent agent: cron ticks dispatch the configured agents",
        description="Each tick reads STATE.md, dispatches the enabled agents (with {STATE} in "
        "their prompts) through the dispatch queue, runs up to max_concurrent in parallel as "
        "kernel runs, and records each as done or failed. Ctrl-C stops gracefully.",
    )
    p.add_argument("config", metavar="CONFIG", help="scheduler config (YAML)")
    p.add_argument("--once", action="store_true", help="run one cycle now, print it, exit")
    p.add_argument("--json", action="store_true", help="print cycle results as JSON lines")
    p.add_argument("--base-url", help="model server for every agent (overrides env/workflow)")
    p.add_argument("--model", help="model for every agent")
    p.set_defaults(handler=cmd_schedule)
    p = sub.add_parser("worker", help="an extra worker that only executes queued dispatches")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--concurrency", type=int, help="dispatches this worker runs at once")
    p.add_argument("--base-url")
    p.add_argument("--model")
    p.set_defaults(handler=cmd_worker)
    p = sub.add_parser("dispatches", help="recent dispatches of a scheduler config")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_dispatches)


def make_runner(config: SchedulerConfig, config_path: Path, options: RunOptions) -> AgentRunner:
    """One dispatch = one kernel run of the agent's workflow, recorded in the config's store,
    with the STATE.md tools added. A dispatch that cannot even start (its workflow does not
    load, the store is down) fails in the executor with one WARNING line (traceback at -v).
    """

    async def run(agent: AgentSpec, prompt: str) -> RunOutcome:
        return await _run_agent(config, config_path, options, agent, prompt)

    return run


async def _run_agent(
    config: SchedulerConfig,
    config_path: Path,
    options: RunOptions,
    agent: AgentSpec,
    prompt: str,
) -> RunOutcome:
    # load_spec puts the workflow's folder and the cwd on sys.path, as `fsm-kernel run` does,
    # so a workflow's own `package.module:function` code imports.
    spec = load_spec(str(_agent_workflow(agent.workflow, config_path)))
    agent_options = RunOptions(
        model=options.model,
        base_url=options.base_url,
        timeout_seconds=float(config.timeout_seconds),
        extra_tools=state_tools(config.state_file),
    )
    store = open_store(config.store)
    try:
        kernel, model = build_kernel(spec, agent_options, store=store)
        try:
            result = await kernel.run(prompt)
        finally:
            await model.aclose()
    finally:
        store.close()
    return RunOutcome(
        ok=result.ok,
        run_id=result.run_id,
        termination_reason=result.termination_reason,
        error=result.error,
    )


def _agent_workflow(name: str, config_path: Path) -> Path:
    """A workflow path relative to the config file wins; then the usual lookup."""
    beside = config_path.parent / name
    return beside if beside.is_file() else resolve_workflow(name)


def _setup(args: argparse.Namespace) -> tuple[SchedulerConfig, Any, AgentRunner]:
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
    )
    for d in result.details:
        outcome = d.termination_reason or ""
        error = f" — {cut(d.error, 120)}" if d.error else ""
        print(f"  {d.status:9} {d.agent_id:16} run {d.run_id or '-'} {outcome}{error}")
    sys.stdout.flush()
    for skip in result.skipped_agents:
        print(_skip_line(skip, result.tick), file=sys.stderr, flush=True)


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
    config, queue, runner = _setup(args)

    async def go() -> CycleResult | None:
        scheduler = Scheduler(config, queue, runner,
                              on_cycle=lambda r: _print_cycle(r, args.json))  # fmt: skip
        _install_stop(scheduler.stop)
        if args.once:
            return await scheduler.run_cycle()
        print(
            f"scheduler {config.kernel_id}: schedule '{config.schedule}', "
            f"state {config.state_file}",
            file=sys.stderr,
        )
        await scheduler.run_forever()
        return None

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
    config, queue, runner = _setup(args)

    async def go() -> None:
        worker = Worker(config, queue, runner, concurrency=args.concurrency,
                        on_result=lambda d: print(f"{d.status:9} {d.agent_id:16} run "
                                                  f"{d.run_id or '-'} {d.termination_reason or ''}",
                                                  flush=True))  # fmt: skip
        _install_stop(worker.stop)
        print(f"worker for {config.kernel_id} started (Ctrl-C to stop)", file=sys.stderr)
        await worker.run()

    try:
        asyncio.run(go())
    finally:
        queue.close()
    return EXIT_OK


def cmd_dispatches(args: argparse.Namespace) -> int:
    config = load_scheduler_config(Path(args.config))
    queue = open_queue(config.store)
    try:
        rows = queue.list(config.kernel_id, limit=args.limit)
    finally:
        queue.close()
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], ensure_ascii=False))
        return EXIT_OK
    if not rows:
        print(f"no dispatches for {config.kernel_id} yet", file=sys.stderr)
        return EXIT_OK
    print(f"{'DISPATCH':36}  {'AGENT':14}  {'STATUS':8}  {'CREATED':19}  {'REASON / ERROR'}")
    for r in rows:
        d = r.to_dict()
        detail = d.get("termination_reason") or cut(d.get("error") or "", 60)
        print(
            f"{d['dispatch_id']:36}  {cut(d['agent_id'], 14):14}  {d['status']:8}  "
            f"{str(d.get('created_at', ''))[:19]:19}  {detail}"
        )
    return EXIT_OK
