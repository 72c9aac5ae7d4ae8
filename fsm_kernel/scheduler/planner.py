"""The planner: which configured agents to dispatch this tick, and with which prompt. Pure: no
I/O, no clock; the engine hands it STATE.md's text and each agent's latest dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    agent_id: str
    reason: str
    """disabled, pending, running or duplicate."""
    dispatch_id: str | None = None
    """The dispatch that caused the skip, when there is one."""

    def to_dict(self) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "reason": self.reason, "dispatch_id": self.dispatch_id}


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
        latest: Each agent's most recent dispatch, by agent_id (absent: never dispatched).
    """
    planned: list[PlannedDispatch] = []
    skipped: list[SkippedAgent] = []
    for agent in agents:
        previous = latest.get(agent.agent_id)
        if not agent.enabled:
            skipped.append(SkippedAgent(agent_id=agent.agent_id, reason="disabled"))
        elif previous is not None and previous.is_active:
            skipped.append(
                SkippedAgent(
                    agent_id=agent.agent_id,
                    reason=previous.status.value,
                    dispatch_id=previous.dispatch_id,
                )
            )
        else:
            planned.append(PlannedDispatch(agent=agent, prompt=render_prompt(agent.prompt, state)))
    return Plan(dispatches=tuple(planned), skipped=tuple(skipped))
