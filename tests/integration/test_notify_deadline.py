"""A webhook's `timeout_seconds` is a deadline for the whole attempt (issue 26): a receiver
that answers at once and then trickles its body a byte at a time (each read well within the
timeout) still ends the attempt as `timed out`, and the CLI process is not held by it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


class Trickler:
    """Answers every request `200` with a 100,000-byte body, then sends it one byte every
    0.2 s (about 5.5 hours in all), until it is stopped."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.stopped = threading.Event()
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)  # the request (small: one read)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                while not self.stopped.wait(0.2):
                    conn.sendall(b".")
            except OSError:
                return

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    server = Trickler()
    try:
        yield server
    finally:
        server.stop()


def test_a_receiver_that_trickles_its_answer_times_the_attempt_out(
    trickler: Trickler, tmp_path: Path
) -> None:
    hooks = [{"url": trickler.url, "on": ["ended"], "timeout_seconds": 1, "retries": 1}]
    path = tmp_path / "notified.yaml"
    path.write_text(
        (ROOT / "workflows" / "default.yaml").read_text() + f"notify: {json.dumps(hooks)}\n"
    )
    store = tmp_path / "runs.db"

    async def go(fake: FakeOpenAIServer) -> str:
        agent = Agent(str(path), base_url=fake.base_url, model="m", store=str(store))
        try:
            return (await agent.run("go")).run_id
        finally:
            await agent.aclose()  # waits for the webhook (up to 15 s before giving it up)

    with FakeOpenAIServer() as fake:
        fake.enqueue(text_reply("done"))
        run_id = asyncio.run(go(fake))

    with SqliteEventStore(store) as events:
        tried = [e.data for e in events.read(run_id) if e.type is EventType.NOTIFY_ATTEMPTED]
    outcomes = [(a["attempt"], a["status"], a.get("error"), a["final"]) for a in tried]
    assert outcomes == [(1, None, "timed out", False), (2, None, "timed out", True)]
    assert trickler.requests == 2
