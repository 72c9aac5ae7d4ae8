"""The run page's "waiting for a person" panel: what a suspended run asks (read from its last
`run.suspended` event), shown escaped. The approve / reject / input controls plug into this
panel once human-in-the-loop runs exist; here, what it shows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fsm_kernel.ui._app import _environment
from fsm_kernel.ui._reader import WaitingFor


def suspended(seq: int, waiting_for: Any) -> Any:
    return SimpleNamespace(seq=seq, data={"waiting_for": waiting_for})


def render(waiting: WaitingFor | None) -> str:
    run = SimpleNamespace(run_id="r1", waiting=waiting)
    return _environment().get_template("_run_waiting.html").render(run=run, csrf_field="")


def test_an_approval_shows_the_tool_call_it_waits_on() -> None:
    waiting = WaitingFor.from_event(suspended(12, {
        "kind": "approval", "state": "act",
        "tool_call": {"id": "c1", "name": "delete_file", "arguments": {"path": "<b>x</b>"}},
    }))  # fmt: skip

    assert waiting == WaitingFor(
        kind="approval", state="act", seq=12, prompt=None,
        tool_call={"id": "c1", "name": "delete_file", "arguments": {"path": "<b>x</b>"}},
    )  # fmt: skip
    html = render(waiting)
    assert 'id="waiting" data-kind="approval" data-seq="12"' in html
    assert "<code>delete_file</code>" in html
    assert "&#34;path&#34;: &#34;&lt;b&gt;x&lt;/b&gt;&#34;" in html  # JSON, then escaped
    assert "<b>act</b>" in html


def test_an_input_shows_the_question_escaped() -> None:
    question = "<script>x</script>?"
    waiting = WaitingFor.from_event(suspended(3, {"kind": "input", "prompt": question}))
    assert (waiting.kind, waiting.prompt, waiting.tool_call) == ("input", question, None)
    html = render(waiting)
    assert "&lt;script&gt;x&lt;/script&gt;?" in html
    assert "<script>" not in html


def test_a_malformed_question_still_shows_and_no_question_shows_nothing() -> None:
    waiting = WaitingFor.from_event(suspended(4, "not a mapping"))
    assert (waiting.kind, waiting.prompt, waiting.state) == ("input", None, None)
    assert "(no question recorded)" in render(waiting)
    assert render(None).strip() == ""
