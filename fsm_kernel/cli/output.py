"""How results and progress look on the terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.streaming import TextDelta

if TYPE_CHECKING:
    from fsm_kernel.kernel import RunResult

CUT = 200


def cut(text: str, limit: int = CUT) -> str:
    """One line, at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _args(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def progress_printer(stream: TextIO) -> Callable[[Event | TextDelta], None]:
    """Prints state changes and tool calls as they happen, and the model's text as it streams
    (on the progress stream: stdout gets the run's final answer only). Of child runs
    (workflow.call, workflow.map) it shows when each starts and how it ended, from the
    parent's events: their own steps would interleave (`runs show` has them)."""
    return _Progress(stream).show


class _Progress:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.streaming = False
        self.child_runs: set[str] = set()  # the runs it does not follow (a chat follows several)
        self.children = 0  # children still going: text streamed meanwhile is theirs

    def show(self, item: Event | TextDelta) -> None:
        if isinstance(item, TextDelta):
            self._text(item)
            return
        if not self._follows(item):
            return
        line = _progress_line(item)
        if line is None:
            return
        if self.streaming:
            self.stream.write("\n")
            self.streaming = False
        print(line, file=self.stream, flush=True)

    def _text(self, delta: TextDelta) -> None:
        if self.children:
            return
        if not self.streaming:
            self.stream.write("  ")
            self.streaming = True
        self.stream.write(delta.text.replace("\n", "\n  "))
        self.stream.flush()

    def _follows(self, event: Event) -> bool:
        """Whether the event is of a run it follows (not a child's), counting the children."""
        if event.type == EventType.CHILD_STARTED:
            self.child_runs.add(str(event.data.get("run_id")))
        if event.type == EventType.RUN_STARTED and event.data.get("parent_run_id"):
            self.child_runs.add(event.run_id)
        if event.run_id in self.child_runs:
            return False
        if event.type == EventType.CHILD_STARTED:
            self.children += 1
        elif event.type == EventType.CHILD_FINISHED:
            self.children = max(self.children - 1, 0)
        return True


def _progress_line(event: Event) -> str | None:
    """The progress line of an event, or None for events progress does not show."""
    data = event.data
    if event.type == EventType.RUN_STARTED:
        return f"run {event.run_id} ({data.get('workflow')})"
    if event.type == EventType.RUN_RESUMED:
        return f"resuming run {event.run_id} at iteration {data.get('iteration', 0)}"
    if event.type == EventType.STATE_ENTERED:
        return f"→ {event.state}"
    if event.type == EventType.TOOL_STARTED:
        call = data["call"]
        return f"  tool {call['name']}({cut(_args(call.get('arguments')), 120)})"
    if event.type == EventType.TOOL_FINISHED and data["result"].get("is_error"):
        return f"  ✗ {data['call']['name']}: {cut(data['result']['content'], 160)}"
    if event.type == EventType.MODEL_NOTICE and data.get("kind") == "stream_restarted":
        return "  (the model's answer restarts: the stream broke and the request is retried)"
    if event.type in (EventType.ACTION_FAILED, EventType.ERROR_CAUGHT):
        return _failure_line(event)
    if event.type in (EventType.CHILD_STARTED, EventType.CHILD_FINISHED):
        return _child_line(event)
    if event.type == EventType.RUN_TERMINATED:
        return f"■ {data.get('reason')}"
    return None


def _failure_line(event: Event) -> str:
    data = event.data
    if event.type == EventType.ACTION_FAILED:
        return (
            f"  ✗ {event.state} failed (attempt {data.get('attempt')}): {_error_text(data)}; "
            f"retrying in {data.get('retry_in', 0):g}s"
        )
    return f"  ✗ {event.state} failed: {_error_text(data)}; caught → {data.get('target')}"


def _child_line(event: Event) -> str:
    data = event.data
    if event.type == EventType.CHILD_STARTED:
        item = f" item {data['item'] + 1}" if "item" in data else ""
        return (
            f"  ↳ child run {data.get('run_id')}{item} ({data.get('workflow')}): "
            f"{cut(str(data.get('input') or ''), 80)}"
        )
    mark = "✓" if data.get("ok") else "✗"
    outcome = data.get("reason") or ("waiting" if data.get("waiting_for") else "not run")
    said = data.get("answer") if data.get("ok") else data.get("error") or data.get("answer")
    return f"  {mark} child run {data.get('run_id')}: {outcome}: {cut(str(said or ''), 100)}"


def _error_text(data: dict[str, Any]) -> str:
    error = data.get("error") or {}
    return cut(f"{error.get('type', 'Error')}: {error.get('message', '')}", 160)


def print_result(result: RunResult, *, as_json: bool, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    if as_json:
        print(json.dumps(result.to_dict(), ensure_ascii=False), file=out)
        return
    if result.waiting_for is not None:
        _print_waiting(result, out)
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


def _print_waiting(result: RunResult, out: TextIO) -> None:
    """A suspended run: what it waits for and the command that answers."""
    waiting = result.waiting_for or {}
    call = waiting.get("tool_call")
    resume = f"fsm-kernel resume {result.run_id}"
    if waiting.get("kind") == "approval" and isinstance(call, dict):
        what = f"approval of {call.get('name')}({cut(_args(call.get('arguments')), 200)})"
        how = f"{resume} --approve   (or --reject WHY)"
    else:
        what = f"input: {cut(str(waiting.get('prompt') or ''), 200)}"
        how = f"{resume} --input TEXT"
    print(f"waiting for {what} in state {waiting.get('state')}", file=out)
    print(f"answer with: {how}", file=out)
    print(f"\niterations: {result.iterations}", file=out)
    print("status: waiting", file=out)
    print(f"run id: {result.run_id}", file=out)
