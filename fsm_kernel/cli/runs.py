"""Subcommands over the event log: runs list/show/events/export, resume, replay."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from fsm_kernel.cli.args import count
from fsm_kernel.cli.terminal import cut

if TYPE_CHECKING:  # the rest is imported where used: building the parsers stays cheap
    from collections.abc import Callable
    from datetime import timedelta
    from pathlib import Path

    from fsm_kernel.api import Agent
    from fsm_kernel.kernel import RunResult
    from fsm_kernel.protocol import Event, EventStore, RunSummary
    from fsm_kernel.replay import RecordedRun
    from fsm_kernel.workflow.human import HumanAnswer
    from fsm_kernel.workflow.spec import WorkflowSpec

EXIT_OK, EXIT_FAIL = 0, 1


def _store_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        metavar="LOCATION",
        help="event store (default FSM_KERNEL_STORE or .fsm-kernel/runs.db)",
    )


def register(sub: Any) -> None:
    """Add the event-log subcommands."""
    from fsm_kernel.cli.commands import add_resume_flags

    runs = sub.add_parser("runs")
    rsub = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    p = rsub.add_parser(
        "list",
        help="recent runs: id, workflow, start, iterations, status, goal",
        description="Recent runs, newest first. STATUS is running (a process drives it now), "
        "interrupted (its process died before it ended: resume it), waiting (for a person: "
        "resume it with the answer), or the reason the run ended.",
    )
    p.add_argument(
        "--waiting",
        action="store_true",
        help="only the runs that wait for a person (approval or input)",
    )
    p.add_argument(
        "--limit",
        type=count(1, 1_000_000),
        default=20,
        metavar="N",
        help="show the N most recent runs (default 20)",
    )
    p.add_argument(
        "--top-level",
        action="store_true",
        help="leave out child runs (those a workflow.call or workflow.map state started); "
        "otherwise each is listed under its parent, marked ↳",
    )
    p.add_argument("--json", action="store_true")
    _store_flag(p)
    p.set_defaults(handler=cmd_runs_list)
    p = rsub.add_parser(
        "show",
        help="a run's iteration table and termination audit",
        description="A run's iterations, how it ended, and the tree of its child runs "
        "(workflow.call, workflow.map), each with its reason and answer.",
    )
    p.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    p.add_argument(
        "--why",
        action="store_true",
        help="also show why each transition fired: the edges each step tried, in order, with "
        "the check that ruled out each edge passed over (its first false one) and the checks "
        "of the edge taken (with --json: the 'why' key, each step's recorded 'tried' list)",
    )
    p.add_argument("--json", action="store_true")
    _store_flag(p)
    p.set_defaults(handler=cmd_runs_show)
    p = rsub.add_parser("events", help="a run's raw events")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    _store_flag(p)
    p.set_defaults(handler=cmd_runs_events)
    p = rsub.add_parser("export", help="write a run's events to a JSON Lines file")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("-o", "--output", required=True, metavar="FILE.jsonl")
    _store_flag(p)
    p.set_defaults(handler=cmd_runs_export)

    p = sub.add_parser(
        "resume",
        description="Rebuild a run from its events and continue it live from the last "
        "recorded step, with the server, model, timeouts, workspace and limits the run "
        "recorded (a flag given here overrides one and is recorded); the model is not asked "
        "again for the steps recorded. A run that ended agent_error because the server could "
        "not be reached or kept failing can be resumed too. A run that waits for a person "
        "(status waiting) needs its answer: --approve or --reject WHY for a tool call, "
        "--input TEXT for a question; each answer is recorded with the time and --by. "
        "The run follows the workflow text it recorded, even after its file changed; "
        "--workflow FILE moves it to another file with --force, or with --migrate once its "
        "recorded steps replay identically under FILE (or the current file).",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    g = p.add_argument_group("answer a run that waits for a person")
    answers = g.add_mutually_exclusive_group()
    answers.add_argument(
        "--approve", action="store_true", help="approve the tool call the run waits on"
    )
    answers.add_argument(
        "--reject",
        metavar="WHY",
        help="reject it; the model gets 'rejected by the user: WHY' as the call's result",
    )
    answers.add_argument("--input", metavar="TEXT", help="the text a human.input state asks for")
    g.add_argument(
        "--by",
        metavar="NAME",
        help="who answers, recorded with the answer (default: the USER environment variable)",
    )
    add_resume_flags(p)
    p.set_defaults(handler=cmd_resume)

    _register_coverage(rsub)

    p = sub.add_parser(
        "replay",
        description="Re-run the workflow with every model answer and tool output "
        "served from the log (no network, no tool side effects). Exit 0 when it "
        "takes the same transitions, 1 with the first differing step named. --all does it "
        "for every stored run (its child runs within it), under the definition each recorded "
        "or --workflow FILE: a summary, each divergence with its run, step and the check that "
        "decided differently; exit 1 when any run diverged.",
    )
    p.add_argument("run_id", metavar="RUN_ID", nargs="?", help="the run (not with --all)")
    p.add_argument(
        "--all",
        action="store_true",
        dest="all_runs",
        help="replay every stored top-level run, newest first, each under the workflow text it "
        "recorded (its child runs are replayed within it); runs still running, and runs whose "
        "definition no longer loads, are counted unreplayable with why",
    )
    p.add_argument(
        "--workflow",
        metavar="FILE",
        help="an edited workflow to check against the recorded decisions, under its own limits; "
        "with --all only the runs of that workflow (the runs that recorded its name:, child "
        "runs included unless their parent is one too) are replayed",
    )
    p.add_argument(
        "--since",
        type=_since,
        metavar="DURATION",
        help="with --all: only the runs started in the last DURATION (90s, 30m, 12h, 7d)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: the replay's steps; with --all the counts and each run that "
        "diverged (its divergence) or could not be replayed (why)",
    )
    _store_flag(p)
    p.set_defaults(handler=cmd_replay)


def _register_coverage(rsub: Any) -> None:
    p = rsub.add_parser(
        "coverage",
        help="over the stored runs of a workflow: edges taken, termination reasons, tokens",
        description="Over the stored runs of WORKFLOW (every run that recorded its name:, child "
        "runs included): how often each edge was taken (and the edges never taken), how the "
        "runs ended, and the tokens the model used in each state. Transitions recorded under "
        "another version that match no edge of WORKFLOW are counted apart. --format svg draws "
        "it on the diagram as heat (needs Graphviz's dot).",
    )
    p.add_argument("workflow", metavar="WORKFLOW", help="a workflow file or stock name")
    p.add_argument(
        "--since",
        type=_since,
        metavar="DURATION",
        help="only the runs started in the last DURATION (90s, 30m, 12h, 7d)",
    )
    p.add_argument(
        "--format",
        choices=("text", "json", "svg"),
        default="text",
        help="text (default), json, or svg: the diagram with each edge as warm and thick as it "
        "is often taken",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    _store_flag(p)
    p.set_defaults(handler=cmd_runs_coverage)


def _since(text: str) -> timedelta:
    """A --since DURATION: a number and one unit (s, m, h, d)."""
    from datetime import timedelta

    from fsm_kernel.workflow.spec import parse_duration

    seconds = parse_duration(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number and one unit, e.g. 90s, 30m, 12h, 7d"
        )
    return timedelta(seconds=seconds)


def _open(args: argparse.Namespace) -> Any:
    """The store, read-only: these commands only read (a missing store is an error, exit 2)."""
    from fsm_kernel.config import default_store_location
    from fsm_kernel.store import open_store

    return open_store(args.store or default_store_location(), read_only=True)


def _nothing_recorded_here(args: argparse.Namespace) -> bool:
    """Whether the list is asked of the default store and none was made yet (a new folder):
    an empty list, not an error; a store named by --store or FSM_KERNEL_STORE must exist."""
    from pathlib import Path

    from fsm_kernel.config import DEFAULT_STORE, default_store_location

    return (
        args.store is None
        and default_store_location() == DEFAULT_STORE
        and not (Path(DEFAULT_STORE).exists())
    )


def cmd_runs_list(args: argparse.Namespace) -> int:
    from fsm_kernel.config import DEFAULT_STORE
    from fsm_kernel.protocol import RunFilter

    if _nothing_recorded_here(args):
        print(f"no runs recorded yet (no store at {DEFAULT_STORE} in this folder)", file=sys.stderr)
        if args.json:
            print("[]")
        return EXIT_OK
    with _open(args) as store:
        # one more tells whether there are more
        where = RunFilter(top_level=True) if args.top_level else None
        runs = store.list_runs(limit=args.limit + 1, waiting=args.waiting, where=where)
    more = len(runs) > args.limit
    runs = _nested(runs[: args.limit])
    if args.json:
        print(json.dumps([r.to_dict() for r, _ in runs], ensure_ascii=False))
        return EXIT_OK
    if not runs:
        print(
            "no run waits for a person" if args.waiting else "no runs recorded yet", file=sys.stderr
        )
        return EXIT_OK
    print(f"{'RUN ID':36}  {'WORKFLOW':12}  {'STARTED':19}  {'ITER':>4}  {'STATUS':16}  GOAL")
    for r, depth in runs:
        workflow = "  " * (depth - 1) + "↳ " + r.workflow if depth else r.workflow
        print(
            f"{r.run_id:36}  {cut(workflow, 12):12}  "
            f"{r.started_at.strftime('%Y-%m-%d %H:%M:%S')}  {r.iterations:>4}  "
            f"{r.shown_status:16}  {cut(r.goal, 50)}"
        )
    if more:
        print(
            f"(showing the {args.limit} most recent runs; there are more: --limit N)",
            file=sys.stderr,
        )
    return EXIT_OK


def _nested(runs: list[RunSummary]) -> list[tuple[RunSummary, int]]:
    """The page's runs, each child right under its parent when the parent is on the page
    (children in the order they started), with its depth; the rest newest first."""
    on_page = {r.run_id for r in runs}
    children: dict[str, list[RunSummary]] = {}
    for r in runs:
        if r.parent_run_id in on_page:
            children.setdefault(str(r.parent_run_id), []).append(r)
    out: list[tuple[RunSummary, int]] = []

    def add(run: RunSummary, depth: int) -> None:
        out.append((run, depth))
        for child in reversed(children.get(run.run_id, [])):  # the page is newest first
            add(child, depth + 1)

    for r in runs:
        if r.parent_run_id not in on_page:
            add(r, 1 if r.parent_run_id else 0)
    return out


def _child_tree(store: EventStore, events: list[Event], seen: set[str]) -> list[dict[str, Any]]:
    """The child runs a run started (from its `child.started` events), each with its own."""
    from fsm_kernel.protocol import EventType

    tree = []
    for e in events:
        if e.type != EventType.CHILD_STARTED:
            continue
        child_id = str(e.data.get("run_id"))
        node: dict[str, Any] = {"run_id": child_id, "workflow": e.data.get("workflow")}
        if "item" in e.data:
            node["item"] = e.data["item"]
        child_events = store.read(child_id) if child_id not in seen else []
        seen.add(child_id)
        if not child_events:
            node.update(status="not started", reason=None, answer=None, children=[])
        else:
            audit = _audit(child_events)
            node.update(
                workflow=audit["workflow"],
                status=_status(store, child_id, audit),
                reason=audit["reason"],
                answer=audit["answer"],
                iterations=max(c.iteration for c in child_events),
                children=_child_tree(store, child_events, seen),
            )
        tree.append(node)
    return tree


def _status(store: Any, run_id: str, audit: dict[str, Any]) -> str:
    """running only while a process drives the run (holds its lock); else interrupted."""
    if audit["status"] == "running" and not store.is_running(run_id):
        return "interrupted"
    return str(audit["status"])


def _print_tree(nodes: list[dict[str, Any]], depth: int = 1) -> None:
    for node in nodes:
        item = f"item {node['item'] + 1}: " if "item" in node else ""
        shown = node["reason"] or node["status"]
        answer = f"  {cut(str(node['answer'] or ''), 60)}" if node.get("answer") else ""
        print(f"{'  ' * depth}└─ {node['run_id']}  {item}{node['workflow']}  {shown}{answer}")
        _print_tree(node["children"], depth + 1)


def _audit(events: list[Event]) -> dict[str, Any]:
    from fsm_kernel.protocol import EventType

    started = events[0].data if events else {}
    terminated: Event | None = None
    waiting: dict[str, Any] | None = None
    for e in events:  # the last ending; one that a resume reopened does not count
        if e.type == EventType.RUN_TERMINATED:
            terminated, waiting = e, None
        elif e.type == EventType.RUN_SUSPENDED:
            waiting = dict(e.data.get("waiting_for") or {})
        elif e.type == EventType.RUN_RESUMED:
            terminated, waiting = None, None
    last = next((e for e in reversed(events) if e.type == EventType.TRANSITION_TAKEN), None)
    entered = next((e for e in reversed(events) if e.type == EventType.STATE_ENTERED), None)
    return {
        "state": (entered.data.get("path") or entered.state) if entered else None,
        "workflow": started.get("workflow"),
        "workflow_path": started.get("workflow_path"),
        "goal": started.get("goal"),
        "status": "ended" if terminated else ("waiting" if waiting else "running"),
        "waiting_for": waiting,
        "answers": [e.data for e in events if e.type == EventType.HUMAN_ANSWERED],
        "reason": terminated.data.get("reason") if terminated else None,
        "answer": terminated.data.get("answer") if terminated else None,
        "error": terminated.data.get("error") if terminated else None,
        "last_transition": last.data if last else None,
        "resumed": sum(1 for e in events if e.type == EventType.RUN_RESUMED),
        "resumable": (terminated is None and waiting is None)
        or bool(terminated and terminated.data.get("resumable")),
        "model": _model_line(started.get("settings") or {}),
        "events": len(events),
        "parent_run_id": started.get("parent_run_id"),
    }


def _model_line(settings: dict[str, Any]) -> str:
    """Which model the run asked, and where (or that the bundled model stood in)."""
    local = settings.get("local")
    if isinstance(local, dict):
        where = f"in-process llama.cpp, {local.get('model')}"
    else:
        where = str(settings.get("base_url") or "")
    line = f"{settings.get('model') or '?'} ({where})" if settings else ""
    if settings.get("fallback"):
        line += " — the bundled model stood in: no model server was configured or running"
    return line


def cmd_runs_show(args: argparse.Namespace) -> int:
    from fsm_kernel.protocol import EventType
    from fsm_kernel.replay import pinning

    with _open(args) as store:
        run_id = store.find_run(args.run_id)
        events = store.read(run_id)
        children = _child_tree(store, events, {run_id})
        audit = _audit(events)
        audit["status"] = _status(store, run_id, audit)
    audit["pinned"] = pinning(events, may_read=lambda _: True)
    iterations = [e.data for e in events if e.type == EventType.ITERATION_COMPLETED]
    why = _why_steps(events) if args.why else None
    if args.json:
        shown: dict[str, Any] = {
            "run_id": run_id,
            "iterations": iterations,
            "termination": audit,
            "children": children,
        }
        if why is not None:
            shown["why"] = why
        print(json.dumps(shown, ensure_ascii=False))
        return EXIT_OK
    print(f"run {run_id}  workflow {audit['workflow']}  ({audit['events']} events)")
    if audit["parent_run_id"]:
        print(f"child of: {audit['parent_run_id']} (fsm-kernel runs show {audit['parent_run_id']})")
    if audit["model"]:
        print(f"model: {audit['model']}")
    if audit["pinned"]["line"]:
        print(f"definition: {audit['pinned']['line']}")
    print(f"goal: {cut(audit['goal'] or '', 150)}\n")
    print(f"{'STEP':>4}  {'DECISION':10}  {'TOOL':16}  {'INPUT':30}  {'OUTPUT':40}  ERROR")
    for it in iterations:
        _print_iteration(it)
    if why is not None:
        _print_why(why)
    _print_audit(run_id, audit)
    if children:
        print("\nchild runs:")
        _print_tree(children)
    return EXIT_OK


def _why_steps(events: list[Event]) -> list[dict[str, Any]]:
    """Each transition the run took, in order, with the edges its step tried (`tried`, as
    recorded in `transition.taken`; None in a log written before fsm-kernel recorded it)."""
    from fsm_kernel.protocol import EventType

    steps: list[dict[str, Any]] = []
    for e in events:
        if e.type != EventType.TRANSITION_TAKEN:
            continue
        d, tried = e.data, e.data.get("tried")
        steps.append(
            {
                "step": len(steps) + 1,
                "seq": e.seq,
                "iteration": e.iteration,
                "index": d.get("index"),
                "source": d.get("from") or d.get("source"),
                "target": d.get("to") or d.get("target"),
                "guard": d.get("guard") or "",
                "reason": d.get("reason"),
                "tried": tried if isinstance(tried, list) else None,
            }
        )
    return steps


def _print_why(steps: list[dict[str, Any]]) -> None:
    from fsm_kernel.workflow.spec import edge_number

    print("\nwhy each transition fired: the edges each step tried, in order")
    print("(✗ passed over: the check that was false; ✓ taken: its checks)")
    for step in steps:
        guard = f" [{step['guard']}]" if step["guard"] else ""
        reason = f" → {step['reason']}" if step["reason"] else ""
        where = f"  (iteration {step['iteration']})" if step["iteration"] else ""
        print(f"  step {step['step']}  {step['source']} → {step['target']}{guard}{reason}{where}")
        if step["tried"] is None:
            print("    (not recorded: the run was recorded before fsm-kernel kept why)")
            continue
        edges = [f"edge {edge_number(t.get('edge'))} → {t.get('target')}" for t in step["tried"]]
        width = max(map(len, edges), default=0)
        for edge, tried in zip(edges, step["tried"], strict=True):
            mark = "✓" if tried.get("passed") else "✗"
            print(f"    {mark} {edge:{width}}  {_decided(tried)}")


def _decided(tried: dict[str, Any]) -> str:
    """What decided one edge: the checks of the edge taken, or the check that was false."""
    checks = [c for c in tried.get("checks") or () if isinstance(c, dict)]
    if tried.get("passed"):
        shown = checks
    else:
        shown = [c for c in checks if not c.get("value")][:1] or checks
    if not shown:
        return "(no condition)" if tried.get("passed") else "(no check recorded)"
    return ", ".join(f"{c.get('check')}: {'true' if c.get('value') else 'false'}" for c in shown)


def _print_audit(run_id: str, audit: dict[str, Any]) -> None:
    print("\ntermination audit:")
    if audit["waiting_for"] is not None:
        waiting = audit["waiting_for"]
        if waiting.get("kind") == "event":  # a waiting state: an event, or its timer
            print(f"  status:          waiting for {_event_line(waiting)}")
            print(f"  go on with:      {_event_commands(run_id, waiting)}")
        else:
            print(f"  status:          waiting for a person: {_waiting_line(waiting)}")
            print(f"  answer with:     fsm-kernel resume {run_id} {_answer_flags(waiting)}")
    elif audit["status"] == "interrupted":
        print("  status:          interrupted (its process stopped before the run ended)")
    else:
        print(f"  reason:          {audit['reason'] or '(not terminated: resume it)'}")
    for answered in audit["answers"]:
        print(f"  answered:        {_answered_line(answered)}")
    _print_where(audit)
    if audit["error"]:
        print(f"  error:           {audit['error']}")
    if audit["answer"]:
        print(f"  answer:          {cut(audit['answer'], 150)}")
    if audit["resumed"]:
        print(f"  resumed:         {audit['resumed']} time(s)")
    if audit["resumable"]:
        why = "it did not end" if audit["reason"] is None else "the model server failed"
        print(f"  resumable:       yes ({why}): fsm-kernel resume {run_id}")


def _print_where(audit: dict[str, Any]) -> None:
    """Where the run is (its full path, inside a compound state) and its last transition, with
    the full paths of the states it left and entered where the log has them."""
    if audit["reason"] is None and "." in str(audit["state"] or ""):
        print(f"  state:           {audit['state']}")
    if audit["last_transition"]:
        t = audit["last_transition"]
        guard = f" [{t.get('guard')}]" if t.get("guard") else ""
        source, target = t.get("from") or t["source"], t.get("to") or t["target"]
        print(f"  last transition: {source} → {target}{guard}")


def _waiting_line(waiting: dict[str, Any]) -> str:
    call = waiting.get("tool_call")
    if waiting.get("kind") == "approval" and isinstance(call, dict):
        arguments = json.dumps(call.get("arguments"), ensure_ascii=False, sort_keys=True)
        return f"approval of {call.get('name')}({cut(arguments, 80)}) in {waiting.get('state')}"
    return f"input {cut(str(waiting.get('prompt') or ''), 80)!r} in {waiting.get('state')}"


def _event_line(waiting: dict[str, Any]) -> str:
    events = " | ".join(str(e) for e in waiting.get("events") or ()) or "no event"
    due = f" or its timer, due {waiting['due']}" if waiting.get("due") else ""
    return f"event {events}{due} in {waiting.get('state')}"


def _event_commands(run_id: str, waiting: dict[str, Any]) -> str:
    first = next(iter(waiting.get("events") or ()), "NAME")
    once_due = f"; once due: fsm-kernel resume {run_id}" if waiting.get("due") else ""
    return f"fsm-kernel signal {run_id} {first} [--data JSON]{once_due}"


def _answer_flags(waiting: dict[str, Any]) -> str:
    return "--approve | --reject WHY" if waiting.get("kind") == "approval" else "--input TEXT"


def _answered_line(data: dict[str, Any]) -> str:
    if data.get("kind") == "input":
        what = f"input {cut(str(data.get('text') or ''), 60)!r}"
    elif data.get("approved"):
        what = "approved"
    else:
        what = f"rejected ({cut(str(data.get('reason') or ''), 60)})"
    return f"{what} by {data.get('by')} in {data.get('state')}"


def _print_iteration(it: dict[str, Any]) -> None:
    tools = it.get("tools") or [{}]
    for n, t in enumerate(tools):
        step = str(it["step"]) if n == 0 else ""
        decision = it["decision"] if n == 0 else ""
        args = json.dumps(t.get("input"), ensure_ascii=False) if t else ""
        output = (
            ("✗ " if t.get("is_error") else "") + t.get("output", "")
            if t
            else cut(it.get("answer", ""), 40)
        )
        error = cut(it.get("error") or "", 40) if n == 0 else ""
        print(
            f"{step:>4}  {decision:10}  {cut(t.get('name', ''), 16):16}  {cut(args, 30):30}  "
            f"{cut(output, 40):40}  {error}"
        )
    if it.get("summary"):
        print(f"{'':>4}  {'':10}  {cut(it['summary'], 110)}")


def cmd_runs_events(args: argparse.Namespace) -> int:
    with _open(args) as store:
        events = store.read(store.find_run(args.run_id))
    for e in events:
        if args.json:
            print(json.dumps(e.to_dict(), ensure_ascii=False))
        else:
            print(
                f"{e.seq:>5}  {e.timestamp.strftime('%H:%M:%S.%f')[:-3]}  {e.iteration:>3}  "
                f"{e.type.value:20}  {e.state or '':12}  {cut(json.dumps(e.data), 100)}"
            )
    return EXIT_OK


def cmd_runs_export(args: argparse.Namespace) -> int:
    from fsm_kernel.store import export_run

    with _open(args) as store:
        count = export_run(store, store.find_run(args.run_id), args.output)
    print(f"wrote {count} events to {args.output}", file=sys.stderr)
    return EXIT_OK


def _recorded_workflow(run: RecordedRun, override: str | WorkflowSpec | None) -> str | WorkflowSpec:
    """The workflow to go on with: --workflow if given, else the text the run recorded (it is
    pinned to it even after its file changed), else (a log from an older fsm-kernel) the file
    at the recorded path, which resume checks against the recorded hash."""
    from fsm_kernel.bootstrap import recorded_workflow

    return override or recorded_workflow(run)


def cmd_resume(args: argparse.Namespace) -> int:
    return continue_run(args, lambda: _answer(args))


def continue_run(args: argparse.Namespace, answer_of: Callable[[], HumanAnswer | None]) -> int:
    """Continue a recorded run (`resume`, `signal`) with the answer `answer_of` gives: on the
    definition it recorded, or the one --workflow/--migrate moves it to, with the recorded
    settings that the flags given override (and are recorded)."""
    import asyncio

    from fsm_kernel.cli import commands
    from fsm_kernel.config import default_store_location
    from fsm_kernel.replay import RecordedRun, check_answer

    with _open(args) as store:
        run = RecordedRun.load(store, args.run_id)
        root = run.root_run_id(store)
    if args.migrate:  # to the current file (or --workflow), checked by agent.resume
        args.workflow = _migration_target(run, args.workflow)
    args.workflow = _recorded_workflow(run, args.workflow)
    overrides = commands.agent_options(commands.options_from_args(args))
    answer = answer_of()
    if not args.migrate:  # else agent.resume checks the migration first, then these
        _check_resumable(run, answer)  # the same refusal with an answer or without (exit 2)
        check_answer(run, answer)  # a one-line usage error before anything is built
    if _runs_under_dbos(run):  # its DBOS workflow drives it: the answer goes there
        return _send_to_dbos(run, answer, as_json=args.json, root=root)
    location = args.store or default_store_location()

    async def go(agent: Agent) -> RunResult:
        result = await agent.resume(
            run.run_id, force=args.force, answer=answer, migrate=args.migrate, **overrides
        )
        if result.status == "ended":  # a scheduler dispatch that waited on it is done now
            await asyncio.to_thread(_settle_dispatch, location, result)
        return result

    return commands.execute(args, go)


def _runs_under_dbos(run: RecordedRun) -> bool:
    """The run's `run.started` says a DBOS workflow drives it (fsm_kernel.integrations.dbos)."""
    return run.engine == "dbos"


