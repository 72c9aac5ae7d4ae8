"""`fsm-kernel ui` on the command line: the help, one-line errors (exit 2) for a bad token, a
busy port or a missing extra, and a real server process that prints its URL, answers, needs its
token off loopback and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fsm_kernel.store import open_store
from tests.clikit import cli
from tests.fakes.openai_server import text_reply
from tests.ui.conftest import record

REPO = Path(__file__).resolve().parents[2]


def test_help_names_the_options_and_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    out = cli(capsys, "ui", "--help")
    assert out.code == 0
    for option in ("--store", "--scheduler", "--host", "--port", "--token", "--open"):
        assert option in out.out
    assert "pip install 'fsm-kernel[ui]'" in " ".join(out.out.split())


def test_bad_arguments_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = str(tmp_path / "runs.db")
    short = cli(capsys, "ui", "--store", store, "--token", "abc", "--port", "0")
    assert (short.code, short.err) == (
        2, "error: the token must be at least 16 characters long\n"
    )  # fmt: skip
    port = cli(capsys, "ui", "--port", "70000")
    assert port.code == 2
    assert "70000 is out of range (0 to 65,535)" in port.err
    bad_store = cli(capsys, "ui", "--store", "mysql://u:secret@h/db", "--port", "0")
    assert bad_store.code == 2
    assert "unsupported store location 'mysql://…'" in bad_store.err
    assert "secret" not in bad_store.err


def test_a_busy_port_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    open_store(tmp_path / "runs.db").close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = cli(capsys, "ui", "--store", str(tmp_path / "runs.db"), "--port", str(port))
    assert out.code == 2
    assert out.err == (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port\n"
    )


def test_without_the_extra_it_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "starlette" or
                 m == "fsm_kernel.ui" or m.startswith("fsm_kernel.ui.")]:  # fmt: skip
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "starlette", None)  # as if it were not installed
    out = cli(capsys, "ui", "--port", "0")
    assert (out.code, out.err) == (
        2, "error: fsm-kernel ui needs the ui extra (starlette is missing): "
        "pip install 'fsm-kernel[ui]'\n",
    )  # fmt: skip


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def start_ui(spawn: list[subprocess.Popen[str]], *args: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FSM_KERNEL_UI_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "fsm_kernel", "ui", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    spawn.append(process)
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    assert url.startswith("http://"), url
    return process, url


def test_the_server_prints_its_url_serves_and_stops_on_ctrl_c(
    spawn: list[subprocess.Popen[str]], store: Path
) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")
    process, url = start_ui(spawn, "--store", str(store))

    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/")
    page = httpx.get(url, timeout=30)
    assert page.status_code == 200
    assert f'data-run-id="{run.run_id}"' in page.text

    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0
    assert err.startswith(f"fsm-kernel ui: serving the runs of {store}; Ctrl-C stops\n")
    assert "Traceback" not in err


def test_off_loopback_a_token_is_generated_and_required(
    spawn: list[subprocess.Popen[str]], store: Path
) -> None:
    process, url = start_ui(spawn, "--store", str(store), "--host", "0.0.0.0")
    base, _, token = url.partition("/?token=")
    assert len(token) == 40
    port = base.rsplit(":", 1)[1]
    local = f"http://127.0.0.1:{port}/"

    assert httpx.get(local, timeout=30).status_code == 401
    with httpx.Client(timeout=30, follow_redirects=True) as browser:
        entered = browser.get(f"{local}?token={token}")  # follows the redirect, keeps the cookie
        assert entered.status_code == 200
        assert str(entered.url) == local
        assert browser.get(local).status_code == 200
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "a token was generated for this session" in err
    assert token not in err
