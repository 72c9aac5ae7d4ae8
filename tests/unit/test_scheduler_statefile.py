"""STATE.md: missing file, round trip, seeding, atomic writes, locking, the agent tools."""

from __future__ import annotations

import fcntl
import inspect
import os
import threading
from pathlib import Path

import pytest

from fsm_kernel.errors import StoreError, ToolExecutionError
from fsm_kernel.scheduler import StateFile, state_tools


@pytest.fixture
def state(tmp_path: Path) -> StateFile:
    return StateFile(tmp_path / "kernel" / "STATE.md")


def temp_files(state: StateFile) -> list[Path]:
    return sorted(state.path.parent.glob("*.tmp"))


def test_missing_file_reads_as_empty(state: StateFile) -> None:
    assert state.read() == ""
    assert not state.path.parent.exists()  # reading creates nothing


def test_round_trip_keeps_text_exactly(state: StateFile) -> None:
    text = "# STATE\n## world\nbraces {STATE} {0} stay, ünïcode ✓, CRLF\r\nend without newline"
    state.write(text)
    assert state.read() == text
    state.write("")
    assert state.read() == ""


def test_seed_writes_once_and_never_overwrites(state: StateFile) -> None:
    assert state.seed("# seed\n") is True
    assert state.seed("# another seed\n") is False
    assert state.read() == "# seed\n"
    state.write("agent wrote this")
    assert state.seed("# seed\n") is False
    assert state.read() == "agent wrote this"


def test_nested_directories_are_created(tmp_path: Path) -> None:
    state = StateFile(tmp_path / "a" / "b" / "c" / "STATE.md")
    state.write("x")
    assert state.read() == "x"
    assert state.lock_path == tmp_path / "a" / "b" / "c" / "STATE.md.lock"


def test_write_leaves_no_temp_file_and_a_readable_file(state: StateFile) -> None:
    for i in range(3):
        state.write(f"version {i}")
    assert temp_files(state) == []
    assert state.path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in state.path.parent.iterdir()) == ["STATE.md", "STATE.md.lock"]


def test_a_failed_write_keeps_the_old_content_and_no_temp_file(state: StateFile) -> None:
    state.write("old")
    with pytest.raises(StoreError, match="cannot write"):
        state.write("lone surrogate \ud800 cannot be encoded")
    assert state.read() == "old"
    assert temp_files(state) == []


def test_the_lock_file_is_never_replaced(state: StateFile) -> None:
    state.write("one")
    inode = state.lock_path.stat().st_ino
    state.write("two")
    assert state.lock_path.stat().st_ino == inode


def test_writers_exclude_each_other_through_the_lock_file(state: StateFile) -> None:
    state.write("x")
    other = os.open(state.lock_path, os.O_RDWR)
    try:
        with state.locked():
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again after the block
        fcntl.flock(other, fcntl.LOCK_UN)
    finally:
        os.close(other)


def test_a_reader_never_sees_a_partial_file(state: StateFile) -> None:
    big_a, big_b = "A" * 300_000, "B" * 300_000
    state.write(big_a)
    seen: set[str] = set()
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            text = state.read()
            seen.add("A" if text == big_a else "B" if text == big_b else f"torn:{len(text)}")

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            state.write(big_b if i % 2 == 0 else big_a)
    finally:
        done.set()
        thread.join(10)
    assert seen <= {"A", "B"}
    assert seen  # the reader did read


def test_stale_temp_files_are_removed(state: StateFile) -> None:
    state.write("x")
    (state.path.parent / ".STATE.md.abc123.tmp").write_text("half a write")
    (state.path.parent / "notes.tmp").write_text("not ours")
    assert state.remove_stale_temps() == 1
    assert [p.name for p in temp_files(state)] == ["notes.tmp"]
    assert StateFile(state.path.parent / "missing-dir" / "STATE.md").remove_stale_temps() == 0


def test_unreadable_state_is_a_store_error(state: StateFile) -> None:
    state.path.mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(StoreError, match="cannot read"):
        state.read()


def test_state_tools_are_plain_typed_documented_functions(state: StateFile) -> None:
    read_state, write_state = state_tools(state)
    assert (read_state.__name__, write_state.__name__) == ("read_state", "write_state")
    assert inspect.signature(read_state).return_annotation is str
    params = inspect.signature(write_state).parameters
    assert list(params) == ["content"]
    assert params["content"].annotation is str
    assert "Args:" in (write_state.__doc__ or "")
    assert "content:" in (write_state.__doc__ or "")
    assert "Returns:" in (read_state.__doc__ or "")

    assert read_state() == ""
    assert write_state("# new state") == "STATE.md updated (11 characters)"
    assert read_state() == "# new state"
    assert state.read() == "# new state"


def test_state_tools_accept_a_path(tmp_path: Path) -> None:
    read_state, write_state = state_tools(tmp_path / "k" / "STATE.md")
    write_state("hello")
    assert read_state() == "hello"
    assert StateFile(tmp_path / "k" / "STATE.md").read() == "hello"


def test_state_tool_failures_are_tool_errors(state: StateFile) -> None:
    read_state, write_state = state_tools(state)
    with pytest.raises(ToolExecutionError) as write_err:
        write_state("\ud800")
    assert write_err.value.tool_name == "write_state"
    state.path.unlink(missing_ok=True)
    state.path.mkdir()
    with pytest.raises(ToolExecutionError) as read_err:
        read_state()
    assert read_err.value.tool_name == "read_state"
