"""Runs own their collaborators: concurrent runs and a resume on one Kernel never share a model
or tools; watchers see events and streamed text (text is never stored); model failures and
stream notices are in the log; the termination reason is one enum."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsm_kernel.errors import AgentConnectionError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, Event, EventType, Message, Tool
from fsm_kernel.replay import resume_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.streaming import TextDelta, emit_notice, emit_text
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow
from fsm_kernel.workflow.spec import TerminationReason

DEFAULT = Path(__file__).resolve().parents[2] / "workflows" / "default.yaml"


class Answers:
    """Answers `text` after `delay` seconds, streaming it in two pieces."""

    def __init__(self, text: str, delay: float = 0.0) -> None:
        self.text, self.delay = text, delay
        self.calls = 0

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        self.calls += 1
        await asyncio.sleep(self.delay)
        half = len(self.text) // 2
        emit_text(self.text[:half])
        emit_text(self.text[half:])
        return Completion(message=Message.assistant(self.text))


class Fails:
    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        emit_notice("stream_fallback", reason="bad chunks")
        raise AgentConnectionError("cannot reach model server at http://x/v1: refused")


def kernel(model: object, store: SqliteEventStore | None = None) -> Kernel:
    return Kernel(
        compile_workflow(load_workflow(DEFAULT)),
        model=model,  # type: ignore[arg-type]
        tools=builtin_registry("."),
        store=store,
    )


def test_concurrent_runs_on_one_kernel_use_their_own_models() -> None:
    k = kernel(Answers("default"))
    slow, fast = Answers("slow answer", delay=0.05), Answers("fast answer")

    async def both() -> tuple[str, str]:
        a, b = await asyncio.gather(k.run("one", model=slow), k.run("two", model=fast))
        return a.response, b.response

    assert asyncio.run(both()) == ("slow answer", "fast answer")
    assert (slow.calls, fast.calls) == (1, 1)
    assert k.model.calls == 0  # type: ignore[attr-defined]


def test_a_resume_does_not_swap_the_kernels_model_under_a_concurrent_run(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "r.db") as store:
        failed = kernel(Fails(), store).run_sync("first")
        live = Answers("live answer", delay=0.05)
        k = kernel(live, store)

        async def resume_and_run() -> tuple[str, str]:
            resumed, fresh = await asyncio.gather(
                resume_run(k, store, failed.run_id), k.run("second")
            )
            return resumed.response, fresh.response

        assert asyncio.run(resume_and_run()) == ("live answer", "live answer")
        assert k.model is live  # never replaced by the resume's recorded model


def test_watchers_see_events_and_text_deltas_which_are_not_stored(tmp_path: Path) -> None:
    seen: list[Event | TextDelta] = []
    with SqliteEventStore(tmp_path / "r.db") as store:
        result = asyncio.run(kernel(Answers("Hello there"), store).run("hi", watch=seen.append))
        stored = store.read(result.run_id)

    deltas = [x.text for x in seen if isinstance(x, TextDelta)]
    events = [x for x in seen if isinstance(x, Event)]
    assert deltas == ["Hello", " there"]
    assert [e.seq for e in events] == [e.seq for e in stored]  # every event, as stored
    assert len(seen) == len(stored) + 2  # the deltas were streamed, not stored


def test_model_failures_and_stream_notices_are_logged(tmp_path: Path) -> None:
    with SqliteEventStore(tmp_path / "r.db") as store:
        result = kernel(Fails(), store).run_sync("hi")
        events = store.read(result.run_id)

    types = [e.type for e in events]
    notice = events[types.index(EventType.MODEL_NOTICE)]
    failed = events[types.index(EventType.MODEL_FAILED)]
    assert notice.data == {"kind": "stream_fallback", "reason": "bad chunks"}
    assert failed.data["error"]["type"] == "AgentConnectionError"
    assert "refused" in failed.data["error"]["message"]
    assert types.index(EventType.MODEL_REQUESTED) < types.index(EventType.MODEL_FAILED)
    assert result.termination_reason is TerminationReason.AGENT_ERROR
    assert result.to_dict()["termination_reason"] == "agent_error"


def test_log_lines_name_the_run_while_it_goes_and_their_caller_after() -> None:
    """A child run goes in its parent's task: once it ends, the parent's log lines name the
    parent again, not the child."""
    from fsm_kernel.kernel import current_run_id

    seen: list[str] = []

    class Notes(Answers):
        async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
            seen.append(current_run_id.get())
            return await super().complete(messages, tools)

    async def inside_a_parent() -> tuple[str, str]:
        current_run_id.set("parent")
        done = await kernel(Notes("hi")).run("go", run_id="child")
        return done.run_id, current_run_id.get()

    assert asyncio.run(inside_a_parent()) == ("child", "parent")
    assert seen == ["child"]


def test_a_resumed_child_of_a_map_counts_the_calls_its_log_holds_and_is_refused_only_live(
    tmp_path: Path,
) -> None:
    from fsm_kernel.errors import AgentConnectionError
    from fsm_kernel.testing import ScriptedChatModel, call
    from fsm_kernel.workflow.children import CallPool, draw_on

    down = AgentConnectionError("cannot reach model server at http://x/v1: refused")
    with SqliteEventStore(tmp_path / "r.db") as store:
        cut_off = kernel(ScriptedChatModel([call("datetime", {}), down]), store).run_sync("go")
        assert cut_off.termination_reason == "agent_error"  # resumable
        later = ScriptedChatModel([call("datetime", {"n": 2}), "never asked"])
        pool = CallPool(0)  # its siblings spent the rest while it was down

        async def resumed_in_its_map() -> Any:
            draw_on(pool)
            return await resume_run(kernel(later, store), store, cut_off.run_id)

        result = asyncio.run(resumed_in_its_map())

    # both calls its log holds go on (the second failed, so it is asked again, live); the
    # third, never taken before, is refused
    assert result.termination_reason == "max_iterations"
    assert result.error is not None
    assert "are spent" in result.error
    assert result.iterations == 2
    assert pool.spent == 2
    assert later.remaining == 1
