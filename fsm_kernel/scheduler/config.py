"""The scheduler's YAML configuration: the pydantic schema and a loader whose errors point at the
offending node as `path:line:col: message`.

Relative paths in the file (state_dir, the SQLite store, workflow paths) are taken as they are,
i.e. relative to the working directory of the process that uses them.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from fsm_kernel.config import default_store_location
from fsm_kernel.errors import ScheduleError, StoreLocationError
from fsm_kernel.scheduler.cron import check_cron_expression
from fsm_kernel.scheduler.queue import DEFAULT_MAX_ATTEMPTS
from fsm_kernel.store import parse_store_location
from fsm_kernel.workflow.loader import (
    StrictBoolLoader,
    YamlLimitError,
    compose_yaml,
    read_yaml_file,
)
from fsm_kernel.workflow.spec import NotifySpec

__all__ = [
    "DEFAULT_SCHEDULE",
    "DEFAULT_STATE_DIR",
    "AgentSpec",
    "SchedulerConfig",
    "load_scheduler_config",
    "parse_scheduler_config",
]

DEFAULT_SCHEDULE = "*/10 * * * *"
DEFAULT_STATE_DIR = "~/.fsm-kernel/kernel"
DEFAULT_HEARTBEAT_SECONDS = 10.0
STATE_FILE_NAME = "STATE.md"

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_Id = Annotated[str, Field(strict=True, min_length=1, max_length=128, pattern=_ID_PATTERN)]
_Seconds = Annotated[float, Field(strict=True, gt=0)]


class AgentSpec(BaseModel):
    """One agent the kernel dispatches on every tick."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_id: _Id
    """Unique within the config; also a path-safe name."""
    prompt: Annotated[str, Field(strict=True, min_length=1)]
    """The task; every `{STATE}` is replaced by the content of STATE.md."""
    workflow: Annotated[str, Field(strict=True, min_length=1)] = "default"
    """A stock workflow name or a path to a workflow YAML file."""
    priority: StrictInt = 0
    """Higher runs first when dispatches wait for a free slot."""
    enabled: StrictBool = True


class SchedulerConfig(BaseModel):
    """A persistent agent: its schedule, its STATE.md, its dispatch store and its agents."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kernel_id: _Id = "default"
    schedule: StrictStr = DEFAULT_SCHEDULE
    """Five-field cron expression, evaluated in UTC."""
    state_dir: Annotated[str, Field(strict=True, min_length=1)] = DEFAULT_STATE_DIR
    """STATE.md lives at <state_dir>/<kernel_id>/STATE.md."""
    seed_state: StrictStr | None = None
    """Written to STATE.md when the file does not exist yet; never overwrites."""
    timeout_seconds: _Seconds = 900.0
    """Wall-clock cap on one dispatch's kernel run."""
    lease_seconds: _Seconds = 1800.0
    """How long a claimed dispatch stays owned without a heartbeat: a dead worker's dispatch is
    reclaimed at most this long after its last heartbeat."""
    heartbeat_seconds: _Seconds | None = None
    """How often a running dispatch renews its lease and checks for a cancel request; at most
    half of lease_seconds. Default: a third of lease_seconds, at most 10 s."""
    max_attempts: Annotated[int, Field(strict=True, ge=1)] = DEFAULT_MAX_ATTEMPTS
    """Claims of a dispatch whose lease keeps expiring (its worker died each time) before it is
    marked failed and never claimed again."""
    poll_seconds: _Seconds = 1.0
    """How often an idle worker looks at the queue: PostgreSQL also wakes it at once (LISTEN/
    NOTIFY), SQLite only polls."""
    max_concurrent: Annotated[int, Field(strict=True, ge=1)] = 3
    """Dispatches running at once across every scheduler and worker sharing the store."""
    store: Annotated[str, Field(strict=True, min_length=1)] = Field(
        default_factory=default_store_location, validate_default=True
    )
    """A SQLite file (path ending in .db, .sqlite or .sqlite3, or a sqlite:/// URL) or a
    postgresql:// URL: the dispatch queue and the agents' event log. The default (from
    FSM_KERNEL_STORE) is checked too, so a bad one fails at load and creates no file."""
    agents: tuple[AgentSpec, ...] = ()
    notify: tuple[NotifySpec, ...] = ()
    """Webhooks told when a dispatch fails (`dispatch_failed`) and when a dispatched run ends
    or waits for a person (`ended`, `failed`, `waiting`); a failed run of a hook that also
    wants dispatch_failed is told once, as dispatch_failed."""

    def run_hooks(self) -> list[NotifySpec]:
        """The hooks a dispatched run tells itself (the dispatch tells dispatch_failed)."""
        out = []
        for hook in self.notify:
            on = [e for e in hook.on if e != "dispatch_failed"]
            if "dispatch_failed" in hook.on:
                on = [e for e in on if e != "failed"]
            if on:
                out.append(hook.model_copy(update={"on": on}))
        return out

    @field_validator("store")
    @classmethod
    def _known_store(cls, value: str) -> str:
        """Refused at load time, pointing at the line, rather than when the queue or the first
        dispatch opens it (an unknown form used to become a SQLite file of that name)."""
        try:
            parse_store_location(value)
        except StoreLocationError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("heartbeat_seconds")
    @classmethod
    def _beats_within_the_lease(cls, value: float | None, info: ValidationInfo) -> float | None:
        lease = info.data.get("lease_seconds")
        if value is not None and lease is not None and value > lease / 2:
            raise ValueError(
                f"must be at most half of lease_seconds ({lease:g} s), so that one late "
                "heartbeat does not lose the lease"
            )
        return value

    @field_validator("schedule")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        try:
            return check_cron_expression(value)
        except ScheduleError as exc:
            raise ValueError(str(exc)) from exc

    @model_validator(mode="after")
    def _unique_agent_ids(self) -> SchedulerConfig:
        seen: set[str] = set()
        for index, agent in enumerate(self.agents):
            if agent.agent_id in seen:
                raise PydanticCustomError(
                    "duplicate_agent_id",
                    "duplicate agent_id '{agent_id}'",
                    {"index": index, "agent_id": agent.agent_id},
                )
            seen.add(agent.agent_id)
        return self

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of a running dispatch."""
        if self.heartbeat_seconds is not None:
            return self.heartbeat_seconds
        return min(DEFAULT_HEARTBEAT_SECONDS, self.lease_seconds / 3)

    @property
    def state_file(self) -> Path:
        """Where this kernel's STATE.md lives (user home expanded)."""
        return Path(self.state_dir).expanduser() / self.kernel_id / STATE_FILE_NAME

    def agent(self, agent_id: str) -> AgentSpec | None:
        """The agent with that id, or None."""
        return self._agents_by_id.get(agent_id)

    @cached_property
    def _agents_by_id(self) -> dict[str, AgentSpec]:
        """Built once: a worker looks an agent up for every dispatch it claims."""
        return {a.agent_id: a for a in self.agents}


