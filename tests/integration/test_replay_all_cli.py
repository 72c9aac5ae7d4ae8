"""`fsm-kernel replay --all` and `fsm-kernel runs coverage` on real SQLite stores filled by real
runs (`fsm-kernel run` against the fake OpenAI server over loopback): a stock workflow's runs
replay identically under the text they recorded; an edit to a guard that changes a recorded
decision is reported with its run and step (exit 1); runs that cannot be replayed are counted
with why; child runs are replayed within their parent; coverage adds up edges, reasons and
tokens, and draws them as heat with the real `dot`."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import Outcome
from tests.clikit import cli as _cli_of
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

REPO = Path(__file__).resolve().parents[2]
CHILDREN = REPO / "tests" / "data" / "children"
THINK_TO_ACT = "{source: think,    target: act,       guard: has_tool_calls}"


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> Outcome:
    """`fsm-kernel ARGS...` in process, paths given as they are."""
    return _cli_of(capsys, [str(a) for a in args])


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _run(
    capsys: pytest.CaptureFixture[str],
    server: FakeOpenAIServer,
    workflow: Path,
    store: Path,
    prompt: str,
) -> str:
    done = cli(capsys, "run", workflow, "-p", prompt, "--base-url", server.base_url,
               "--model", "m", "--store", store, "--max-retries", "0", "--json")  # fmt: skip
    assert done.code == 0, done.out + done.err
    return str(done.json()["run_id"])


def _react_runs(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> tuple[Path, Path, str, str]:
    """A copy of the stock react workflow and two runs of it: one that calls a tool (datetime)
    and one that answers at once. Returns (workflow, store, tool run, answer run)."""
    workflow, store = tmp_path / "react.yaml", tmp_path / "runs.db"
    shutil.copy(REPO / "workflows" / "react.yaml", workflow)
    server.enqueue(
        text_reply("I need the time."),
        tool_reply(call("datetime", {})),
        text_reply("Now I have it."),
        text_reply("It is noon."),
        text_reply("It is noon."),
    )
    tool_run = _run(capsys, server, workflow, store, "What time is it?")
    server.enqueue(text_reply("Easy."), text_reply("4"), text_reply("4"))
    answer_run = _run(capsys, server, workflow, store, "What is 2+2?")
    return workflow, store, tool_run, answer_run


def _edited(workflow: Path, tmp_path: Path) -> Path:
    """react, edited so that think goes to act only when `done` was called too: a tool call
    now goes to answer instead (the decision the tool run recorded at step 2 changes)."""
    edited = tmp_path / "edited.yaml"
    text = workflow.read_text()
    assert THINK_TO_ACT in text
    edited.write_text(
        text.replace("guard: has_tool_calls}", "guard: [has_tool_calls, done_called]}")
    )
    return edited


def _replay_all(capsys: pytest.CaptureFixture[str], store: Path, *flags: str | Path) -> Outcome:
    return cli(capsys, "replay", "--all", "--store", store, *flags)


# -- replay --all ------------------------------------------------------------------------------


def test_stored_runs_replay_identically_under_the_definition_they_recorded(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, _, _ = _react_runs(capsys, server, tmp_path)
    workflow.write_text(_edited(workflow, tmp_path).read_text())  # the file changed since

    text = _replay_all(capsys, store)
    data = _replay_all(capsys, store, "--json").json()

    assert text.code == 0, text.out + text.err
    assert text.out == (
        "2 runs replayed: 2 identical, 0 diverged, 0 unreplayable; no model or tool called\n"
    )
    assert (data["runs"], data["identical"], data["diverged"], data["unreplayable"]) == (2, 2, 0, 0)
    assert data["reported"] == []


def test_replay_all_catches_a_real_regression(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, tool_run, _ = _react_runs(capsys, server, tmp_path)
    edited = _edited(workflow, tmp_path)

    text = _replay_all(capsys, store, "--workflow", edited)
    data = _replay_all(capsys, store, "--workflow", edited, "--json")

    # With the checks each step tried recorded (transition.taken's `tried`), the guard the
    # edit added is named; a log without them names the two transitions alone.
    decided_by = (
        "done_called: false on edge 2 → act (the recorded run did not check it)"
        if _records_tried(store, tool_run)
        else "recorded think → act [has_tool_calls], replayed think → answer (no checks "
        "recorded to compare)"
    )
    by_check = f"; decided by {decided_by}" if "(no checks" not in decided_by else ""
    assert text.code == 1, text.out + text.err
    assert text.out.splitlines() == [
        f"≠ {tool_run} (react): diverged at step 2 (iteration 2): recorded think → act "
        f"[has_tool_calls], replay took think → answer{by_check}",
        "2 runs replayed: 1 identical, 1 diverged, 0 unreplayable; no model or tool called",
    ]
    assert data.code == 1
    summary = data.json()
    assert (summary["identical"], summary["diverged"]) == (1, 1)
    (reported,) = summary["reported"]
    divergence = reported["divergence"]
    assert (reported["run_id"], reported["outcome"]) == (tool_run, "diverged")
    assert (divergence["run_id"], divergence["step"]) == (tool_run, 2)
    assert divergence["recorded"] == "think → act [has_tool_calls]"
    assert divergence["replayed"] == "think → answer"
    assert divergence["decided_by"] == decided_by


def _records_tried(store: Path, run_id: str) -> bool:
    with SqliteEventStore(store) as events:
        taken = [e for e in events.read(run_id) if e.type == EventType.TRANSITION_TAKEN]
    return "tried" in taken[0].data


def test_the_unedited_file_is_no_regression(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, _, _ = _react_runs(capsys, server, tmp_path)

    same = _replay_all(capsys, store, "--workflow", workflow)

    assert same.code == 0, same.out + same.err
    assert same.out.startswith("2 runs replayed: 2 identical, 0 diverged")


def test_workflow_picks_only_the_runs_of_that_workflow(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, _, _ = _react_runs(capsys, server, tmp_path)
    other = tmp_path / "single_shot.yaml"
    shutil.copy(REPO / "workflows" / "single_shot.yaml", other)
    server.enqueue(text_reply("hello"))
    _run(capsys, server, other, store, "Say hello.")

    of_react = _replay_all(capsys, store, "--workflow", _edited(workflow, tmp_path), "--json")
    of_nothing_stored = _replay_all(capsys, store, "--workflow", REPO / "workflows/reflect.yaml")
    every = _replay_all(capsys, store, "--json").json()

    assert of_react.json()["runs"] == 2
    assert of_nothing_stored.code == 0
    assert of_nothing_stored.out == "no stored runs of workflow reflect to replay\n"
    assert every["runs"] == 3


def test_a_child_run_is_replayed_within_its_parent_and_not_counted_twice(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    for name in ("delegate.yaml", "step.yaml"):
        shutil.copy(CHILDREN / name, tmp_path / name)
    store = tmp_path / "runs.db"
    server.enqueue(text_reply("a tree is planted"))
    parent = _run(capsys, server, tmp_path / "delegate.yaml", store, "plant a tree")
    step = tmp_path / "step.yaml"
    edited_step = tmp_path / "step_edited.yaml"
    edited_step.write_text(
        step.read_text().replace("target: terminate, reason: final_answer", "target: answer")
    )

    every = _replay_all(capsys, store, "--json")
    children = _replay_all(capsys, store, "--workflow", edited_step)

    assert every.code == 0, every.out + every.err
    summary = every.json()
    assert (summary["runs"], summary["identical"], summary["child_runs"]) == (1, 1, 1)
    with SqliteEventStore(store) as events:
        (child,) = [r.run_id for r in events.list_runs() if r.parent_run_id == parent]
    assert children.code == 1
    assert children.out.splitlines()[0].startswith(
        f"≠ {child} (step): diverged at step 1 (iteration 1): recorded answer → terminate → "
        "final_answer, replay took answer → answer"
    )


def test_runs_that_cannot_be_replayed_are_counted_with_why(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, tool_run, answer_run = _react_runs(capsys, server, tmp_path)
    with sqlite3.connect(store) as db:  # as an older fsm-kernel wrote them: no text
        db.execute(
            "UPDATE events SET data = json_remove(data, '$.workflow_text') "
            "WHERE type = 'run.started'"
        )
    workflow.write_text(_edited(workflow, tmp_path).read_text())
    running = _running_run(store)
    try:
        text = _replay_all(capsys, store)
    finally:
        running.kill()
        running.communicate()  # reaped, its pipe closed

    assert text.code == 0, text.out + text.err  # nothing diverged
    lines = text.out.splitlines()
    assert lines[0] == (
        "? running-run (react): unreplayable: still running (a process drives it now): replay "
        "it once it ends"
    )
    for line, run_id in zip(lines[1:3], (answer_run, tool_run), strict=True):
        assert line.startswith(
            f"? {run_id} (react): unreplayable: run {run_id} recorded no workflow text and its "
            f"file {workflow} changed since (sha256 "
        )
        assert line.endswith("): replay it with --workflow")
    assert lines[3] == (
        "3 runs replayed: 0 identical, 0 diverged, 3 unreplayable; no model or tool called"
    )


def _running_run(store: Path) -> subprocess.Popen[str]:
    """A run of react recorded as started, whose lock another process holds (it runs)."""
    events = SqliteEventStore(store)
    first = events.read(events.list_runs(limit=1)[0].run_id)[0]
    newest = first.timestamp.replace(year=first.timestamp.year + 1)
    started = Event(
        run_id="running-run", seq=1, type=EventType.RUN_STARTED, timestamp=newest, data=first.data
    )
    events.append([started])
    events.close()
    holder = (
        "import sys, time\n"
        "from fsm_kernel.store import SqliteEventStore\n"
        "with SqliteEventStore(sys.argv[1]) as s, s.lock_run('running-run'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(store)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_since_leaves_out_older_runs(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    _, store, tool_run, _ = _react_runs(capsys, server, tmp_path)
    with sqlite3.connect(store) as db:
        db.execute("UPDATE runs SET started_at = '2020-01-01T00:00:00+00:00' WHERE run_id = ?",
                   (tool_run,))  # fmt: skip

    recent = _replay_all(capsys, store, "--since", "1d", "--json").json()
    every = _replay_all(capsys, store, "--json").json()

    assert (recent["runs"], every["runs"]) == (1, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "--all", "some-run"], "give RUN_ID or --all, not both"),
        (["replay"], "give a RUN_ID, or --all for every stored run"),
        (["replay", "some-run", "--since", "1d"], "--since goes with --all"),
        (["replay", "--all", "--since", "yesterday"], "'yesterday' is not a duration"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    store = tmp_path / "runs.db"
    SqliteEventStore(store).close()

    refused = cli(capsys, *args, "--store", store)

    assert refused.code == 2
    assert message in refused.err


def test_a_broken_edited_file_is_bad_input(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    _, store, _, _ = _react_runs(capsys, server, tmp_path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\ninitial: a\nstates:\n  a: {action: agent.think\n")

    refused = _replay_all(capsys, store, "--workflow", broken)

    assert refused.code == 2
    assert refused.out == ""
    assert f"{broken}:" in refused.err


# -- runs coverage -----------------------------------------------------------------------------


def test_coverage_counts_edges_reasons_and_tokens_over_the_stored_runs(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, _, _ = _react_runs(capsys, server, tmp_path)

    text = cli(capsys, "runs", "coverage", workflow, "--store", store)
    data = cli(capsys, "runs", "coverage", workflow, "--store", store, "--format", "json").json()

    assert text.code == 0, text.err
    taken = {e["index"]: e["taken"] for e in data["edges"] if e["taken"]}
    # reason → think ×3 (two runs, one looped), think → act ×1, think → answer ×2,
    # act → evaluate ×1, evaluate → reason ×1, answer → terminate ×2
    assert taken == {0: 3, 1: 1, 4: 2, 5: 1, 11: 1, 12: 2}
    assert data["never_taken"] == [2, 3, 6, 7, 8, 9, 10]
    assert data["reasons"] == {"final_answer": 2}
    assert data["runs"] == 2
    # the fake server reports 15 tokens per answer (10 prompt + 5 completion)
    assert data["tokens"] == {"reason": 45, "think": 45, "answer": 30}
    lines = text.out.splitlines()
    assert lines[0] == "workflow react, 2 runs: 6 of 13 edges taken (46%)"
    assert "       ×3  reason → think" in lines
    never = lines.index("never taken:")
    assert lines[never + 1] == (
        "           think → think  3. [malformed_output and not retries_exhausted]"
    )
    assert "       2  final_answer" in lines


def test_coverage_svg_draws_the_heat_with_dot(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    if shutil.which("dot") is None:
        pytest.skip("needs Graphviz's dot")
    workflow, store, _, _ = _react_runs(capsys, server, tmp_path)
    out = tmp_path / "heat.svg"

    drawn = cli(capsys, "runs", "coverage", workflow, "--store", store, "--format", "svg",
                "-o", out)  # fmt: skip

    assert drawn.code == 0, drawn.err
    svg = out.read_text()
    assert svg.startswith("<?xml")
    assert "2 runs: final_answer 2" in svg
    assert 'stroke="#dc2626"' in svg  # the edges taken most: reason → think ×3
    assert "45 tokens" in svg


def test_coverage_since_and_a_workflow_without_runs(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow, store, tool_run, _ = _react_runs(capsys, server, tmp_path)
    with sqlite3.connect(store) as db:
        db.execute("UPDATE runs SET started_at = '2020-01-01T00:00:00+00:00' WHERE run_id = ?",
                   (tool_run,))  # fmt: skip

    recent = cli(capsys, "runs", "coverage", workflow, "--store", store, "--since", "7d",
                 "--format", "json").json()  # fmt: skip
    none = cli(capsys, "runs", "coverage", "reflect", "--store", store)

    assert recent["runs"] == 1
    assert recent["reasons"] == {"final_answer": 1}
    assert none.code == 0
    assert none.out == "no stored runs of workflow reflect\n"
