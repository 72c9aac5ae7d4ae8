"""The live ChildRunner's own decisions, on real SQLite logs: what a parent reads of a child
that ended or waits (`_from_log`), and which settings a child inherits (`_inherited`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel.bootstrap import RunOptions, load_spec
from fsm_kernel.child_runs import LiveChildren, _from_log
from fsm_kernel.protocol import Completion, Event, EventType, Message, Tool, ToolCall, Usage
from fsm_kernel.replay import RecordedRun
from fsm_kernel.store import SqliteEventStore

ENDS_WELL = """name: ends_well
tools: []
reasons:
  shipped: {success: true}
initial: answer
states:
  answer: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: answer, target: terminate, reason: shipped}
"""


class Counting:
    """A model that answers `replies` in turn, each with 10 + 5 tokens."""

    def __init__(self, *replies: Message) -> None:
        self.replies = list(replies)

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **options: Any
    ) -> Completion:
        usage = Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)
        return Completion(message=self.replies.pop(0), usage=usage)


def test_a_child_that_ended_is_read_back_with_its_own_success_reasons(tmp_path: Path) -> None:
    flow = tmp_path / "ends_well.yaml"
    flow.write_text(ENDS_WELL)
    store = tmp_path / "runs.db"
    done = fsm_kernel.run(flow, "go", chat_model=Counting(Message.assistant("shipped it")),
                          store=str(store))  # fmt: skip

    with SqliteEventStore(store) as events:
        child = _from_log(RecordedRun.load(events, done.run_id), load_spec(str(flow)))

    assert (child.run_id, child.workflow, child.reason, child.ok) == (
        done.run_id, "ends_well", "shipped", True
    )  # fmt: skip
    assert (child.answer, child.iterations, child.error, child.waiting_for) == (
        "shipped it", 1, None, None
    )  # fmt: skip
    assert child.usage == Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)


def test_a_child_that_ended_spends_its_calls_from_its_maps_pool_when_read_back(
    tmp_path: Path,
) -> None:
    """A resumed parent meets its map's children again: one that ended is read from its log,
    and its model calls count against the calls the map's children share, as they did."""
    import asyncio

    from fsm_kernel.workflow.children import CallPool, ChildRequest, draw_on

    flow = tmp_path / "ends_well.yaml"
    flow.write_text(ENDS_WELL)
    store = tmp_path / "runs.db"

    async def a_child_of_a_map() -> Any:
        draw_on(CallPool(9))
        model = Counting(Message.assistant("shipped it"))
        async with fsm_kernel.Agent(flow, chat_model=model, store=str(store)) as agent:
            return await agent.run("go")

    done = asyncio.run(a_child_of_a_map())
    with SqliteEventStore(store) as events:
        ending = events.read(done.run_id)[-1].data
    assert (ending["iterations"], ending["shared_calls"]) == (1, 1)
    assert "child_iterations" not in ending  # it had no children
    pool = CallPool(5)
    request = ChildRequest(run_id=done.run_id, parent_run_id="parent", workflow=str(flow),
                           caller=str(flow), prompt="go")  # fmt: skip

    async def in_a_map() -> Any:
        draw_on(pool)
        with SqliteEventStore(store) as events:
            runner = LiveChildren(RunOptions(), store=events, parent_model=Counting())
            return await runner.run(request)

    child = asyncio.run(in_a_map())

    assert (child.reason, child.iterations) == ("shipped", 1)
    assert pool.spent == 1


def test_a_child_that_waits_is_read_back_waiting(tmp_path: Path) -> None:
    store = tmp_path / "runs.db"
    ask = Message.assistant("", [ToolCall(id="t1", name="read_file", arguments={"path": "x"})])
    waiting = fsm_kernel.run("approve_tools", "go", chat_model=Counting(ask), store=str(store),
                             workspace=str(tmp_path))  # fmt: skip
    assert waiting.status == "waiting"

    with SqliteEventStore(store) as events:
        child = _from_log(RecordedRun.load(events, waiting.run_id), load_spec("approve_tools"))

    assert (child.reason, child.ok, child.answer) == (None, False, "")
    assert child.waiting_for is not None
    assert child.waiting_for["tool_call"]["name"] == "read_file"
    assert child.usage.total_tokens == 15


