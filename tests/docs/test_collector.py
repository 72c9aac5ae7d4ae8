"""The docs' example runner catches docs that lie: wrong output, a broken workflow, a flag the
CLI does not have, a Python example that fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs._blocks import blocks
from tests.docs.test_examples import Page, command_lines, matches, normalise
from tests.fakes.openai_server import FakeOpenAIServer

RUN = (
    '<!-- test: replies=["Four."] -->\n'
    "```console\n"
    '$ fsm-kernel run single_shot -p "2 + 2?"\n'
    "run 01a21a16-ac1a-7d86-ab14-f0fab80d7ab8 (single_shot)\n"
    "→ answer\n"
    "{answer}\n"
    "■ final_answer\n"
    "\n"
    "iterations: 1\n"
    "termination: final_answer\n"
    "run id: 01a21a16-ac1a-7d86-ab14-f0fab80d7ab8\n"
    "```\n"
)


@pytest.fixture(autouse=True)
def _checking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check output even while FSM_KERNEL_DOCS_REGEN=1 rewrites the real pages."""
    monkeypatch.setattr("tests.docs.test_examples.REGEN", False)


def run_page(tmp_path: Path, text: str) -> None:
    page_file = tmp_path / "page.md"
    page_file.write_text(text, encoding="utf-8")
    folder = tmp_path / "work"
    folder.mkdir()
    with FakeOpenAIServer(strict=False) as server:
        page = Page(page_file, folder, server)
        for block in blocks(page_file):
            page.run(block)


def test_output_as_shown_passes(tmp_path: Path) -> None:
    run_page(tmp_path, RUN.format(answer="Four."))


def test_output_other_than_shown_fails(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="not what the page shows"):
        run_page(tmp_path, RUN.format(answer="Five."))


def test_a_broken_workflow_fails_unless_marked_invalid(tmp_path: Path) -> None:
    broken = (
        "```yaml\nname: b\ninitial: a\nstates:\n  a: {action: agent.think}\n"
        "  end: {final: true}\ntransitions:\n  - {source: a, target: nowhere, reason: done}\n```\n"
    )
    with pytest.raises(AssertionError, match="unknown target state 'nowhere'"):
        run_page(tmp_path, broken)
    marked = tmp_path / "marked"
    marked.mkdir()
    run_page(marked, "<!-- test: invalid -->\n" + broken)


def test_a_failing_python_example_fails(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="the example failed"):
        run_page(tmp_path, "```python\nimport fsm_kernel\nassert fsm_kernel.__all__ == []\n```\n")


def test_a_skipped_block_does_not_run(tmp_path: Path) -> None:
    run_page(tmp_path, "<!-- test: skip=a server -->\n```sh\nexit 1\n```\n")


def test_command_lines_are_cut_at_shell_syntax(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "```sh\n"
        'FOO=1 fsm-kernel run default -p "a b" --json; echo "exit $?"  # note\n'
        "fsm-kernel runs list --json 2>&1 | head\n"
        "fsm-kernel replay 01a2 [--workflow edited.yaml]\n"
        "```\n",
        encoding="utf-8",
    )
    (block,) = blocks(page)
    assert list(command_lines(block)) == [
        ["run", "default", "-p", "a b", "--json"],
        ["runs", "list", "--json"],
        ["replay", "01a2", "--workflow", "edited.yaml"],
    ]


def test_masks_and_wildcards() -> None:
    shown = "run 01a21a16-ac1a-7d86-ab14-f0fab80d7ab8 at 2026-11-26T23:01:55+00:00\n...\nend 3 ms"
    actual = (
        "run 01a21a17-aaaa-7d86-ab14-f0fab80d7ab8 at 2027-01-01T00:00:00+00:00\nx\ny\nend 12 ms"
    )
    assert matches(normalise(shown), normalise(actual))
    assert not matches(normalise("run\nend"), normalise("run\nx\nend"))
