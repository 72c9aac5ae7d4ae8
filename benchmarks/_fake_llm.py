"""The test suite's fake OpenAI server (tests/fakes/openai_server.py) for the concurrency
benchmark: every request is answered after LATENCY seconds from what it carries, not from a
script, so any number of runs can share it.

    python benchmarks/_fake_llm.py --latency 0.05 --iterations 5

A request whose conversation holds k tool results gets `echo(text="ping k")` (call id `call_k`)
while k < ITERATIONS - 1, else the text answer `done`: a run of ITERATIONS model calls. Prints
`READY <base url>` and serves until stdin closes or SIGTERM. Keep-alive connections (a client
that keeps them gets them), a listen backlog of 4096 (the default 5 drops connections when
hundreds arrive at once), no OpenAI message-order checks (they cost the server CPU).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from http.server import ThreadingHTTPServer  # noqa: E402

from tests.fakes.openai_server import (  # noqa: E402
    FakeOpenAIServer,
    Reply,
    call,
    text_reply,
    tool_reply,
)


class LatencyServer(FakeOpenAIServer):
    """Answers every request from its content, after a fixed latency."""

    def __init__(self, latency: float, iterations: int) -> None:
        super().__init__(strict=False, keep_alive=True, stream_style=None)
        self.latency = latency
        self.iterations = iterations

    def _record(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        pass  # nothing kept: thousands of requests

    def _next_reply(self, request: dict[str, Any]) -> Reply:
        messages = request.get("messages") or []
        k = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
        if k < self.iterations - 1:
            reply = tool_reply(call("echo", {"text": f"ping {k}"}, id=f"call_{k}"))
        else:
            reply = text_reply("done")
        return replace(self._finish(reply, request), delay=self.latency)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    ThreadingHTTPServer.request_queue_size = 4096
    ThreadingHTTPServer.daemon_threads = True
    server = LatencyServer(args.latency, args.iterations)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    with server:
        sys.stdout.write(f"READY {server.base_url}\n")
        sys.stdout.flush()
        done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