@pytest.mark.parametrize(
    ("own", "kept", "cleared", "dropped"),
    [
        ({"model": "x"}, {"base_url", "api_key"}, {"model"}, {"FSM_KERNEL_MODEL"}),
        (
            {"base_url": "http://other:2/v1"},
            {"model"},
            {"base_url", "api_key"},
            {"FSM_KERNEL_BASE_URL", "FSM_KERNEL_API_KEY", "OPENAI_API_KEY"},
        ),
        ({"base_url": "http://parent:1/elsewhere"}, {"model", "api_key"}, {"base_url"},
         {"FSM_KERNEL_BASE_URL"}),
        ({"max_retries": 0, "stream": False}, {"model", "base_url", "api_key"},
         {"max_retries", "stream"}, {"FSM_KERNEL_MAX_RETRIES", "FSM_KERNEL_STREAM"}),
    ],
)  # fmt: skip
def test_a_childs_own_agent_keys_win_and_the_key_stays_with_its_origin(
    own: dict[str, Any],
    kept: set[str],
    cleared: set[str],
    dropped: set[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {"FSM_KERNEL_BASE_URL", "FSM_KERNEL_MODEL", "FSM_KERNEL_API_KEY", "OPENAI_API_KEY",
             "FSM_KERNEL_MAX_RETRIES", "FSM_KERNEL_STREAM"}  # fmt: skip
    for name in names:
        monkeypatch.setenv(name, "1")
    options = RunOptions(base_url="http://parent:1/v1", model="m", api_key="k", max_retries=3,
                         stream=True)  # fmt: skip
    runner = LiveChildren(options, store=None, parent_model=Counting(),
                          parent_base_url="http://parent:1/v1")  # fmt: skip

    inherited, environ = runner._inherited(own, runner.options)

    assert {k for k in ("model", "base_url", "api_key") if getattr(inherited, k) is not None} == (
        kept & {"model", "base_url", "api_key"}
    )
    assert all(getattr(inherited, k) is None for k in cleared)
    assert names - set(environ) == dropped


def test_children_use_the_agents_own_model_and_its_person(tmp_path: Path) -> None:
    """An Agent's `chat_model` and `human` serve its runs' children too: no server is asked,
    and a child's approval goes to the person instead of suspending the run."""
    import asyncio

    from fsm_kernel.testing import ScriptedHuman
    from fsm_kernel.workflow.human import HumanAnswer
    from tests.integration.test_child_runs import default_variant, delegating_to

    default_variant(tmp_path, "careful", "tools: [{name: datetime, approval: required}]")
    parent = delegating_to(tmp_path, "careful.yaml")
    model = Counting(
        Message.assistant("", [ToolCall(id="t1", name="datetime", arguments={})]),
        Message.assistant("It is noon."),
    )
    person = ScriptedHuman([HumanAnswer.approve(by="ann")])

    async def go() -> Any:
        async with fsm_kernel.Agent(parent, chat_model=model, human=person) as agent:
            return await agent.run("what time?")

    result = asyncio.run(go())

    assert (result.termination_reason, result.response) == ("final_answer", "It is noon.")
    assert [q.tool_call.name for q in person.questions if q.tool_call] == ["datetime"]
    assert model.replies == []


def test_a_child_reports_its_own_model_calls_and_its_childrens() -> None:
    """What a parent counts against its `max_iterations`: a child's calls and those of the
    child's own children, live and as read back from a log."""
    from fsm_kernel.kernel import RunResult

    live = RunResult(run_id="c", workflow="w", termination_reason="final_answer", response="",
                     iterations=2, child_iterations=5)  # fmt: skip
    assert live.as_child().iterations == 7

    spec = load_spec(str(Path(fsm_kernel.__file__).parents[1] / "workflows" / "default.yaml"))
    assert _from_log(ended(iterations=2, child_iterations=5), spec).iterations == 7
    assert _from_log(ended(iterations=2), spec).iterations == 2


def ended(**data: Any) -> RecordedRun:
    """The log of a child run that ended for `final_answer`, its ending carrying `data`."""
    now = datetime.now(UTC)
    started = Event(run_id="c", seq=1, type=EventType.RUN_STARTED, timestamp=now)
    terminated = Event(run_id="c", seq=2, type=EventType.RUN_TERMINATED, timestamp=now,
                       data={"reason": "final_answer", "answer": "", **data})  # fmt: skip
    return RecordedRun("c", [started, terminated], started, terminated)


@pytest.mark.parametrize(
    ("data", "drawn"),
    [
        ({"iterations": 3, "shared_calls": 2, "child_iterations": 4}, 6),  # its own and theirs
        ({"iterations": 3, "shared_calls": 0}, 0),  # refused at once
        ({"iterations": 3, "child_iterations": 4}, 7),  # an older log: all its calls
    ],
)
def test_what_a_child_that_ended_drew_on_its_maps_pool(data: dict[str, Any], drawn: int) -> None:
    from fsm_kernel.child_runs import _drawn

    run = ended(**data)
    spec = load_spec(str(Path(fsm_kernel.__file__).parents[1] / "workflows" / "default.yaml"))
    assert _drawn(run, _from_log(run, spec)) == drawn
