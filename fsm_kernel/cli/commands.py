"""Subcommands: run, validate, tools, schema, workflows (and the registration of the others)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fsm_kernel.cli.args import count, existing_dir, read_prompt, seconds

if TYPE_CHECKING:  # imported where used: `fsm-kernel --help` stays fast
    from fsm_kernel.api import Agent
    from fsm_kernel.bootstrap import RunOptions
    from fsm_kernel.kernel import RunResult
    from fsm_kernel.protocol import EventStore, Tool

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_WAITING = 0, 1, 2, 3


def register(sub: Any) -> None:
    """Add run, validate, tools, schema and workflows (fsm_kernel.cli.COMMANDS lists every
    command with the module that adds it)."""
    _add_run(sub)
    p = sub.add_parser(
        "validate",
        description="Check workflow files (paths or stock names) as a run would load them: "
        "each file's every error is reported, in file order, as path:line:col: message (a "
        "called workflow's errors at their place in it); exit 2 when any file has one.",
    )
    p.add_argument("workflows", nargs="+", metavar="WORKFLOW")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: ok, and per file its path, ok and errors (each with "
        "file, line, col and message; with --explain, a valid file's explain too)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="for each valid file, also list every termination reason its edges can end a run "
        "with and the shortest path to each (states by full compound path, each edge's "
        "conditions), the reasons it declares or names but can never reach, and those the "
        "kernel may end any run with (limits, errors, cancellation)",
    )
    p.set_defaults(handler=cmd_validate)
    p = sub.add_parser(
        "tools",
        description="Without --workflow: the built-in tools. With it: the tools the workflow "
        "offers the model, its own and its MCP servers' (which are started to list them), "
        "with their parameters; --json prints their JSON Schemas.",
    )
    p.add_argument(
        "--workflow",
        metavar="WORKFLOW",
        help="a workflow file or stock name: list the tools it offers",
    )
    p.add_argument("--json", action="store_true", help="print the tool schemas as JSON")
    p.set_defaults(handler=cmd_tools)
    p = sub.add_parser("schema")
    p.set_defaults(handler=cmd_schema)
    p = sub.add_parser("workflows")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_workflows)


def add_model_flags(p: argparse.ArgumentParser, *, resuming: bool = False) -> None:
    """The model/server flags shared by run and resume (where each defaults to the value the
    run recorded)."""
    title = (
        "model server (default: what the run recorded; a flag overrides it and is recorded)"
        if resuming
        else "model server (flags > FSM_KERNEL_* env > workflow agent: block)"
    )
    g = p.add_argument_group(title)
    g.add_argument(
        "--model",
        help="model name; 'local' runs the bundled model in-process, 'local:PATH.gguf' any GGUF"
        + ("" if resuming else " (default qwen3 on Ollama, else the bundled model)"),
    )
    g.add_argument(
        "--base-url",
        help="OpenAI-compatible base URL"
        + ("" if resuming else " (default Ollama's http://localhost:11434/v1)"),
    )
    g.add_argument(
        "--request-timeout",
        type=seconds,
        metavar="SECONDS",
        help="deadline for one model answer, the whole response included (default 120; 0 = none)",
    )
    g.add_argument(
        "--max-retries",
        type=count(0, 100),
        metavar="N",
        help="retries on connection errors, 429 and 5xx (default 3)",
    )
    g.add_argument(
        "--otel",
        action="store_const",
        const=True,
        help="trace the run with OpenTelemetry (spans per run, state, model and tool call) to "
        "the OTLP endpoint the OTEL_EXPORTER_OTLP_* variables name; on by default when they "
        "(or OTEL_TRACES_EXPORTER) are set. Needs the otel extra",
    )
    g.add_argument(
        "--no-stream",
        dest="stream",
        action="store_const",
        const=False,
        help="ask for whole answers instead of streamed ones (for servers that stream badly)",
    )
    g.add_argument(
        "--max-response-bytes",
        type=count(1, 2**40),
        metavar="N",
        help="largest model response accepted (default 8 MiB)",
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--max-iterations",
        type=count(0, 1_000_000),
        metavar="N",
        help="cap on model calls (0 = unlimited; default from the workflow)",
    )
    g.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        dest="timeout_seconds",
        help="wall-clock limit for the run (0 = none)",
    )
    g.add_argument(
        "--workspace",
        type=existing_dir,
        metavar="DIR",
        help="root the file tools are confined to (default: current directory)",
    )
    g.add_argument(
        "--store",
        metavar="LOCATION",
        help="event store: a path ending in .db/.sqlite/.sqlite3 or .jsonl, sqlite:///PATH, or a "
        "postgresql:// URL (default FSM_KERNEL_STORE or .fsm-kernel/runs.db)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object with the result on stdout",
    )


def add_resume_flags(p: argparse.ArgumentParser) -> None:
    """The flags of commands that continue a recorded run (`resume`, `signal`): which workflow
    it goes on under, and the model settings that may be overridden."""
    p.add_argument("--workflow", help="workflow file to use (default: the one the run recorded)")
    p.add_argument(
        "--force",
        action="store_true",
        help="continue even though the workflow file changed (records the new hash)",
    )
    p.add_argument(
        "--migrate",
        action="store_true",
        help="move the run to the current workflow file (or --workflow) only if replaying its "
        "recorded steps under it decides identically; else name the first divergence, exit 2, "
        "change nothing",
    )
    add_model_flags(p, resuming=True)


def _add_run(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        description="Run WORKFLOW (a file, or a stock name such as 'default' or 'react') on "
        "the prompt against an OpenAI-compatible model server. Progress goes to stderr; the "
        "answer, the tool calls and the termination reason to stdout (on a terminal the "
        "answer streams there as it comes, and is not printed again). A run that waits for a "
        "person (a tool that needs approval, a human.input state) asks at the terminal; where "
        "nobody can be asked (--json, or no terminal on stdin) it exits 3.",
    )
    p.add_argument("workflow", metavar="WORKFLOW")
    p.add_argument(
        "--prompt",
        "-p",
        metavar="TEXT",
        help="the task for the agent; '-' reads it from stdin (bytes that are not UTF-8 "
        "become U+FFFD)",
    )
    p.add_argument(
        "--prompt-file", metavar="PATH", help="read the task from a file (for long prompts)"
    )
    p.add_argument(
        "--continue",
        dest="continue_run",
        metavar="RUN_ID",
        help="start from that run's conversation (read from the store): the new run is "
        "recorded as continuing it",
    )
    p.add_argument("--system-prompt", help="replace the workflow's system prompt")
    p.add_argument(
        "--memory",
        type=existing_dir,
        metavar="DIR",
        help="folder of *.md files appended to the system prompt",
    )
    add_model_flags(p)
    p.set_defaults(handler=cmd_run)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from fsm_kernel.bootstrap import RunOptions

    return RunOptions(
        model=args.model,
        base_url=args.base_url,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        max_response_bytes=args.max_response_bytes,
        stream=args.stream,
        max_iterations=args.max_iterations,
        timeout_seconds=args.timeout_seconds,
        system_prompt=getattr(args, "system_prompt", None),
        memory=getattr(args, "memory", None),
        workspace=args.workspace,
    )


def open_event_store(location: str | None) -> EventStore:
    from fsm_kernel.config import default_store_location
    from fsm_kernel.store import open_store

    return open_store(location or default_store_location())


async def run_cancellable(coro: Awaitable[RunResult]) -> RunResult:
    """Run a kernel coroutine so Ctrl-C cancels it (recorded as `cancelled`), not kills it."""
    import asyncio
    import signal

    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
        pass
    try:
        result: RunResult = await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return result


def agent_options(options: RunOptions) -> dict[str, Any]:
    """The Agent keyword arguments for the options that were given."""
    given = options.given()
    if "timeout_seconds" in given:
        given["timeout"] = given.pop("timeout_seconds")
    return given


def execute(args: argparse.Namespace, start: Callable[[Agent], Awaitable[RunResult]]) -> int:
    """Build the Agent from the flags (the same public API Python code uses), run
    `start(agent)` under Ctrl-C handling, print, exit code."""
    import asyncio

    from fsm_kernel.api import Agent
    from fsm_kernel.bootstrap import load_spec
    from fsm_kernel.cli import output
    from fsm_kernel.cli.human import TerminalChannel, interactive
    from fsm_kernel.config import default_store_location

    spec = load_spec(args.workflow) if isinstance(args.workflow, str) else args.workflow
    live = None if args.json else output.live_output(sys.stdout, sys.stderr)
    by = getattr(args, "by", None)
    human = TerminalChannel(by=by) if interactive(args.json) else None

    async def go() -> RunResult:
        agent = Agent(
            spec,
            **agent_options(options_from_args(args)),
            store=args.store or default_store_location(),
            on_event=live,
            human=human,
            otel=getattr(args, "otel", None),
        )
        async with agent:
            return await run_cancellable(start(agent))

    result = asyncio.run(go())
    if live is not None:
        live.finish()
    shown = live is not None and live.shown(result.response)
    output.print_result(result, as_json=args.json, shown=shown)
    if result.status == "waiting":
        return EXIT_WAITING
    return EXIT_OK if result.ok else EXIT_FAIL


def cmd_run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt, args.prompt_file)
    return execute(args, lambda agent: agent.run(prompt, continue_from=args.continue_run))


def cmd_validate(args: argparse.Namespace) -> int:
    reports = [_validate_file(name, explain=args.explain) for name in args.workflows]
    explained = [r.pop("explain_lines", []) for r in reports]
    ok = all(r["ok"] for r in reports)
    if args.json:
        print(json.dumps({"ok": ok, "files": reports}, ensure_ascii=False))
        return EXIT_OK if ok else EXIT_USAGE
    for report, lines in zip(reports, explained, strict=True):
        for error in report["errors"]:
            print(f"error: {error['text']}", file=sys.stderr)
        if report["ok"]:
            catches = report["catch_edges"]
            extra = f", {catches} catch edge{'s' if catches != 1 else ''}" if catches else ""
            print(
                f"{report['path']}: ok ({report['states']} states, {report['transitions']} "
                f"transitions{extra})"
            )
        for line in lines:
            print(line)
    return EXIT_OK if ok else EXIT_USAGE


def _validate_file(name: str, *, explain: bool = False) -> dict[str, Any]:
    """What `validate` found in one file: every error in file order (those of its tools
    too), or the size of a valid one (and with `explain`, its termination reasons: `explain`
    for --json, `explain_lines` for the terminal). Imports as a run would (load_spec's
    sys.path)."""
    from pathlib import Path

    from fsm_kernel.bootstrap import RunOptions, build_tools, resolve_workflow
    from fsm_kernel.errors import FsmKernelError, WorkflowError, WorkflowValidationError
    from fsm_kernel.workflow.loader import check_workflow
    from fsm_kernel.workflow.validate import in_file_order

    try:
        path = resolve_workflow(name)
    except WorkflowError as exc:
        return {"workflow": name, "path": name, "ok": False, "errors": [_error_json(exc, name)]}
    for folder in (str(Path.cwd()), str(path.resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    check = check_workflow(path)
    errors = list(check.errors)
    if check.spec is not None:
        try:
            build_tools(check.spec, RunOptions())
        except WorkflowError as exc:
            errors.append(exc)
        except FsmKernelError as exc:
            errors.append(WorkflowValidationError(exc.message, location=str(path)))
    found = in_file_order(errors, str(path))
    report: dict[str, Any] = {"workflow": name, "path": str(path), "ok": not found}
    report["errors"] = [_error_json(e, str(path)) for e in found]
    if check.spec is not None and not found:
        report["states"] = len(check.spec.states)
        report["transitions"] = len(check.spec.transitions)
        report["catch_edges"] = len(check.spec.catch_edges())
        if explain:
            from fsm_kernel.workflow.analysis import explain as explain_reasons

            explanation = explain_reasons(check.spec)
            report["explain"] = explanation.to_dict()
            report["explain_lines"] = explanation.lines()
    return report


def _error_json(error: Any, path: str) -> dict[str, Any]:
    """One WorkflowError as `validate --json` gives it (`text`: the line the terminal shows;
    `line` and `col` null for an error of the whole file, such as one that cannot be read)."""
    loc = error.location
    line, col = (loc.line, loc.col) if hasattr(loc, "line") else (None, None)
    file = loc.path if hasattr(loc, "path") else path
    return {"file": file, "line": line, "col": col, "message": error.message, "text": str(error)}


def cmd_tools(args: argparse.Namespace) -> int:
    import asyncio

    from fsm_kernel.tools import builtin_registry

    if args.workflow is not None:
        tools = asyncio.run(_workflow_tools(args.workflow))
    else:
        tools = builtin_registry(".").list_tools()
    if args.json:
        print(json.dumps([t.to_dict() for t in tools], indent=2))
        return EXIT_OK
    for t in tools:
        props = t.parameters.get("properties", {})
        required = set(t.parameters.get("required", []))
        params = ", ".join(
            f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items()
        )
        print(f"{t.name}({params})\n    {t.description}")
    return EXIT_OK


async def _workflow_tools(workflow: str) -> list[Tool]:
    """The tools a workflow offers, its MCP servers' included (started, listed, stopped)."""
    from fsm_kernel.bootstrap import RunOptions, attach_mcp, build_kernel, load_spec
    from fsm_kernel.tools.mcp_client import McpServers

    spec = load_spec(workflow)
    kernel, _ = build_kernel(spec, RunOptions(), chat_model=_NoModel())
    servers = McpServers(spec.mcp_servers)
    try:
        await attach_mcp(kernel, spec, servers)
    finally:
        await servers.aclose()
    return kernel.tools.list_tools(list(kernel.tool_names))


class _NoModel:
    """Stands in for the model where none is asked (listing tools)."""

    async def complete(self, messages: Any, tools: Any, **options: Any) -> Any:
        raise AssertionError("no model is asked here")


def cmd_schema(args: argparse.Namespace) -> int:
    from fsm_kernel.workflow.spec import WorkflowSpec

    schema = WorkflowSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "fsm-kernel workflow"
    print(json.dumps(schema, indent=2))
    return EXIT_OK


def cmd_workflows(args: argparse.Namespace) -> int:
    from fsm_kernel.bootstrap import list_stock_workflows

    stock = list_stock_workflows()
    if args.json:
        print(json.dumps([{"name": n, "description": d} for n, d in stock], indent=2))
        return EXIT_OK
    width = max((len(n) for n, _ in stock), default=0)
    for name, description in stock:
        print(f"{name:<{width}}  {description}")
    return EXIT_OK
