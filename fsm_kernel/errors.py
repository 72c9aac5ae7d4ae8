"""The one exception tree of fsm-kernel. Imports nothing from fsm_kernel.

    FsmKernelError
    ├─ ConfigError
    │  └─ StoreLocationError (a --store / FSM_KERNEL_STORE / `store:` of no known form)
    ├─ MemoryStoreError (the memory folder or a file in it cannot be read)
    ├─ WorkflowError(message, location)      str() -> "path:line:col: message"
    │  ├─ WorkflowSyntaxError                YAML that does not parse
    │  └─ WorkflowValidationError            YAML that parses but is not a valid workflow
    ├─ AgentError(message, base_url)         nothing from httpx escapes fsm_kernel.agent
    │  ├─ AgentHTTPError(status_code, body, retry_after)
    │  │  ├─ AgentAuthError (401/403)   ├─ AgentBadRequestError (other 4xx)
    │  │  ├─ AgentRateLimitError (429)  └─ AgentServerError (5xx, 408, 409)
    │  ├─ AgentTimeoutError  ├─ AgentConnectionError  └─ AgentResponseError (unusable body)
    ├─ ToolError(message, tool_name)
    │  ├─ ToolNotFoundError  ├─ ToolArgumentsError  ├─ ToolExecutionError  ├─ ToolTimeoutError
    │  └─ ToolFatalError (a handler's way to say the run cannot go on: fatal_tool_error)
    ├─ RunError(message, run_id)
    │  ├─ NoTransitionError  ├─ RunNotFoundError  ├─ ReplayDivergenceError
    │  └─ ResumeError
    │     ├─ RunLockedError (another process is running the run right now)
    │     └─ AnswerError (resume without the answer a waiting run needs, or the wrong kind)
    ├─ StoreError
    │  ├─ StoreConflictError (an event seq or a lease already taken)  └─ StoreSchemaError
    └─ ScheduleError (bad cron expression, bad scheduler config)

`retryable` on the agent errors is the only thing the client's retry loop reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = [
    "AgentAuthError",
    "AgentBadRequestError",
    "AgentConnectionError",
    "AgentError",
    "AgentHTTPError",
    "AgentRateLimitError",
    "AgentResponseError",
    "AgentServerError",
    "AgentTimeoutError",
    "AnswerError",
    "ConfigError",
    "FsmKernelError",
    "MemoryStoreError",
    "NoTransitionError",
    "ReplayDivergenceError",
    "ResumeError",
    "RunError",
    "RunLockedError",
    "RunNotFoundError",
    "ScheduleError",
    "StoreConflictError",
    "StoreError",
    "StoreLocationError",
    "StoreSchemaError",
    "ToolArgumentsError",
    "ToolError",
    "ToolExecutionError",
    "ToolFatalError",
    "ToolNotFoundError",
    "ToolTimeoutError",
    "WorkflowError",
    "WorkflowSyntaxError",
    "WorkflowValidationError",
]


class FsmKernelError(Exception):
    """Base of every error fsm-kernel raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for the event log: the type, the message and the public attributes."""
        attrs = {
            k: v
            for k, v in vars(self).items()
            if not k.startswith("_") and isinstance(v, str | int | float | bool | type(None))
        }
        return {"type": type(self).__name__, **attrs, "message": str(self)}

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (the scheduler's workers): keep the attributes.
        return (_rebuild, (type(self), dict(vars(self))))


def _rebuild(cls: type[FsmKernelError], state: dict[str, Any]) -> FsmKernelError:
    err = cls.__new__(cls)
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


class ConfigError(FsmKernelError):
    """A setting, flag or environment variable has an unusable value."""


class StoreLocationError(ConfigError):
    """A store location that names no backend; a ConfigError, as it is a bad setting and not a
    failing store, so nothing is created and the CLI exits 2."""


class MemoryStoreError(FsmKernelError):
    """The memory folder or one of its files cannot be read."""


class ScheduleError(FsmKernelError):
    """A scheduler configuration or cron expression is invalid."""


class WorkflowError(FsmKernelError):
    """A workflow file is wrong; `location` says where. A check that found several problems
    raises the first (in file order) with all of them in `errors`."""

    def __init__(
        self, message: str, *, location: Any = None, errors: Sequence[WorkflowError] = ()
    ) -> None:
        super().__init__(message)
        self.location = location
        self._errors = tuple(errors)

    @property
    def errors(self) -> list[WorkflowError]:
        """Every problem found, in file order (this one alone when it was raised by itself)."""
        return list(self._errors) or [self]

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "message": str(self)}


class WorkflowSyntaxError(WorkflowError):
    """The file is not valid YAML."""


class WorkflowValidationError(WorkflowError):
    """The file is YAML but not a valid workflow."""


class AgentError(FsmKernelError):
    """The model server could not give a usable answer."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, base_url: str = "") -> None:
        super().__init__(message)
        self.base_url = base_url


