"""Where traces go, as the standard environment says (issue 26): `OTEL_TRACES_EXPORTER` is
honoured as the SDK reads it (`otlp`, `console` to stderr, `none`; an unknown name is one
clear line), and a collector that accepts connections but never answers costs the documented
flush deadline, not the exporter's 10 s timeout again at exit.

Each run is a process of its own (a process sets OpenTelemetry's global provider once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fsm_kernel.telemetry import FLUSH_SECONDS
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

pytest.importorskip("opentelemetry.sdk")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        server.enqueue(text_reply("Hello."))
        yield server


@pytest.fixture
def collector() -> Iterator[tuple[str, list[str]]]:
    """An OTLP/HTTP endpoint that answers 200 and keeps the paths it was sent to."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", paths
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def mute_collector() -> Iterator[str]:
    """A collector that accepts every connection and never answers."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        for conn in held:
            conn.close()


def command(fake: FakeOpenAIServer, tmp_path: Path, *extra: str) -> list[str]:
    args = ["run", "default", "-p", "Say hello.", "--base-url", fake.base_url, "--model", "m"]
    args += ["--store", str(tmp_path / "r.db"), "--json", "--max-retries", "0", *extra]
    return [sys.executable, "-m", "fsm_kernel", *args]


def environ(**otel: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, **otel}


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_console_prints_the_spans_on_stderr_and_nothing_goes_to_a_collector(
    fake: FakeOpenAIServer, tmp_path: Path, collector: tuple[str, list[str]]
) -> None:
    url, paths = collector
    env = environ(OTEL_TRACES_EXPORTER="console", OTEL_EXPORTER_OTLP_ENDPOINT=url)

    proc = run(command(fake, tmp_path), env, tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["response"] == "Hello."  # stdout: the answer only
    assert '"name": "invoke_agent default"' in proc.stderr
    assert '"name": "chat m"' in proc.stderr
    assert "not exported" not in proc.stderr
    assert paths == []


@pytest.mark.parametrize("flag", [[], ["--otel"]], ids=["environment", "--otel"])
def test_none_exports_nothing_even_with_an_endpoint_set(
    fake: FakeOpenAIServer, tmp_path: Path, collector: tuple[str, list[str]], flag: list[str]
) -> None:
    url, paths = collector
    env = environ(OTEL_TRACES_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT=url)

    proc = run(command(fake, tmp_path, *flag), env, tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["response"] == "Hello."
    assert proc.stderr.strip() == ""
    assert paths == []


def test_otlp_and_console_together(
    fake: FakeOpenAIServer, tmp_path: Path, collector: tuple[str, list[str]]
) -> None:
    url, paths = collector
    env = environ(OTEL_TRACES_EXPORTER="otlp, console", OTEL_EXPORTER_OTLP_ENDPOINT=url)

    proc = run(command(fake, tmp_path), env, tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert '"name": "invoke_agent default"' in proc.stderr
    assert set(paths) == {"/v1/traces"}


def test_an_exporter_fsm_kernel_does_not_have_is_one_line(
    fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    proc = run(command(fake, tmp_path), environ(OTEL_TRACES_EXPORTER="zipkin"), tmp_path)

    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: OTEL_TRACES_EXPORTER names 'zipkin': fsm-kernel exports traces to "
        "otlp, console, none"
    )
    assert fake.requests == []


def test_a_collector_that_never_answers_holds_the_exit_no_longer_than_the_flush(
    fake: FakeOpenAIServer, tmp_path: Path, mute_collector: str
) -> None:
    """The answer is printed once the flush has given up (after FLUSH_SECONDS); from then on
    the process must exit at once (it waited out the exporter's 10 s timeout again)."""
    env = environ(OTEL_EXPORTER_OTLP_ENDPOINT=mute_collector)

    with subprocess.Popen(
        command(fake, tmp_path, "--otel"), env=env, cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        assert proc.stderr is not None
        answer = proc.stdout.readline()
        printed = time.monotonic()
        code = proc.wait(timeout=60)
        after = time.monotonic() - printed
        stderr = proc.stderr.read()

    assert code == 0, stderr
    assert json.loads(answer)["termination_reason"] == "final_answer"
    assert after < FLUSH_SECONDS, f"exited {after:.1f}s after the answer"
    warnings = [line for line in stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, stderr
    assert warnings[0].startswith(f"WARNING [-]: traces not exported within {FLUSH_SECONDS:g}s")
