"""fsm-kernel: an agent runtime whose loop is an explicit finite-state machine written in YAML.

    import fsm_kernel

    result = fsm_kernel.run("default", "What time is it?", base_url="http://localhost:11434/v1")
    print(result.termination_reason, result.response)

The names below are the public API (a test pins the list). They are imported on first use, so
`import fsm_kernel` stays cheap for the CLI and for tools that only need one corner of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentError",
    "AnswerError",
    "ChatModel",
    "ConfigError",
    "EventStore",
    "FsmKernelError",
    "HumanAnswer",
    "HumanChannel",
    "IterationCompleted",
    "Question",
    "ReplayReport",
    "ResumeError",
    "RunEnded",
    "RunError",
    "RunLockedError",
    "RunNotFoundError",
    "RunResult",
    "StateEntered",
    "StoreError",
    "StreamEvent",
    "TerminationReason",
    "TextDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolError",
    "ToolExecutor",
    "ToolFatalError",
    "TransitionTaken",
    "WorkflowError",
    "WorkflowSpec",
    "__version__",
    "arun",
    "load_workflow",
    "reads",
    "run",
    "tool",
    "writes",
]

_HOME = {
    "Agent": "fsm_kernel.api",
    "IterationCompleted": "fsm_kernel.api",
    "RunEnded": "fsm_kernel.api",
    "StateEntered": "fsm_kernel.api",
    "StreamEvent": "fsm_kernel.api",
    "ToolCallFinished": "fsm_kernel.api",
    "ToolCallStarted": "fsm_kernel.api",
    "TransitionTaken": "fsm_kernel.api",
    "arun": "fsm_kernel.api",
    "run": "fsm_kernel.api",
    "TextDelta": "fsm_kernel.streaming",
    "RunResult": "fsm_kernel.kernel",
    "ReplayReport": "fsm_kernel.replay",
    "ChatModel": "fsm_kernel.protocol",
    "EventStore": "fsm_kernel.protocol",
    "ToolExecutor": "fsm_kernel.protocol",
    "TerminationReason": "fsm_kernel.workflow.spec",
    "WorkflowSpec": "fsm_kernel.workflow.spec",
    "load_workflow": "fsm_kernel.workflow.loader",
    "tool": "fsm_kernel.tools",
    "reads": "fsm_kernel.workflow.variables",
    "writes": "fsm_kernel.workflow.variables",
    "HumanAnswer": "fsm_kernel.workflow.human",
    "HumanChannel": "fsm_kernel.workflow.human",
    "Question": "fsm_kernel.workflow.human",
    **dict.fromkeys(
        (
            "AgentError",
            "AnswerError",
            "ConfigError",
            "FsmKernelError",
            "ResumeError",
            "RunError",
            "RunLockedError",
            "RunNotFoundError",
            "StoreError",
            "ToolError",
            "ToolFatalError",
            "WorkflowError",
        ),
        "fsm_kernel.errors",
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'fsm_kernel' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from fsm_kernel.api import (
        Agent,
        IterationCompleted,
        RunEnded,
        StateEntered,
        StreamEvent,
        ToolCallFinished,
        ToolCallStarted,
        TransitionTaken,
        arun,
        run,
    )
    from fsm_kernel.errors import (
        AgentError,
        AnswerError,
        ConfigError,
        FsmKernelError,
        ResumeError,
        RunError,
        RunLockedError,
        RunNotFoundError,
        StoreError,
        ToolError,
        ToolFatalError,
        WorkflowError,
    )
    from fsm_kernel.kernel import RunResult
    from fsm_kernel.protocol import ChatModel, EventStore, ToolExecutor
    from fsm_kernel.replay import ReplayReport
    from fsm_kernel.streaming import TextDelta
    from fsm_kernel.tools import tool
    from fsm_kernel.workflow.human import HumanAnswer, HumanChannel, Question
    from fsm_kernel.workflow.loader import load_workflow
    from fsm_kernel.workflow.spec import TerminationReason, WorkflowSpec
    from fsm_kernel.workflow.variables import reads, writes
