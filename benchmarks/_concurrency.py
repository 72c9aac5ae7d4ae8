"""One measurement of the concurrency benchmark, in a process of its own (for its peak RSS).

    python benchmarks/_concurrency.py MODE --base-url URL [--runs 500] [--iterations 5]

MODE `raw`: RUNS asyncio tasks, each a minimal agent loop over one shared httpx.AsyncClient
(as many connections as runs, one per request): POST the conversation, append the answer and
the echo result, ITERATIONS times. MODE `raw_oneshot`: the same on fsm-kernel's one-shot
transport (a connection per request without httpcore's pool, as fsm-kernel's client uses),
the leanest peer, so a ratio against it is the kernel's own cost. MODE `fsm_memory`,
`fsm_sqlite`, `fsm_sqlite_stream`: RUNS concurrent `Agent.run`s of the default workflow (plus
the `echo` tool) on one Agent, no store or an SQLite store, plain answers (or streamed).
Prints one JSON line: wall seconds, model requests, peak RSS. The clock times the runs alone,
from the first request to the last reply: each side's client is made before it starts (raw's
AsyncClient; fsm-kernel's Agent, its workflow compiled and its model client opened), as
start-up is a part of its own, and both pay their first connection's imports inside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _loop import SYSTEM_PROMPT, echo  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Repeat the text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "what to repeat."}},
                "required": ["text"],
            },
        },
    }
]


async def raw(
    base_url: str, runs: int, iterations: int, *, one_shot: bool = False
) -> tuple[int, float]:
    import httpx

    # One connection per request, as fsm-kernel's client does, and as many as there are runs:
    # httpx's pool is slowest when requests queue for a connection or scan hundreds of idle
    # kept-alive ones (measured: 500 runs, 2,500 requests: 5 s this way, 34 s kept alive).
    # `one_shot`: on fsm-kernel's own transport instead (a connection per request without
    # httpcore's pool, which scans every open connection at each request's start and end):
    # the leanest peer, so the ratio against it is the kernel's cost alone.
    limits = httpx.Limits(max_connections=runs, max_keepalive_connections=0)
    transport = None
    if one_shot:
        import ssl

        from fsm_kernel.agent.transport import OneShotTransport

        transport = OneShotTransport(ssl.create_default_context())
    async with httpx.AsyncClient(limits=limits, timeout=120, transport=transport) as client:

        async def one(i: int) -> int:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"task {i}"},
            ]
            for n in range(1, iterations + 1):
                response = await client.post(
                    f"{base_url}/chat/completions",
                    json={"model": "fake", "messages": messages, "tools": TOOLS},
                )
                response.raise_for_status()
                message = response.json()["choices"][0]["message"]
                messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls:
                    return n
                for c in calls:
                    args = json.loads(c["function"]["arguments"])
                    messages.append(
                        {"role": "tool", "tool_call_id": c["id"], "content": echo(**args)}
                    )
            return iterations

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(runs)))
        seconds = time.perf_counter() - t0
    return sum(done), seconds


async def fsm(
    base_url: str, runs: int, iterations: int, store: str | None, stream: bool
) -> tuple[int, float]:
    import fsm_kernel

    async with fsm_kernel.Agent(
        "default",
        base_url=base_url,
        model="fake",
        tools=[echo],
        store=store,
        stream=stream,
        max_iterations=iterations,
    ) as agent:
        agent.kernel  # noqa: B018 -- made before the clock, as raw's client is
        t0 = time.perf_counter()
        results = await asyncio.gather(*(agent.run(f"task {i}") for i in range(runs)))
        seconds = time.perf_counter() - t0
    bad = [r for r in results if r.termination_reason != "final_answer"]
    if bad:
        raise SystemExit(
            f"{len(bad)} runs ended badly, e.g. {bad[0].termination_reason}: {bad[0].error}"
        )
    return sum(r.iterations for r in results), seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode", choices=["raw", "raw_oneshot", "fsm_memory", "fsm_sqlite", "fsm_sqlite_stream"]
    )
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    # Each side's client is built before its clock starts (raw's AsyncClient, fsm-kernel's
    # agent with its model client): the clock times the runs alone, from the first request to
    # the last reply, and both pay the same first-connection imports inside it.
    import httpx  # noqa: F401

    if args.mode != "raw":
        import fsm_kernel.api  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="fsmk-conc-") as tmp:
        if args.mode.startswith("raw"):
            work = raw(args.base_url, args.runs, args.iterations, one_shot=args.mode != "raw")
        else:
            store = None if args.mode == "fsm_memory" else str(Path(tmp) / "runs.db")
            work = fsm(
                args.base_url, args.runs, args.iterations, store, args.mode.endswith("stream")
            )
        requests, seconds = asyncio.run(work)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "requests": requests, "peak_rss_mib": rss_kib / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
