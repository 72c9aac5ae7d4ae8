"""The scheduler config: defaults, the example file, `path:line:col: message` errors, the YAML
limits it shares with the workflow loader, and the `store:` forms."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsm_kernel.errors import ScheduleError
from fsm_kernel.scheduler import load_scheduler_config, parse_scheduler_config
from fsm_kernel.workflow.loader import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "scheduler.yaml"
ALIAS_BOMB = REPO / "tests" / "data" / "yaml_alias_bomb.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sched.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSM_KERNEL_STORE", "/somewhere/runs.db")
    config = parse_scheduler_config("agents: []\n")
    assert config.kernel_id == "default"
    assert config.schedule == "*/10 * * * *"
    assert config.state_dir == "~/.fsm-kernel/kernel"
    assert config.seed_state is None
    assert (config.timeout_seconds, config.lease_seconds, config.max_concurrent) == (900, 1800, 3)
    assert (config.max_attempts, config.poll_seconds, config.heartbeat_seconds) == (3, 1.0, None)
    assert config.heartbeat_interval == 10.0  # a third of the lease, at most 10 s
    assert config.store == "/somewhere/runs.db"
    assert config.state_file == Path.home() / ".fsm-kernel" / "kernel" / "default" / "STATE.md"


def test_heartbeat_interval_follows_the_lease_unless_set() -> None:
    assert parse_scheduler_config("lease_seconds: 6\n").heartbeat_interval == 2.0
    assert parse_scheduler_config("lease_seconds: 600\n").heartbeat_interval == 10.0
    explicit = parse_scheduler_config("lease_seconds: 60\nheartbeat_seconds: 30\n")
    assert explicit.heartbeat_interval == 30.0
    config = parse_scheduler_config("max_attempts: 1\npoll_seconds: 0.25\n")
    assert (config.max_attempts, config.poll_seconds) == (1, 0.25)


def test_store_default_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSM_KERNEL_STORE")
    assert parse_scheduler_config("{}").store == ".fsm-kernel/runs.db"


def test_the_example_config_loads() -> None:
    config = load_scheduler_config(EXAMPLE)
    assert config.kernel_id == "research"
    assert len(config.agents) == 3
    assert {a.workflow for a in config.agents} == {"default"}
    assert all("{STATE}" in a.prompt for a in config.agents)
    assert [a.enabled for a in config.agents] == [True, True, False]
    assert (config.max_attempts, config.lease_seconds, config.heartbeat_interval) == (3, 1800, 10)
    assert config.seed_state is not None
    assert config.seed_state.startswith("# STATE")


def test_agents_and_lookup(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "kernel_id: inner-brain\n"
        "state_dir: /tmp/kernels\n"
        "agents:\n"
        "  - agent_id: pooda\n"
        "    prompt: 'go {STATE}'\n"
        "    workflow: workflows/react.yaml\n"
        "    priority: 10\n"
        "  - {agent_id: quiet, prompt: p, enabled: false}\n",
    )
    config = load_scheduler_config(path)
    pooda = config.agent("pooda")
    assert pooda is not None
    assert (pooda.workflow, pooda.priority, pooda.enabled) == ("workflows/react.yaml", 10, True)
    quiet = config.agent("quiet")
    assert quiet is not None
    assert (quiet.workflow, quiet.priority, quiet.enabled) == ("default", 0, False)
    assert config.agent("nobody") is None
    assert config.state_file == Path("/tmp/kernels/inner-brain/STATE.md")


BAD = [
    (
        "schedule: '*/10 * * *'\n",
        1,
        11,
        "schedule: cron expression '*/10 * * *' must have 5 fields",
    ),
    ("schedule: '61 * * * *'\n", 1, 11, "schedule: invalid cron expression '61 * * * *'"),
    ("schedule: 'H * * * *'\n", 1, 11, "hashed (H) forms are not supported"),
    ("kernel_id: x\nagent: []\n", 2, 1, "agent: unknown setting"),
    ("max_concurrent: 0\n", 1, 17, "max_concurrent: Input should be greater than or equal to 1"),
    ("max_attempts: 0\n", 1, 15, "max_attempts: Input should be greater than or equal to 1"),
    ("max_attempts: 2.5\n", 1, 15, "max_attempts: Input should be a valid integer"),
    ("poll_seconds: 0\n", 1, 15, "poll_seconds: Input should be greater than 0"),
    (
        "lease_seconds: 60\nheartbeat_seconds: 31\n",
        2,
        20,
        "heartbeat_seconds: must be at most half of lease_seconds (60 s)",
    ),
    ("heartbeat_seconds: -1\n", 1, 20, "heartbeat_seconds: Input should be greater than 0"),
    ("timeout_seconds: soon\n", 1, 18, "timeout_seconds: Input should be a valid number"),
    ("kernel_id: 'a/b'\n", 1, 12, "kernel_id: String should match pattern"),
    (
        "agents:\n  - agent_id: a\n    prompt: p\n"
        "  - agent_id: b\n    prompt: p\n    priority: hi\n",
        6,
        15,
        "agents[1].priority: Input should be a valid integer",
    ),
    ("agents:\n  - agent_id: a\n    enabled: 'yes'\n", 2, 5, "agents[0].prompt: Field required"),
    (
        "agents:\n  - {agent_id: a, prompt: p}\n  - {agent_id: b, prompt: p}\n"
        "  - {agent_id: a, prompt: q}\n",
        4,
        16,
        "agents[2].agent_id: duplicate agent_id 'a'",
    ),
    ("agents:\n  - {agent_id: a, prompt: p, colour: red}\n", 2, 30, "agents[0].colour: unknown"),
    (
        "agents:\n  - {agent_id: a, prompt: p, enabled: 'yes'}\n",
        2,
        39,
        "agents[0].enabled: Input should be a valid boolean",
    ),
    ("agents: 5\n", 1, 9, "agents: Input should be a valid tuple"),
    ("kernel_id: [unclosed\n", 2, 1, "invalid YAML"),
    ("- just\n- a list\n", 1, 1, "the scheduler config must be a mapping"),
    ("", 1, 1, "the scheduler config must be a mapping"),
    ("store: mysql://fsm:hunter2@db/runs\n", 1, 8, "store: unsupported store location 'mysql://…'"),
    ("store: 'host=db password=hunter2'\n", 1, 8, "store: unsupported store location (a keyword"),
    ("kernel_id: k\nstore: runs\n", 2, 8, "store: unsupported store location 'runs': use a path"),
    ("store: sqlite://runs.db\n", 1, 8, "store: unsupported store location 'sqlite://…'"),
]


@pytest.mark.parametrize(("text", "line", "col", "fragment"), BAD)
def test_invalid_config_gives_path_line_col(
    tmp_path: Path, text: str, line: int, col: int, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ScheduleError) as err:
        load_scheduler_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}:{col}: "), message
    assert fragment in message


def test_several_errors_are_summarised_on_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "max_concurrent: 0\nlease_seconds: -1\ncolour: red\n")
    with pytest.raises(ScheduleError) as err:
        load_scheduler_config(path)
    assert re.fullmatch(rf"{re.escape(str(path))}:1:17: .* \(and 2 more errors\)", str(err.value))


def test_an_unreadable_file_is_a_schedule_error(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"missing\.yaml: cannot read scheduler config"):
        load_scheduler_config(tmp_path / "missing.yaml")


def test_a_refused_store_never_shows_its_password(tmp_path: Path) -> None:
    for store in ("mysql://fsm:hunter2@db/runs", "host=db password=hunter2", "x password=hunter2"):
        path = write(tmp_path, f"store: '{store}'\n")
        with pytest.raises(ScheduleError) as err:
            load_scheduler_config(path)
        assert "hunter2" not in str(err.value)
        assert "sqlite:///relative/path.db" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sched.yaml"]


def test_a_bad_store_from_the_environment_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSM_KERNEL_STORE", "host=db password=hunter2")
    with pytest.raises(ScheduleError) as err:
        parse_scheduler_config("agents: []\n", source="s.yaml")
    assert str(err.value).startswith("s.yaml:1:1: store: unsupported store location (a keyword")
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    "store",
    ["runs.db", "kernel.sqlite3", "sqlite:///state/runs.data", "postgresql://fsm:pw@db/runs"],
)
def test_accepted_store_forms(store: str) -> None:
    assert parse_scheduler_config(f"store: '{store}'\n").store == store


DEPTH = f"nesting deeper than {MAX_YAML_DEPTH} levels"
# name -> (file text or None for the alias bomb file, line, col, message)
LIMITS: dict[str, tuple[str | None, int, int, str]] = {
    "alias_bomb": (None, 5, 8, f"more than {MAX_YAML_NODES} nodes once aliases are expanded"),
    # The scanner, which reads ahead of the composer, stops at the 65th bracket.
    "deep_flow": ("agents: " + "[" * 100_000, 1, 9 + MAX_YAML_DEPTH, DEPTH),
    "deep_block": ("- " * 100_000 + "x\n", 1, 2 * MAX_YAML_DEPTH + 1, DEPTH),
    "too_big": ("#" * (MAX_YAML_BYTES + 1), 1, 1, f"file larger than {MAX_YAML_BYTES} bytes"),
}


@pytest.mark.parametrize(("name", "case"), sorted(LIMITS.items()))
def test_yaml_limits_of_the_workflow_loader_apply(
    tmp_path: Path, name: str, case: tuple[str | None, int, int, str]
) -> None:
    text, line, col, message = case
    path = ALIAS_BOMB if text is None else write(tmp_path, text)

    with pytest.raises(ScheduleError) as err:
        load_scheduler_config(path)

    assert str(err.value) == f"{path}:{line}:{col}: YAML limit exceeded: {message}"


def test_a_small_anchor_reused_in_the_config_still_loads() -> None:
    config = parse_scheduler_config(
        "agents:\n  - {agent_id: a, prompt: &p 'look at {STATE}'}\n  - {agent_id: b, prompt: *p}\n"
    )
    assert [a.prompt for a in config.agents] == ["look at {STATE}"] * 2
