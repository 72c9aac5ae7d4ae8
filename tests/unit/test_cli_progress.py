"""The CLI's live output: where streamed text goes, by what it is."""

from __future__ import annotations

import io

from fsm_kernel.cli.output import Progress
from fsm_kernel.streaming import TextDelta


def test_a_tool_call_being_generated_is_progress_and_the_answer_is_the_result() -> None:
    out, err = io.StringIO(), io.StringIO()
    progress = Progress(err, text=out, text_is_result=True)  # stdout a terminal

    progress(TextDelta("Tool call: datetime(", tool_call="datetime"))
    progress(TextDelta('{"timezone": "UTC"})', tool_call="datetime"))
    progress(TextDelta("It is "))
    progress(TextDelta("noon."))
    progress.finish()

    assert err.getvalue() == '  Tool call: datetime({"timezone": "UTC"})\n'
    assert out.getvalue() == "It is noon.\n"
    assert progress.shown("It is noon.")  # the call's text is not taken for the answer


def test_streamed_text_among_progress_lines_is_indented_and_each_line_ends() -> None:
    err = io.StringIO()
    progress = Progress(err, text=err)  # stdout a pipe: the text streams with the progress

    progress(TextDelta("Tool call: now(", tool_call="now"))
    progress(TextDelta("line one\nline two"))
    progress.finish()
    progress.finish()  # nothing open: nothing written

    assert err.getvalue() == "  Tool call: now(\n  line one\n  line two\n"
    assert not progress.shown("line one\nline two")  # not on stdout: printed at the end
