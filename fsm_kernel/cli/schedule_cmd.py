"""The persistent agent's subcommands on the command line: schedule, worker, dispatches. What
they do lives in scheduling.py, imported when one of them runs, so `fsm-kernel --help` does not
load the scheduler."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["register"]


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module("fsm_kernel.cli.scheduling"), name
        )
        return command(args)

    handler.__name__ = name
    return handler


_ENGINE_HELP = (
    "local (default): fsm-kernel's own dispatch queue in the config's store; dbos: DBOS "
    "scheduled workflows and a DBOS queue (pip install 'fsm-kernel[dbos]'; see the docs' "
    "Scaling out page, docs/how-to/scaling-out.md)"
)


def _engine(p: Any) -> None:
    p.add_argument("--engine", choices=("local", "dbos"), default="local", help=_ENGINE_HELP)


def register(sub: Any) -> None:
    """Add schedule, worker and dispatches."""
    p = sub.add_parser(
        "schedule",
        description="Each tick reads STATE.md, dispatches the enabled agents (with {STATE} in "
        "their prompts) through the dispatch queue, runs up to max_concurrent in parallel as "
        "kernel runs, and records each as done or failed. Each tick first wakes the runs whose "
        "timer is due: a dispatched run's dispatch goes back into the queue, for this scheduler "
        "or any worker to resume the run. Ctrl-C stops gracefully.",
    )
    p.add_argument("config", metavar="CONFIG", help="scheduler config (YAML)")
    p.add_argument(
        "--once",
        action="store_true",
        help="run one cycle now (each run shown on stderr as it starts), print its result, exit",
    )
    p.add_argument("--json", action="store_true", help="print cycle results as JSON lines")
    p.add_argument("--base-url", help="model server for every agent (overrides env/workflow)")
    p.add_argument("--model", help="model for every agent")
    _engine(p)
    p.set_defaults(handler=_lazy("cmd_schedule"))
    p = sub.add_parser(
        "worker",
        description="Claims and runs the dispatches of a scheduler config, on this host or "
        "another (a postgresql:// store); a dispatch the scheduler woke because its run's timer "
        "is due resumes that run. Ctrl-C stops gracefully (twice: abandons running dispatches).",
    )
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--concurrency", type=int, help="dispatches this worker runs at once")
    p.add_argument(
        "--base-url",
        help="model server for every agent (overrides env/workflow, and what a "
        "resumed run recorded)",
    )
    p.add_argument("--model", help="model for every agent (a resumed run's too)")
    _engine(p)
    p.set_defaults(handler=_lazy("cmd_worker"))
    p = sub.add_parser(
        "dispatches",
        description="Lists the most recent dispatches: status, attempts (claims so far / "
        "max_attempts), and the run's termination reason or the error. A dispatch whose worker "
        "died max_attempts times is failed ('abandoned after 3 attempts: lease expired'). "
        "--cancel DISPATCH_ID (the full id or a unique prefix) cancels a pending dispatch at "
        "once; a running one is stopped by its worker within one heartbeat (at once on "
        "PostgreSQL) and its run ends with the reason 'cancelled'. An unknown or finished "
        "dispatch is a usage error (exit 2).",
    )
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--cancel",
        metavar="DISPATCH_ID",
        help="cancel this pending or running dispatch instead of listing",
    )
    _engine(p)
    p.set_defaults(handler=_lazy("cmd_dispatches"))
