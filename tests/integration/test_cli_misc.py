"""The CLI's other commands: validate (exit codes, file:line:col), tools, schema, workflows,
--help and --version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.clikit import cli

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
DATA = REPO / "tests" / "data"
STOCK = sorted(p.stem for p in (REPO / "workflows").glob("*.yaml"))


# --- validate ---------------------------------------------------------------------------------


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["validate", str(DEFAULT)])

    assert outcome.code == 0
    assert outcome.out == f"{DEFAULT}: ok (5 states, 12 transitions)\n"
    assert outcome.err == ""


@pytest.mark.parametrize("name", STOCK)
def test_every_stock_workflow_validates(capsys: pytest.CaptureFixture[str], name: str) -> None:
    outcome = cli(capsys, ["validate", str(REPO / "workflows" / f"{name}.yaml")])

    assert outcome.code == 0, outcome.err
    assert ": ok (" in outcome.out


def test_validate_a_stock_name(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["validate", "default"])

    assert outcome.code == 0
    assert outcome.out.endswith(": ok (5 states, 12 transitions)\n")


def test_validate_failing_file(capsys: pytest.CaptureFixture[str]) -> None:
    broken = DATA / "broken_on_key.yaml"

    outcome = cli(capsys, ["validate", str(broken)])

    assert outcome.code == 2
    assert outcome.err == f"error: {broken}:10:40: unknown key 'on'; guards are written 'guard:'\n"
    assert outcome.out == ""


def test_validate_reports_every_file(capsys: pytest.CaptureFixture[str]) -> None:
    first = DATA / "broken_duplicate_key.yaml"
    second = DATA / "broken_yaml_syntax.yaml"

    outcome = cli(capsys, ["validate", str(first), str(DEFAULT), str(second)])

    assert outcome.code == 2
    assert outcome.out == f"{DEFAULT}: ok (5 states, 12 transitions)\n"
    errors = outcome.err.splitlines()
    assert errors == [
        f"error: {first}:7:3: duplicate key 'observe'",
        f"error: {second}:3:18: YAML syntax error: mapping values are not allowed here",
    ]


def test_validate_checks_tool_names(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    text = DEFAULT.read_text(encoding="utf-8").replace(
        "tools: [datetime, read_file, list_directory, done]",
        "tools: [datetime, teleport, done]",
    )
    path.write_text(text, encoding="utf-8")
    line = text.splitlines().index("tools: [datetime, teleport, done]") + 1

    outcome = cli(capsys, ["validate", str(path)])

    assert outcome.code == 2
    assert outcome.err.startswith(f"error: {path}:{line}:19: unknown tool 'teleport'")


def test_validate_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    outcome = cli(capsys, ["validate", str(tmp_path / "nope.yaml")])

    assert outcome.code == 2
    assert outcome.err.startswith("error: ")
    assert "nope.yaml" in outcome.err


def test_validate_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, ["validate"]).code == 2


# --- tools, schema, workflows -----------------------------------------------------------------


def test_tools_lists_the_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["tools"])

    assert outcome.code == 0
    heads = [line for line in outcome.out.splitlines() if not line.startswith(" ")]
    assert [h.split("(")[0] for h in heads] == ["datetime", "read_file", "list_directory", "done"]
    assert "read_file(path: string)" in heads
    assert "done(answer: string)" in heads
    assert "    Read a text file from the workspace." in outcome.out.splitlines()


def test_tools_json(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["tools", "--json"])

    assert outcome.code == 0
    tools = json.loads(outcome.out)
    assert [t["name"] for t in tools] == ["datetime", "read_file", "list_directory", "done"]
    for t in tools:
        assert set(t) == {"name", "description", "parameters"}
        assert t["parameters"]["type"] == "object"
    read_file = tools[1]
    assert read_file["parameters"]["required"] == ["path"]


def test_schema_is_json_schema_for_workflows(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["schema"])

    assert outcome.code == 0
    schema = json.loads(outcome.out)
    assert schema["type"] == "object"
    assert {"states", "transitions"} <= set(schema["properties"])
    assert {"name", "initial", "states", "transitions"} <= set(schema["required"])
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["title"] == "fsm-kernel workflow"


def test_stock_workflows_match_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(cli(capsys, ["schema"]).out)

    for path in sorted((REPO / "workflows").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text(encoding="utf-8")), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "initial": "a", "states": {}}, schema)


def test_workflows_lists_the_stock_files(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["workflows"])

    assert outcome.code == 0
    names = [line.split()[0] for line in outcome.out.splitlines()]
    assert names == STOCK
    assert "(invalid" not in outcome.out


def test_workflows_json(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["workflows", "--json"])

    listed = json.loads(outcome.out)
    assert [w["name"] for w in listed] == STOCK
    default = next(w for w in listed if w["name"] == "default")
    assert default["description"].startswith("Observe → Think → Act → Evaluate → Terminate")


# --- help and version -------------------------------------------------------------------------


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["--help"])

    assert outcome.code == 0
    for word in ("run", "validate", "tools", "schema", "workflows", "--debug", "--version"):
        assert word in outcome.out
    assert "FSM_KERNEL_BASE_URL" in outcome.out


def test_run_help_mentions_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["run", "--help"])

    assert outcome.code == 0
    for flag in (
        "--prompt",
        "--model",
        "--base-url",
        "--request-timeout",
        "--max-retries",
        "--max-iterations",
        "--timeout",
        "--workspace",
        "--store",
        "--json",
        "--system-prompt",
        "--memory",
        "--verbose",
    ):
        assert flag in outcome.out, flag
    assert "WORKFLOW" in outcome.out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from fsm_kernel import __version__

    outcome = cli(capsys, ["--version"])

    assert outcome.code == 0
    assert outcome.out.strip() == f"fsm-kernel {__version__}"


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["fly"])

    assert outcome.code == 2
    assert "error: " in outcome.err


def test_help_loads_no_engine_no_client_no_store() -> None:
    """`fsm-kernel --help` and each subcommand's help build the whole parser without importing
    what runs work (measured in benchmarks/compare.py's start-up part, not timed here)."""
    code = (
        "import sys; from fsm_kernel.cli import build_parser; build_parser(); "
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    heavy = {
        "fsm_kernel.api",
        "fsm_kernel.bootstrap",
        "fsm_kernel.kernel",
        "fsm_kernel.scheduler",
        "fsm_kernel.store",
        "fsm_kernel.workflow.compiler",
        "httpx",
        "pydantic",
        "statemachine",
        "yaml",
    }
    assert loaded & heavy == set()
    assert "fsm_kernel.cli.commands" in loaded
