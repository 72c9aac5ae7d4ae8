"""How results and progress look on the terminal."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from fsm_kernel.cli.terminal import CUT, cut
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.redact import StreamRedactor
from fsm_kernel.streaming import TextDelta

if TYPE_CHECKING:
    from fsm_kernel.kernel import RunResult

__all__ = ["CUT", "Progress", "cut", "live_output", "print_result"]


def _args(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def live_output(out: TextIO, err: TextIO) -> Progress:
    """What shows while a run goes: progress lines on `err`, and the model's text as it
    streams where a person sees it once.

    * stdout a terminal: the text streams onto it, where the answer belongs (as `llm` does);
      the answer is then not printed again (`Progress.shown`).
    * stdout a file or a pipe: it gets the whole answer once, at the end, and nothing else
      the model said (an agent's model also speaks before its tool calls); the text streams
      with the progress on stderr instead, unless stderr is stdout's own file (`2>&1`), where
      it would show twice.
    """
    if _isatty(out):
        return Progress(err, text=out, text_is_result=True)
    if _same_file(out, err):
        return Progress(err, text=None)
    return Progress(err, text=err)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or a stand-in without it
        return False


def _same_file(a: TextIO, b: TextIO) -> bool:
    """Whether two streams write to the same open file (`2>&1`)."""
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):  # no file behind one (a test's StringIO)
        return False


class Progress:
    """Prints state changes and tool calls as they happen, and the model's text as it
    streams (see `live_output`). Of child runs (workflow.call, workflow.map) it shows when
    each starts and how it ended, from the parent's events: their own steps would interleave
    (`runs show` has them). Called with every event and text delta of the runs it watches."""

    def __init__(self, stream: TextIO, *, text: TextIO | None, text_is_result: bool = False):
        self.stream = stream
        self.text = text
        self.text_is_result = text_is_result
        self.indent = "  " if text is stream else ""  # text among progress lines is indented
        self.open_on: TextIO | None = None  # the stream a line of streamed text is open on
        self.open_call: str | None = None  # the tool whose call that line shows (None: text)
        self.open_indent = ""  # how that line's continuation lines are indented
        self.held = StreamRedactor()  # a secret split between pieces is redacted whole
        self.call_text: list[str] = []  # what the latest model call streamed
        self.child_runs: set[str] = set()  # the runs it does not follow (a chat follows several)
        self.children = 0  # children still going: text streamed meanwhile is theirs

    def __call__(self, item: Event | TextDelta) -> None:
        if isinstance(item, TextDelta):
            self._text(item)
            return
        if not self._follows(item):
            return
        if item.type == EventType.MODEL_REQUESTED or _restarts(item):
            self.call_text = []
        line = _progress_line(item)
        if line is None:
            return
        self.finish()
        print(line, file=self.stream, flush=True)

    def finish(self) -> None:
        """End the line of streamed text, if one is open."""
        if self.open_on is not None:
            self.open_on.write(self.held.close().replace("\n", "\n" + self.open_indent) + "\n")
            self.open_on.flush()
        self.open_on = None

    def shown(self, response: str) -> bool:
        """Whether `response` is on stdout already: the latest model call streamed it there."""
        streamed = "".join(self.call_text).strip()
        return self.text_is_result and bool(streamed) and streamed == response.strip()

    def _text(self, delta: TextDelta) -> None:
        """The answer's text goes to `text`; a tool call being generated is progress, shown
        on the progress stream (never on stdout, never taken for the answer)."""
        if self.children:
            return
        if delta.tool_call is None:
            self.call_text.append(delta.text)
            target, indent = self.text, self.indent
        else:
            target, indent = self.stream, "  "
        if target is None:
            return
        if self.open_on is not target or self.open_call != delta.tool_call:
            self.finish()
            target.write(indent)
            self.open_on, self.open_call, self.open_indent = target, delta.tool_call, indent
        target.write(self.held.feed(delta.text).replace("\n", "\n" + indent))
        target.flush()

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


def _restarts(event: Event) -> bool:
    """The model's answer starts again (its stream broke and the request is retried)."""
    return event.type == EventType.MODEL_NOTICE and event.data.get("kind") == "stream_restarted"


def _progress_line(event: Event) -> str | None:
    """The progress line of an event, or None for events progress does not show."""
    data = event.data
    if event.type == EventType.RUN_STARTED:
        return f"run {event.run_id} ({data.get('workflow')})"
    if event.type == EventType.RUN_RESUMED:
        return f"resuming run {event.run_id} at iteration {data.get('iteration', 0)}"
    if event.type == EventType.STATE_ENTERED:
        return f"→ {event.data.get('path') or event.state}"  # research.think when nested
    if event.type == EventType.TOOL_STARTED:
        call = data["call"]
        return f"  tool {call['name']}({cut(_args(call.get('arguments')), 120)})"
    if event.type == EventType.TOOL_FINISHED and data["result"].get("is_error"):
        return f"  ✗ {data['call']['name']}: {cut(data['result']['content'], 160)}"
    if _restarts(event):
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


def print_result(
    result: RunResult, *, as_json: bool, stream: TextIO | None = None, shown: bool = False
) -> None:
    """The run's result on stdout: its answer (unless `shown`: streamed there already), the
    tool calls, how it ended; or one JSON object."""
    out = stream or sys.stdout
    if as_json:
        print(json.dumps(result.to_dict(), ensure_ascii=False), file=out)
        return
    if result.waiting_for is not None:
        _print_waiting(result, out)
        return
    if result.response and not shown:
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


def _event_wait(run_id: str, waiting: dict[str, Any]) -> tuple[str, str]:
    """What a run in a waiting state waits for (its events, its timer), and how to go on."""
    events = [str(e) for e in waiting.get("events") or ()]
    due = waiting.get("due")
    what = f"event {' | '.join(events)}" if events else "its timer"
    if events and due:
        what += f" (or its timer, due {due})"
    elif due:
        what += f" (due {due})"
    how = f"fsm-kernel signal {run_id} {events[0] if events else 'NAME'} [--data JSON]"
    if due:
        how += f"   (or, once due, fsm-kernel resume {run_id})"
    return what, how


def _print_waiting(result: RunResult, out: TextIO) -> None:
    """A suspended run: what it waits for and the command that answers."""
    waiting = result.waiting_for or {}
    call = waiting.get("tool_call")
    resume = f"fsm-kernel resume {result.run_id}"
    if waiting.get("kind") == "approval" and isinstance(call, dict):
        what = f"approval of {call.get('name')}({cut(_args(call.get('arguments')), 200)})"
        how = f"{resume} --approve   (or --reject WHY)"
    elif waiting.get("kind") == "event":
        what, how = _event_wait(result.run_id, waiting)
    else:
        what = f"input: {cut(str(waiting.get('prompt') or ''), 200)}"
        how = f"{resume} --input TEXT"
    print(f"waiting for {what} in state {waiting.get('state')}", file=out)
    print(f"answer with: {how}", file=out)
    print(f"\niterations: {result.iterations}", file=out)
    print("status: waiting", file=out)
    print(f"run id: {result.run_id}", file=out)
