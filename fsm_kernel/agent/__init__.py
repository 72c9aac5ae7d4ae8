"""The model client: HttpChatModel (httpx, retries, error translation) and the pure
chat-completions wire conversion. Never imports tools, store, workflow or kernel."""

from fsm_kernel.agent.client import HttpChatModel
from fsm_kernel.agent.wire import (
    completion_from_wire,
    message_from_wire,
    messages_from_wire,
    messages_to_wire,
    new_call_id,
    tools_to_wire,
)

__all__ = [
    "HttpChatModel",
    "completion_from_wire",
    "message_from_wire",
    "messages_from_wire",
    "messages_to_wire",
    "new_call_id",
    "tools_to_wire",
]
