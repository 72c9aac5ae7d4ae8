"""`fsm-kernel ui`: the run viewer in a browser (the `ui` extra): parse, open, print the URL,
serve until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fsm_kernel.cli.args import count
from fsm_kernel.errors import ConfigError

__all__ = ["cmd_ui", "register"]

EXIT_OK = 0
TOKEN_ENV = "FSM_KERNEL_UI_TOKEN"


def register(sub: Any) -> None:
    """Add the `ui` subcommand."""
    from fsm_kernel.cli.runs import _store_flag

    p = sub.add_parser(
        "ui",
        description="Serve a local web app over the event store: the runs (filtered, paged), "
        "each run live on its workflow's diagram beside the timeline of its model calls, tool "
        "calls and transitions, the workflows, and with --scheduler the dispatches of recent "
        "cycles. Reads the store without ever holding up the runs writing to it. Needs the ui "
        "extra: pip install 'fsm-kernel[ui]'.",
    )
    _store_flag(p)
    p.add_argument(
        "--scheduler",
        metavar="CONFIG",
        help="a scheduler config: show its dispatches and link them to their runs (its store "
        "is the default --store)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; any other address needs a token)",
    )
    p.add_argument(
        "--port",
        type=count(0, 65535),
        default=8765,
        metavar="N",
        help="port to listen on (default 8765; 0 = any free port)",
    )
    p.add_argument(
        "--token",
        help=f"require this token (16+ characters) on every request; default: {TOKEN_ENV}, "
        "else none on a loopback address and a generated one on any other (printed in the URL)",
    )
    p.add_argument("--open", action="store_true", help="open the viewer in the web browser")
    p.set_defaults(handler=cmd_ui)


def cmd_ui(args: argparse.Namespace) -> int:
    try:
        from fsm_kernel.ui import ViewerConfig, is_loopback, new_token, open_viewer
    except ImportError as exc:
        missing = f" ({exc.name.split('.')[0]} is missing)" if exc.name else ""
        raise ConfigError(
            f"fsm-kernel ui needs the ui extra{missing}: pip install 'fsm-kernel[ui]'"
        ) from None
    token = args.token or os.environ.get(TOKEN_ENV) or None
    generated = token is None and not is_loopback(args.host)
    if generated:
        token = new_token()
    viewer = open_viewer(
        ViewerConfig(
            store=args.store,
            scheduler=args.scheduler,
            host=args.host,
            port=args.port,
            token=token,
        )
    )
    print(viewer.url, flush=True)
    note = "; a token was generated for this session (it is in the URL)" if generated else ""
    print(
        f"fsm-kernel ui: serving the runs of {viewer.store_location}{note}; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    if args.open:
        import webbrowser

        webbrowser.open(viewer.url)
    try:
        viewer.serve()
    except KeyboardInterrupt:  # uvicorn stopped gracefully, then re-raised the Ctrl-C
        pass
    return EXIT_OK
