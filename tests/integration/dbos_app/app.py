"""A small DBOS application for the integration tests, run as a subprocess so a test can
SIGKILL it: a DBOSAgent over a workflow whose model asks for `--calls` calls of the tool
`work` (tools.py; then answers), each call and each model request written to a file in `--dir`.

    python -m tests.integration.dbos_app.app --dir D --system-db URL --store URL \
        --workflow work|approve --calls N (--start RUN_ID PROMPT | --recover RUN_ID)

`--start` starts the run; `--recover` only launches DBOS, which recovers the runs left
pending. Either way it prints the run's result as JSON once the run's workflow ends. A file
`slow-N` in the directory makes call N sleep (for the test to kill the process meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

from dbos import DBOS
from dbos._error import DBOSAwaitedWorkflowCancelledError

from fsm_kernel import Agent
from fsm_kernel.integrations.dbos import DBOSAgent
from fsm_kernel.protocol import Message, Role, Tool
from fsm_kernel.testing import FunctionChatModel, call

HERE = Path(__file__).parent


def _log(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


def build(args: argparse.Namespace) -> DBOSAgent:
    folder = Path(args.dir)
    os.environ["FSM_KERNEL_TEST_DIR"] = str(folder)

    def reply(messages: Sequence[Message], tools: Sequence[Tool]) -> object:
        done = sum(1 for m in messages if m.role == Role.TOOL)
        _log(folder / "model.log", f"asked after {done}")
        if done < args.calls:
            return call("work", {"n": done + 1})
        return f"all {done} done"

    agent = Agent(
        HERE / f"{args.workflow}.yaml",
        store=args.store,
        chat_model=FunctionChatModel(reply),
    )
    return DBOSAgent(agent, system_database_url=args.system_db)


async def main(args: argparse.Namespace) -> None:
    DBOS(
        config={
            "name": "fsm-kernel-tests",
            "system_database_url": args.system_db,
            "notification_listener_polling_interval_sec": 0.05,
            "log_level": "WARNING",
        }
    )
    agent = build(args)
    DBOS.launch()
    try:
        if args.start:
            run_id, prompt = args.start
            await agent.start(prompt, run_id=run_id)
        else:
            run_id = args.recover
        try:
            result = await agent.result(run_id)
        except DBOSAwaitedWorkflowCancelledError:
            print(json.dumps({"run_id": run_id, "dbos": "CANCELLED"}), flush=True)
        else:
            print(json.dumps(result.to_dict()), flush=True)
    finally:  # as the CLI's workers stop: the runs going on here end first
        await asyncio.to_thread(DBOS.destroy, workflow_completion_timeout_sec=30)
        await agent.agent.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--system-db", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--workflow", default="work")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--start", nargs=2, metavar=("RUN_ID", "PROMPT"))
    parser.add_argument("--recover", metavar="RUN_ID")
    asyncio.run(main(parser.parse_args()))
