"""The planner: which configured agents to dispatch this tick, and with which prompt. Pure: no
I/O, no clock; the engine hands it STATE.md's text and each agent's active dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fsm_kernel.scheduler.config import AgentSpec
from fsm_kernel.scheduler.queue import Dispatch

__all__ = [
    "STATE_PLACEHOLDER",
    "Plan",
    "PlannedDispatch",
    "SkippedAgent",
    "plan_dispatches",
    "render_prompt",
]

STATE_PLACEHOLDER = "{STATE}"


@dataclass(frozen=True, kw_only=True)
class PlannedDispatch:
    agent: AgentSpec
    prompt: str
    """The agent's prompt with every {STATE} replaced by the state text."""


@dataclass(frozen=True, kw_only=True)
class SkippedAgent:
    """An agent a tick did not dispatch, with enough to tell the user why and until when: a
    scheduler killed mid-run leaves its dispatches running until their leases expire."""

    agent_id: str
    reason: str
    """disabled (in the config), pending or running (its previous dispatch is still active;
    one active dispatch per agent), or duplicate (this tick's dispatch already exists)."""
    dispatch_id: str | None = None
    """The dispatch that caused the skip, when there is one."""
    worker_id: str | None = None
    """For a running dispatch: the worker holding its lease."""
    lease_expires_at: datetime | None = None
    """For a running dispatch: when the lease runs out and another worker may reclaim it."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; worker_id and lease_expires_at only when known (a leased dispatch)."""
        out: dict[str, Any] = {
            "agent_id": self.agent_id,
            "reason": self.reason,
            "dispatch_id": self.dispatch_id,
        }
        if self.worker_id is not None:
            out["worker_id"] = self.worker_id
        if self.lease_expires_at is not None:
            out["lease_expires_at"] = self.lease_expires_at.isoformat()
        return out


@dataclass(frozen=True, kw_only=True)
class Plan:
    dispatches: tuple[PlannedDispatch, ...] = ()
    skipped: tuple[SkippedAgent, ...] = field(default_factory=tuple)


def render_prompt(template: str, state: str) -> str:
    """Insert the state text. str.replace, not str.format: prompts and STATE.md may contain any
    other braces."""
    return template.replace(STATE_PLACEHOLDER, state)


def plan_dispatches(
    agents: Sequence[AgentSpec], state: str, latest: Mapping[str, Dispatch]
) -> Plan:
    """Dispatch every enabled agent whose most recent dispatch is not pending or running.

    Args:
        agents: The configured agents, in config order.
        state: The whole text of STATE.md.
        latest: Each agent's pending or running dispatch, by agent_id (its most recent one
            works too: only an active one prevents a new dispatch).
    """
    planned: list[PlannedDispatch] = []
    skipped: list[SkippedAgent] = []
    for agent in agents:
        previous = latest.get(agent.agent_id)
        if not agent.enabled:
            skipped.append(SkippedAgent(agent_id=agent.agent_id, reason="disabled"))
        elif previous is not None and previous.is_active:
            skipped.append(_still_active(previous))
        else:
            planned.append(PlannedDispatch(agent=agent, prompt=render_prompt(agent.prompt, state)))
    return Plan(dispatches=tuple(planned), skipped=tuple(skipped))


def _still_active(dispatch: Dispatch) -> SkippedAgent:
    """The skip of an agent whose previous dispatch is pending or running (maybe under the
    lease of a worker that died: it stays running until the lease expires)."""
    return SkippedAgent(
        agent_id=dispatch.agent_id,
        reason=dispatch.status.value,
        dispatch_id=dispatch.dispatch_id,
        worker_id=dispatch.worker_id,
        lease_expires_at=dispatch.lease_expires_at,
    )