def _send_to_dbos(run: RecordedRun, answer: HumanAnswer | None, *, as_json: bool, root: str) -> int:
    """Send the answer to the run's DBOS workflow, which goes on with it in its process."""
    from fsm_kernel.errors import ConfigError

    try:
        from fsm_kernel.integrations.dbos import send_to_run
    except ImportError:
        raise ConfigError(
            f"run {run.run_id} runs under DBOS: answering it needs pip install 'fsm-kernel[dbos]'"
        ) from None
    workflow = send_to_run(run, answer, root=root)
    if as_json:
        print(json.dumps({"run_id": run.run_id, "status": "sent", "engine": "dbos"}))
    else:
        print(f"sent to run {run.run_id}: its DBOS workflow ({workflow}) goes on with it")
    return 0


def _migration_target(run: RecordedRun, given: str | None) -> str:
    """Where `--migrate` moves the run: --workflow, else the file at its recorded path (as it
    reads now). Agent.resume(migrate=True) replays the run's recorded steps under it and
    refuses a definition that decides differently (see regression.migration_check).

    Raises:
        ResumeError: the run ended for good, or recorded no path and none was given.
    """
    from fsm_kernel.errors import ResumeError

    _check_resumable(run, None)
    path = given or run.started.data.get("workflow_path")
    if not path:
        raise ResumeError(f"run {run.run_id} recorded no workflow path; pass --workflow")
    return str(path)


