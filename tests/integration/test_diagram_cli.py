"""`fsm-kernel diagram` through its own argparse registration: stdout, files, a recorded run from a
real SQLite store, and --all."""

from __future__ import annotations

import argparse
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.cli import diagram_cmd
from fsm_kernel.diagram import to_dot, to_mermaid
from fsm_kernel.errors import ConfigError, RunNotFoundError, WorkflowError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store.sqlite import SqliteEventStore
from fsm_kernel.workflow.loader import load_workflow
from fsm_kernel.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
HAS_DOT = shutil.which("dot") is not None
RUN_ID = "0190f00d-0000-7000-8000-000000000001"
T0 = datetime(2025, 1, 2, tzinfo=UTC)

needs_dot = pytest.mark.skipif(not HAS_DOT, reason="the dot program is not installed")


def diagram(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="fsm-kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    diagram_cmd.register(sub)
    args = parser.parse_args(["diagram", *argv])
    code: int = args.handler(args)
    return code


@pytest.fixture(scope="module")
def default() -> WorkflowSpec:
    return load_workflow(DEFAULT)


def run_events(spec: WorkflowSpec, path: list[int], reason: str, **started: Any) -> list[Event]:
    """A run as the kernel records it: started, the initial state, transitions, terminated."""
    events: list[Event] = []
    state: str | None = spec.initial

    def add(type_: EventType, **data: Any) -> None:
        events.append(
            Event(
                run_id=RUN_ID, seq=len(events) + 1, type=type_, timestamp=T0, state=state, data=data
            )
        )

    add(
        EventType.RUN_STARTED,
        workflow=spec.name,
        workflow_path=str(DEFAULT),
        workflow_hash=spec.content_hash,
        goal="what time is it",
        **started,
    )
    add(EventType.STATE_ENTERED)
    for index in path:
        t = spec.transitions[index]
        add(
            EventType.TRANSITION_TAKEN,
            index=index,
            source=t.source,
            target=t.target,
            guard=t.label(),
            reason=t.reason,
        )
        state = t.target
        if not spec.states[t.target].final:
            add(EventType.STATE_ENTERED)
    add(EventType.RUN_TERMINATED, reason=reason, answer="noon", iterations=2)
    return events


@pytest.fixture
def store(tmp_path: Path, default: WorkflowSpec) -> Path:
    path = tmp_path / "runs.db"
    with SqliteEventStore(path) as s:
        s.append(run_events(default, [0, 1, 5, 11, 0, 1, 5, 6], "done"))
    return path


def test_dot_to_stdout_by_stock_name(
    capsys: pytest.CaptureFixture[str], default: WorkflowSpec
) -> None:
    assert diagram("default") == 0
    out = capsys.readouterr().out
    assert out == to_dot(default)
    assert out.startswith("digraph default {")


def test_mermaid_to_stdout_and_to_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default: WorkflowSpec
) -> None:
    assert diagram(str(DEFAULT), "--format", "mermaid") == 0
    assert capsys.readouterr().out == to_mermaid(default)
    target = tmp_path / "out" / "default.mmd"
    assert diagram("default", "-o", str(target)) == 0
    assert target.read_text(encoding="utf-8").startswith("stateDiagram-v2\n")
    assert capsys.readouterr().out == f"{target}\n"


def test_dot_file_from_suffix(tmp_path: Path, default: WorkflowSpec) -> None:
    assert diagram("default", "-o", str(tmp_path / "d.gv")) == 0
    assert (tmp_path / "d.gv").read_text(encoding="utf-8") == to_dot(default)


@needs_dot
def test_svg_file(tmp_path: Path) -> None:
    assert diagram("default", "-o", str(tmp_path / "default.svg")) == 0
    svg = (tmp_path / "default.svg").read_text(encoding="utf-8")
    assert "<svg" in svg
    assert "observe" in svg


def test_svg_without_dot_program_names_the_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as err:
        diagram("default", "-o", str(tmp_path / "default.svg"))
    assert str(err.value) == (
        "the 'dot' program is needed for svg/png: apt-get install graphviz "
        "(or brew install graphviz); dot and mermaid output need nothing"
    )
    assert not (tmp_path / "default.svg").exists()


def test_binary_format_needs_an_output_file() -> None:
    with pytest.raises(ConfigError, match=r"png is a binary format: give -o FILE.png"):
        diagram("default", "--format", "png")


