"""MkDocs hook: the Reference pages, generated from the code at build time so they cannot drift.

Registered in mkdocs.yml (`hooks: [docs/hooks.py]`). `on_files` adds pages that exist in no
file of the repository:

- reference/cli.md: every command, subcommand and flag, walked from the argparse parsers
  `fsm_kernel.cli.build_parser()` builds (the same objects `--help` prints);
- reference/workflow.md: every workflow key, from the JSON Schema of the pydantic models
  (`fsm-kernel schema`), with its type, default and description;
- reference/events.md: every event type of `fsm_kernel.protocol.EventType`, with its docstring
  and the data fields it carried in sample runs made right here with a scripted model;
- reference/builtins.md: the built-in actions, guards and tools, from their registries;
- reference/exit-codes.md and reference/environment.md;
- diagrams/NAME.svg: each stock workflow drawn by the real `dot` (the committed
  diagrams/*.svg when Graphviz is not installed).

`on_page_markdown` draws charts: a table preceded by `<!-- chart: TITLE | columns=1,2 -->` gets
an SVG bar chart of those columns below it, drawn from the table's own figures, so a chart can
never show other numbers than the table beside it.

tests/docs/test_reference.py imports this module to check that nothing is left undescribed.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# --- descriptions the code does not carry --------------------------------------------------
# A test fails when a key, guard or event is added without a description here or in the code,
# and when an entry below describes something that no longer exists.

SCHEMA_DESCRIPTIONS: dict[str, str] = {
    "WorkflowSpec.name": "The workflow's name: shown in `runs list`, recorded in every run.",
    "WorkflowSpec.description": "One line saying what the loop is for (`fsm-kernel workflows`).",
    "WorkflowSpec.agent": "Model server settings for every state; environment and flags "
    "override them (see [Model servers](../how-to/model-servers.md)).",
    "WorkflowSpec.system_prompt": "The system prompt; `memory:` files are appended to it.",
    "WorkflowSpec.limits": "The run's limits; the kernel enforces each in code, whatever the "
    "transitions say.",
    "WorkflowSpec.initial": "The state a run starts in.",
    "WorkflowSpec.states": "The states, by id (snake_case, unique at any depth).",
    "WorkflowSpec.transitions": "The edges, tried in file order; the first whose guards pass "
    "fires.",
    "AgentBlock.model": "The model name the server knows (`local` or `local:PATH.gguf` for the "
    "in-process model).",
    "AgentBlock.base_url": "The OpenAI-compatible server, e.g. `http://localhost:11434/v1`.",
    "AgentBlock.temperature": "Sampling temperature sent with each request.",
    "AgentBlock.max_retries": "Retries of a failed request (connection errors, timeouts, 408, "
    "409, 429, 5xx), with exponential backoff and jitter.",
    "CatchSpec.description": "A note for readers and diagrams.",
    "StateSpec.description": "A note for readers and diagrams.",
    "StateSpec.final": "A final state: entering it ends the run (top level) or completes its "
    "compound parent.",
    "TransitionSpec.source": "The state the edge leaves (a compound state: from every state "
    "inside it).",
    "TransitionSpec.target": "The state the edge enters (a compound state: its initial child).",
    "TransitionSpec.description": "A note for readers and diagrams.",
}

GUARD_DESCRIPTIONS: dict[str, str] = {
    "malformed_output": "The last reply was malformed: arguments that are not JSON, a tool "
    "that was not offered, or an answer that fails the `output:` schema.",
    "retries_exhausted": "`limits.max_malformed_outputs` malformed replies in a row.",
    "done_called": "The model called the `done(answer)` tool.",
    "fatal_tool_error": "A tool raised `ToolFatalError`.",
    "iteration_limit": "The run made `limits.max_iterations` model calls (its children's "
    "included).",
    "no_progress": "The same tool with the same arguments `limits.no_progress_repeats` times "
    "in a row.",
    "tool_failures": "`limits.max_tool_failures` failed tool calls in a row.",
    "tool_failed": "A tool call of the last step failed.",
    "caught": "A state's `catch:` routed a failure (it is `ctx.caught`).",
    "completed": "On an edge out of a compound state: the run is in one of its final children.",
}

EVENT_DESCRIPTIONS: dict[str, str] = {
    "run.started": "A run began: every setting that decides its behaviour (server, model, "
    "timeouts, limits, tools, system prompt, the workflow's full text and sha256; never the "
    "key), its goal, and `parent_run_id` / `continues` when it has them.",
    "run.resumed": "`resume` or `signal` continued the run: flags that override the recorded "
    "settings, and a new workflow text when it was migrated.",
    "state.entered": "The run entered a state (`path`: its full path inside compound states).",
    "message.added": "A message joined the conversation (the goal, a person's input, a "
    "child's answers).",
    "transition.taken": "An edge fired: source, target, its index in `transitions:`, the "
    "guard that passed and the reason for an edge into a final state.",
    "model.requested": "A model call is about to be made: the messages added since the last "
    "one, the tools offered, the options.",
    "model.responded": "The model's reply (text, reasoning, tool calls, usage) and latency.",
    "model.failed": "A model call failed for good (after the HTTP client's retries).",
    "model.notice": "Something about the live model call worth knowing: `stream_fallback`, "
    "`response_format_fallback`, `loop_stopped`.",
    "tool.started": "A tool call is about to run (on disk before it does).",
    "tool.finished": "A tool call ended: its result or error and duration.",
    "iteration.completed": "An iteration (one model call) ended: the decision it led to, its "
    "usage and answer.",
    "human.answered": "A person answered (approval, rejection or input), with who and when, "
    "recorded before the tool runs.",
    "run.suspended": "The run waits for a person or an event: `waiting_for` says what for.",
    "run.terminated": "The run ended: its reason, response, structured output, usage and error.",
}

# Fields of events that the sample runs below do not produce; checked against the code by
# tests/docs/test_reference.py (each name appears where the event is recorded).
EVENT_FIELDS_UNOBSERVED: dict[str, list[str]] = {
    "run.resumed": [
        "workflow_hash",
        "forced",
        "workflow_text",
        "workflow_version",
        "settings",
        "limits",
        "system_prompt",
        "overrides",
        "reopened",
        "rerun_tool_calls",
        "translation",
        "iteration",
    ],
    "model.notice": ["kind", "reason", "step", "tokens"],
    "context.trimmed": [
        "strategy",
        "estimated_tokens_before",
        "estimated_tokens_after",
        "shortened_tool_results",
        "dropped_messages",
        "cut_messages",
    ],
    "notify.attempted": ["url", "event", "format", "attempt", "status", "ok", "final", "error"],
}

FLAG_DESCRIPTIONS: dict[str, str] = {
    "run WORKFLOW": "a workflow file, or a stock workflow's name (`fsm-kernel workflows`)",
    "chat WORKFLOW": "a workflow file, or a stock workflow's name",
    "validate WORKFLOW": "workflow files to check (each reported, every error at its "
    "`path:line:col`)",
    "workflows --json": "a JSON list of `{name, description}`",
    "runs list --json": "a JSON list, one object per run (with `tokens`, `updated_at`, "
    "`parent_run_id`)",
    "runs show --json": "the run as one JSON object",
    "runs events RUN_ID": "a run id or a unique prefix",
    "runs export RUN_ID": "a run id or a unique prefix",
    "runs export --output": "the file to write (JSON Lines, one event per line)",
    "resume RUN_ID": "a run id or a unique prefix",
    "replay RUN_ID": "a run id or a unique prefix",
    "replay --json": "the replay report as one JSON object (with `children` for child runs)",
    "worker CONFIG": "the scheduler config (YAML) whose queue to work on",
    "worker --base-url": "the model server for this worker's runs (else the environment's)",
    "worker --model": "the model for this worker's runs (else the environment's)",
    "dispatches CONFIG": "the scheduler config (YAML) whose dispatches to list",
    "dispatches --limit": "how many recent dispatches to show",
    "dispatches --json": "a JSON list, one object per dispatch",
}
"""What the parsers' own `help=` leaves out, by "COMMAND WORDS FLAG-OR-ARGUMENT"."""

