"""A minimal asyncio HTTP/1.1 server speaking the fake OpenAI server's replies, for when the
thread-per-connection test server (tests/fakes/openai_server.py) would be the bottleneck of
the concurrency benchmark: hundreds of concurrent connections cost it more CPU than the client
under test, and its kept-alive connections stall.

    python benchmarks/_asyncio_llm.py --latency 0.05 --iterations 5

The same answers as _fake_llm.py (built with the test server's own `tool_reply`/`text_reply`):
`echo(text="ping k")` while the conversation holds k < ITERATIONS - 1 tool results, then the text
`done`, each after LATENCY seconds; keep-alive unless the client says `Connection: close`.
Prints `READY <base url>` and serves until stdin closes or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakes.openai_server import call, text_reply, tool_reply  # noqa: E402

_ids = itertools.count(1)


def answer(request: dict[str, Any], iterations: int) -> bytes:
    messages = request.get("messages") or []
    k = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
    if k < iterations - 1:
        reply = tool_reply(call("echo", {"text": f"ping {k}"}, id=f"call_{k}"))
    else:
        reply = text_reply("done")
    body = dict(reply.body)
    body.update(
        id=f"chatcmpl-fake-{next(_ids)}", created=int(time.time()), model=request.get("model", "")
    )
    return json.dumps(body).encode()


async def serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency: float, iterations: int
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            body = await reader.readexactly(int(headers.get("content-length") or 0))
            await asyncio.sleep(latency)
            payload = answer(json.loads(body), iterations)
            close = headers.get("connection", "").lower() == "close"
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            writer.write(
                head % len(payload)
                + (b"Connection: close\r\n" if close else b"")
                + b"\r\n"
                + payload
            )
            await writer.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main_async(latency: float, iterations: int) -> None:
    server = await asyncio.start_server(
        lambda r, w: serve(r, w, latency, iterations), "127.0.0.1", 0, backlog=4096
    )
    port = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"READY http://127.0.0.1:{port}/v1\n")
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(
        sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(1) else None
    )
    async with server:
        await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main_async(args.latency, args.iterations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
