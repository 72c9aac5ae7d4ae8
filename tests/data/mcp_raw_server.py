"""A hand-written MCP server over stdio, without the SDK: quick to start, and able to
misbehave as the hardening tests need.

    python tests/data/mcp_raw_server.py [--tools N] [--banner TEXT] [--silent] [--stubborn]
                                        [--pidfile PATH]

It offers `getenv` (the value of an environment variable: a server echoing what it was given)
and, with --tools N, N more (`t0` … `tN-1`). --banner writes TEXT (not JSON-RPC) on stdout
before anything else; --silent reads its stdin and never answers; --stubborn ignores SIGTERM
and the end of its stdin (only SIGKILL stops it); --pidfile writes its process id to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

_EMPTY = {"type": "object", "properties": {}}


def _tools(count: int) -> list[dict[str, Any]]:
    getenv = {
        "name": "getenv",
        "description": "The value of an environment variable.",
        "inputSchema": {"type": "object", "properties": {"name": {"type": "string"}}},
    }
    many = [
        {"name": f"t{i}", "description": f"Tool {i}.", "inputSchema": _EMPTY} for i in range(count)
    ]
    return [getenv, *many]


def _answer(message: dict[str, Any], count: int) -> dict[str, Any]:
    method, params = message.get("method"), message.get("params") or {}
    if method == "initialize":
        return {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "raw", "version": "1"},
        }
    if method == "tools/list":
        return {"tools": _tools(count)}
    if method == "tools/call" and params.get("name") == "getenv":
        value = os.environ.get(str((params.get("arguments") or {}).get("name")), "")
        return {"content": [{"type": "text", "text": value}], "isError": False}
    if method == "tools/call":
        return {"content": [{"type": "text", "text": str(params.get("name"))}], "isError": False}
    raise LookupError(str(method))


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tools", type=int, default=0)
    parser.add_argument("--banner")
    parser.add_argument("--silent", action="store_true")
    parser.add_argument("--stubborn", action="store_true")
    parser.add_argument("--pidfile")
    options = parser.parse_args()
    if options.pidfile:
        with open(options.pidfile, "w") as out:
            out.write(str(os.getpid()))
    if options.stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if options.banner is not None:
        sys.stdout.write(options.banner + "\n")
        sys.stdout.flush()
    for line in sys.stdin:
        message = json.loads(line)
        if options.silent or "id" not in message:
            continue
        try:
            _send(
                {"jsonrpc": "2.0", "id": message["id"], "result": _answer(message, options.tools)}
            )
        except LookupError as exc:
            error = {"code": -32601, "message": f"method not found: {exc}"}
            _send({"jsonrpc": "2.0", "id": message["id"], "error": error})
    while options.stubborn:  # its stdin ended: it stays anyway
        time.sleep(1)


if __name__ == "__main__":
    main()