ENVIRONMENT: dict[str, str] = {
    "FSM_KERNEL_BASE_URL": "The model server (default `http://localhost:11434/v1`, Ollama).",
    "FSM_KERNEL_MODEL": "The model (default `qwen3`; `local` for the bundled model, "
    "`local:PATH.gguf` for any GGUF file).",
    "FSM_KERNEL_API_KEY": "The API key, sent as a Bearer token; never logged, printed or stored.",
    "OPENAI_API_KEY": "Used as the API key when `FSM_KERNEL_API_KEY` is not set.",
    "FSM_KERNEL_DBOS_URL": "The DBOS system database for runs under DBOS (`--engine dbos`, "
    "`DBOSAgent`); else `DBOS_SYSTEM_DATABASE_URL`, else the one the run recorded.",
    "FSM_KERNEL_REQUEST_TIMEOUT": "Deadline of one model request, the whole answer included "
    "(seconds, default 120, 0 = none).",
    "FSM_KERNEL_MAX_RETRIES": "Retries of a failed model request (0-100, default 3).",
    "FSM_KERNEL_MAX_RESPONSE_BYTES": "The largest response accepted (default 8 MiB).",
    "FSM_KERNEL_STREAM": "Whether answers are asked for streamed (default on; `--no-stream`).",
    "FSM_KERNEL_STORE": "The event store (default `.fsm-kernel/runs.db` under the current "
    "folder); any location `--store` takes.",
    "FSM_KERNEL_LOCAL_CONTEXT": "The local model's context window in tokens (default 4096).",
    "FSM_KERNEL_LOCAL_THREADS": "llama.cpp threads (default one fewer than the CPUs you may "
    "use, at least one).",
    "FSM_KERNEL_LOCAL_MAX_TOKENS": "The local model's tokens per reply (default 512; a cut-off "
    "answer ends the run `truncated`).",
    "FSM_KERNEL_LOCAL_SMALL_MODEL": "`auto` (default), `on` or `off`: the help a small model "
    "(under 1B parameters) gets after a tool result.",
    "FSM_KERNEL_UI_TOKEN": "The run viewer's token when it listens on a non-loopback host.",
    "OTEL_TRACES_EXPORTER": "`otlp` (default), `console` or `none`; setting it turns tracing on.",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "The OTLP/HTTP collector; setting it turns tracing on.",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "The collector for traces only; setting it turns "
    "tracing on.",
    "OTEL_SDK_DISABLED": "`true` turns tracing off.",
    "OTEL_SERVICE_NAME": "The service name of the spans.",
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "`true` adds prompts, replies, tool "
    "arguments and results to the spans (redacted like the log).",
}

