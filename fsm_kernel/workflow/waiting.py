"""Waiting states: a state without an action whose edges fire on a named event (`event:`) or
once the run has been in it for a while (`after:`).

A waiting state is a question like a person's approval (see human.py): the run asks its
channel for an answer of kind `event`, and a channel that cannot answer now suspends the run
(`run.suspended` with `waiting_for: {kind: event, events, due}`). `fsm-kernel signal` (or
`Agent.signal`) resumes it with the event as the answer; `resume` after the due time fires the
timer. Everything that decides the way out is in the log: `timer.set` (with the due time, read
back from the log when the run is re-driven), `timer.fired`, `event.delivered` and
`timer.cancelled`. A re-drive is served the recorded deliveries and firings in order (they are
answers, like a person's), so resume and replay take the same edges without the clock.

The rule for waiting in process: a timer due within `in_process` seconds (the kernel's
`await_timers`, 60 by default) is slept on in the process that drives the run rather than
suspending it, off the run's clock (`limits.timeout_seconds` counts the run's own work, not
its waiting). Meanwhile the run holds its lock, so a signal is refused until the timer fired.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fsm_kernel.errors import AnswerError, NoTransitionError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.workflow.compiler import FiredTransition, Machine, Waits
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.deadlines import Deadline
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended
from fsm_kernel.workflow.spec import edge_number

__all__ = ["AWAIT_IN_PROCESS", "Record", "Timer", "advance_past_deadline", "wait_and_advance"]

AWAIT_IN_PROCESS = 60.0
"""Seconds: a timer due within this is awaited in process instead of suspending the run."""

Record = Callable[[EventType, dict[str, Any]], Event | None]
"""The recorder: returns the event recorded, or the recorded one it matched (a re-drive)."""


@dataclass(frozen=True)
class Timer:
    """One `after:` edge's timer, set when the run entered its state."""

    edge: int
    due: datetime


async def wait_and_advance(
    ctx: RunContext,
    machine: Machine,
    waits: Waits,
    record: Record,
    *,
    in_process: float = AWAIT_IN_PROCESS,
    deadlines: Sequence[Deadline] = (),
) -> FiredTransition:
    """Take the waiting state's way out: a guarded edge that passes at once, else the edge of
    the first event delivered (or timer fired) whose guards pass. An event whose edges' guards
    all fail is recorded and dropped; the run goes on waiting. `deadlines` (of the compound
    states it is inside, already set) are waited for too; they are not the state's to cancel."""
    if waits.guarded:
        try:
            return await machine.advance()  # its event and timer edges do not pass yet
        except NoTransitionError:
            pass
    own = _set_timers(ctx, waits, record)
    timers = own + [Timer(d.edge, d.due) for d in deadlines]
    while True:
        question = Question(
            kind="event", state=machine.state, events=waits.events, due=_earliest_due(timers)
        )
        answer = await _next_answer(ctx, question, timers, in_process)
        trigger = _take(ctx, answer, waits, timers, record)
        timers = [t for t in timers if ("timer", t.edge) != trigger]  # a timer fires once
        ctx.notes.trigger = trigger
        try:
            fired = await machine.advance()
        except NoTransitionError:
            continue  # no edge's guards passed: the event is dropped, the state still waits
        finally:
            ctx.notes.trigger = None
        for timer in own:  # the state is left: its other timers never fire
            if timer in timers:
                record(EventType.TIMER_CANCELLED, {"edge": timer.edge})
        return fired


async def advance_past_deadline(
    ctx: RunContext, machine: Machine, deadline: Deadline, record: Record, step: int
) -> FiredTransition:
    """Leave the current state by the edge of a compound state's deadline that is due (see
    deadlines.py), recorded with the step it fired at, so a re-drive fires it there again."""
    due = deadline.due.isoformat()
    record(EventType.TIMER_FIRED, {"edge": deadline.edge, "due": due, "step": step})
    ctx.notes.trigger = ("timer", deadline.edge)
    try:
        return await machine.advance()
    finally:
        ctx.notes.trigger = None


def _set_timers(ctx: RunContext, waits: Waits, record: Record) -> list[Timer]:
    """Record each `after:` edge's timer; its due time is the log's when the run is re-driven
    (the first time it was set), else the run's clock now plus the edge's duration."""
    now = ctx.services.clock.now()
    timers = []
    for edge, seconds in waits.timers:
        due = (now + timedelta(seconds=seconds)).isoformat()
        event = record(EventType.TIMER_SET, {"edge": edge, "after": seconds, "due": due})
        recorded = event.data.get("due") if event is not None else None
        timers.append(Timer(edge, datetime.fromisoformat(str(recorded or due))))
    return timers


def _earliest(timers: Sequence[Timer]) -> Timer | None:
    return min(timers, key=lambda t: t.due) if timers else None


def _earliest_due(timers: Sequence[Timer]) -> str | None:
    first = _earliest(timers)
    return first.due.isoformat() if first is not None else None


async def _next_answer(
    ctx: RunContext, question: Question, timers: Sequence[Timer], in_process: float
) -> HumanAnswer:
    """The channel's answer (a recorded delivery or firing first, then the event given to
    `signal`); when it has none, the earliest timer if it is due, or due within `in_process`
    seconds (slept on off the run's clock); else the run suspends."""
    try:
        return await ctx.services.human.ask(question)
    except Suspended:
        first = _earliest(timers)
        if first is None:
            raise
        delay = (first.due - ctx.services.clock.now()).total_seconds()
        if delay > in_process:
            raise
        if delay > 0:
            await ctx.flush()  # the timer is in the log before the process sleeps on it
            await _sleep_off_the_clock(ctx, delay)
        return HumanAnswer.timer_fired(first.edge)


async def _sleep_off_the_clock(ctx: RunContext, seconds: float) -> None:
    """Sleep until a timer is due; the run's deadline moves by as long (waiting is not work)."""
    deadline, loop = ctx.notes.deadline, asyncio.get_running_loop()
    when = deadline.when() if deadline is not None else None
    if deadline is not None:
        deadline.reschedule(None)
    started = loop.time()
    try:
        await ctx.services.sleep(seconds)
    finally:
        if deadline is not None and when is not None:
            deadline.reschedule(when + loop.time() - started)


def _take(
    ctx: RunContext, answer: HumanAnswer, waits: Waits, timers: Sequence[Timer], record: Record
) -> tuple[str, str | int]:
    """Record the delivery or firing `answer` is, and what the state's edges are tried with."""
    if answer.kind != "event":
        raise AnswerError(f"the run waits for an event, not {answer.flag}")
    if answer.timer is not None:
        timer = next((t for t in timers if t.edge == answer.timer), None)
        if timer is None:
            raise AnswerError(f"no timer of edge {edge_number(answer.timer)} waits here")
        record(EventType.TIMER_FIRED, {"edge": timer.edge, "due": timer.due.isoformat()})
        return ("timer", timer.edge)
    name = str(answer.event)
    if name not in waits.events:
        awaited = ", ".join(waits.events) or "no event"
        raise AnswerError(f"the run does not wait for event {name!r} (it waits for {awaited})")
    record(EventType.EVENT_DELIVERED, {"name": name, "data": answer.data, "by": answer.by})
    ctx.event = {"name": name, "data": answer.data}
    return ("event", name)