def _check_resumable(run: RecordedRun, answer: HumanAnswer | None) -> None:
    """Refuse a run that ended for good before asking whether an answer fits it.

    Raises:
        ResumeError: the run ended, and not because its model server failed.
    """
    nobody = "" if answer is None else f", so it does not wait for a person ({answer.flag})"
    run.refuse_if_ended(detail=nobody)


def _settle_dispatch(store: str, result: RunResult) -> None:
    import logging

    from fsm_kernel.scheduler.queue import settle_waiting_dispatch

    reason = result.termination_reason
    settled = settle_waiting_dispatch(
        store,
        result.run_id,
        ok=result.ok,
        termination_reason=None if reason is None else str(reason),
        error=result.error,
    )
    if settled is not None:
        logging.getLogger(__name__).info(
            "dispatch %s (%s): %s", settled.dispatch_id, settled.agent_id, settled.status
        )


def _answer(args: argparse.Namespace) -> HumanAnswer | None:
    from fsm_kernel.workflow.human import HumanAnswer

    if args.approve:
        return HumanAnswer.approve(by=args.by)
    if args.reject is not None:
        return HumanAnswer.reject(args.reject, by=args.by)
    if args.input is not None:
        return HumanAnswer.input(args.input, by=args.by)
    return None


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from fsm_kernel.bootstrap import load_spec
    from fsm_kernel.errors import ConfigError

    if args.all_runs:
        if args.run_id is not None:
            raise ConfigError("give RUN_ID or --all, not both")
        return cmd_replay_all(args)
    if args.run_id is None:
        raise ConfigError("give a RUN_ID, or --all for every stored run")
    if args.since is not None:
        raise ConfigError("--since goes with --all")
    from fsm_kernel.replay import RecordedRun, replay_run
    from fsm_kernel.workflow.compiler import compile_workflow

    with _open(args) as store:
        run = RecordedRun.load(store, args.run_id)
        chosen = _recorded_workflow(run, args.workflow)
        spec = load_spec(chosen) if isinstance(chosen, str) else chosen
        # Without --workflow: reproduce the run under the limits it ran with (from its log);
        # with it: a what-if under the edited file's own limits.
        limits = spec.limits if args.workflow else None
        report = asyncio.run(replay_run(compile_workflow(spec), store, run.run_id, limits=limits))
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
        return EXIT_OK if report.identical else EXIT_FAIL
    for s in report.steps:
        mark = "=" if s.same else "≠"
        line = f"{mark} step {s.step:>3} (iteration {s.iteration}): {s.recorded or '(none)'}"
        if not s.same:
            line += f"   replayed: {s.replayed or '(none)'}"
        print(line)
    first = report.first_divergence
    if report.identical:
        print(
            f"identical: {len(report.steps)} transitions, reason {report.replayed_reason}, "
            f"{report.model_calls} model answers served from the log, no model or tool called"
        )
        return EXIT_OK
    if first is not None:
        print(
            f"diverged at step {first.step} (iteration {first.iteration}): recorded "
            f"{first.recorded or '(nothing)'}, replay took {first.replayed or '(nothing)'}"
        )
    else:
        print(
            f"diverged: recorded reason {report.recorded_reason}, replay ended with "
            f"{report.replayed_reason}"
        )
    return EXIT_FAIL