class AgentHTTPError(AgentError):
    """The server answered with an error status."""

    def __init__(
        self,
        message: str,
        *,
        base_url: str = "",
        status_code: int,
        body: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, base_url=base_url)
        self.status_code = status_code
        self.body = body
        self.retry_after = retry_after


class AgentAuthError(AgentHTTPError):
    """401 or 403: the API key is missing or wrong."""


class AgentBadRequestError(AgentHTTPError):
    """A 4xx that retrying will not fix (400, 404, 422, ...)."""


class AgentRateLimitError(AgentHTTPError):
    """429: slow down; `retry_after` says for how long when the server told."""

    retryable = True


class AgentServerError(AgentHTTPError):
    """5xx, 408 or 409: the server failed; a retry may work."""

    retryable = True


class AgentTimeoutError(AgentError):
    """No answer within the timeout."""

    retryable = True


class AgentConnectionError(AgentError):
    """The server could not be reached."""

    retryable = True


class AgentResponseError(AgentError):
    """The server answered 200 with a body that is not a chat completion."""


class ToolError(FsmKernelError):
    """A tool call could not produce a result. Sent back to the model, never a crash."""

    def __init__(self, message: str, *, tool_name: str = "") -> None:
        super().__init__(message)
        self.tool_name = tool_name


class ToolNotFoundError(ToolError):
    """The model named a tool that is not registered or not offered."""


class ToolArgumentsError(ToolError):
    """The arguments do not match the tool's schema."""


class ToolExecutionError(ToolError):
    """The tool's handler raised."""


class ToolTimeoutError(ToolError):
    """The tool did not finish within its timeout."""


class ToolFatalError(ToolError):
    """Raised by a tool handler when the run cannot continue (ends it as fatal_tool_error)."""


class RunError(FsmKernelError):
    """A run could not proceed."""

    def __init__(self, message: str, *, run_id: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id


class NoTransitionError(RunError):
    """No transition out of the current state had its guards pass."""


class RunNotFoundError(RunError):
    """No run with that id is in the store."""


class ResumeError(RunError):
    """A run cannot be resumed (finished already, workflow changed, ...)."""


class RunLockedError(ResumeError):
    """Another holder (a process, or another task of this one) has the run's lock: two
    processes appending to one run would collide on its next seq."""


class AnswerError(ResumeError):
    """`resume` of a run that waits for a person without the answer it waits for, with the
    wrong kind of answer, or with an answer for a run that waits for none (a usage error)."""


class ReplayDivergenceError(RunError):
    """A replay took a different transition than the recorded run."""


class StoreError(FsmKernelError):
    """The event or dispatch store failed."""


class StoreConflictError(StoreError):
    """The (run_id, seq) slot or the lease is already taken."""


class StoreSchemaError(StoreError):
    """The database schema is newer than this code or otherwise unusable."""
