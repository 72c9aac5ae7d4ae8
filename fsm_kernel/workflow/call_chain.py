"""The workflows a workflow calls (`workflow.call` / `workflow.map`), checked as a whole: each
exists and is valid, none calls back a workflow on the way to it (a cycle of files), and no
chain of calls nests deeper than MAX_CALL_DEPTH (the runtime refuses a child past it, so such a
workflow could only fail).

A depth-first walk with an explicit stack that loads each file once and remembers the longest
chain of calls below it: a chain of hundreds of files, or a diamond of many paths, costs one
load per file and never meets Python's recursion limit. A problem of the top file is reported
at the state of it that the chain starts from; a called file's own errors as they are, at
their place in that file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.children import CALL_ACTIONS
from fsm_kernel.workflow.limits import MAX_CALL_DEPTH
from fsm_kernel.workflow.loader import check_workflow, find_workflow
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["call_errors"]

_SHOWN = 4
"""Files shown at each end of a chain too long to name whole."""


def call_errors(spec: WorkflowSpec) -> list[WorkflowError]:
    """Every problem of the workflows `spec` calls, directly or through others."""
    walk = _Walk(spec)
    walk.run()
    return walk.errors


def _calls(spec: WorkflowSpec) -> Iterator[tuple[str, str]]:
    """(state id, workflow it names) of each calling state."""
    for sid, state in spec.states.items():
        if state.action in CALL_ACTIONS and state.workflow:
            yield sid, state.workflow


def _at_state(spec: WorkflowSpec, sid: str, message: str) -> WorkflowValidationError:
    where = spec.location("states", sid, "workflow") or spec.path
    return WorkflowValidationError(message, location=where)


def _chain(names: list[str]) -> str:
    if len(names) > 2 * _SHOWN + 1:
        skipped = len(names) - 2 * _SHOWN
        names = [*names[:_SHOWN], f"… ({skipped} more)", *names[-_SHOWN:]]
    return " → ".join(names)


@dataclass
class _Frame:
    """A file being walked: its calls not yet followed, and the longest chain below it."""

    path: Path
    spec: WorkflowSpec
    calls: Iterator[tuple[str, str]]
    height: int = 0
    """Calls in the longest chain that starts here (0: it calls nothing)."""
    below: Path | None = None
    """The file that chain goes through next."""


@dataclass
class _Walk:
    top: WorkflowSpec
    errors: list[WorkflowError] = field(default_factory=list)
    stack: list[_Frame] = field(default_factory=list)
    done: dict[Path, tuple[int, Path | None]] = field(default_factory=dict)
    """Each file walked to the end: the height of its longest chain, and the next file on it."""
    origin: str = ""
    """The state of the top file whose calls are being followed."""

    def run(self) -> None:
        self._push(Path(self.top.path).resolve(), self.top)
        while self.stack:
            frame = self.stack[-1]
            step = next(frame.calls, None)
            if step is None:
                self._pop()
                continue
            if len(self.stack) == 1:
                self.origin = step[0]
            self._follow(frame, *step)

    def _push(self, path: Path, spec: WorkflowSpec) -> None:
        self.stack.append(_Frame(path, spec, _calls(spec)))

    def _pop(self) -> None:
        frame = self.stack.pop()
        self.done[frame.path] = (frame.height, frame.below)
        if self.stack:
            self._count(self.stack[-1], frame.path)

    def _follow(self, frame: _Frame, sid: str, ref: str) -> None:
        """Follow the call of state `sid` of the file `frame` walks."""
        try:
            path = find_workflow(ref, relative_to=frame.spec.path)
        except WorkflowValidationError as exc:
            self.errors.append(_at_state(frame.spec, sid, exc.message))
            return
        resolved = path.resolve()
        walking = [f.path for f in self.stack]
        if resolved in walking:
            names = [p.name for p in walking[walking.index(resolved) :]] + [resolved.name]
            self.errors.append(
                _at_state(
                    self.top,
                    self.origin,
                    f"state {self.origin!r} starts a cycle of workflow calls that would never "
                    f"end: {' → '.join(names)}",
                )
            )
            return
        if resolved in self.done:
            self._count(frame, resolved)
            return
        check = check_workflow(path, import_code=False, calls=False)
        self.errors += check.errors
        if check.spec is None:
            self.done[resolved] = (0, None)
            self._count(frame, resolved)
        else:
            self._push(resolved, check.spec)

    def _count(self, frame: _Frame, child: Path) -> None:
        """`frame`'s file calls `child`, walked to the end: its chain may be the longest."""
        height = 1 + self.done[child][0]
        if height > frame.height:
            frame.height, frame.below = height, child
        if frame is self.stack[0] and height > MAX_CALL_DEPTH:
            self._too_deep(child, height)

    def _too_deep(self, child: Path, depth: int) -> None:
        names = [Path(self.top.path).name]
        at: Path | None = child
        while at is not None:
            names.append(at.name)
            at = self.done[at][1]
        self.errors.append(
            _at_state(
                self.top,
                self.origin,
                f"state {self.origin!r} starts a chain of {depth} nested workflow calls, "
                f"deeper than calls may nest (MAX_CALL_DEPTH = {MAX_CALL_DEPTH}): "
                f"{_chain(names)}",
            )
        )