ENV_PATTERN = re.compile(r"""["']((?:FSM_KERNEL|OTEL)_[A-Z_]+)["']""")
TEST_ONLY_ENV = frozenset({"FSM_KERNEL_REQUIRE_PG", "FSM_KERNEL_REQUIRE_BROWSER"})


# --- small Markdown helpers ----------------------------------------------------------------


def _cell(text: Any) -> str:
    """One table cell: pipes escaped, whitespace folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


GENERATED_NOTE = "<!-- Generated by docs/hooks.py at build time from the code; do not edit. -->\n\n"


# --- the CLI --------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def flag_key(words: str, action: argparse.Action) -> str:
    """How FLAG_DESCRIPTIONS names a flag or an argument of a command."""
    name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
    return f"{words} {name}"


def flag_help(words: str, action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default))
    return text or FLAG_DESCRIPTIONS.get(flag_key(words, action), "")


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's flags and arguments, without --help, --debug, -v and subcommands."""
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)
        and a.dest not in ("debug", "verbose")
    ]


def _flag_rows(words: str, parser: argparse.ArgumentParser) -> Iterator[list[str]]:
    for action in arguments(parser):
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest.upper()}`"
        if action.choices:
            name += " (" + ", ".join(f"`{c}`" for c in action.choices) + ")"
        default = action.default
        shown = (
            ""
            if default in (None, False, argparse.SUPPRESS) or action.nargs == 0
            else f"`{default}`"
        )
        yield [name, flag_help(words, action), shown]


def commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every command as (its words, its parser, its one-line help), subcommands included."""
    from fsm_kernel.cli import build_parser

    found: list[tuple[str, argparse.ArgumentParser, str]] = []

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        helps = _command_helps(parser)
        for name, sub in _subparsers(parser).items():
            words = f"{prefix} {name}".strip()
            found.append((words, sub, helps.get(name, "")))
            walk(words, sub)

    walk("", build_parser())
    return found


def cli_page() -> str:
    from fsm_kernel.cli import EXIT_CODES_HELP, build_parser

    top = build_parser()
    out = [
        "# Command line\n\n",
        GENERATED_NOTE,
        f"{top.description}\n\n",
        "Every command accepts `--debug` (tracebacks) and `-v/--verbose` (debug logs tagged "
        "with the run id), before or after its name. "
        f"{EXIT_CODES_HELP} See [exit codes](exit-codes.md).\n\n",
    ]
    for words, parser, summary in commands():
        out.append(f"## `fsm-kernel {words}`\n\n")
        if summary:
            out.append(f"{summary[0].upper()}{summary[1:]}.\n\n")
        if parser.description and parser.description != summary:
            out.append(f"{parser.description}\n\n")
        usage = " ".join(parser.format_usage().split())
        out.append(f"```text\n{usage}\n```\n\n")
        rows = list(_flag_rows(words, parser))
        if rows:
            out.append(_table(["argument", "what it does", "default"], rows) + "\n")
    return "".join(out)


# --- the workflow file ----------------------------------------------------------------------


def _type(schema: dict[str, Any]) -> str:
    """A short type for a JSON Schema node: `integer ≥ 0`, `list of TransitionSpec`, …"""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        kinds = [_type(s) for s in schema["anyOf"] if s.get("type") != "null"]
        return " or ".join(dict.fromkeys(kinds)) or "null"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {_type(schema['additionalProperties'])}"
    bounds = [
        f"{sign} {schema[key]}"
        for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"))
        if key in schema
    ]
    return " ".join([str(kind), ", ".join(bounds)]).strip()


def schema_description(model: str, key: str, node: dict[str, Any]) -> str:
    """The key's description: the schema's own, else the one above (empty when neither)."""
    return str(node.get("description") or SCHEMA_DESCRIPTIONS.get(f"{model}.{key}", ""))


def schema_keys() -> list[tuple[str, str, dict[str, Any], bool]]:
    """(model, key, schema node, required) for every key of the workflow's JSON Schema."""
    from fsm_kernel.workflow.spec import WorkflowSpec

    schema = WorkflowSpec.model_json_schema()
    models = {"WorkflowSpec": schema, **schema.get("$defs", {})}
    return [
        (model, key, node, key in body.get("required", []))
        for model, body in models.items()
        for key, node in body.get("properties", {}).items()
    ]


def _example_sources() -> Iterator[Any]:
    """Every workflow the project shows (the stock ones, then the docs' YAML blocks, whole
    workflows and fragments of one)."""
    import yaml

    from fsm_kernel.workflow.loader import StrictBoolLoader  # `on:` is a key, not True

    texts = [p.read_text("utf-8") for p in sorted((ROOT / "workflows").glob("*.yaml"))]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        texts += re.findall(r"```ya?ml\n(.*?)```", page.read_text("utf-8"), re.S)
    for text in texts:
        try:
            data = yaml.load(text, Loader=StrictBoolLoader)  # a SafeLoader
        except yaml.YAMLError:
            continue
        if isinstance(data, list) and all(isinstance(e, dict) and "source" in e for e in data):
            data = {"transitions": data}  # a fragment of edges
        if isinstance(data, dict) and "cases" not in data:  # not a test file
            yield data


def _walk_examples(
    value: Any, node: dict[str, Any], models: dict[str, Any], found: dict[str, Any]
) -> None:
    """Record, per `Model.key`, the first value `value` holds for it (walking the schema)."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        props = models[name].get("properties", {})
        for key, item in value.items() if isinstance(value, dict) else ():
            if key in props:
                found.setdefault(f"{name}.{key}", item)
                _walk_examples(item, props[key], models, found)
    for branch in node.get("anyOf", []):
        _walk_examples(value, branch, models, found)
    if node.get("type") == "array" and isinstance(value, list):
        for item in value:
            _walk_examples(item, node.get("items", {}), models, found)
    extra = node.get("additionalProperties")
    if node.get("type") == "object" and isinstance(extra, dict) and isinstance(value, dict):
        for item in value.values():
            _walk_examples(item, extra, models, found)


def schema_examples() -> dict[str, str]:
    """`Model.key` → an example of the key, as written in a stock workflow or the docs."""
    import yaml

    from fsm_kernel.workflow.spec import WorkflowSpec

    schema = WorkflowSpec.model_json_schema()
    models = {"WorkflowSpec": schema, **schema.get("$defs", {})}
    found: dict[str, Any] = {}
    for data in _example_sources():
        _walk_examples(data, {"$ref": "#/WorkflowSpec"}, models, found)
    examples = {}
    for name, value in found.items():
        key = name.split(".", 1)[1]
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10**6, sort_keys=False)
        text = text.strip()[1:-1].strip()
        examples[name] = text if len(text) <= 80 else text[:77] + "…"
    return examples


def workflow_page() -> str:
    from fsm_kernel.workflow.spec import WorkflowSpec

    schema = WorkflowSpec.model_json_schema()
    out = [
        "# Workflow file\n\n",
        GENERATED_NOTE,
        "Every key a workflow file may hold, read from the JSON Schema that `fsm-kernel "
        "schema` prints (point your editor's YAML language server at it for completion). "
        "Each example is taken from a stock workflow or a guide, where it runs in the test "
        "suite; the [workflow guide](../how-to/workflows.md) explains the keys in context and "
        "[semantics](../explanation/semantics.md) says what a run does with them.\n\n",
    ]
    examples = schema_examples()
    by_model: dict[str, list[list[str]]] = {}
    for model, key, node, required in schema_keys():
        default = (
            "required"
            if required
            else f"`{json.dumps(node['default'])}`"
            if "default" in node
            else ""
        )
        example = examples.get(f"{model}.{key}", "")
        row = [
            f"`{key}`",
            _type(node),
            default,
            schema_description(model, key, node),
            f"`{example}`" if example else "",
        ]
        by_model.setdefault(model, []).append(row)
    for model, rows in by_model.items():
        body = schema if model == "WorkflowSpec" else schema["$defs"][model]
        title = "The top level" if model == "WorkflowSpec" else model
        anchor = "" if model == "WorkflowSpec" else f" {{#{model.lower()}}}"
        out.append(f"## {title}{anchor}\n\n")
        if body.get("description"):
            out.append(" ".join(body["description"].split()) + "\n\n")
        out.append(_table(["key", "type", "default", "description", "example"], rows) + "\n")
    return "".join(out)


