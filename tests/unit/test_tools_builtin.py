"""Built-in tools: datetime with an injected clock, workspace-confined file tools, done."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import ToolCall, ToolResult
from fsm_kernel.tools import DONE_TOOL, ToolRegistry, builtin_registry
from fsm_kernel.tools.builtin import READ_LIMIT_BYTES


class FixedClock:
    def __init__(self, now: datetime) -> None:
        self._now = now

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return 0.0


# Thursday 2026-03-05 23:30 UTC is already Friday in Tokyo (UTC+9).
FIXED = datetime(2026, 3, 5, 23, 30, 15, 123456, tzinfo=UTC)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "notes.txt").write_text("hello\nworld\n", encoding="utf-8")
    (root / "sub" / "a.md").write_text("# A", encoding="utf-8")
    (root / "image.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "secret.txt").write_text("top secret", encoding="utf-8")
    return root


@pytest.fixture
def registry(workspace: Path) -> ToolRegistry:
    return builtin_registry(workspace, clock=FixedClock(FIXED))


def execute(registry: ToolRegistry, name: str, **arguments: Any) -> ToolResult:
    return asyncio.run(registry.execute(ToolCall(id="c1", name=name, arguments=arguments)))


def test_builtin_tool_names_and_order(registry: ToolRegistry) -> None:
    assert registry.names() == ["datetime", "read_file", "list_directory", DONE_TOOL]
    assert DONE_TOOL == "done"
    for definition in registry.list_tools():
        assert definition.description
        assert definition.parameters["type"] == "object"


# --- datetime ---------------------------------------------------------------------------------


def test_datetime_in_utc_and_a_named_zone(registry: ToolRegistry) -> None:
    result = execute(registry, "datetime", timezone="Asia/Tokyo")
    assert not result.is_error
    assert result.content == (
        "utc: 2026-03-05T23:30:15+00:00 (Thursday)\n"
        "local: 2026-03-06T08:30:15+09:00 (Friday) [Asia/Tokyo]"
    )


def test_datetime_without_zone_uses_the_machine_local_time(registry: ToolRegistry) -> None:
    result = execute(registry, "datetime")
    local = FIXED.astimezone()
    utc_line, local_line = result.content.splitlines()
    assert utc_line == "utc: 2026-03-05T23:30:15+00:00 (Thursday)"
    assert local_line.startswith(f"local: {local.isoformat(timespec='seconds')} ")
    assert f"({local.strftime('%A')})" in local_line


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "../../etc/passwd", "Not A Zone"])
def test_datetime_with_unknown_zone_is_an_argument_error(registry: ToolRegistry, zone: str) -> None:
    result = execute(registry, "datetime", timezone=zone)
    assert result.is_error
    assert result.error_type == "ToolArgumentsError"
    assert result.content.startswith(f"unknown time zone {zone!r}: use an IANA name")


def test_datetime_uses_the_system_clock_by_default(workspace: Path) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    result = execute(builtin_registry(workspace), "datetime", timezone="UTC")
    after = datetime.now(UTC)
    stamp = result.content.splitlines()[0].split()[1]
    assert before <= datetime.fromisoformat(stamp) <= after


# --- read_file --------------------------------------------------------------------------------


def test_read_file_returns_text(registry: ToolRegistry) -> None:
    assert execute(registry, "read_file", path="notes.txt").content == "hello\nworld\n"
    assert execute(registry, "read_file", path="sub/a.md").content == "# A"
    assert execute(registry, "read_file", path="./sub/../notes.txt").content == "hello\nworld\n"


def test_read_file_accepts_an_absolute_path_inside_the_workspace(
    registry: ToolRegistry, workspace: Path
) -> None:
    result = execute(registry, "read_file", path=str(workspace / "notes.txt"))
    assert result.content == "hello\nworld\n"


def test_read_file_replaces_invalid_utf8(registry: ToolRegistry) -> None:
    assert execute(registry, "read_file", path="latin1.txt").content == "caf\ufffd"


def test_read_file_refuses_binary_files(registry: ToolRegistry) -> None:
    result = execute(registry, "read_file", path="image.bin")
    assert result.is_error
    assert result.error_type == "ToolExecutionError"
    assert result.content == (
        "'image.bin' is a binary file (it contains NUL bytes); only text files can be read"
    )


def test_read_file_refuses_directories(registry: ToolRegistry) -> None:
    result = execute(registry, "read_file", path="sub")
    assert result.error_type == "ToolExecutionError"
    assert result.content == "'sub' is a directory; use list_directory"


def test_read_file_missing_file(registry: ToolRegistry) -> None:
    result = execute(registry, "read_file", path="nope.txt")
    assert result.error_type == "ToolExecutionError"
    assert result.content == "'nope.txt' does not exist"


def test_read_file_reads_at_most_the_limit(workspace: Path) -> None:
    (workspace / "huge.txt").write_text("a" * (READ_LIMIT_BYTES + 10), encoding="utf-8")
    registry = builtin_registry(workspace, output_cap=READ_LIMIT_BYTES * 2)
    content = execute(registry, "read_file", path="huge.txt").content
    assert content == "a" * READ_LIMIT_BYTES + (
        f"\n[file is {READ_LIMIT_BYTES + 10} bytes; read the first {READ_LIMIT_BYTES}]"
    )


def test_read_file_output_is_capped_by_the_registry(workspace: Path) -> None:
    (workspace / "long.txt").write_text("b" * 500, encoding="utf-8")
    result = execute(builtin_registry(workspace, output_cap=100), "read_file", path="long.txt")
    assert result.truncated
    assert result.content.endswith("[output truncated: 500 chars, showing the first 100]")


# --- workspace confinement --------------------------------------------------------------------

ESCAPES = ["../secret.txt", "sub/../../secret.txt", "..", "/etc/passwd"]


@pytest.mark.parametrize("tool_name", ["read_file", "list_directory"])
@pytest.mark.parametrize("path", ESCAPES)
def test_paths_outside_the_workspace_are_refused(
    registry: ToolRegistry, tool_name: str, path: str
) -> None:
    result = execute(registry, tool_name, path=path)
    assert result.is_error
    assert result.error_type == "ToolArgumentsError"
    assert result.content == (
        f"path {path!r} is outside the workspace; use a path inside it, relative to its root"
    )


def test_absolute_path_to_a_sibling_of_the_workspace_is_refused(
    registry: ToolRegistry, workspace: Path
) -> None:
    # /tmp/x/ws-other must not pass a naive string-prefix check against /tmp/x/ws.
    sibling = workspace.parent / (workspace.name + "-other")
    sibling.mkdir()
    (sibling / "f.txt").write_text("no", encoding="utf-8")
    result = execute(registry, "read_file", path=str(sibling / "f.txt"))
    assert result.error_type == "ToolArgumentsError"
    absolute = execute(registry, "read_file", path=str(workspace.parent / "secret.txt"))
    assert absolute.error_type == "ToolArgumentsError"
    assert "top secret" not in absolute.content


def test_symlinks_pointing_outside_are_refused(registry: ToolRegistry, workspace: Path) -> None:
    os.symlink(workspace.parent / "secret.txt", workspace / "link.txt")
    os.symlink(workspace.parent, workspace / "up")
    for tool_name, path in [("read_file", "link.txt"), ("read_file", "up/secret.txt")]:
        result = execute(registry, tool_name, path=path)
        assert result.error_type == "ToolArgumentsError", path
        assert "top secret" not in result.content
    assert execute(registry, "list_directory", path="up").error_type == "ToolArgumentsError"


def test_symlinks_staying_inside_are_followed(registry: ToolRegistry, workspace: Path) -> None:
    os.symlink(workspace / "notes.txt", workspace / "sub" / "alias.txt")
    assert execute(registry, "read_file", path="sub/alias.txt").content == "hello\nworld\n"


def test_relative_symlinks_inside_resolve_from_the_link_directory(
    registry: ToolRegistry, workspace: Path
) -> None:
    os.symlink("../notes.txt", workspace / "sub" / "up.txt")
    os.symlink("sub/deeper", workspace / "deep")
    os.symlink("deep", workspace / "deep2")  # a link to a link
    os.symlink(workspace, workspace / "sub" / "home")  # the root itself, absolute
    assert execute(registry, "read_file", path="sub/up.txt").content == "hello\nworld\n"
    assert execute(registry, "list_directory", path="deep2").content == "(empty directory)"
    # `..` after a symlinked directory climbs from where the link leads, as the OS does.
    assert execute(registry, "read_file", path="deep2/../a.md").content == "# A"
    assert execute(registry, "read_file", path="sub/home/sub/home/notes.txt").content == (
        "hello\nworld\n"
    )


def test_relative_symlinks_climbing_out_are_refused(
    registry: ToolRegistry, workspace: Path
) -> None:
    os.symlink("../../secret.txt", workspace / "sub" / "esc.txt")
    os.symlink("../../..", workspace / "sub" / "deeper" / "esc")
    for tool_name, path in [("read_file", "sub/esc.txt"), ("list_directory", "sub/deeper/esc")]:
        result = execute(registry, tool_name, path=path)
        assert result.error_type == "ToolArgumentsError", path
        assert result.content.startswith(f"path {path!r} is outside the workspace")


@pytest.mark.parametrize("tool_name", ["read_file", "list_directory"])
def test_symlink_loops_are_refused(registry: ToolRegistry, workspace: Path, tool_name: str) -> None:
    os.symlink("loop", workspace / "loop")
    os.symlink("ping", workspace / "pong")
    os.symlink("pong", workspace / "ping")
    for path in ["loop", "ping", "ping/x.txt"]:
        result = execute(registry, tool_name, path=path)
        assert result.error_type == "ToolArgumentsError", path
        assert result.content == (
            f"invalid path {path!r}: more than 40 symlinks to follow (a symlink loop?)"
        )


def test_a_chain_of_40_symlinks_is_followed_and_41_is_not(
    registry: ToolRegistry, workspace: Path
) -> None:
    os.symlink("notes.txt", workspace / "l1")
    for i in range(2, 42):
        os.symlink(f"l{i - 1}", workspace / f"l{i}")
    assert execute(registry, "read_file", path="l40").content == "hello\nworld\n"
    assert execute(registry, "read_file", path="l41").error_type == "ToolArgumentsError"


def test_a_file_used_as_a_directory_does_not_exist(registry: ToolRegistry) -> None:
    result = execute(registry, "read_file", path="notes.txt/x")
    assert (result.error_type, result.content) == (
        "ToolExecutionError",
        "'notes.txt/x' does not exist",
    )


def test_read_file_refuses_a_fifo_without_hanging(registry: ToolRegistry, workspace: Path) -> None:
    os.mkfifo(workspace / "pipe")
    registry.default_timeout = 5.0  # a blocking open would end as ToolTimeoutError
    result = execute(registry, "read_file", path="pipe")
    assert (result.error_type, result.content) == (
        "ToolExecutionError",
        "'pipe' is a FIFO, not a regular file; only regular files can be read",
    )


def test_workspace_given_as_a_relative_path_is_resolved(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(workspace / "sub")
    registry = builtin_registry("..", clock=FixedClock(FIXED))
    assert execute(registry, "read_file", path="notes.txt").content == "hello\nworld\n"
    assert execute(registry, "read_file", path="../secret.txt").is_error


def test_path_with_nul_byte_is_an_argument_error(registry: ToolRegistry) -> None:
    result = execute(registry, "read_file", path="notes\x00.txt")
    assert result.error_type == "ToolArgumentsError"
    assert result.content.startswith("invalid path")


# --- list_directory ---------------------------------------------------------------------------


def test_list_directory_sorted_with_markers_and_sizes(registry: ToolRegistry) -> None:
    assert execute(registry, "list_directory").content == "\n".join(
        [
            "image.bin (7 bytes)",
            "latin1.txt (4 bytes)",
            "notes.txt (12 bytes)",
            "sub/",
        ]
    )
    assert execute(registry, "list_directory", path="sub").content == "a.md (3 bytes)\ndeeper/"


def test_list_directory_of_an_empty_directory(registry: ToolRegistry) -> None:
    assert execute(registry, "list_directory", path="sub/deeper").content == "(empty directory)"


def test_list_directory_errors(registry: ToolRegistry, workspace: Path) -> None:
    missing = execute(registry, "list_directory", path="ghost")
    assert (missing.error_type, missing.content) == ("ToolExecutionError", "'ghost' does not exist")
    a_file = execute(registry, "list_directory", path="notes.txt")
    assert a_file.error_type == "ToolExecutionError"
    assert a_file.content == "'notes.txt' is a file, not a directory; use read_file"


def test_list_directory_shows_symlinks_as_links(registry: ToolRegistry, workspace: Path) -> None:
    deeper = workspace / "sub" / "deeper"
    os.symlink(workspace / "gone", deeper / "dangling")
    os.symlink("../a.md", deeper / "inside.md")
    os.symlink("..", deeper / "parent")
    assert execute(registry, "list_directory", path="sub/deeper").content == "\n".join(
        [
            f"dangling -> {workspace / 'gone'} (symlink)",
            "inside.md -> ../a.md (symlink)",
            "parent -> .. (symlink)",
        ]
    )


def test_list_directory_never_shows_what_an_outside_symlink_points_at(
    registry: ToolRegistry, workspace: Path
) -> None:
    outside_file = workspace.parent / "secret.txt"
    os.symlink(outside_file, workspace / "sub" / "deeper" / "leak.txt")
    os.symlink(workspace.parent, workspace / "sub" / "deeper" / "up")
    assert execute(registry, "list_directory", path="sub/deeper").content == "\n".join(
        [f"leak.txt -> {outside_file} (symlink)", f"up -> {workspace.parent} (symlink)"]
    )


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("evil\nnotes.txt (999 bytes)", "'evil\\nnotes.txt (999 bytes)' (2 bytes)"),
        ("\x1b[31mred\x1b[0m", "'\\x1b[31mred\\x1b[0m' (2 bytes)"),
        ("tab\there", "'tab\\there' (2 bytes)"),
        ("\u202eexe.txt", "'\\u202eexe.txt' (2 bytes)"),  # right-to-left override
        (" padded ", "' padded ' (2 bytes)"),
        ("'quoted'", "\"'quoted'\" (2 bytes)"),
        ("plain name é.txt", "plain name é.txt (2 bytes)"),
    ],
)
def test_list_directory_quotes_odd_names(
    registry: ToolRegistry, workspace: Path, name: str, shown: str
) -> None:
    (workspace / "sub" / "deeper" / name).write_bytes(b"hi")
    assert execute(registry, "list_directory", path="sub/deeper").content == shown


def test_list_directory_quotes_odd_symlink_targets(registry: ToolRegistry, workspace: Path) -> None:
    os.symlink("a\nb (5 bytes)", workspace / "sub" / "deeper" / "link")
    content = execute(registry, "list_directory", path="sub/deeper").content
    assert content == "link -> 'a\\nb (5 bytes)' (symlink)"


def test_list_directory_shows_a_fifo_as_such(registry: ToolRegistry, workspace: Path) -> None:
    os.mkfifo(workspace / "sub" / "deeper" / "pipe")
    assert execute(registry, "list_directory", path="sub/deeper").content == "pipe (FIFO)"


# --- done -------------------------------------------------------------------------------------


def test_done_returns_the_answer(registry: ToolRegistry) -> None:
    result = execute(registry, DONE_TOOL, answer="42 is the answer")
    assert (result.content, result.is_error) == ("42 is the answer", False)
    definition = registry.list_tools([DONE_TOOL])[0]
    assert definition.parameters["required"] == ["answer"]


def test_done_requires_an_answer(registry: ToolRegistry) -> None:
    result = execute(registry, DONE_TOOL)
    assert result.error_type == "ToolArgumentsError"
    assert "answer: Field required" in result.content
