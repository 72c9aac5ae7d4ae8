"""The workflow explorer: runs a workflow many times on random model replies, tool results and
answers, and checks each run against what every run must keep. Hypothesis draws the inputs and,
when a run breaks a rule, shrinks them to a small run that still breaks it.

Each run goes through the real Kernel (WorkflowHarness.run) into an in-memory SQLite store, its
model, tools and person drawing what they answer as the run asks:

* model replies: text (PASS, 42, empty, anything), calls of the offered tools with arguments
  drawn from their JSON Schemas (several at once too), calls of a tool that does not exist,
  arguments that are not JSON, a reply cut off by the length limit, a failing model server; in
  an agent.decide state a pick among the offered choices, or an illegal one; in a state with an
  `output:` schema, JSON that fits it and JSON that does not;
* tool results: ok, an error, a fatal error;
* a person's answers: approve or reject a call, some text, a named event the state waits for
  (with data), one of its timers firing, or nobody answering (the run then waits).

The invariants, checked on every run: the run ends (or waits, when nobody answered) with
exactly one `run.terminated` and one reason the workflow or the kernel can give; its model
calls stay within `limits.max_iterations`; nothing raised (no exception out of the run, and no
`error` ending, which is how the kernel reports an action, a guard or itself raising); and a
replay from its log (fsm_kernel.replay.replay_run, child runs included) takes the same steps
to the same ending.

Hypothesis is imported here only: the rest of the kit works without it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import string
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from fsm_kernel.bootstrap import RunOptions, build_tools
from fsm_kernel.errors import AgentConnectionError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import (
    Completion,
    Event,
    EventStore,
    EventType,
    Message,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
)
from fsm_kernel.replay import replay_run
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing._harness import WorkflowHarness, run_child_in_turn
from fsm_kernel.workflow.children import ChildRequest, ChildResult
from fsm_kernel.workflow.compiler import CompiledWorkflow, Waits, compile_workflow
from fsm_kernel.workflow.decide import CHOOSE
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended
from fsm_kernel.workflow.loader import find_workflow, load_workflow
from fsm_kernel.workflow.spec import TerminationReason, WorkflowSpec, edge_number

__all__ = [
    "DEFAULT_EXAMPLES",
    "UNBOUNDED_ITERATIONS",
    "ExploreReport",
    "InvariantViolation",
    "explore",
]

DEFAULT_EXAMPLES = 100
"""Runs tried when nobody says."""
UNBOUNDED_ITERATIONS = 25
"""The `max_iterations` a workflow without one (0: unlimited) is explored with."""
MAX_ANSWERS = 20
"""A person's answers per run; then nobody answers (a waiting state whose guards drop every
event would otherwise wait forever)."""
PROMPT = "Explore this workflow: do what it is for."

Strategy = st.SearchStrategy[Any]


# -- the report -------------------------------------------------------------------------------


@dataclass
class ExploreReport:
    """What an exploration found: whether every run kept the invariants and, if one did not,
    the shrunk counterexample as readable text."""

    workflow: str
    passed: bool
    runs: int
    """Runs tried, shrinking's included."""
    endings: dict[str, int] = field(default_factory=dict)
    """How many runs ended with each reason ("waiting" for runs left waiting)."""
    counterexample: str | None = None
    seed: int | None = None
    """The seed given (None: derandomized, the same examples every time)."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the verdict, the runs tried and the endings seen."""
        seen = ", ".join(f"{reason} {n}" for reason, n in sorted(self.endings.items()))
        verdict = "ok" if self.passed else "FAILED"
        return f"explore {self.workflow}: {verdict} after {self.runs} run(s) (endings: {seen})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "passed": self.passed,
            "runs": self.runs,
            "endings": dict(sorted(self.endings.items())),
            "counterexample": self.counterexample,
            "seed": self.seed,
            "notes": list(self.notes),
        }


class InvariantViolation(AssertionError):
    """A run broke an invariant; the message is the readable counterexample."""


# -- what the fakes answer --------------------------------------------------------------------


@dataclass(frozen=True)
class _Reply:
    """A drawn model reply, before it becomes a Completion (the call ids are the run's)."""

    kind: str
    text: str = ""
    calls: tuple[tuple[str, Any], ...] = ()
    """(tool name, arguments): a dict, or a str that is not JSON (kind "bad arguments")."""

    def completion(self, ids: Iterator[int]) -> Completion:
        calls = [_tool_call(name, arguments, f"call_{next(ids)}") for name, arguments in self.calls]
        message = Message.assistant(self.text, calls) if calls else Message.assistant(self.text)
        finish = "tool_calls" if calls else ("length" if self.kind == "cut off" else "stop")
        return Completion(message=message, finish_reason=finish)


