"""`fsm-kernel signal RUN_ID NAME [--data JSON]`: deliver a named event to a run that waits in
a waiting state (one whose edges carry `event:` / `after:`), and continue the run in this
process, as `resume --approve` does for an approval."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fsm_kernel.errors import AnswerError

__all__ = ["cmd_signal", "register"]


def register(sub: Any) -> None:
    """Add the `signal` subcommand."""
    from fsm_kernel.cli.commands import add_resume_flags

    p = sub.add_parser(
        "signal",
        description="Deliver the event NAME (with --data, any JSON value) to a run waiting in "
        "a state whose edges carry 'event: NAME', record it (event.delivered) and continue the "
        "run in this process from its log, as resume does. Refused (exit 2, nothing recorded) "
        "when the run does not wait for that event, or its timer is already due (resume it: "
        "the timer fires). The run's recorded settings apply; a flag given here overrides one.",
    )
    p.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    p.add_argument("name", metavar="NAME", help="the event, as the workflow's 'event:' names it")
    p.add_argument(
        "--data",
        metavar="JSON",
        help="the event's data, any JSON value: guards read ctx.event['data'], templates "
        "{event.data.KEY}",
    )
    p.add_argument(
        "--by",
        metavar="NAME",
        help="who sends it, recorded with the event (default: the USER environment variable)",
    )
    add_resume_flags(p)
    p.set_defaults(handler=cmd_signal)


def cmd_signal(args: argparse.Namespace) -> int:
    from fsm_kernel.cli.runs import continue_run
    from fsm_kernel.workflow.human import HumanAnswer

    answer = HumanAnswer.signal(args.name, _data(args.data), by=args.by)
    return continue_run(args, lambda: answer)


def _data(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AnswerError(f"--data is not JSON: {exc}") from None
