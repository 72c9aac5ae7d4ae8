# ruff: noqa: C901, E501 -- one flat function per framework
"""One contender of the loop benchmark, in a process of its own, driven over stdin/stdout.

    python benchmarks/_contenders.py NAME [--pg-dsn DSN]

It imports its framework, builds what it needs, prints `READY`, then answers each JSON command
line (`{"n": 50, "sample_io": false, "stored": false}`) with one JSON line: the run's wall time,
the model-call times, the I/O it caused, the stored bytes and the digest of its final history.
compare.py starts one per contender and asks them in turn (round-robin), so one framework's
imports, threads or garbage never slow another down.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import operator
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypedDict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _loop import (  # noqa: E402
    PROMPT,
    SYSTEM_PROMPT,
    Clock,
    call_args,
    call_id,
    digest,
    echo,
    final_text,
    io_counters,
    reference,
    row,
    tree_bytes,
)

Outcome = dict[str, Any]


class Contender:
    """Runs the loop N times per command; subclasses fill in `_run`."""

    name = ""
    durable = False

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def run(self, n: int, *, sample_io: bool, stored: bool) -> Outcome:
        run_dir = Path(tempfile.mkdtemp(dir=self.workdir))
        try:
            clock = Clock(sample_io=sample_io)
            gc.collect()
            out = self._run(n, clock, run_dir, stored=stored)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        out["calls"] = clock.calls
        if sample_io:
            out["io"] = clock.io
        out["ok"] = out["digest"] == digest(reference(n))
        return out

    def _run(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        raise NotImplementedError


def _measure(
    run: Callable[[], Any], close: Callable[[], None], files: Callable[[], Sequence[str]]
) -> tuple[Any, Outcome]:
    """Time `run()`; count the I/O of the run and of closing the store; size the store."""
    io0 = io_counters()
    t0 = time.perf_counter()
    result = run()
    t1 = time.perf_counter()
    close()
    io1 = io_counters()
    return result, {
        "seconds": t1 - t0,
        "write_bytes": io1[0] - io0[0],
        "wchar": io1[1] - io0[1],
        "store_bytes": tree_bytes(files()),
    }


# --- the floor -------------------------------------------------------------------------------


class Floor(Contender):
    """A hand-written Python loop: the least any runtime can cost."""

    name = "floor"

    def _run(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        def model(messages: list[dict[str, Any]]) -> dict[str, Any]:
            i = clock.tick()
            if i < n:
                return {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [(call_id(i), "echo", call_args(i))],
                }
            return {"role": "assistant", "content": final_text(n), "tool_calls": []}

        def loop() -> list[dict[str, Any]]:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": PROMPT},
            ]
            tools = {"echo": echo}
            while True:
                reply = model(messages)
                messages.append(reply)
                if not reply["tool_calls"]:
                    return messages
                for cid, name, args in reply["tool_calls"]:
                    out = tools[name](**args)
                    messages.append({"role": "tool", "content": out, "tool_call_id": cid})

        messages, out = _measure(loop, lambda: None, list)
        rows = [
            row(m["role"], m["content"], m.get("tool_calls", ()), m.get("tool_call_id", ""))
            for m in messages[1:]
        ]
        out["digest"] = digest(rows)
        return out


# --- fsm-kernel ------------------------------------------------------------------------------


class FsmKernel(Contender):
    """fsm-kernel's Kernel driving the default workflow's shape, offering one `echo` tool.
    With `tool_timeout=False` its registry has no timeout, so `echo` is called inline on the
    event loop's thread, as the peers call it, instead of on a pool thread that enforces the
    default 30 s (the `_inline` contenders)."""

    def __init__(
        self, workdir: Path, store: str, pg_dsn: str | None = None, *, tool_timeout: bool = True
    ) -> None:
        super().__init__(workdir)
        from fsm_kernel.tools.registry import ToolRegistry
        from fsm_kernel.workflow.compiler import compile_workflow
        from fsm_kernel.workflow.loader import load_workflow
        from fsm_kernel.workflow.spec import Limits

        self.store_kind = store
        self.name = f"fsm_{store}" if tool_timeout else f"fsm_{store}_inline"
        self.durable = store != "memory"
        self.pg_dsn = pg_dsn
        self.compiled = compile_workflow(load_workflow(REPO / "workflows" / "default.yaml"))
        self.registry = ToolRegistry() if tool_timeout else ToolRegistry(default_timeout=None)
        self.registry.register(echo)
        self.limits = Limits(max_iterations=0, max_transitions=10**9, timeout_seconds=0)
        # A plain loop, not asyncio.run/Runner: on Python 3.11 Runner.run ends with
        # signal.getsignal(SIGINT), which builds a ValueError quoting repr() of its handler,
        # a partial holding the main task, hence repr() of the task's RunResult with every
        # event: O(run) of work per run that belongs to neither contender.
        self.loop = asyncio.new_event_loop()

    def _open(self, run_dir: Path) -> tuple[Any, list[str]]:
        from fsm_kernel.store import JsonlEventStore, PostgresEventStore, SqliteEventStore

        if self.store_kind == "memory":
            return None, []
        if self.store_kind == "sqlite":
            path = run_dir / "runs.db"
            return SqliteEventStore(path), [str(path), f"{path}-wal", f"{path}-shm"]
        if self.store_kind == "jsonl":
            path = run_dir / "runs.jsonl"
            return JsonlEventStore(path), [str(path)]
        assert self.pg_dsn is not None
        return PostgresEventStore(self.pg_dsn), []

    def _run(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        from fsm_kernel.kernel import Kernel
        from fsm_kernel.protocol import Completion, Message, ToolCall

        class Scripted:
            async def complete(
                self, messages: Sequence[Message], tools: Sequence[Any]
            ) -> Completion:
                i = clock.tick()
                if i < n:
                    call = ToolCall(id=call_id(i), name="echo", arguments=call_args(i))
                    return Completion(
                        message=Message.assistant("", [call]), finish_reason="tool_calls"
                    )
                return Completion(message=Message.assistant(final_text(n)))

        store, files = self._open(run_dir)
        kernel = Kernel(
            self.compiled,
            model=Scripted(),
            tools=self.registry,
            store=store,
            system_prompt=SYSTEM_PROMPT,
            tool_names=["echo"],
            limits=self.limits,
        )
        run_id = str(uuid.uuid4())

        def close() -> None:
            if store is not None:
                store.close()

        result, out = _measure(
            lambda: self.loop.run_until_complete(kernel.run(PROMPT, run_id=run_id)),
            close,
            lambda: files,
        )
        assert result.termination_reason == "final_answer", (
            result.termination_reason,
            result.error,
        )
        rows = [
            row(
                m.role.value,
                m.content,
                [(c.id, c.name, c.arguments) for c in m.tool_calls],
                m.tool_call_id or "",
            )
            for m in result.messages
        ]
        out["digest"] = digest(rows)
        if stored and store is not None:
            out["stored_per_iteration"] = self._stored(run_dir, run_id, n)
        if self.store_kind == "postgres":
            out["store_bytes"] = self._pg_bytes(run_id)
        return out

    def _stored(self, run_dir: Path, run_id: str, n: int) -> list[int]:
        """Bytes of stored event payload per iteration (JSON of each event), read back."""
        from fsm_kernel.store import open_store

        location = {"sqlite": run_dir / "runs.db", "jsonl": run_dir / "runs.jsonl"}.get(
            self.store_kind, self.pg_dsn
        )
        per = [0] * (n + 2)
        with open_store(str(location)) as store:
            for event in store.read(run_id):
                per[min(event.iteration, n + 1)] += len(json.dumps(event.to_dict()))
        return per

    def _pg_bytes(self, run_id: str) -> int:
        import psycopg

        assert self.pg_dsn is not None
        with psycopg.connect(self.pg_dsn) as conn:
            row_ = conn.execute(
                "SELECT COALESCE(SUM(pg_column_size(e.*)), 0) FROM events e WHERE run_id = %s",
                (run_id,),
            ).fetchone()
        return int(row_[0]) if row_ else 0


# --- LangGraph -------------------------------------------------------------------------------


class LeanState(TypedDict):
    """LangGraph's leanest state for the loop: plain dict messages, appended."""

    messages: Annotated[list[dict[str, Any]], operator.add]