def load_scheduler_config(path: str | Path) -> SchedulerConfig:
    """Read and validate a scheduler YAML file.

    Raises:
        ScheduleError: the file cannot be read, is not YAML (or breaks a limit of the workflow
            loader's, see `compose_yaml`), or is not a valid config; str() is
            `path:line:col: message`.
    """
    try:
        text = read_yaml_file(Path(path))
    except YamlLimitError as exc:
        raise _yaml_error(exc, str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ScheduleError(f"{path}: cannot read scheduler config: {reason}") from exc
    return parse_scheduler_config(text, source=str(path))


def parse_scheduler_config(text: str, *, source: str = "<config>") -> SchedulerConfig:
    """Validate scheduler YAML given as text; errors name `source` as the file."""
    root, data = _compose(text, source)
    if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
        raise ScheduleError(f"{_where(source, root)}: the scheduler config must be a mapping")
    try:
        return SchedulerConfig.model_validate(data)
    except ValidationError as exc:
        raise _located_error(exc, root, source) from None


def _compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The node graph (for error locations) and the data, both within the YAML limits of the
    workflow loader; `off`/`no` stay strings, as in workflow files."""
    try:
        root = compose_yaml(text)
        data = StrictBoolLoader("").construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        raise _yaml_error(exc, source) from exc
    except yaml.YAMLError as exc:
        raise ScheduleError(f"{source}: invalid YAML: {exc}") from exc
    return root, data


def _yaml_error(exc: yaml.MarkedYAMLError, source: str) -> ScheduleError:
    mark = exc.problem_mark or exc.context_mark
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
    kind = "YAML limit exceeded" if isinstance(exc, YamlLimitError) else "invalid YAML"
    return ScheduleError(f"{where}: {kind}: {exc.problem or exc}")


def _located_error(exc: ValidationError, root: yaml.Node, source: str) -> ScheduleError:
    """The error that comes first in the file, as one line; the others are only counted."""
    located = sorted(
        ((_error_node(error, root), index, error) for index, error in enumerate(exc.errors())),
        key=lambda item: (item[0].start_mark.line, item[0].start_mark.column, item[1]),
    )
    node, _, first = located[0]
    field = _dotted(_error_loc(first))
    message = f"{field}: {_error_message(first)}" if field else _error_message(first)
    if len(located) > 1:
        message += f" (and {len(located) - 1} more error{'s' if len(located) > 2 else ''})"
    return ScheduleError(f"{_where(source, node)}: {message}")


def _error_node(error: ErrorDetails, root: yaml.Node) -> yaml.Node:
    return _node_at(root, _error_loc(error), key=error["type"] == "extra_forbidden")


def _error_loc(error: ErrorDetails) -> tuple[int | str, ...]:
    if error["type"] == "duplicate_agent_id":
        return ("agents", int(error.get("ctx", {})["index"]), "agent_id")
    return tuple(error["loc"])


def _error_message(error: ErrorDetails) -> str:
    if error["type"] == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if error["type"] == "extra_forbidden":
        return "unknown setting"
    return error["msg"]


def _node_at(root: yaml.Node, loc: tuple[int | str, ...], *, key: bool) -> yaml.Node:
    """The node a pydantic error location points at; the deepest existing ancestor otherwise."""
    node = root
    for depth, part in enumerate(loc):
        last = depth == len(loc) - 1
        child = _child(node, part, key=key and last)
        if child is None:
            break
        node = child
    return node


def _child(node: yaml.Node, part: int | str, *, key: bool) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(part):
                return key_node if key else value_node
    if (
        isinstance(node, yaml.SequenceNode)
        and isinstance(part, int)
        and 0 <= part < len(node.value)
    ):
        item: yaml.Node = node.value[part]
        return item
    return None


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _where(source: str, node: yaml.Node | None) -> str:
    if node is None:
        return f"{source}:1:1"
    mark = node.start_mark
    return f"{source}:{mark.line + 1}:{mark.column + 1}"
