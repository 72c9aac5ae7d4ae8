"""Child runs end to end, through the CLI against the fake server over loopback: a
`workflow.call` state answers with its child's answer, a `workflow.map` of 10 items never has
more than `max_concurrency` children asking the server at once (the server counts), a crash
inside a child is finished by a resume of the parent without repeating the child's completed
steps, replay covers parent and children, `runs show` prints the tree, and children spend the
parent's budget."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    Reply,
    call,
    hang,
    http_error,
    text_reply,
    tool_reply,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "children"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(stream_style=None) as fake:
        yield fake


def _last_user(request: dict[str, Any]) -> str:
    users = [m for m in request["messages"] if m["role"] == "user"]
    return str(users[-1]["content"])


def steps_server(steps: list[str], *, delay: float = 0.0, failing: str | None = None) -> Any:
    """A reply for every request of a fanout run: the plan (the request asking for JSON), each
    step's answer (after `delay`; a 400 for the step named `failing`), the summary."""

    def answer(request: dict[str, Any]) -> Reply:
        if "response_format" in request:
            return text_reply(json.dumps({"steps": steps}))
        last = _last_user(request)
        if last.startswith("Step "):
            step = last.rsplit(": ", 1)[-1]
            if step == failing:
                return http_error(400)
            return hang(delay, text_reply(f"did {step}"))
        return text_reply("summary of the steps")

    return answer


def run_cli(capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, *args: Any) -> Any:
    return cli(capsys, *args, "--base-url", server.base_url, "--model", "m", "--max-retries", "0")