class LangGraph(Contender):
    """LangGraph's StateGraph over MessagesState: a model node, a hand-written tool node (no
    ToolNode thread pool), a conditional edge back; `invoke` (sync, as SqliteSaver is).
    `lean`: its leanest form instead, a TypedDict state whose `messages` are plain dicts
    appended with operator.add (no message classes, no add_messages reducer)."""

    def __init__(
        self, workdir: Path, saver: str, durability: str | None, lean: bool = False
    ) -> None:
        super().__init__(workdir)
        self.saver_kind = saver
        self.durability = durability
        self.durable = saver != "memory"
        self.lean = lean
        base = "langgraph_lean" if lean else "langgraph"
        self.name = f"{base}_memory" if saver == "memory" else f"{base}_sqlite_{durability}"
        import langgraph.graph  # noqa: F401 -- imported before timing
        from langchain_core.messages import AIMessage  # noqa: F401

    def _run(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        if self.lean:
            return self._run_lean(n, clock, run_dir, stored=stored)
        return self._run_messages(n, clock, run_dir, stored=stored)

    def _compile(
        self, graph: Any, run_dir: Path
    ) -> tuple[Any, sqlite3.Connection | None, list[str]]:
        if self.saver_kind != "sqlite":
            return graph.compile(), None, []
        from langgraph.checkpoint.sqlite import SqliteSaver

        path = run_dir / "lg.db"
        conn = sqlite3.connect(str(path), check_same_thread=False)
        saver = SqliteSaver(conn)
        saver.setup()
        return graph.compile(checkpointer=saver), conn, [str(path), f"{path}-wal", f"{path}-shm"]

    def _run_lean(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        from langgraph.graph import END, START, StateGraph

        def model(state):  # type: ignore[no-untyped-def]  # unannotated: LangGraph reads hints
            i = clock.tick()
            if i < n:
                calls = [[call_id(i), "echo", call_args(i)]]
                return {"messages": [{"role": "assistant", "content": "", "tool_calls": calls}]}
            return {"messages": [{"role": "assistant", "content": final_text(n), "tool_calls": []}]}

        def run_tools(state):  # type: ignore[no-untyped-def]
            last = state["messages"][-1]
            return {
                "messages": [
                    {"role": "tool", "content": echo(**args), "tool_call_id": cid}
                    for cid, _name, args in last["tool_calls"]
                ]
            }

        def route(state):  # type: ignore[no-untyped-def]
            return "tools" if state["messages"][-1]["tool_calls"] else END

        graph = StateGraph(LeanState)
        graph.add_node("model", model)
        graph.add_node("tools", run_tools)
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", route, ["tools", END])
        graph.add_edge("tools", "model")
        app, conn, files = self._compile(graph, run_dir)
        config: dict[str, Any] = {
            "configurable": {"thread_id": "bench"},
            "recursion_limit": 2 * n + 10,
        }
        inputs = {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                               {"role": "user", "content": PROMPT}]}  # fmt: skip
        kwargs = {"durability": self.durability} if self.durability else {}

        def close() -> None:
            if conn is not None and not stored:
                conn.close()

        state, out = _measure(lambda: app.invoke(inputs, config, **kwargs), close, lambda: files)
        rows = [
            row(m["role"], m["content"], [tuple(c) for c in m.get("tool_calls", ())],
                m.get("tool_call_id", ""))
            for m in state["messages"][1:]
        ]  # fmt: skip
        out["digest"] = digest(rows)
        if stored and conn is not None:
            out["stored_per_iteration"] = self._stored(conn, n)
            conn.close()
            out["store_bytes"] = tree_bytes(files)
        return out

    def _run_messages(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
        from langgraph.graph import END, START, MessagesState, StateGraph

        tools = {"echo": echo}

        def model(state):  # type: ignore[no-untyped-def]  # unannotated: LangGraph reads hints
            i = clock.tick()
            if i < n:
                call = {"name": "echo", "args": call_args(i), "id": call_id(i), "type": "tool_call"}
                return {"messages": [AIMessage(content="", tool_calls=[call])]}
            return {"messages": [AIMessage(content=final_text(n))]}

        def run_tools(state):  # type: ignore[no-untyped-def]
            last = state["messages"][-1]
            return {
                "messages": [
                    ToolMessage(
                        content=tools[tc["name"]](**tc["args"]),
                        tool_call_id=tc["id"],
                        name=tc["name"],
                    )
                    for tc in last.tool_calls  # type: ignore[attr-defined]
                ]
            }

        def route(state):  # type: ignore[no-untyped-def]
            return "tools" if state["messages"][-1].tool_calls else END  # type: ignore[attr-defined]

        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", run_tools)
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", route, ["tools", END])
        graph.add_edge("tools", "model")

        conn: sqlite3.Connection | None = None
        files: list[str] = []
        if self.saver_kind == "sqlite":
            from langgraph.checkpoint.sqlite import SqliteSaver

            path = run_dir / "lg.db"
            conn = sqlite3.connect(str(path), check_same_thread=False)
            saver = SqliteSaver(conn)
            saver.setup()
            files = [str(path), f"{path}-wal", f"{path}-shm"]
            app = graph.compile(checkpointer=saver)
        else:
            app = graph.compile()
        config: dict[str, Any] = {
            "configurable": {"thread_id": "bench"},
            "recursion_limit": 2 * n + 10,
        }
        inputs = {"messages": [SystemMessage(SYSTEM_PROMPT), HumanMessage(PROMPT)]}
        kwargs = {"durability": self.durability} if self.durability else {}

        def close() -> None:
            if conn is not None and not stored:
                conn.close()

        state, out = _measure(lambda: app.invoke(inputs, config, **kwargs), close, lambda: files)
        rows = []
        for m in state["messages"][1:]:
            if isinstance(m, HumanMessage):
                rows.append(row("user", str(m.content)))
            elif isinstance(m, AIMessage):
                calls = [(tc["id"], tc["name"], tc["args"]) for tc in m.tool_calls]
                rows.append(row("assistant", str(m.content), calls))
            elif isinstance(m, ToolMessage):
                rows.append(row("tool", str(m.content), tool_call_id=m.tool_call_id))
        out["digest"] = digest(rows)
        if stored and conn is not None:
            out["stored_per_iteration"] = self._stored(conn, n)
            conn.close()
            out["store_bytes"] = tree_bytes(files)
        return out

    @staticmethod
    def _stored(conn: sqlite3.Connection, n: int) -> list[int]:
        """Checkpoint and pending-write bytes per iteration (two supersteps each)."""
        per = [0] * (n + 2)
        q = "SELECT json_extract(CAST(metadata AS TEXT), '$.step'), LENGTH(checkpoint) + LENGTH(metadata) FROM checkpoints"
        for step, size in conn.execute(q):
            per[min(max(int(step or 0), 0) // 2, n + 1)] += int(size or 0)
        q = (
            "SELECT json_extract(CAST(c.metadata AS TEXT), '$.step'), LENGTH(w.value) "
            "FROM writes w JOIN checkpoints c ON c.checkpoint_id = w.checkpoint_id"
        )
        for step, size in conn.execute(q):
            per[min(max(int(step or 0), 0) // 2, n + 1)] += int(size or 0)
        return per


# --- Burr ------------------------------------------------------------------------------------


class Burr(Contender):
    """Apache Burr: `model` and `tools` actions over a `messages` list in its State, halting
    after `final`; optionally its SQLitePersister saving state after every step."""

    def __init__(self, workdir: Path, persister: bool) -> None:
        super().__init__(workdir)
        self.persist = persister
        self.durable = persister
        self.name = "burr_sqlite" if persister else "burr_memory"
        import burr.core  # noqa: F401 -- imported before timing

    def _run(self, n: int, clock: Clock, run_dir: Path, *, stored: bool) -> Outcome:
        from burr.core import ApplicationBuilder, State, default, when
        from burr.core.action import action

        @action(reads=["messages"], writes=["messages", "done"])
        def model(state: State) -> State:
            i = clock.tick()
            if i < n:
                msg = {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [[call_id(i), "echo", call_args(i)]],
                }
                return state.append(messages=msg).update(done=False)
            return state.append(messages={"role": "assistant", "content": final_text(n)}).update(
                done=True
            )

        @action(reads=["messages"], writes=["messages"])
        def tools(state: State) -> State:
            last = state["messages"][-1]
            for cid, _name, args in last["tool_calls"]:
                state = state.append(
                    messages={"role": "tool", "content": echo(**args), "tool_call_id": cid}
                )
            return state

        @action(reads=[], writes=[])
        def final(state: State) -> State:
            return state

        builder = (
            ApplicationBuilder()
            .with_actions(model=model, tools=tools, final=final)
            .with_transitions(
                ("model", "final", when(done=True)),
                ("model", "tools", default),
                ("tools", "model", default),
            )
            .with_state(
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": PROMPT},
                ],
                done=False,
            )
            .with_entrypoint("model")
            .with_identifiers(app_id=str(uuid.uuid4()))
        )
        persister = None
        files: list[str] = []
        if self.persist:
            from burr.core.persistence import SQLitePersister

            path = run_dir / "burr.db"
            persister = SQLitePersister(db_path=str(path), table_name="burr_state")
            persister.initialize()
            builder = builder.with_state_persister(persister)
            files = [str(path), f"{path}-journal", f"{path}-wal"]
        app = builder.build()

        def close() -> None:
            if persister is not None and not stored:
                persister.connection.close()

        (_, _, state), out = _measure(lambda: app.run(halt_after=["final"]), close, lambda: files)
        rows = [
            row(
                m["role"],
                m["content"],
                [tuple(c) for c in m.get("tool_calls", ())],
                m.get("tool_call_id", ""),
            )
            for m in state["messages"][1:]
        ]
        out["digest"] = digest(rows)
        if stored and persister is not None:
            per = [0] * (n + 2)
            q = "SELECT sequence_id, LENGTH(state) FROM burr_state"
            for seq, size in persister.connection.execute(q):
                per[min(int(seq) // 2, n + 1)] += int(size)
            out["stored_per_iteration"] = per
            persister.connection.close()
            out["store_bytes"] = tree_bytes(files)
        return out


# --- the worker ------------------------------------------------------------------------------

CONTENDERS: dict[str, Callable[[Path, str | None], Contender]] = {
    "floor": lambda w, dsn: Floor(w),
    "fsm_memory": lambda w, dsn: FsmKernel(w, "memory"),
    "fsm_sqlite": lambda w, dsn: FsmKernel(w, "sqlite"),
    "fsm_jsonl": lambda w, dsn: FsmKernel(w, "jsonl"),
    "fsm_memory_inline": lambda w, dsn: FsmKernel(w, "memory", tool_timeout=False),
    "fsm_sqlite_inline": lambda w, dsn: FsmKernel(w, "sqlite", tool_timeout=False),
    "fsm_postgres": lambda w, dsn: FsmKernel(w, "postgres", dsn),
    "langgraph_memory": lambda w, dsn: LangGraph(w, "memory", None),
    "langgraph_sqlite_async": lambda w, dsn: LangGraph(w, "sqlite", "async"),
    "langgraph_sqlite_sync": lambda w, dsn: LangGraph(w, "sqlite", "sync"),
    "langgraph_lean_memory": lambda w, dsn: LangGraph(w, "memory", None, lean=True),
    "langgraph_lean_sqlite_sync": lambda w, dsn: LangGraph(w, "sqlite", "sync", lean=True),
    "burr_memory": lambda w, dsn: Burr(w, persister=False),
    "burr_sqlite": lambda w, dsn: Burr(w, persister=True),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(CONTENDERS))
    parser.add_argument("--pg-dsn")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"fsmk-bench-{args.name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    contender = CONTENDERS[args.name](workdir, args.pg_dsn)
    contender.run(3, sample_io=False, stored=False)  # warm caches and lazy imports
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints of a framework must not corrupt the protocol
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            result = contender.run(
                int(command["n"]),
                sample_io=bool(command.get("sample_io")),
                stored=bool(command.get("stored")),
            )
        except Exception as exc:  # reported, not fatal: the table shows the failure
            result = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(result) + "\n")
        out.flush()
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LANGSMITH_TRACING", "false")
    sys.exit(main())