def cmd_replay_all(args: argparse.Namespace) -> int:
    """`replay --all`: every stored run re-decided, one at a time; a line per run that diverged
    or could not be replayed as it comes, then the summary."""
    import asyncio
    from datetime import UTC, datetime

    from fsm_kernel.bootstrap import load_spec
    from fsm_kernel.regression import Verdict, replay_all

    edited = load_spec(args.workflow) if args.workflow else None  # a broken file: exit 2
    since = datetime.now(UTC) - args.since if args.since is not None else None
    counts = {"identical": 0, "diverged": 0, "unreplayable": 0}
    shown: list[Verdict] = []  # only the runs to report: a store of identical runs keeps none
    children = 0

    async def sweep(store: Any) -> None:
        nonlocal children
        async for verdict in replay_all(store, workflow=edited, since=since):
            counts[verdict.outcome] += 1
            children += verdict.children
            if verdict.outcome != "identical":
                shown.append(verdict)
                if not args.json:
                    print(_verdict_line(verdict), flush=True)

    with _open(args) as store:
        asyncio.run(sweep(store))
    if args.json:
        summary = {
            "runs": sum(counts.values()),
            **counts,
            "child_runs": children,
            "workflow": args.workflow,
            "since": since.isoformat() if since else None,
            "reported": [v.to_dict() for v in shown],
        }
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(_replay_all_summary(counts, children, edited.name if edited else None))
    return EXIT_FAIL if counts["diverged"] else EXIT_OK


