"""Cron expressions: the accepted subset and fire-time arithmetic."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from fsm_kernel.errors import ScheduleError
from fsm_kernel.scheduler import CronSchedule, check_cron_expression


def at(hour: int, minute: int, second: int = 0) -> datetime:
    return datetime(2026, 2, 11, hour, minute, second, tzinfo=UTC)


@pytest.mark.parametrize(
    "expr", ["*/10 * * * *", " 0 8 * * MON-FRI ", "0 0 * * THU", "5,35 */2 1-15 JAN,jul *"]
)
def test_accepted_expressions(expr: str) -> None:
    assert check_cron_expression(expr) == expr.strip()


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("* * * * * *", "must have 5 fields"),
        ("* * * *", "must have 5 fields"),
        ("", "must have 5 fields"),
        ("H * * * *", "hashed"),
        ("H/5 * * * *", "hashed"),
        ("61 * * * *", "invalid cron expression"),
        ("* * * * FUNDAY", "invalid cron expression"),
        ("every minute of the day", "invalid cron expression"),
    ],
)
def test_rejected_expressions(expr: str, fragment: str) -> None:
    with pytest.raises(ScheduleError, match=fragment):
        check_cron_expression(expr)
    with pytest.raises(ScheduleError):
        CronSchedule(expr)


def test_next_after_is_strictly_after() -> None:
    schedule = CronSchedule("*/10 * * * *")
    assert schedule.next_after(at(10, 0)) == at(10, 10)
    assert schedule.next_after(at(10, 0, 30)) == at(10, 10)
    assert schedule.next_after(at(10, 9, 59)) == at(10, 10)


def test_latest_at_or_before_is_inclusive() -> None:
    schedule = CronSchedule("*/10 * * * *")
    assert schedule.latest_at_or_before(at(10, 30)) == at(10, 30)
    assert schedule.latest_at_or_before(at(10, 35, 30)) == at(10, 30)
    assert schedule.latest_at_or_before(at(10, 39, 59)) == at(10, 30)


def test_other_timezones_are_converted_to_utc() -> None:
    schedule = CronSchedule("0 8 * * *")
    paris = timezone(timedelta(hours=1))
    fire = schedule.next_after(datetime(2026, 2, 11, 7, 30, tzinfo=paris))  # 06:30 UTC
    assert fire == datetime(2026, 2, 11, 8, 0, tzinfo=UTC)
    assert fire.tzinfo is UTC


def test_fires_between_counts_inclusive_bounds() -> None:
    schedule = CronSchedule("*/10 * * * *")
    assert schedule.fires_between(at(10, 10), at(10, 30)) == 3
    assert schedule.fires_between(at(10, 5), at(10, 9)) == 0
    assert schedule.fires_between(at(10, 0, 1), at(11, 0)) == 6


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ScheduleError, match="naive"):
        CronSchedule("* * * * *").next_after(datetime(2026, 2, 11, 10, 0))  # naive on purpose
