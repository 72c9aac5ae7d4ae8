"""File memory: loading *.md files and building the system prompt from them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.memory import MemoryFile, MemoryStoreError, build_system_prompt, load_memory

REPO_MEMORY = Path(__file__).resolve().parents[2] / "memory"


def test_loads_markdown_files_sorted_by_name(tmp_path: Path) -> None:
    (tmp_path / "b_tools.md").write_text("Use tools.\n", encoding="utf-8")
    (tmp_path / "a_identity.md").write_text("\n# Who\n\nAn agent.\n\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not markdown", encoding="utf-8")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "deep.md").write_text("not loaded", encoding="utf-8")
    (tmp_path / "folder.md").mkdir()

    memory = load_memory(tmp_path)

    assert memory == [
        MemoryFile(
            name="a_identity.md", path=tmp_path / "a_identity.md", content="# Who\n\nAn agent."
        ),
        MemoryFile(name="b_tools.md", path=tmp_path / "b_tools.md", content="Use tools."),
    ]


def test_accepts_a_string_path(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text("x", encoding="utf-8")
    assert [m.name for m in load_memory(str(tmp_path))] == ["x.md"]


def test_none_means_no_memory() -> None:
    assert load_memory(None) == []


def test_empty_folder_gives_no_memory(tmp_path: Path) -> None:
    assert load_memory(tmp_path) == []


def test_empty_and_blank_files_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "empty.md").write_text("", encoding="utf-8")
    (tmp_path / "blank.md").write_text("  \n\n\t\n", encoding="utf-8")
    (tmp_path / "real.md").write_text("content", encoding="utf-8")
    assert [m.name for m in load_memory(tmp_path)] == ["real.md"]


def test_missing_folder_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(MemoryStoreError) as info:
        load_memory(missing)
    assert str(info.value) == f"memory folder {str(missing)!r} does not exist"
    assert "\n" not in str(info.value)
    assert isinstance(info.value, FsmKernelError)


def test_a_file_instead_of_a_folder_is_an_error(tmp_path: Path) -> None:
    a_file = tmp_path / "memory.md"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(MemoryStoreError, match="is not a folder"):
        load_memory(a_file)


def test_non_utf8_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "good.md").write_text("fine", encoding="utf-8")
    bad = tmp_path / "bad.md"
    bad.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(MemoryStoreError) as info:
        load_memory(tmp_path)
    assert str(info.value) == f"memory file {str(bad)!r} is not valid UTF-8 (byte 3)"


def test_dangling_symlink_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "dangling.md").symlink_to(tmp_path / "gone.md")
    assert load_memory(tmp_path) == []


def test_unreadable_file_is_an_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked.md"
    locked.write_text("secret", encoding="utf-8")

    def refuse(self: Path, *args: object, **kwargs: object) -> str:
        # The tests run as root, where chmod 000 does not stop a read.
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(MemoryStoreError) as info:
        load_memory(tmp_path)
    assert str(info.value) == f"cannot read memory file {str(locked)!r}: Permission denied"


def test_error_pickles_with_its_message() -> None:
    err = pickle.loads(pickle.dumps(MemoryStoreError("memory folder 'x' does not exist")))
    assert isinstance(err, MemoryStoreError)
    assert str(err) == "memory folder 'x' does not exist"
    assert err.to_dict() == {"type": "MemoryStoreError", "message": str(err)}


def test_build_system_prompt_appends_each_file_under_its_name() -> None:
    memory = [
        MemoryFile(name="identity.md", path=Path("identity.md"), content="You are an agent."),
        MemoryFile(name="user.md", path=Path("user.md"), content="The user likes tea."),
    ]
    prompt = build_system_prompt("Be careful.\n", memory)
    assert prompt == (
        "Be careful.\n\n## identity.md\n\nYou are an agent.\n\n## user.md\n\nThe user likes tea."
    )


def test_build_system_prompt_without_memory_or_base() -> None:
    memory = [MemoryFile(name="a.md", path=Path("a.md"), content="A")]
    assert build_system_prompt("Base.", []) == "Base."
    assert build_system_prompt("", memory) == "## a.md\n\nA"
    assert build_system_prompt("  ", []) == ""


def test_the_shipped_identity_loads_and_mentions_tools_and_done() -> None:
    memory = load_memory(REPO_MEMORY)
    identity = next(m for m in memory if m.name == "identity.md")
    assert "tool" in identity.content
    assert "`done`" in identity.content
    assert len(identity.content) < 2000