def _verdict_line(verdict: Any) -> str:
    """`≠ RUN (workflow): diverged at step 2 …` or `? RUN (workflow): unreplayable: why`."""
    head = f"{verdict.run_id} ({verdict.workflow})"
    if verdict.outcome == "unreplayable":
        return f"? {head}: unreplayable: {verdict.why}"
    d = verdict.divergence
    where = "" if d.run_id == verdict.run_id else f" in its child run {d.run_id}"
    return f"≠ {head}: diverged{where} {d.line()}"


def _replay_all_summary(counts: dict[str, int], children: int, workflow: str | None) -> str:
    total = sum(counts.values())
    if not total:
        of = f" of workflow {workflow}" if workflow else ""
        return f"no stored runs{of} to replay"
    within = f" ({children} child runs replayed within their parents)" if children else ""
    return (
        f"{total} run{'s' if total != 1 else ''} replayed: {counts['identical']} identical, "
        f"{counts['diverged']} diverged, {counts['unreplayable']} unreplayable{within}; "
        "no model or tool called"
    )


def cmd_runs_coverage(args: argparse.Namespace) -> int:
    """`runs coverage WORKFLOW`: a workflow's stored runs, added up."""
    from datetime import UTC, datetime
    from pathlib import Path

    from fsm_kernel.bootstrap import load_spec
    from fsm_kernel.regression import workflow_coverage

    spec = load_spec(args.workflow)
    since = datetime.now(UTC) - args.since if args.since is not None else None
    with _open(args) as store:
        heat = workflow_coverage(store, spec, since=since)
    if args.format == "svg":
        text = _coverage_svg(spec, heat)
    elif args.format == "json":
        text = json.dumps(_coverage_dict(spec, heat), ensure_ascii=False) + "\n"
    else:
        text = "\n".join(_coverage_lines(spec, heat)) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(Path(args.output), text)
        print(args.output)
    return EXIT_OK


