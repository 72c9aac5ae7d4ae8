"""Cron expressions: validation of the accepted subset and fire-time arithmetic over croniter.

Owns nothing stateful; the scheduler loop (engine.py) decides when to sleep and what to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from croniter import CroniterError, croniter

from fsm_kernel.errors import ScheduleError

__all__ = ["CronSchedule", "check_cron_expression"]

_FIELDS = 5
_HASHED = re.compile(r"(?<![A-Z])H(?![A-Z])")  # H, H/5, H(0-29); not the H of THU


def check_cron_expression(expr: str) -> str:
    """Validate a five-field cron expression and return it stripped.

    Only the classic five fields are accepted (no seconds field, no hashed `H` forms), so an
    expression means the same thing whichever croniter release is installed.

    Raises:
        ScheduleError: the expression is not a valid five-field cron expression.
    """
    text = expr.strip()
    fields = text.split()
    if len(fields) != _FIELDS:
        raise ScheduleError(
            f"cron expression {expr!r} must have 5 fields (minute hour day month weekday), "
            f"got {len(fields)}"
        )
    if any(_HASHED.search(f.upper()) for f in fields):
        raise ScheduleError(f"cron expression {expr!r}: hashed (H) forms are not supported")
    try:
        croniter(text, datetime(2000, 1, 1, tzinfo=UTC))
    except (CroniterError, ValueError, KeyError) as exc:
        raise ScheduleError(f"invalid cron expression {expr!r}: {exc}") from exc
    return text


@dataclass(frozen=True)
class CronSchedule:
    """Fire times of one cron expression, computed in UTC."""

    expression: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "expression", check_cron_expression(self.expression))

    def next_after(self, moment: datetime) -> datetime:
        """The first fire time strictly after `moment`."""
        fire = croniter(self.expression, _utc(moment)).get_next(datetime)
        return _utc(fire)

    def latest_at_or_before(self, moment: datetime) -> datetime:
        """The last fire time at or before `moment`."""
        moment = _utc(moment)
        prev = _utc(croniter(self.expression, moment).get_prev(datetime))
        following = self.next_after(prev)
        return following if following <= moment else prev

    def fires_between(self, start: datetime, end: datetime, *, limit: int = 100_000) -> int:
        """How many fire times lie in [start, end] (counting stops at `limit`)."""
        fire = self.latest_at_or_before(start)
        if fire < _utc(start):
            fire = self.next_after(fire)
        ticks = croniter(self.expression, fire)
        count = 0
        while fire <= _utc(end) and count < limit:
            count += 1
            fire = _utc(ticks.get_next(datetime))
        return count


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise ScheduleError(f"naive datetime {moment.isoformat()} (expected timezone-aware)")
    return moment.astimezone(UTC)