def test_call_answers_with_its_child_and_links_it(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(text_reply("the child's answer"))

    done = run_cli(
        capsys, server, "run", DATA / "delegate.yaml", "-p", "plant a tree", "--store", store,
        "--json",
    )  # fmt: skip

    assert done.code == 0, done.err
    result = done.json()
    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "the child's answer"
    assert _last_user(server.requests[0]) == "Please do: plant a tree"
    with SqliteEventStore(store) as events:
        runs = {r.run_id: r for r in events.list_runs()}
        parent = runs[result["run_id"]]
        (child,) = [r for r in runs.values() if r.run_id != parent.run_id]
        log = events.read(parent.run_id)
    assert parent.parent_run_id is None
    assert child.parent_run_id == parent.run_id
    assert child.workflow == "step"
    started = [e.data for e in log if e.type is EventType.CHILD_STARTED]
    finished = [e.data for e in log if e.type is EventType.CHILD_FINISHED]
    assert started == [
        {"run_id": child.run_id, "workflow": "step.yaml", "input": "Please do: plant a tree"}
    ]
    assert finished[0]["reason"] == "final_answer"
    assert finished[0]["ok"] is True
    types = [e.type for e in log]
    assert types.index(EventType.CHILD_STARTED) < types.index(EventType.CHILD_FINISHED)

    shown = cli(capsys, "runs", "show", parent.run_id, "--store", store)
    assert f"└─ {child.run_id}  step  final_answer  the child's answer" in shown.out
    child_shown = cli(capsys, "runs", "show", child.run_id, "--store", store)
    assert f"child of: {parent.run_id}" in child_shown.out
    listed = cli(capsys, "runs", "list", "--store", store)
    lines = listed.out.splitlines()[1:]
    assert lines[0].startswith(parent.run_id)
    assert lines[1].startswith(child.run_id)
    assert "↳ step" in lines[1]
    top = cli(capsys, "runs", "list", "--top-level", "--store", store)
    assert child.run_id not in top.out
    assert parent.run_id in top.out

    replayed = cli(capsys, "replay", parent.run_id, "--store", store, "--json")
    assert replayed.code == 0, replayed.out
    report = replayed.json()
    assert report["identical"] is True
    assert [c["run_id"] for c in report["children"]] == [child.run_id]


def test_a_failed_child_routes_the_parent(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(http_error(400))

    done = run_cli(
        capsys, server, "run", DATA / "delegate.yaml", "-p", "x", "--store", tmp_path / "r.db",
        "--json",
    )  # fmt: skip

    assert done.code == 1
    assert done.json()["termination_reason"] == "delegation_failed"


def test_a_map_of_ten_items_runs_at_most_three_children_at_once(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "runs.db"
    steps = [f"s{i}" for i in range(1, 11)]
    server.enqueue(*[steps_server(steps, delay=0.3)] * 12)

    done = run_cli(
        capsys, server, "run", DATA / "fanout.yaml", "-p", "build", "--store", store, "--json"
    )

    assert done.code == 0, done.err
    assert server.peak_in_flight == 3  # max_concurrency: 3, and 10 items do fill it
    summary_request = server.requests[-1]
    results = summary_request["messages"][-2]["content"]
    assert results.startswith("The workflow 'step.yaml' ran once per item (10 items):")
    expected = [f"{i}. Step {i} of the task build: s{i}\n   → did s{i}" for i in range(1, 11)]
    assert results.split("\n", 1)[1] == "\n".join(expected)  # item order, whatever the timing
    result = done.json()
    with SqliteEventStore(store) as events:
        log = events.read(result["run_id"])
        children = [r for r in events.list_runs() if r.parent_run_id == result["run_id"]]
    assert len(children) == 10
    started = [e.data["item"] for e in log if e.type is EventType.CHILD_STARTED]
    assert started == list(range(10))
    types = [e.type for e in log if e.type.value.startswith("child.")]
    assert types == [EventType.CHILD_STARTED] * 10 + [EventType.CHILD_FINISHED] * 10
    # the children's usage is the parent's too: plan + summary + 10 children, 10+5 tokens each
    assert result["usage"]["total_tokens"] == 12 * 15

    replayed = cli(capsys, "replay", result["run_id"], "--store", store, "--json").json()
    assert replayed["identical"] is True
    assert len(replayed["children"]) == 10


def test_one_failed_item_does_not_cancel_the_others_unless_fail_fast(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    steps = ["a", "b", "c", "d"]
    server.enqueue(*[steps_server(steps, delay=0.2, failing="a")] * 5)

    done = run_cli(
        capsys, server, "run", DATA / "fanout.yaml", "-p", "go", "--store", tmp_path / "1.db",
        "--json",
    )  # fmt: skip

    assert done.json()["termination_reason"] == "steps_failed"
    assert sorted(_last_user(r) for r in server.requests[1:]) == [
        f"Step {i} of the task go: {s}" for i, s in enumerate(steps, 1)
    ]  # every item ran

    fail_fast = tmp_path / "fail_fast.yaml"
    fail_fast.write_text(
        (DATA / "fanout.yaml")
        .read_text()
        .replace("max_concurrency: 3", "max_concurrency: 1\n    fail_fast: true")
        .replace("workflow: step.yaml", f"workflow: {DATA / 'step.yaml'}")
    )
    with FakeOpenAIServer(stream_style=None) as second:
        second.enqueue(*[steps_server(steps, failing="a")] * 2)
        quick = run_cli(
            capsys, second, "run", fail_fast, "-p", "go", "--store", tmp_path / "2.db", "--json"
        )
        assert [_last_user(r) for r in second.requests[1:]] == ["Step 1 of the task go: a"]
    assert quick.json()["termination_reason"] == "steps_failed"
    with SqliteEventStore(tmp_path / "2.db") as events:
        log = events.read(quick.json()["run_id"])
    finished = [e.data for e in log if e.type is EventType.CHILD_FINISHED]
    assert [f["ok"] for f in finished] == [False] * 4
    assert all("fail_fast" in f["error"] for f in finished[1:])


def test_children_spend_the_parents_iteration_budget(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    # a child that keeps calling tools, 20 iterations
    default_variant(tmp_path, "looping", cap=("max_iterations: 10", "max_iterations: 20"))
    parent = delegating_to(
        tmp_path, "looping.yaml", "limits:\n  max_iterations: 3\n  timeout_seconds: 45\n"
    )
    server.enqueue(
        *[tool_reply(call("datetime", {}, id=f"c{i}"), call("datetime", {"x": i}, id=f"d{i}"))
          for i in range(3)]
    )  # fmt: skip

    done = run_cli(
        capsys, server, "run", parent, "-p", "go", "--store", tmp_path / "r.db", "--json"
    )

    assert len(server.requests) == 3  # the child got what the parent had left: 3 model calls
    assert done.json()["termination_reason"] == "delegation_failed"
    with SqliteEventStore(tmp_path / "r.db") as events:
        child = next(r for r in events.list_runs() if r.parent_run_id)
        started = events.read(child.run_id)[0].data
    assert started["limits"]["max_iterations"] == 3
    assert 0 < started["limits"]["timeout_seconds"] <= 45  # what the parent had left, not 600
    assert child.termination_reason == "max_iterations"


def test_the_children_of_a_map_share_the_parents_remaining_iterations(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    # three children at once, each calling tools until a cap stops it (its own is 20)
    default_variant(tmp_path, "looping", cap=("max_iterations: 10", "max_iterations: 20"))
    parent = tmp_path / "fanout.yaml"
    parent.write_text(
        (DATA / "fanout.yaml")
        .read_text()
        .replace("workflow: step.yaml", "workflow: looping.yaml")
        .replace("max_iterations: 30", "max_iterations: 7")
    )
    made = iter(range(1000))

    def reply(request: dict[str, Any]) -> Reply:
        if "response_format" in request:
            return text_reply(json.dumps({"steps": ["a", "b", "c"]}))
        n = next(made)
        return tool_reply(call("datetime", {}, id=f"c{n}"), call("datetime", {"x": n}, id=f"d{n}"))

    server.enqueue(*[reply] * 40)

    done = run_cli(
        capsys, server, "run", parent, "-p", "go", "--store", tmp_path / "r.db", "--json"
    )

    # the plan, then the 6 calls left for all three children together (not 6 each: 19)
    assert len(server.requests) == 7
    assert done.json()["termination_reason"] == "steps_failed"
    with SqliteEventStore(tmp_path / "r.db") as events:
        log = events.read(done.json()["run_id"])
    finished = [e.data for e in log if e.type is EventType.CHILD_FINISHED]
    assert sum(f["iterations"] for f in finished) == 6
    assert log[-1].data["child_iterations"] == 6  # the parent's ending: 1 call + 6 of theirs
    assert (done.json()["iterations"], done.json()["child_iterations"]) == (1, 6)
    assert {f["reason"] for f in finished} == {"max_iterations"}
    refused = [
        f for f in finished if "the children of a workflow.map share them" in (f.get("error") or "")
    ]
    assert len(refused) >= 2  # whichever child ran dry of the pool, not of its own cap
    assert "the 6 model call(s) its parent had left are spent" in refused[0]["error"]
    replayed = cli(capsys, "replay", done.json()["run_id"], "--store", tmp_path / "r.db",
                   "--json").json()  # fmt: skip
    assert [c["identical"] for c in replayed["children"]] == [True] * 3
    assert replayed["identical"] is True


BLOCKING = '''
import os, time


def slow(tag: str) -> str:
    """Note the call, then wait while the marker file exists.

    Args:
        tag: a label
    """
    with open(os.environ["CR_MARKS"], "a") as f:
        f.write(tag + "\\n")
    while os.path.exists(os.environ["CR_BLOCK"]):
        time.sleep(0.05)
    return f"done {tag}"
'''

DEFAULT_TOOLS = "tools: [datetime, read_file, list_directory, done]"


def default_variant(
    tmp_path: Path, name: str, tools: str = DEFAULT_TOOLS, **swaps: tuple[str, str]
) -> Path:
    """tmp_path/NAME.yaml: the stock default workflow named NAME, offering `tools` (a `tools:`
    line), with each further `old=new` text swap made."""
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", f"name: {name}").replace(DEFAULT_TOOLS, tools)
    for old, new in swaps.values():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def delegating_to(tmp_path: Path, child: str, extra: str = "") -> Path:
    """tmp_path/parent.yaml: delegate.yaml handing the task to `child` (a file in tmp_path)."""
    parent = tmp_path / "parent.yaml"
    text = (DATA / "delegate.yaml").read_text().replace("workflow: step.yaml", f"workflow: {child}")
    parent.write_text(text + extra)
    return parent


def blocking_env(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """The environment of a run whose `blocking:slow` tool notes each call in the first path
    and waits while the second exists (created here)."""
    (tmp_path / "blocking.py").write_text(BLOCKING)
    marks, block = tmp_path / "marks.txt", tmp_path / "block"
    block.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
           "CR_MARKS": str(marks), "CR_BLOCK": str(block)}  # fmt: skip
    return env, marks, block


def kill_once_marked(command: list[str], env: dict[str, str], marks: Path) -> None:
    """Start `command` and SIGKILL it once its blocking tool has started (`marks` exists)."""
    first = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marks.exists():
            assert time.monotonic() < deadline, "the blocking tool never started"
            assert first.poll() is None, "the run ended before it was killed"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait(timeout=10)


def test_a_crash_inside_a_child_is_finished_by_resuming_the_parent(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    default_variant(tmp_path, "child", "tools: ['blocking:slow']")
    parent = delegating_to(tmp_path, "child.yaml")
    env, marks, block = blocking_env(tmp_path)
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(call("slow", {"tag": "one"}, id="t1")))
    base = [sys.executable, "-m", "fsm_kernel"]
    flags = ["--base-url", server.base_url, "--model", "m", "--store", str(store), "--json"]
    kill_once_marked([*base, "run", str(parent), "-p", "go", *flags], env, marks)
    with SqliteEventStore(store) as events:
        runs = events.list_runs()
    (top,) = [r for r in runs if r.parent_run_id is None]
    (kid,) = [r for r in runs if r.parent_run_id == top.run_id]
    assert top.status == "interrupted"  # killed: no process drives them
    assert kid.status == "interrupted"

    block.unlink()
    server.enqueue(text_reply("finished after the crash"))
    done = subprocess.run(
        [*base, "resume", top.run_id, "--store", str(store), "--json"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["response"] == "finished after the crash"
    assert len(server.requests) == 2  # the child's first reply came from its log
    assert marks.read_text().split() == ["one", "one"]  # the interrupted call, run again
    with SqliteEventStore(store) as events:
        kid_log = events.read(kid.run_id)
        top_log = events.read(top.run_id)
        assert events.list_runs(limit=5)[0].run_id in (top.run_id, kid.run_id)
        assert len(events.list_runs()) == 2  # no new child: the recorded one was resumed
    assert sum(1 for e in kid_log if e.type is EventType.RUN_RESUMED) == 1
    assert sum(1 for e in top_log if e.type is EventType.CHILD_STARTED) == 1
    assert top_log[-1].data["reason"] == "final_answer"

    replayed = subprocess.run(
        [*base, "replay", top.run_id, "--store", str(store), "--json"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert json.loads(replayed.stdout)["identical"] is True, replayed.stdout


def test_validate_rejects_a_cycle_of_calls(capsys: pytest.CaptureFixture[str]) -> None:
    refused = cli(capsys, "validate", DATA / "cycle_a.yaml")

    assert refused.code == 2
    assert refused.err.strip().endswith(
        "state 'call' starts a cycle of workflow calls that would never end: "
        "cycle_a.yaml → cycle_b.yaml → cycle_a.yaml"
    )
    assert f"{DATA / 'cycle_a.yaml'}:5:" in refused.err


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("{action: workflow.call}", "state 'call' runs workflow.call but names no workflow"),
        (
            "{action: workflow.map, workflow: step.yaml}",
            "state 'call' runs workflow.map but says nothing of its items",
        ),
        (
            "{action: workflow.call, workflow: step.yaml, items: output}",
            "'items' does nothing on state 'call': only a workflow.map state uses it",
        ),
        (
            "{action: kernel.evaluate, workflow: step.yaml}",
            "'workflow' does nothing on state 'call': only a workflow.call or workflow.map",
        ),
        (
            "{action: workflow.call, workflow: step.yaml, input: '{goals}'}",
            "input of state 'call' names 'goals', which the run does not have",
        ),
        (
            "{action: workflow.call, workflow: step.yaml, input: '{item}'}",
            "input of state 'call' names 'item'",
        ),
        (
            "{action: workflow.map, workflow: step.yaml, items: item}",
            "items of state 'call' names 'item'",
        ),
        ("{action: workflow.call, workflow: nowhere.yaml}", "nowhere.yaml: no such workflow"),
    ],
)
def test_call_states_are_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, state: str, message: str
) -> None:
    (tmp_path / "step.yaml").write_text((DATA / "step.yaml").read_text())
    workflow = tmp_path / "w.yaml"
    workflow.write_text((DATA / "cycle_a.yaml").read_text().replace(
        "{action: workflow.call, workflow: cycle_b.yaml}", state
    ))  # fmt: skip

    refused = cli(capsys, "validate", workflow)

    assert refused.code == 2
    assert message in refused.err
    assert f"{workflow}:5:" in refused.err


def test_a_child_that_waits_for_a_person_makes_its_parent_wait(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    default_variant(tmp_path, "careful", "tools: [{name: datetime, approval: required}]")
    parent = delegating_to(tmp_path, "careful.yaml")
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(call("datetime", {}, id="t1")))

    waiting = run_cli(capsys, server, "run", parent, "-p", "what time?", "--store", store, "--json")

    assert waiting.code == 3, waiting.err
    result = waiting.json()
    assert result["status"] == "waiting"
    with SqliteEventStore(store) as events:
        kid = next(r for r in events.list_runs() if r.parent_run_id)
    assert kid.status == "waiting"
    assert result["waiting_for"]["child_run_id"] == kid.run_id
    assert result["waiting_for"]["tool_call"]["name"] == "datetime"
    listed = cli(capsys, "runs", "list", "--waiting", "--top-level", "--store", store)
    assert result["run_id"] in listed.out
    assert kid.run_id not in listed.out

    server.enqueue(text_reply("It is noon."))
    done = cli(
        capsys, "resume", result["run_id"], "--approve", "--by", "ann", "--store", store, "--json"
    )

    assert done.code == 0, done.err
    assert done.json()["response"] == "It is noon."
    with SqliteEventStore(store) as events:
        kid_log = events.read(kid.run_id)
        assert {r.status for r in events.list_runs()} == {"ended"}
    answered = [e.data for e in kid_log if e.type is EventType.HUMAN_ANSWERED]
    assert answered[0]["approved"] is True
    assert answered[0]["by"] == "ann"
    tool = next(e.data for e in kid_log if e.type is EventType.TOOL_FINISHED)
    assert tool["result"]["is_error"] is False

    replayed = cli(capsys, "replay", result["run_id"], "--store", store, "--json").json()
    assert replayed["identical"] is True


def test_diagrams_draw_a_calling_state_and_expand_what_it_calls(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plain = cli(capsys, "diagram", DATA / "fanout.yaml")
    assert plain.code == 0
    work = next(line for line in plain.out.splitlines() if line.strip().startswith("work ["))
    assert 'fillcolor="#eaf2fc"' in work
    assert "⇢ step.yaml × output.steps, 3 at once" in work
    assert "cluster_work__" not in plain.out

    expanded = cli(capsys, "diagram", DATA / "fanout.yaml", "--expand")
    assert "subgraph cluster_work__ {" in expanded.out
    assert "step (once per item)" in expanded.out
    assert "work__answer -> work__terminate" in expanded.out
    assert "work -> work__answer [arrowhead=empty" in expanded.out

    nested = tmp_path / "outer.yaml"  # a call of a workflow that maps: clusters nest
    nested.write_text((DATA / "delegate.yaml").read_text().replace(
        "workflow: step.yaml", f"workflow: {DATA / 'fanout.yaml'}"
    ))  # fmt: skip
    deep = cli(capsys, "diagram", nested, "--expand", "-o", tmp_path / "outer.svg")
    assert deep.code == 0, deep.err
    svg = (tmp_path / "outer.svg").read_text()
    assert "hand_over__work__answer" in svg
    assert "fanout (as a child run)" in svg

    refused = cli(capsys, "diagram", DATA / "fanout.yaml", "--expand", "--format", "mermaid")
    assert refused.code == 2
    assert "--expand draws dot, svg or png, not mermaid" in refused.err


def test_progress_shows_each_child_once_started_and_once_ended(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    steps = ["a", "b"]
    server.enqueue(*[steps_server(steps)] * 4)

    done = run_cli(
        capsys, server, "run", DATA / "fanout.yaml", "-p", "go", "--store", tmp_path / "r.db"
    )

    assert done.code == 0, done.err
    lines = done.err.splitlines()
    started = [line for line in lines if line.startswith("  ↳ child run ")]
    ended = [line for line in lines if line.startswith("  ✓ child run ")]
    assert [line.split(" item ")[1] for line in started] == [
        "1 (step.yaml): Step 1 of the task go: a",
        "2 (step.yaml): Step 2 of the task go: b",
    ]
    assert sorted(line.rsplit(": ", 1)[1] for line in ended) == ["did a", "did b"]
    assert sum(1 for line in lines if line.startswith("run ")) == 1  # the children's own: not shown
    assert "  did a" not in lines  # nor their streamed text
    assert done.out.startswith("summary of the steps\n")


def test_a_resumed_parent_keeps_the_ending_its_child_had(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    """A child that ended agent_error (which a direct resume could reopen) stays ended when its
    parent is resumed: the parent already went on with that outcome."""
    parent = tmp_path / "after.yaml"
    parent.write_text(
        "name: after\n"
        "tools: ['blocking:slow']\n"
        "initial: hand_over\n"
        "states:\n"
        f"  hand_over: {{action: workflow.call, workflow: {DATA / 'step.yaml'}}}\n"
        "  work: {action: agent.think}\n"
        "  act: {action: tools.execute}\n"
        "  terminate: {final: true}\n"
        "transitions:\n"
        "  - {source: hand_over, target: work, guard: child_failed}\n"  # goes on after a failure
        "  - {source: hand_over, target: work}\n"
        "  - {source: work, target: act, guard: has_tool_calls}\n"
        "  - {source: work, target: terminate, reason: final_answer}\n"
        "  - {source: act, target: work}\n"
    )
    env, marks, block = blocking_env(tmp_path)
    store = tmp_path / "runs.db"
    server.enqueue(http_error(500), tool_reply(call("slow", {"tag": "t"}, id="t1")))
    base = [sys.executable, "-m", "fsm_kernel"]
    flags = ["--base-url", server.base_url, "--model", "m", "--store", str(store), "--json",
             "--max-retries", "0"]  # fmt: skip
    kill_once_marked([*base, "run", str(parent), "-p", "go", *flags], env, marks)
    with SqliteEventStore(store) as events:
        kid = next(r for r in events.list_runs() if r.parent_run_id)
        top = next(r for r in events.list_runs() if r.parent_run_id is None)
    assert kid.termination_reason == "agent_error"

    block.unlink()
    server.enqueue(text_reply("done despite the helper"))
    done = subprocess.run(
        [*base, "resume", top.run_id, "--store", str(store), "--json"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert len(server.requests) == 3  # the child was not asked again
    with SqliteEventStore(store) as events:
        kid_log = events.read(kid.run_id)
    assert not any(e.type is EventType.RUN_RESUMED for e in kid_log)


def test_a_child_asks_its_parents_server_unless_its_workflow_names_its_own(
    capsys: pytest.CaptureFixture[str],
    server: FakeOpenAIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child's own `agent:` keys win over the settings it inherits (flags, environment), and
    the parent's API key never goes to a server of another origin."""
    monkeypatch.setenv("FSM_KERNEL_API_KEY", "sk-parent-key-0123456789")
    with FakeOpenAIServer(stream_style=None) as own:
        child = tmp_path / "own.yaml"
        child.write_text(
            (DATA / "step.yaml").read_text().replace(
                "name: step\n", f"name: own\nagent: {{base_url: '{own.base_url}', model: x}}\n"
            )
        )  # fmt: skip
        parent = tmp_path / "parent.yaml"
        parent.write_text(
            (DATA / "fanout.yaml").read_text().replace("workflow: step.yaml", "workflow: own.yaml")
            .replace("max_concurrency: 3", "max_concurrency: 1")
        )  # fmt: skip

        def plan(request: dict[str, Any]) -> Any:
            return text_reply(json.dumps({"steps": ["a"]}))

        server.enqueue(plan, text_reply("summary"))
        own.enqueue(text_reply("did a on my own server"))
        seen: list[Any] = []

        async def go() -> Any:
            from fsm_kernel import Agent

            store = str(tmp_path / "r.db")
            options = {"base_url": server.base_url, "model": "m", "store": store}
            async with Agent(parent, on_event=seen.append, **options) as agent:
                return await agent.run("go")

        result = asyncio.run(go())

        assert result.response == "summary", result.messages[-1].content
        assert len(own.requests) == 1  # the child's own server
        assert own.requests[0]["model"] == "x"
        assert "authorization" not in own.request_headers[0]
        assert len(server.requests) == 2  # the parent's plan and summary only
        assert server.request_headers[0]["authorization"] == "Bearer sk-parent-key-0123456789"
    started = [e for e in seen if getattr(e, "type", None) is EventType.RUN_STARTED]
    assert [e.data.get("parent_run_id") for e in started] == [None, result.run_id]
