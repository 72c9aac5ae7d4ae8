"""An MCP tool server for the tests, written with the official SDK's server side.

    python tests/data/mcp_server.py                 # stdio
    python tests/data/mcp_server.py --http PORT     # streamable HTTP on 127.0.0.1:PORT/mcp

Tools: add, echo, shout (a name another server shares), slow (sleeps), die (the process exits),
whoami (over HTTP: the SHA-256 of the Authorization header it received, which the client
redacts wherever the header itself would appear)."""

from __future__ import annotations

import argparse
import contextvars
import hashlib
import os
import time
from typing import Any

from mcp.server.mcpserver import MCPServer

NAME = os.environ.get("MCP_TEST_NAME", "calc")
server = MCPServer(NAME)
_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "headers", default=None
)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"{NAME} says {text}"


@server.tool()
def shout(text: str) -> str:
    """Say the text loudly."""
    return f"{NAME}: {text.upper()}!"


@server.tool()
def slow(seconds: float) -> str:
    """Take a while."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def die() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
def whoami() -> str:
    """The SHA-256 of the Authorization header this request carried (HTTP only)."""
    header = (_headers.get() or {}).get("authorization")
    return "(none)" if header is None else hashlib.sha256(header.encode()).hexdigest()


def _http(port: int) -> None:
    import uvicorn

    app = server.streamable_http_app()

    async def remember_headers(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            _headers.set({k.decode(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    uvicorn.run(remember_headers, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    if os.environ.get("MCP_TEST_STARTS"):  # count the processes started
        with open(os.environ["MCP_TEST_STARTS"], "a") as starts:
            starts.write(f"{os.getpid()}\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, metavar="PORT")
    options = parser.parse_args()
    if options.http is not None:
        _http(options.http)
    else:
        server.run("stdio")