def _coverage_svg(spec: WorkflowSpec, heat: Any) -> str:
    from fsm_kernel.diagram import render_svg, to_dot
    from fsm_kernel.redact import redact

    return render_svg(redact(to_dot(spec, overlay=heat)))


def _coverage_edges(spec: WorkflowSpec, heat: Any) -> list[dict[str, Any]]:
    from fsm_kernel.diagram import edge_label
    from fsm_kernel.diagram._labels import edge_end

    edges = []
    for index in heat.edges(spec):
        source, target, reason = edge_end(spec, index)
        edges.append(
            {
                "index": index,
                "source": source,
                "target": target,
                "reason": reason,
                "label": edge_label(spec, index),
                "taken": heat.traversals.get(index, 0),
            }
        )
    return edges


def _coverage_dict(spec: WorkflowSpec, heat: Any) -> dict[str, Any]:
    edges = _coverage_edges(spec, heat)
    return {
        "workflow": spec.name,
        "runs": heat.runs,
        "edges": edges,
        "edges_taken": sum(1 for e in edges if e["taken"]),
        "never_taken": [e["index"] for e in edges if not e["taken"]],
        "unmatched_transitions": heat.unmatched,
        "reasons": dict(sorted(heat.reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "tokens": dict(sorted(heat.tokens.items(), key=lambda kv: (-kv[1], kv[0]))),
        "visits": dict(sorted(heat.visits.items())),
    }


def _coverage_lines(spec: WorkflowSpec, heat: Any) -> list[str]:
    data = _coverage_dict(spec, heat)
    edges = data["edges"]
    if not heat.runs:
        return [f"no stored runs of workflow {spec.name}"]
    runs = f"{heat.runs} run{'s' if heat.runs != 1 else ''}"
    share = 100 * data["edges_taken"] // max(len(edges), 1)
    lines = [f"workflow {spec.name}, {runs}: {data['edges_taken']} of {len(edges)} edges taken "
             f"({share}%)", "", "edges taken:"]  # fmt: skip
    lines += [_edge_line(e) for e in edges if e["taken"]]
    never = [e for e in edges if not e["taken"]]
    if never:
        lines += ["", "never taken:", *(_edge_line(e) for e in never)]
    if heat.unmatched:
        lines.append(
            f"({heat.unmatched} recorded transitions match no edge of this file: recorded under "
            "another version; not counted)"
        )
    lines += ["", "termination reasons:"]
    lines += [f"  {n:>6}  {reason}" for reason, n in data["reasons"].items()]
    lines += ["", "tokens per state:"]
    tokens = [f"  {n:>10,}  {state}" for state, n in data["tokens"].items()]
    lines += tokens or ["  (none reported)"]
    return lines


def _edge_line(edge: dict[str, Any]) -> str:
    taken = f"×{edge['taken']}" if edge["taken"] else ""
    label = f"  {edge['label']}" if edge["label"] else ""
    return f"  {taken:>7}  {edge['source']} → {edge['target']}{label}"


def _write(path: Path, text: str) -> None:
    from fsm_kernel.errors import ConfigError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