# --- events -----------------------------------------------------------------------------------


def event_docstrings() -> dict[str, str]:
    """The docstring written under each EventType member (Python keeps none at run time)."""
    from fsm_kernel import protocol

    tree = ast.parse(Path(protocol.__file__).read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "EventType":
            body = node.body
            for here, after in itertools.pairwise(body):
                if (
                    isinstance(here, ast.Assign)
                    and isinstance(here.value, ast.Constant)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                ):
                    found[str(here.value.value)] = " ".join(str(after.value.value).split())
    return found


def event_description(kind: str) -> str:
    return event_docstrings().get(kind) or EVENT_DESCRIPTIONS.get(kind, "")


_SAMPLES: dict[str, str] = {
    "approve.yaml": """
name: approve
tools: [{name: datetime, approval: required}]
limits: {max_iterations: 4}
initial: think
states:
  think: {action: agent.think, retry: {error: agent_error, max_attempts: 1, backoff_seconds: 0},
          catch: [{error: agent_error, target: failed, reason: gave_up}]}
  act: {action: tools.execute}
  ask: {action: human.input, prompt: "Anything else?"}
  done: {final: true}
  failed: {final: true}
reasons: {gave_up: {success: false}}
variables: {asked: {type: integer, default: 0}}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: ask, when: "vars.asked == 0", assign: {asked: "vars.asked + 1"}}
  - {source: think, target: done, reason: final_answer}
  - {source: act, target: think}
  - {source: ask, target: think}
""",
    "wait.yaml": """
name: wait
initial: work
states:
  work: {action: workflow.call, workflow: child.yaml}
  wait_for_ci: {}
  deploy: {action: agent.think}
  done: {final: true}
transitions:
  - {source: work, target: wait_for_ci, guard: child_succeeded}
  - {source: work, target: done, reason: error}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: done, after: 1h, reason: timeout}
  - {source: deploy, target: done, reason: final_answer}
""",
    "child.yaml": """
name: child
initial: think
states:
  think: {action: agent.think}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
""",
}


def sample_events() -> dict[str, dict[str, Any]]:
    """Each event type's data from sample runs with a scripted model: an example and its fields.

    Two workflows cover a tool that needs approval, a person's input, a failed model call
    retried and caught, a variable assigned, a child run, a waiting state with an event and a
    timer.
    """
    from fsm_kernel.errors import AgentServerError
    from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, WorkflowHarness, call
    from fsm_kernel.workflow.human import HumanAnswer

    seen: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, text in _SAMPLES.items():
            (Path(folder) / name).write_text(text, encoding="utf-8")
        failing = AgentServerError("the server said 503", status_code=503)
        runs = [
            WorkflowHarness(Path(folder) / "approve.yaml").run(
                "What time is it?",
                model=ScriptedChatModel([failing, call("datetime"), "Noon.", "Noon."]),
                human=ScriptedHuman([HumanAnswer.approve(), HumanAnswer.input("no")]),
            ),
            WorkflowHarness(Path(folder) / "approve.yaml").run(
                "What time is it?", model=ScriptedChatModel([failing, failing])
            ),
            WorkflowHarness(Path(folder) / "approve.yaml").run(
                "What time is it?", model=ScriptedChatModel([call("datetime")])
            ),
            WorkflowHarness(Path(folder) / "wait.yaml").run(
                "Ship it.",
                model=ScriptedChatModel(["Built.", "Deployed."]),
                human=ScriptedHuman([HumanAnswer.signal("ci_passed", {"build": 7})]),
            ),
            WorkflowHarness(Path(folder) / "wait.yaml").run(
                "Ship it.", model=ScriptedChatModel(["Built."])
            ),
            WorkflowHarness(Path(folder) / "wait.yaml").run(
                "Ship it.", model=ScriptedChatModel(["Built."]), fire_timers=True
            ),
        ]
    for result in runs:
        for event in result.events:
            entry = seen.setdefault(event.type.value, {"fields": set(), "example": event.data})
            entry["fields"].update(event.data)
    return seen


def events_page() -> str:
    from fsm_kernel.protocol import LIVE_ONLY_EVENTS, EventType

    samples = sample_events()
    out = [
        "# Event catalogue\n\n",
        GENERATED_NOTE,
        "Every event a run records, in the order `EventType` declares them. Each stored event "
        "is one JSON object: `v` (the schema version), `run_id`, `seq`, `type`, `ts`, "
        "`iteration`, `state` and `data`; the fields below are those of `data`, as sample runs "
        "with a scripted model recorded them when this page was built. `fsm-kernel runs "
        "events RUN --json` prints a run's events; [the event log](../explanation/event-log.md) "
        "says what resume and replay make of them.\n\n",
    ]
    for kind in EventType:
        out.append(f"## `{kind.value}`\n\n{event_description(kind.value)}\n\n")
        if kind in LIVE_ONLY_EVENTS:
            out.append("About the live process only: resume and replay do not expect it back.\n\n")
        sample = samples.get(kind.value)
        fields = sorted(sample["fields"]) if sample else EVENT_FIELDS_UNOBSERVED.get(kind.value)
        if fields:
            out.append("Fields: " + ", ".join(f"`{f}`" for f in fields) + ".\n\n")
        if sample:
            example = json.dumps(sample["example"], indent=2, default=str, ensure_ascii=False)
            if len(example) < 1500:
                out.append('??? example "Example `data`"\n\n    ```json\n')
                out.append("".join(f"    {line}\n" for line in example.splitlines()))
                out.append("    ```\n\n")
    return "".join(out)


# --- built-ins, exit codes, environment --------------------------------------------------------


def _doc(fn: Any) -> str:
    text = (getattr(fn, "__doc__", None) or "").strip()
    if getattr(fn, "__name__", "") == "<lambda>":
        return ""
    return " ".join(text.split("\n\n")[0].split())


def guard_description(name: str, fn: Any) -> str:
    return GUARD_DESCRIPTIONS.get(name) or _doc(fn)


def guards() -> dict[str, Any]:
    from fsm_kernel.workflow.actions import BUILTIN_GUARDS
    from fsm_kernel.workflow.spec import COMPLETED

    return {**BUILTIN_GUARDS, COMPLETED: None}


def builtins_page() -> str:
    from fsm_kernel.tools.builtin import builtin_registry
    from fsm_kernel.workflow.actions import BUILTIN_ACTIONS

    out = ["# Built-in actions, guards and tools\n\n", GENERATED_NOTE]
    out.append(
        "Read from the registries the kernel resolves names in. Anything else is "
        "`package.module:function` ([your own](../how-to/custom-code.md)).\n\n## Actions\n\n"
    )
    rows = []
    for name, action in BUILTIN_ACTIONS.items():
        notes = [
            n
            for n, on in (
                ("calls the model", action.calls_model),
                ("starts child runs", action.starts_children),
            )
            if on
        ]
        rows.append([f"`{name}`", _doc(action.fn), ", ".join(notes)])
    out.append(_table(["action", "what it does", "notes"], rows) + "\n## Guards\n\n")
    out.append(
        "`guard:` and `unless:` take a name or a list (all must pass / all must fail); "
        "`when:` takes a CEL expression.\n\n"
    )
    out.append(
        _table(
            ["guard", "passes when"],
            [[f"`{n}`", guard_description(n, f)] for n, f in guards().items()],
        )
    )
    out.append("\n## Tools\n\n`fsm-kernel tools` lists them (`--json`: with their schemas).\n\n")
    with tempfile.TemporaryDirectory() as folder:
        for spec in builtin_registry(folder).list_tools():
            params = spec.parameters.get("properties", {})
            required = set(spec.parameters.get("required", []))
            args = ", ".join(f"`{p}`" + ("" if p in required else "?") for p in params)
            out.append(f"### `{spec.name}`\n\n{spec.description}\n\n")
            if params:
                out.append(
                    _table(
                        ["parameter", "type", "description"],
                        [
                            [
                                f"`{p}`" + ("" if p in required else " (optional)"),
                                _type(node),
                                node.get("description", ""),
                            ]
                            for p, node in params.items()
                        ],
                    )
                    + "\n"
                )
            elif args == "":
                out.append("No parameters.\n\n")
    return "".join(out)


EXIT_CODE_ROWS = [
    [
        "**0**",
        "success: the run ended with `final_answer`, `done` or a reason the workflow declares "
        "with `success: true`; any other command did what it was asked",
    ],
    [
        "**1**",
        "the run did not succeed: it ended with any other reason, a replay diverged, or "
        "something failed at run time (the model server, the store, a run that another "
        "process is running right now)",
    ],
    [
        "**2**",
        "bad input: an unknown option, a bad value, an invalid workflow or config file "
        "(reported as `path:line:col: message`), an unknown or ambiguous run or dispatch id, "
        "a run that cannot be resumed as asked",
    ],
    [
        "**3**",
        "the run waits for a person (`fsm-kernel resume RUN_ID --approve | --reject WHY | "
        "--input TEXT`) or, in a waiting state, for an event or its timer (`fsm-kernel signal "
        "RUN_ID NAME`, or `resume` once the timer is due)",
    ],
]


def exit_codes_page() -> str:
    from fsm_kernel.cli import EXIT_CODES_HELP

    return (
        "# Exit codes\n\n"
        + GENERATED_NOTE
        + "Every command follows one table; its `--help` ends with it, word for word:\n\n"
        + f"> {EXIT_CODES_HELP}\n\n"
        + _table(["code", "meaning"], EXIT_CODE_ROWS)
        + "\nNothing prints a Python traceback unless you pass `--debug`. A failure is one "
        "line on stderr; under `--json`, a command that fails before producing its result "
        'still prints one JSON object on stdout: `{"error": "<the message>", "exit_code": '
        "2}`.\n"
    )


def environment_names() -> set[str]:
    """Every FSM_KERNEL_* and OTEL_* name the package reads, found in its source."""
    names: set[str] = set()
    for path in (ROOT / "fsm_kernel").rglob("*.py"):
        names.update(ENV_PATTERN.findall(path.read_text(encoding="utf-8")))
    return names - TEST_ONLY_ENV


def environment_page() -> str:
    names = sorted(environment_names() | {"OPENAI_API_KEY"})
    return (
        "# Environment variables\n\n"
        + GENERATED_NOTE
        + "Settings are layered: built-in defaults < the workflow's `agent:` block < "
        "environment < command-line flags. The list below is every name the package's source "
        "reads.\n\n"
        + _table(["variable", "what it sets"], [[f"`{n}`", ENVIRONMENT.get(n, "")] for n in names])
    )


# --- diagrams --------------------------------------------------------------------------------


def stock_diagrams() -> dict[str, str]:
    """Each stock workflow's SVG: drawn now by `dot`, else the committed diagrams/NAME.svg."""
    from fsm_kernel.diagram import render_svg, to_dot
    from fsm_kernel.workflow.loader import load_workflow

    drawn = {}
    for path in sorted((ROOT / "workflows").glob("*.yaml")):
        if shutil.which("dot"):
            drawn[path.stem] = render_svg(to_dot(load_workflow(path)))
        else:
            drawn[path.stem] = (ROOT / "diagrams" / f"{path.stem}.svg").read_text("utf-8")
    return drawn


# --- charts drawn from the pages' own tables ---------------------------------------------------

CHART_DIRECTIVE = re.compile(
    r"^<!-- chart: (?P<title>[^|>]+?)(?: \| columns=(?P<cols>[\d,]+))? -->\n"
)
CHART_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
CHART_COLOURS = ("#3f51b5", "#9e9e9e", "#ff9800", "#4caf50")
CHART_ROW, CHART_LABEL, CHART_BARS = 22, 250, 330


def chart_value(cell: str) -> float | None:
    """The first number of a table cell (`2,433 [1,736 / ...]` → 2433.0); None for `—`."""
    found = CHART_NUMBER.search(cell)
    return float(found.group(0).replace(",", "")) if found else None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_chart_table(
    lines: list[str], columns: list[int]
) -> tuple[list[str], list[tuple[str, list[float | None]]]]:
    """A Markdown table's series names (the headers of `columns`) and its rows' values."""
    header = _cells(lines[0])
    rows = []
    for line in lines[2:]:
        cells = _cells(line)
        rows.append((cells[0].replace("`", ""), [chart_value(cells[c]) for c in columns]))
    return [header[c] for c in columns], rows


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:g}"


