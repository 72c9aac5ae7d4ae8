"""How results and progress look on the terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from fsm_kernel.kernel import RunResult
from fsm_kernel.protocol import Event, EventType

CUT = 200


def cut(text: str, limit: int = CUT) -> str:
    """One line, at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _args(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def progress_printer(stream: TextIO) -> Callable[[Event], None]:
    """Prints state changes and tool calls as they happen."""

    def show(event: Event) -> None:
        data = event.data
        if event.type == EventType.RUN_STARTED:
            line = f"run {event.run_id} ({data.get('workflow')})"
        elif event.type == EventType.RUN_RESUMED:
            line = f"resuming run {event.run_id} at iteration {data.get('iteration', 0)}"
        elif event.type == EventType.STATE_ENTERED:
            line = f"→ {event.state}"
        elif event.type == EventType.TOOL_STARTED:
            call = data["call"]
            line = f"  tool {call['name']}({cut(_args(call.get('arguments')), 120)})"
        elif event.type == EventType.TOOL_FINISHED and data["result"].get("is_error"):
            line = f"  ✗ {data['call']['name']}: {cut(data['result']['content'], 160)}"
        elif event.type == EventType.RUN_TERMINATED:
            line = f"■ {data.get('reason')}"
        else:
            return
        print(line, file=stream, flush=True)

    return show


def print_result(result: RunResult, *, as_json: bool, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    if as_json:
        print(json.dumps(result.to_dict(), ensure_ascii=False), file=out)
        return
    if result.response:
        print(result.response, file=out)
    if result.tool_calls:
        print("\ntool calls:", file=out)
        for r in result.tool_calls:
            mark = "✗" if r.result.is_error else "✓"
            args = r.call.raw_arguments if r.call.arguments_error else r.call.arguments
            print(
                f"  {mark} [{r.iteration}] {r.call.name}({cut(_args(args), 120)}) → "
                f"{cut(r.result.content)}",
                file=out,
            )
    print(f"\niterations: {result.iterations}", file=out)
    print(f"termination: {result.termination_reason}", file=out)
    if result.error:
        print(f"error: {result.error}", file=out)
    print(f"run id: {result.run_id}", file=out)