def test_unknown_suffix_needs_format(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot tell the format"):
        diagram("default", "-o", str(tmp_path / "x.txt"))


def test_unknown_workflow_is_a_workflow_error() -> None:
    with pytest.raises(WorkflowError, match="no such workflow file or stock workflow"):
        diagram("no_such_workflow")


def test_nothing_to_draw() -> None:
    with pytest.raises(ConfigError, match="give a WORKFLOW"):
        diagram()


def test_run_overlay_from_sqlite_store(
    capsys: pytest.CaptureFixture[str], store: Path, default: WorkflowSpec
) -> None:
    assert diagram("default", "--run", RUN_ID[:8], "--store", str(store)) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "observe  ×2" in captured.out
    assert "7. [done_called] → done  ×1  ■ ended here" in captured.out
    assert f"run {RUN_ID}: done after 8 transitions" in captured.out
    assert captured.out != to_dot(default)


def test_run_overlay_uses_the_store_from_the_environment(
    capsys: pytest.CaptureFixture[str], store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSM_KERNEL_STORE", str(store))
    assert diagram("--run", RUN_ID, "--format", "mermaid") == 0  # the run's own workflow
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2\n")
    assert "    evaluate --> terminate : 7. [done_called] → done ×1 ■ ended here" in out


def test_run_of_another_workflow_warns(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default: WorkflowSpec
) -> None:
    path = tmp_path / "runs.db"
    events = run_events(default, [0], "timeout")
    events[0] = Event(
        run_id=RUN_ID,
        seq=1,
        type=EventType.RUN_STARTED,
        timestamp=T0,
        data={"workflow": "react", "workflow_hash": "x", "goal": "g"},
    )
    with SqliteEventStore(path) as s:
        s.append(events)
    assert diagram("default", "--run", RUN_ID, "--store", str(path)) == 0
    err = capsys.readouterr().err
    assert err == f"warning: run {RUN_ID} is of workflow 'react', not 'default'\n"


def test_unknown_run(store: Path) -> None:
    with pytest.raises(RunNotFoundError):
        diagram("default", "--run", "ffff", "--store", str(store))


def copy_workflows(folder: Path) -> Path:
    folder.mkdir()
    text = DEFAULT.read_text(encoding="utf-8")
    (folder / "default.yaml").write_text(text, encoding="utf-8")
    (folder / "other.yaml").write_text(
        text.replace("name: default", "name: other"), encoding="utf-8"
    )
    (folder / "notes.txt").write_text("not a workflow", encoding="utf-8")
    return folder


@needs_dot
def test_all_writes_dot_and_svg(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, default: WorkflowSpec
) -> None:
    src = copy_workflows(tmp_path / "wf")
    out = tmp_path / "diagrams"
    assert diagram("--all", str(src), "-o", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "default.dot",
        "default.svg",
        "other.dot",
        "other.svg",
    ]
    assert (out / "default.dot").read_text(encoding="utf-8") == to_dot(default)
    assert "<svg" in (out / "other.svg").read_text(encoding="utf-8")
    assert capsys.readouterr().out.splitlines() == [
        str(out / n) for n in ("default.dot", "default.svg", "other.dot", "other.svg")
    ]


def test_all_without_dot_writes_dot_and_warns(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    src = copy_workflows(tmp_path / "wf")
    out = tmp_path / "diagrams"
    assert diagram("--all", str(src), "-o", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["default.dot", "other.dot"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("warning: writing .dot only; the 'dot' program is needed")


def test_all_with_a_broken_workflow_writes_nothing(tmp_path: Path) -> None:
    src = copy_workflows(tmp_path / "wf")
    (src / "broken.yaml").write_text("name: broken\ninitial: nowhere\n", encoding="utf-8")
    out = tmp_path / "diagrams"
    with pytest.raises(WorkflowError, match=r"broken\.yaml"):
        diagram("--all", str(src), "-o", str(out))
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--all", "workflows"], "--all DIR needs -o OUTDIR"),
        (["default", "--all", "workflows", "-o", "x"], "drop WORKFLOW and --run"),
        (["--all", "workflows", "-o", "x", "--format", "svg"], "drop --format"),
        (["--all", "no/such/dir", "-o", "x"], "not a folder"),
    ],
)
def test_all_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        diagram(*argv)


def test_all_on_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no \*\.yaml workflow files"):
        diagram("--all", str(tmp_path), "-o", str(tmp_path / "out"))
