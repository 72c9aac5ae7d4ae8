"""ticket_agent: an example of a user's own guard, action and tool for an fsm-kernel workflow.

`workflow.yaml` next to this package names them as `ticket_agent:looks_like_ticket_id` (a guard),
`ticket_agent:note_ticket` (an action) and `ticket_agent:lookup_ticket` (a tool). The package
must be importable when the workflow loads: run with `PYTHONPATH=examples/custom_guard` or
install it.
"""

from __future__ import annotations

import re
from typing import Any

from fsm_kernel.protocol import EventType, Message
from fsm_kernel.tools import tool
from fsm_kernel.workflow.context import RunContext

__all__ = ["TICKETS", "find_ticket_id", "looks_like_ticket_id", "lookup_ticket", "note_ticket"]

TICKET_ID = re.compile(r"\b[A-Z][A-Z0-9]{1,9}-\d{1,6}\b")
"""A ticket id such as OPS-7 or HELPDESK-1024."""

TICKETS: dict[str, dict[str, str]] = {
    "OPS-7": {
        "title": "Printer on floor 3 jams on every job",
        "status": "closed",
        "resolution": "Replaced the fuser unit on 2024-05-02.",
    },
    "OPS-12": {
        "title": "VPN drops every 10 minutes",
        "status": "open",
        "resolution": "",
    },
}
"""The example's ticket system: a real one would be an HTTP API or a database."""


def find_ticket_id(text: str) -> str | None:
    """The first ticket id in `text`, if any."""
    match = TICKET_ID.search(text)
    return match.group(0) if match else None


def looks_like_ticket_id(ctx: RunContext) -> bool:
    """Guard: the last model reply is text naming a ticket id (the triage step's answer).

    Pure and fast: it only reads the context.
    """
    reply = ctx.last_completion
    if reply is None or reply.message.tool_calls:
        return False
    return find_ticket_id(reply.message.content) is not None


def note_ticket(ctx: RunContext) -> None:
    """Action: remember the ticket id in `ctx.scratch` and ask the model to look it up.

    Raises:
        ValueError: the last reply names no ticket (the run then ends with reason `error`).
    """
    reply = ctx.last_completion
    ticket_id = find_ticket_id(reply.message.content) if reply is not None else None
    if ticket_id is None:
        raise ValueError("note_ticket runs after a reply naming a ticket id")
    ctx.scratch["ticket_id"] = ticket_id
    message = Message.user(
        f"Look up ticket {ticket_id} with the lookup_ticket tool, then answer the question "
        "about it in one or two sentences."
    )
    ctx.session.add(message)
    ctx.record(EventType.MESSAGE_ADDED, {"message": message.to_dict()})


@tool
def lookup_ticket(ticket_id: str) -> dict[str, Any]:
    """Look up a support ticket: its title, status and resolution.

    Args:
        ticket_id: The ticket id, such as OPS-7.
    """
    ticket = TICKETS.get(ticket_id.strip().upper())
    if ticket is None:
        known = ", ".join(sorted(TICKETS))
        raise ValueError(f"no ticket {ticket_id!r} (known tickets: {known})")
    return {"id": ticket_id.strip().upper(), **ticket}
