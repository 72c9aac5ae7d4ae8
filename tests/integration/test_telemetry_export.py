"""Traces leave the process: `fsm-kernel run --otel` sets up the SDK's OTLP/HTTP exporter, and
its spans reach a collector on loopback; with the collector down the run still ends as it
should, with one warning instead of the exporter's retries holding up the exit.

Each run is a process of its own: a process may set OpenTelemetry's global provider only once,
and the in-process tests (test_telemetry.py) set an in-memory one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

REPO = Path(__file__).resolve().parents[2]


class Collector:
    """An OTLP/HTTP endpoint on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        received = self.received = []  # (path, content type, body)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name for the hook
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        server.enqueue(tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))
        yield server


def run_traced(
    fake: FakeOpenAIServer, tmp_path: Path, endpoint: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    args = ["run", "default", "-p", "What time is it?", "--base-url", fake.base_url]
    args += ["--model", "m", "--store", str(tmp_path / "r.db"), "--json", "--otel"]
    return subprocess.run(
        [sys.executable, "-m", "fsm_kernel", *args, "--max-retries", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_spans_of_a_run_reach_an_otlp_collector(fake: FakeOpenAIServer, tmp_path: Path) -> None:
    with Collector() as collector:
        proc = run_traced(fake, tmp_path, collector.url)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["termination_reason"] == "final_answer"
    assert "not exported" not in proc.stderr
    assert collector.received, "no export reached the collector"
    paths = {path for path, _, _ in collector.received}
    assert paths == {"/v1/traces"}
    assert {kind for _, kind, _ in collector.received} == {"application/x-protobuf"}
    sent = b"".join(body for _, _, body in collector.received)
    for name in (b"invoke_agent default", b"state think", b"chat m", b"execute_tool datetime"):
        assert name in sent  # span names travel as plain strings in the protobuf


def test_a_collector_that_is_down_costs_a_warning_not_the_run(
    fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"

    proc = run_traced(fake, tmp_path, dead)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["termination_reason"] == "final_answer"
    warnings = [line for line in proc.stderr.splitlines() if "not exported within" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"{dead}/v1/traces" in warnings[0]
    assert "Traceback" not in proc.stderr
    assert "retrying" not in proc.stderr  # the SDK's chatter for each retry is left out
    assert "already shutdown" not in proc.stderr