def _tool_call(name: str, arguments: Any, call_id: str) -> ToolCall:
    if isinstance(arguments, str):  # not JSON, as a model server hands a broken call over
        return ToolCall(
            id=call_id,
            name=name,
            raw_arguments=arguments,
            arguments_error="Expecting value: line 1 column 1 (char 0)",
        )
    return ToolCall(id=call_id, name=name, arguments=dict(arguments))


_WORDS = ["PASS", "42", "I need more information.", "Done: the answer is 7.", "FAIL: too short"]
_TEXT = st.sampled_from(_WORDS) | st.text(string.printable, max_size=24)
_JSON: Strategy = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(string.ascii_letters, max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(string.ascii_lowercase, min_size=1, max_size=6), inner, max_size=3
        )
    ),
    max_leaves=6,
)


def _weighted(options: Sequence[tuple[int, Strategy]]) -> Strategy:
    """One of `options`, each as likely as its weight; shrinking goes to the first."""
    bounds = list(itertools.accumulate(weight for weight, _ in options))

    def pick(n: int) -> Strategy:
        return next(s for bound, (_, s) in zip(bounds, options, strict=True) if n < bound)

    return st.integers(0, bounds[-1] - 1).flatmap(pick)


def _from_schema(schema: Any, depth: int = 0) -> Strategy:
    """Values that fit a JSON Schema's common keywords (type, enum, const, properties,
    required, items, min/max sizes and bounds); anything it does not know yields JSON data."""
    if not isinstance(schema, Mapping) or depth > 4:
        return _JSON
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(list(schema["enum"]) or [None])
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return st.one_of([_from_schema(s, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([_from_schema({**schema, "type": k}, depth) for k in kind] or [_JSON])
    return _TYPED.get(str(kind), _any)(schema, depth)


def _object(schema: Mapping[str, Any], depth: int) -> Strategy:
    properties = schema.get("properties") or {}
    required = [k for k in schema.get("required", ()) if k in properties]
    optional = [k for k in properties if k not in required]
    return st.fixed_dictionaries(
        {k: _from_schema(properties[k], depth + 1) for k in required},
        optional={k: _from_schema(properties[k], depth + 1) for k in optional},
    )


def _array(schema: Mapping[str, Any], depth: int) -> Strategy:
    low = int(schema.get("minItems", 0))
    high = int(schema.get("maxItems", low + 3))
    return st.lists(_from_schema(schema.get("items"), depth + 1), min_size=low, max_size=high)


def _string(schema: Mapping[str, Any], _depth: int) -> Strategy:
    low = int(schema.get("minLength", 0))
    return st.text(
        string.printable, min_size=low, max_size=max(low, int(schema.get("maxLength", 20)))
    )


def _number(schema: Mapping[str, Any], _depth: int, *, integer: bool = False) -> Strategy:
    low, high = schema.get("minimum"), schema.get("maximum")
    if integer:
        return st.integers(None if low is None else int(low), None if high is None else int(high))
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def _integer(schema: Mapping[str, Any], depth: int) -> Strategy:
    return _number(schema, depth, integer=True)


def _boolean(_schema: Mapping[str, Any], _depth: int) -> Strategy:
    return st.booleans()


def _null(_schema: Mapping[str, Any], _depth: int) -> Strategy:
    return st.none()


def _any(_schema: Mapping[str, Any], _depth: int) -> Strategy:
    return _JSON


_TYPED: dict[str, Callable[[Mapping[str, Any], int], Strategy]] = {
    "object": _object,
    "array": _array,
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
}


def _calls(tools: Sequence[Tool]) -> Strategy:
    one = st.sampled_from(list(tools)).flatmap(
        lambda t: _from_schema(t.parameters).map(lambda args: (t.name, args))
    )
    return st.lists(one, min_size=1, max_size=3).map(
        lambda calls: _Reply("tool calls", calls=tuple(calls))
    )


def _reply_strategy(
    tools: Sequence[Tool], response_format: ResponseFormat | None, choices: Sequence[str]
) -> Strategy:
    """A model reply to a request offering `tools`, under `response_format` if any."""
    choose = next((t for t in tools if t.name == CHOOSE), None)
    if choose is not None:
        return _pick_strategy(choose, choices)
    options: list[tuple[int, Strategy]] = [(30, _TEXT.map(lambda t: _Reply("text", t)))]
    if response_format is not None:
        fits = _from_schema(response_format.schema).map(_as_json_reply("output"))
        options += [(30, fits), (10, _JSON.map(_as_json_reply("output that may not fit")))]
    if tools:
        names = [t.name for t in tools]
        options += [
            (40, _calls(tools)),
            (4, st.just(_Reply("tool calls", calls=(("no_such_tool", {}),)))),
            (6, st.sampled_from(names).map(lambda n: _Reply("bad arguments", calls=((n, "{x"),)))),
        ]
    options += [
        (5, st.just(_Reply("empty"))),
        (4, _TEXT.map(lambda t: _Reply("cut off", t))),
        (3, st.just(_Reply("model error"))),
    ]
    return _weighted(options)


def _as_json_reply(kind: str) -> Any:
    return lambda value: _Reply(kind, json.dumps(value))


def _pick_strategy(choose: Tool, every_choice: Sequence[str]) -> Strategy:
    """agent.decide: a pick among the offered choices, mostly; else an illegal one, text, or
    two picks at once."""
    offered = list(choose.parameters["properties"]["choice"].get("enum") or ())
    illegal = [c for c in every_choice if c not in offered] + ["none of these"]

    def picks(texts: Sequence[str], kind: str) -> Strategy:
        return st.sampled_from(list(texts)).map(
            lambda c: _Reply(kind, calls=((CHOOSE, {"choice": c}),))
        )

    options: list[tuple[int, Strategy]] = []
    if offered:
        options.append((60, picks(offered, "pick")))
    options += [
        (15, picks(illegal, "illegal pick")),
        (10, _TEXT.map(lambda t: _Reply("text", t))),
        (5, st.just(_Reply("two picks", calls=((CHOOSE, {"choice": "a"}),) * 2))),
        (3, st.just(_Reply("model error"))),
    ]
    return _weighted(options)


_RESULTS: Strategy = _weighted(
    [
        (60, _TEXT.map(lambda t: ToolResult(content=t))),
        (30, _TEXT.map(lambda t: ToolResult(content=f"error: {t}", is_error=True))),
        (5, st.just(ToolResult(content="error: broken for good", is_error=True, fatal=True))),
    ]
)


def _answer_strategy(question: Question, waits: Waits | None) -> Strategy:
    """A person's answer to `question` (None: nobody answers, the run waits)."""
    nobody: tuple[int, Strategy] = (10, st.none())
    if question.kind == "approval":
        reject = _TEXT.map(lambda t: HumanAnswer.reject(t, by="explorer"))
        return _weighted([(50, st.just(HumanAnswer.approve(by="explorer"))), (40, reject), nobody])
    if question.kind == "input":
        return _weighted([(90, _TEXT.map(lambda t: HumanAnswer.input(t, by="explorer"))), nobody])
    options: list[tuple[int, Strategy]] = []
    if question.events:
        signal = st.tuples(st.sampled_from(list(question.events)), _JSON)
        options.append((60, signal.map(lambda e: HumanAnswer.signal(e[0], e[1], by="explorer"))))
    if waits is not None and waits.timers:
        edges = [edge for edge, _ in waits.timers]
        options.append((30, st.sampled_from(edges).map(HumanAnswer.timer_fired)))
    return _weighted([*options, nobody])


# -- the run's collaborators ------------------------------------------------------------------


class _Draws:
    """One run's source of inputs (Hypothesis's `data`), with what was drawn, in order."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.drawn: list[str] = []
        self.ids = itertools.count(1)
        self.answers = 0

    def draw(self, strategy: Strategy, label: str) -> Any:
        value = self.data.draw(strategy)
        self.drawn.append(f"{label}: {value!r}")
        return value


class _ExploringModel:
    """A ChatModel whose every reply is drawn for the request it gets."""

    def __init__(self, draws: _Draws, choices: Sequence[str]) -> None:
        self._draws, self._choices = draws, choices

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        tool_choice: str | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Completion:
        strategy = _reply_strategy(tools, response_format, self._choices)
        reply: _Reply = self._draws.draw(strategy, "model")
        if reply.kind == "model error":
            raise AgentConnectionError("the model server is down (drawn by the explorer)")
        return reply.completion(self._draws.ids)


class _ExploringTools:
    """The workflow's tools as offered (names, schemas), each call's result drawn."""

    def __init__(self, registry: ToolExecutor, offered: Sequence[str], draws: _Draws) -> None:
        self._registry, self._offered, self._draws = registry, list(offered), draws

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        return self._registry.list_tools(self._offered if names is None else names)

    async def execute(self, call: ToolCall) -> ToolResult:
        result: ToolResult = self._draws.draw(_RESULTS, f"tool {call.name}")
        return result


class _ExploringHuman:
    """A person (and the clock) whose answers are drawn; None drawn, or too many answers
    given, and nobody answers: the run waits."""

    def __init__(self, draws: _Draws, waits: Mapping[str, Waits]) -> None:
        self._draws, self._waits = draws, waits

    async def ask(self, question: Question) -> HumanAnswer:
        if self._draws.answers >= MAX_ANSWERS:
            raise Suspended(question)
        strategy = _answer_strategy(question, self._waits.get(question.state))
        answer: HumanAnswer | None = self._draws.draw(strategy, f"{question.kind} answer")
        if answer is None:
            raise Suspended(question)
        self._draws.answers += 1
        return answer


class _ExploringChildren:
    """Child runs of workflow.call / workflow.map states: real runs of the called workflows
    with their own tools drawn the same way, one at a time (so the draws come in an order
    that does not depend on timing)."""

    def __init__(self, draws: _Draws, store: EventStore, root: Path) -> None:
        self._draws, self._store, self._root = draws, store, root
        self._one_at_a_time = asyncio.Lock()

    async def run(self, request: ChildRequest) -> ChildResult:
        spec = load_workflow(find_workflow(request.workflow, relative_to=request.caller))
        compiled = compile_workflow(spec)
        registry, offered, approval = build_tools(spec, RunOptions(workspace=str(self._root)))
        kernel = Kernel(
            compiled,
            model=_ExploringModel(self._draws, _choice_texts(compiled)),
            tools=_ExploringTools(registry, offered, self._draws),
            store=self._store,
            system_prompt=spec.system_prompt,
            tool_names=offered,
            human=_ExploringHuman(self._draws, compiled.waits),
            approval_required=approval,
            sleep=_no_wait,
            children=self,
        )
        return await run_child_in_turn(kernel, spec, request, self._one_at_a_time)


async def _no_wait(_seconds: float) -> None:
    return None


def _choice_texts(compiled: CompiledWorkflow) -> list[str]:
    """Every choice text of the workflow's agent.decide states (illegal picks come from
    these)."""
    return sorted({c.text for choices in compiled.choices.values() for c in choices})


# -- one run and its checks -------------------------------------------------------------------


@dataclass
class _Target:
    """The workflow under exploration, compiled once."""

    harness: WorkflowHarness
    compiled: CompiledWorkflow
    limits: dict[str, Any]
    """Overrides of the workflow's limits (an unlimited max_iterations is capped)."""
    reasons: frozenset[str]
    """The reasons a run of it may end with: its edges' and the kernel's."""

    @classmethod
    def of(cls, workflow: str | Path | WorkflowSpec) -> _Target:
        harness = WorkflowHarness(workflow)
        spec = harness.spec
        limits = {} if spec.limits.max_iterations else {"max_iterations": UNBOUNDED_ITERATIONS}
        reasons = set(spec.edge_reasons()) | {str(r) for r in TerminationReason}
        reasons |= set(spec.reasons)
        return cls(harness, compile_workflow(spec), limits, frozenset(reasons))


def _run_once(target: _Target, draws: _Draws, store: EventStore) -> RunResult:
    """One run of the target on drawn inputs, recorded in `store`."""
    with tempfile.TemporaryDirectory(prefix="fsm-kernel-explore-") as tmp:
        root = Path(tmp)
        spec = target.harness.spec
        registry, offered, _ = build_tools(spec, RunOptions(workspace=str(root)))
        return target.harness.run(
            PROMPT,
            model=_ExploringModel(draws, _choice_texts(target.compiled)),
            tools=_ExploringTools(registry, offered, draws),
            workspace=root,
            limits=target.limits,
            store=store,
            human=_ExploringHuman(draws, target.compiled.waits),
            children=_ExploringChildren(draws, store, root),
        )


def _ending(result: RunResult) -> str:
    return "waiting" if result.status == "waiting" else str(result.termination_reason)


def _problems(target: _Target, result: RunResult, store: EventStore) -> list[str]:
    """Every invariant the run broke, one line each (none: it kept them all)."""
    events = store.read(result.run_id)
    problems = _ending_problems(target, result, events)
    cap = int(target.limits.get("max_iterations") or target.harness.spec.limits.max_iterations)
    used = result.iterations + result.child_iterations
    if cap and used > cap:
        problems.append(f"the run made {used} model call(s), over max_iterations {cap}")
    problems += _replay_problems(target, result, store)
    return problems


def _ending_problems(target: _Target, result: RunResult, events: Sequence[Event]) -> list[str]:
    endings = [e for e in events if e.type is EventType.RUN_TERMINATED]
    reasons = [str(e.data.get("reason")) for e in endings]
    if result.status == "waiting":
        last = events[-1].type.value if events else "nothing"
        if endings or last != EventType.RUN_SUSPENDED.value:
            return [f"the run waits, but its log ends with {last} and has {len(endings)} ending(s)"]
        return []
    problems = []
    if reasons != [str(result.termination_reason)]:
        problems.append(
            f"the run ended {result.termination_reason}, but its log has "
            f"{len(endings)} run.terminated ({', '.join(reasons) or 'none'})"
        )
    if result.termination_reason == TerminationReason.ERROR:
        problems.append(f"the run ended with reason error (something raised): {result.error}")
    elif str(result.termination_reason) not in target.reasons:
        problems.append(f"the run ended with {result.termination_reason}, a reason nothing gives")
    return problems


def _replay_problems(target: _Target, result: RunResult, store: EventStore) -> list[str]:
    try:
        report = asyncio.run(replay_run(target.compiled, store, result.run_id))
    except Exception as exc:  # a replay that raises is what we report
        return [f"the replay raised {type(exc).__name__}: {exc}"]
    if report.identical:
        return []
    first = report.first_divergence
    if first is not None:
        return [
            f"the replay diverged at step {first.step}: recorded {first.recorded}, "
            f"replayed {first.replayed}"
        ]
    return [
        f"the replay ended {report.replayed_reason} ({report.error or 'no error'}), the run "
        f"{report.recorded_reason}"
    ]


# -- the counterexample -----------------------------------------------------------------------


def _transcript(store: EventStore, run_id: str, indent: str = "  ") -> list[str]:
    """The run's log as lines: each reply, result and answer in the state that got it, the
    transitions taken, child runs inside their step, and how it ended."""
    lines = []
    for event in store.read(run_id):
        line = _line(event)
        if line is not None:
            lines.append(f"{indent}{line}")
        if event.type is EventType.CHILD_STARTED:
            lines += _transcript(store, str(event.data.get("run_id")), indent + "    ")
    return lines


def _line(event: Event) -> str | None:
    """One event as a line of the transcript (None: not shown)."""
    render = _RENDER.get(event.type)
    if render is None:
        return None
    line = render(event.data)
    return line if event.type in _RUN_LEVEL else f"[{event.state or '-'}] {line}"


def _tool_line(d: Mapping[str, Any]) -> str:
    call, res = d.get("call") or {}, d.get("result") or {}
    flag = "fatal error" if res.get("fatal") else "error" if res.get("is_error") else "ok"
    return f"tool {call.get('name')} → {flag} {_short(res.get('content'))}"


def _transition_line(d: Mapping[str, Any]) -> str:
    guard = f" [{d['guard']}]" if d.get("guard") else ""
    return f"{d.get('from') or d.get('source')} → {d.get('to') or d.get('target')}{guard}"


def _ended_line(d: Mapping[str, Any]) -> str:
    error = f": {d['error']}" if d.get("error") else ""
    return f"ended: {d.get('reason')}{error}"


_RENDER: dict[EventType, Callable[[Mapping[str, Any]], str]] = {
    EventType.MODEL_RESPONDED: lambda d: f"model replies {_describe(d.get('completion') or {})}",
    EventType.MODEL_FAILED: lambda d: f"model fails: {d.get('message') or d.get('error') or d}",
    EventType.TOOL_FINISHED: _tool_line,
    EventType.HUMAN_ANSWERED: lambda d: _answer_line(d),
    EventType.EVENT_DELIVERED: lambda d: f"event {d.get('name')} arrives, data {_args(d, 'data')}",
    EventType.TIMER_FIRED: lambda d: f"the timer of edge {edge_number(d.get('edge'))} fires",
    EventType.CHILD_STARTED: lambda d: f"child run of {d.get('workflow')}:",
    EventType.TRANSITION_TAKEN: _transition_line,
    EventType.RUN_TERMINATED: _ended_line,
    EventType.RUN_SUSPENDED: lambda d: (
        f"waiting: {_short(json.dumps(d.get('waiting_for'), sort_keys=True), 120)}"
    ),
}
"""How each event shown in a transcript reads."""
_RUN_LEVEL = frozenset(
    {EventType.TRANSITION_TAKEN, EventType.RUN_TERMINATED, EventType.RUN_SUSPENDED}
)
"""Events shown without the state they happened in."""


def _describe(completion: Mapping[str, Any]) -> str:
    message = completion.get("message") or {}
    calls = message.get("tool_calls") or []
    cut = " (cut off: finish_reason length)" if completion.get("finish_reason") == "length" else ""
    if not calls:
        return f"text {_short(message.get('content', ''))}{cut}"
    shown = [
        f"{c.get('name')}({c.get('raw_arguments') if c.get('arguments_error') else _args(c)})"
        for c in calls
    ]
    return "call " + ", ".join(shown)


def _args(call: Mapping[str, Any], key: str = "arguments") -> str:
    return _short(json.dumps(call.get(key) or {}, sort_keys=True), 80, quote=False)


def _answer_line(d: Mapping[str, Any]) -> str:
    """A person's recorded answer (human.answered), as a phrase."""
    if d.get("kind") == "approval" and d.get("approved"):
        return "person approves"
    if d.get("kind") == "approval":
        return f"person rejects: {_short(d.get('reason'))}"
    if d.get("kind") == "input":
        return f"person answers {_short(d.get('text'))}"
    return f"person answers {_short(json.dumps(d, sort_keys=True), 120)}"


def _short(value: Any, limit: int = 60, *, quote: bool = True) -> str:
    text = str(value if value is not None else "")
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return json.dumps(text, ensure_ascii=False) if quote else text


def _counterexample(
    target: _Target,
    problems: Sequence[str],
    result: RunResult | None,
    store: EventStore,
    draws: _Draws,
) -> str:
    name = target.harness.spec.name
    lines = [f"workflow {name}: a run broke {len(problems)} invariant(s):"]
    lines += [f"  - {p}" for p in problems]
    steps = _transcript(store, result.run_id) if result is not None else []
    if steps:
        lines += ["the run (shrunk by Hypothesis):", *steps]
    else:
        lines += ["what was drawn, in order (shrunk by Hypothesis):"]
        lines += [f"  {d}" for d in draws.drawn] or ["  nothing"]
    return "\n".join(lines)


# -- the exploration --------------------------------------------------------------------------


def explore(
    workflow: str | Path | WorkflowSpec,
    *,
    examples: int = DEFAULT_EXAMPLES,
    seed: int | None = None,
) -> ExploreReport:
    """Run `workflow` (a file, a stock name or a spec) `examples` times on drawn inputs and
    check every run; the first run that breaks an invariant is shrunk and returned as
    `report.counterexample`.

    Without `seed` the examples are derandomized (the same ones every time: what CI wants);
    with one, Hypothesis draws them from that seed. Raises WorkflowError for a workflow that
    does not load, ValueError for `examples` below 1.
    """
    if examples < 1:
        raise ValueError(f"examples must be at least 1, not {examples}")
    target = _Target.of(workflow)
    endings: Counter[str] = Counter()

    def check(data: Any) -> None:
        draws = _Draws(data)
        with SqliteEventStore(":memory:") as store:
            result: RunResult | None = None
            try:
                result = _run_once(target, draws, store)
            except HypothesisException:
                raise
            except Exception as exc:  # anything out of a run is a finding
                problems = [f"the run raised {type(exc).__name__}: {exc}"]
            else:
                endings[_ending(result)] += 1
                problems = _problems(target, result, store)
            if problems:
                raise InvariantViolation(_counterexample(target, problems, result, store, draws))

    test = _settings(examples, seed)(given(st.data())(check))
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    report = ExploreReport(target.harness.spec.name, passed=True, runs=0, seed=seed)
    if target.limits:
        report.notes.append(
            f"max_iterations is 0 (unlimited): explored with max_iterations {UNBOUNDED_ITERATIONS}"
        )
    try:
        test()
    except InvariantViolation as exc:
        report.passed, report.counterexample = False, str(exc)
    report.runs, report.endings = sum(endings.values()), dict(endings)
    return report


def _settings(examples: int, seed: int | None) -> settings:
    return settings(
        max_examples=examples,
        derandomize=seed is None,
        database=None,  # nothing written to the user's folder
        deadline=None,  # a run's time varies with the machine; the limits bound it
        phases=(Phase.generate, Phase.shrink),
        verbosity=Verbosity.quiet,  # the report is the counterexample, not Hypothesis's notes
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )
