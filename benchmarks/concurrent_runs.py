"""Concurrent runs on one PostgreSQL store: 1 run vs N runs at once, each waiting on a model that
takes DELAY seconds per reply (2 replies per run: a datetime call, then an answer).

Store appends go to a thread, so N runs should take about as long as one (the model's latency),
not N times as long. Prints the ratio; fails (exit 1) above --max-ratio.

    python benchmarks/concurrent_runs.py [--runs 50] [--delay 0.2] [--max-ratio 3]

Needs PostgreSQL (`apt-get install postgresql`); starts a throwaway cluster with the test
suite's helper (initdb + pg_ctl), or uses FSM_KERNEL_TEST_PG_DSN.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsm_kernel.kernel import Kernel  # noqa: E402
from fsm_kernel.protocol import Completion, Message, Tool, ToolCall  # noqa: E402
from fsm_kernel.store import PostgresEventStore  # noqa: E402
from fsm_kernel.tools import builtin_registry  # noqa: E402
from fsm_kernel.workflow.compiler import compile_workflow  # noqa: E402
from fsm_kernel.workflow.loader import load_workflow  # noqa: E402


class SlowModel:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        await asyncio.sleep(self.delay)
        if messages[-1].role.value == "user":
            call = ToolCall(id=uuid.uuid4().hex[:12], name="datetime", arguments={})
            return Completion(message=Message.assistant("", [call]))
        return Completion(message=Message.assistant("It is noon."))


async def timed(kernel: Kernel, runs: int) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(*(kernel.run(f"task {i}") for i in range(runs)))
    elapsed = time.perf_counter() - started
    assert all(r.termination_reason == "final_answer" for r in results)
    return elapsed


def measure(dsn: str, runs: int, delay: float) -> tuple[float, float]:
    store = PostgresEventStore(dsn)
    try:
        kernel = Kernel(
            compile_workflow(load_workflow(REPO / "workflows" / "default.yaml")),
            model=SlowModel(delay),
            tools=builtin_registry("."),
            store=store,
        )
        one = asyncio.run(timed(kernel, 1))
        many = asyncio.run(timed(kernel, runs))
    finally:
        store.close()
    return one, many


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--max-ratio", type=float, default=3.0)
    args = parser.parse_args()
    import os

    from tests.pg import _Cluster

    dsn = os.environ.get("FSM_KERNEL_TEST_PG_DSN")
    cluster = None
    if not dsn:
        cluster = _Cluster()
        dsn = cluster.start()
    try:
        one, many = measure(dsn, args.runs, args.delay)
    finally:
        if cluster is not None:
            cluster.stop()
    ratio = many / one
    print(f"1 run: {one:.2f} s; {args.runs} concurrent runs: {many:.2f} s; ratio {ratio:.2f}")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
