"""The run viewer (`fsm-kernel ui`, the `ui` extra): runs, a run live on its diagram with its
timeline, the workflows and the scheduler's dispatches, in a browser.

Reads the event stores (SQLite read-only), the diagrams and the scheduler's queue; only the CLI
imports it. Starlette, uvicorn and Jinja2 come with `pip install 'fsm-kernel[ui]'`.
"""

from fsm_kernel.ui._app import FormHandler, create_app, post_action
from fsm_kernel.ui._security import is_loopback
from fsm_kernel.ui._server import (
    MIN_TOKEN_LENGTH,
    Viewer,
    ViewerConfig,
    new_token,
    open_event_store,
    open_viewer,
)

__all__ = [
    "MIN_TOKEN_LENGTH",
    "FormHandler",
    "Viewer",
    "ViewerConfig",
    "create_app",
    "is_loopback",
    "new_token",
    "open_event_store",
    "open_viewer",
    "post_action",
]