def ours(label: str) -> bool:
    """A row of fsm-kernel's own (drawn in colour among grey peers)."""
    return label.startswith("fsm-kernel") or not label[:1].isalpha()


def chart_svg(title: str, series: list[str], rows: list[tuple[str, list[float | None]]]) -> str:
    """A horizontal bar chart: one group of bars per row, one bar per series, to scale."""
    top = max((v for _, values in rows for v in values if v is not None), default=1.0) or 1.0
    per_row = CHART_ROW * len(series) + 8
    legend = 22 if len(series) > 1 else 0
    height = 30 + legend + per_row * len(rows)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="100%" '
        f'viewBox="0 0 {CHART_LABEL + CHART_BARS + 80} {height}" font-family="sans-serif" '
        f'font-size="12"><title>{_xml(title)}</title>',
        f'<text x="0" y="16" font-weight="bold">{_xml(title)}</text>',
    ]
    for i, name in enumerate(series if legend else []):
        x = CHART_LABEL + i * 120
        out.append(f'<rect x="{x}" y="26" width="12" height="12" fill="{CHART_COLOURS[i % 4]}"/>')
        out.append(f'<text x="{x + 16}" y="37">{_xml(name)}</text>')
    y = 30 + legend
    for label, values in rows:
        out.append(
            f'<text x="0" y="{y + CHART_ROW * len(series) / 2 + 4:.0f}">{_xml(label)}</text>'
        )
        for i, value in enumerate(values):
            if value is not None:
                width = CHART_BARS * value / top
                colour = CHART_COLOURS[i % 4] if len(series) > 1 or ours(label) else "#9e9e9e"
                out.append(
                    f'<rect x="{CHART_LABEL}" y="{y + 2}" width="{width:.1f}" '
                    f'height="{CHART_ROW - 6}" fill="{colour}"/>'
                )
                out.append(
                    f'<text x="{CHART_LABEL + width + 4:.1f}" y="{y + 15}">{_fmt(value)}</text>'
                )
            y += CHART_ROW
        y += 8
    return "".join(out) + "</svg>"


def with_charts(markdown: str) -> str:
    """`markdown` with a chart drawn below each table its `<!-- chart: ... -->` names."""
    out: list[str] = []
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        directive = CHART_DIRECTIVE.match(lines[i] + "\n")
        out.append(lines[i])
        i += 1
        if not directive:
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        table = lines[start:i]
        columns = [int(c) for c in (directive["cols"] or "1").split(",")]
        series, rows = parse_chart_table(table, columns)
        svg = chart_svg(directive["title"].strip(), series, rows)
        out += [*table, "", f'<div class="chart">{svg}</div>']
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return with_charts(markdown) if "<!-- chart:" in markdown else markdown


# --- MkDocs -------------------------------------------------------------------------------------

PAGES = {
    "reference/cli.md": cli_page,
    "reference/workflow.md": workflow_page,
    "reference/events.md": events_page,
    "reference/builtins.md": builtins_page,
    "reference/exit-codes.md": exit_codes_page,
    "reference/environment.md": environment_page,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for name, svg in stock_diagrams().items():
        files.append(File.generated(config, f"diagrams/{name}.svg", content=svg))
    return files
