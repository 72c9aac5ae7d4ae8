"""`schedule`, `worker` and `dispatches` with `--engine dbos`: the scheduler config on DBOS
(fsm_kernel.integrations.dbos_scheduler), imported only when asked for."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from fsm_kernel.bootstrap import RunOptions
from fsm_kernel.cli import heap
from fsm_kernel.errors import ConfigError
from fsm_kernel.scheduler import load_scheduler_config

__all__ = ["cmd_dispatches", "cmd_schedule", "cmd_worker"]

EXIT_OK, EXIT_FAIL = 0, 1


def _integration() -> Any:
    try:
        from fsm_kernel.integrations import dbos_scheduler
    except ImportError:
        raise ConfigError("--engine dbos needs DBOS: pip install 'fsm-kernel[dbos]'") from None
    return dbos_scheduler


def _fleet(args: argparse.Namespace, *, quiet: bool = False) -> Any:
    path = Path(args.config)
    config = load_scheduler_config(path)
    options = RunOptions(model=args.model, base_url=args.base_url)

    def ended(agent_id: str, result: Any) -> None:
        if not quiet:
            reason = result.termination_reason or ("waiting" if result.status == "waiting" else "")
            state = "done" if result.ok else "failed"
            print(f"{state:9} {agent_id:16} run {result.run_id} {reason}", flush=True)

    def ticked(tick: Any) -> None:
        if not quiet:
            print(f"tick {tick.tick}: dispatched {len(tick.enqueued)}, skipped "
                  f"{len(tick.skipped)}", flush=True)  # fmt: skip

    return _integration().DBOSFleet(config, path, options, on_result=ended, on_tick=ticked)


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def cmd_schedule(args: argparse.Namespace) -> int:
    fleet = _fleet(args, quiet=args.once)

    async def go() -> int:
        await fleet.launch()
        heap.settle()
        try:
            if args.once:
                return await _once(fleet, args.json)
            await fleet.schedule()
            config = fleet.config
            print(
                f"scheduler {config.kernel_id} on DBOS: schedule '{config.schedule}', "
                f"queue {fleet.queue_name}",
                file=sys.stderr,
            )
            try:
                await _until_stopped()
            finally:
                await fleet.unschedule()
            return EXIT_OK
        finally:
            await _shut_down(fleet)

    return asyncio.run(go())


async def _once(fleet: Any, as_json: bool) -> int:
    """One tick now; wait for each run it dispatched to end or wait for a person."""
    tick = await fleet.tick_now()
    outcomes = [await fleet.outcome(a, r) for a, r in tick.enqueued]
    summary = _integration().outcomes_line(outcomes, tick)
    if as_json:
        skipped = [{"agent_id": a, "reason": r} for a, r in tick.skipped]
        details = [o.to_dict() for o in outcomes]
        print(json.dumps({"tick": tick.tick, "engine": "dbos", "details": details,
                          "skipped_agents": skipped}))  # fmt: skip
    else:
        print(summary)
        for o in outcomes:
            print(f"  {o.status:9} {o.agent_id:16} run {o.run_id} {o.termination_reason or ''}")
    for agent_id, reason in tick.skipped:
        print(f"skipped {agent_id}: {reason}", file=sys.stderr)
    return EXIT_OK if all(o.status != "failed" for o in outcomes) else EXIT_FAIL


def cmd_worker(args: argparse.Namespace) -> int:
    fleet = _fleet(args)

    async def go() -> int:
        await fleet.launch(worker_concurrency=args.concurrency)
        heap.settle()
        print(f"worker for {fleet.config.kernel_id} on DBOS, queue {fleet.queue_name} "
              "(Ctrl-C to stop)", file=sys.stderr)  # fmt: skip
        try:
            await _until_stopped()
        finally:
            await _shut_down(fleet)
        return EXIT_OK

    return asyncio.run(go())


def cmd_dispatches(args: argparse.Namespace) -> int:
    config = load_scheduler_config(Path(args.config))
    dbos = _integration()
    if args.cancel is not None:
        print(dbos.cancel_dispatch(config, args.cancel))
        return EXIT_OK
    rows = dbos.list_dispatches(config, limit=args.limit)
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return EXIT_OK
    print(f"{'RUN':36}  {'AGENT':16}  {'STATUS':30}  {'CREATED':25}  ATTEMPTS")
    for r in rows:
        print(f"{r['run_id']:36}  {r['agent_id']:16}  {r['status']:30}  "
              f"{r['created_at'] or '-':25}  {r['attempts']}")  # fmt: skip
    return EXIT_OK


async def _shut_down(fleet: Any) -> None:
    """Stop taking runs off the queue, let the runs going on in this process end (at most
    timeout_seconds: a longer one is recovered when an executor of this DBOS__VMID starts),
    then close DBOS and the agents. DBOS waits on a thread: the runs go on on this loop."""
    from dbos import DBOS

    wait = int(fleet.config.timeout_seconds)
    await asyncio.to_thread(DBOS.destroy, workflow_completion_timeout_sec=wait)
    await fleet.aclose()
