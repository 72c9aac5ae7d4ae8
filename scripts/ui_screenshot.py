"""Regenerate docs/ui-run.png, the run viewer's screenshot in docs/how-to/viewer.md: a real run of
the default workflow against the fake OpenAI-compatible server (two tool calls, then an answer),
recorded in a throwaway store, shown by `fsm-kernel ui` in headless Chromium.

    python scripts/ui_screenshot.py [--out docs/ui-run.png] [--chromium /usr/bin/chromium]

Needs the ui extra, playwright (`pip install playwright`) and a Chromium (Debian: apt-get
install chromium); playwright downloads nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fsm_kernel  # noqa: E402
from fsm_kernel.ui import ViewerConfig, open_viewer  # noqa: E402
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply  # noqa: E402

GOAL = "Which of the Python files here define a class, and what is it called?"


def record(store: Path, workspace: Path) -> str:
    (workspace / "shapes.py").write_text("class Circle:\n    radius: float = 1.0\n")
    (workspace / "util.py").write_text("def area(r):\n    return 3.14159 * r * r\n")
    with FakeOpenAIServer() as server:
        server.enqueue(
            tool_reply(call("list_directory", {"path": "."}, id="call_1")),
            tool_reply(
                call("read_file", {"path": "shapes.py"}, id="call_2"),
                call("read_file", {"path": "util.py"}, id="call_3"),
            ),
            text_reply("Only shapes.py defines a class: `Circle` (with a `radius`)."),
        )
        result = fsm_kernel.run(
            "default", GOAL, base_url=server.base_url, model="qwen3", store=str(store),
            workspace=str(workspace), max_retries=0,
        )  # fmt: skip
    return result.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "ui-run.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        store, workspace = Path(tmp) / "runs.db", Path(tmp) / "work"
        workspace.mkdir()
        with ThreadPoolExecutor(1) as pool:  # playwright's loop runs on this thread
            run_id = pool.submit(record, store, workspace).result()
        with open_viewer(ViewerConfig(store=str(store), port=0)) as viewer:
            with sync_playwright() as playwright:
                sandbox = ["--no-sandbox"] if os.geteuid() == 0 else []
                browser = playwright.chromium.launch(executable_path=args.chromium, args=sandbox)
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.goto(f"http://127.0.0.1:{viewer.port}/runs/{run_id}")
                page.locator('#run-timeline details.tool[data-call-id="call_2"] summary').click()
                page.locator('#diagram g[data-state="act"]').click()
                page.screenshot(path=args.out)
                browser.close()
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
