"""The exception tree: messages, locations, pickling (errors cross process boundaries) and the
JSON form the event log stores."""

from __future__ import annotations

import json
import pickle

import pytest

from fsm_kernel import errors
from fsm_kernel.errors import (
    AgentAuthError,
    AgentConnectionError,
    AgentError,
    AgentHTTPError,
    AgentRateLimitError,
    AgentServerError,
    AgentTimeoutError,
    ConfigError,
    FsmKernelError,
    NoTransitionError,
    RunError,
    ToolError,
    ToolFatalError,
    WorkflowError,
    WorkflowSyntaxError,
    WorkflowValidationError,
)
from fsm_kernel.workflow.spec import SourceLocation

LOC = SourceLocation("workflows/react.yaml", 12, 5)


def test_workflow_error_str_has_the_location() -> None:
    err = WorkflowValidationError("unknown target 'act'", location=LOC)

    assert str(err) == "workflows/react.yaml:12:5: unknown target 'act'"
    assert err.message == "unknown target 'act'"
    assert err.location == LOC


def test_workflow_error_with_a_path_only_or_nothing() -> None:
    assert str(WorkflowError("bad", location="w.yaml")) == "w.yaml: bad"
    assert str(WorkflowError("bad")) == "bad"


def test_plain_error_str_is_the_message() -> None:
    err = ConfigError("FSM_KERNEL_MAX_RETRIES='x' is not a number")

    assert str(err) == "FSM_KERNEL_MAX_RETRIES='x' is not a number"
    assert err.args == ("FSM_KERNEL_MAX_RETRIES='x' is not a number",)


def _roundtrip(err: FsmKernelError) -> FsmKernelError:
    return pickle.loads(pickle.dumps(err))


@pytest.mark.parametrize(
    "err",
    [
        ConfigError("bad setting"),
        WorkflowSyntaxError("YAML syntax error: x", location=LOC),
        WorkflowValidationError("no final state", location="w.yaml"),
        AgentError("down", base_url="http://h/v1"),
        AgentRateLimitError(
            "slow down", base_url="http://h/v1", status_code=429, body="{}", retry_after=2.5
        ),
        AgentAuthError("no key", status_code=401, body="unauthorized"),
        AgentConnectionError("refused", base_url="http://127.0.0.1:9/v1"),
        ToolFatalError("disk gone", tool_name="write"),
        NoTransitionError("stuck", run_id="r1"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_pickle_round_trip_keeps_type_and_attributes(err: FsmKernelError) -> None:
    back = _roundtrip(err)

    assert type(back) is type(err)
    assert vars(back) == vars(err)
    assert str(back) == str(err)
    assert back.args == err.args


def test_pickle_keeps_attributes_set_after_construction() -> None:
    err = ToolError("broke")
    err.tool_name = "read_file"

    back = _roundtrip(err)

    assert isinstance(back, ToolError)
    assert back.tool_name == "read_file"


def test_pickled_http_error_keeps_the_http_details() -> None:
    err = AgentServerError("503", base_url="u", status_code=503, body="busy", retry_after=None)

    back = _roundtrip(err)

    assert isinstance(back, AgentHTTPError)
    assert (back.status_code, back.body, back.retry_after, back.base_url) == (
        503,
        "busy",
        None,
        "u",
    )
    assert back.retryable


def test_to_dict_has_type_message_and_public_attributes() -> None:
    err = AgentRateLimitError("slow", base_url="http://h", status_code=429, retry_after=3.0)

    d = err.to_dict()

    assert d == {
        "type": "AgentRateLimitError",
        "message": "slow",
        "base_url": "http://h",
        "status_code": 429,
        "body": "",
        "retry_after": 3.0,
    }
    assert json.loads(json.dumps(d)) == d


def test_to_dict_skips_values_that_are_not_json_scalars() -> None:
    err = RunError("x", run_id="r")
    err.details = {"nested": [1, 2]}  # type: ignore[attr-defined]
    err._private = "hidden"  # type: ignore[attr-defined]

    assert err.to_dict() == {"type": "RunError", "message": "x", "run_id": "r"}


def test_workflow_error_to_dict_carries_the_location_in_the_message() -> None:
    d = WorkflowValidationError("unknown target 'act'", location=LOC).to_dict()

    assert d == {
        "type": "WorkflowValidationError",
        "message": "workflows/react.yaml:12:5: unknown target 'act'",
    }
    json.dumps(d)


def test_retryable_only_where_a_retry_can_help() -> None:
    retryable = {
        name
        for name in errors.__all__
        if issubclass(cls := getattr(errors, name), AgentError) and cls.retryable
    }

    assert retryable == {
        "AgentConnectionError",
        "AgentRateLimitError",
        "AgentServerError",
        "AgentTimeoutError",
    }


def test_every_exported_error_is_in_the_one_tree() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, FsmKernelError), name
    assert issubclass(WorkflowSyntaxError, WorkflowError)
    assert issubclass(AgentTimeoutError, AgentError)
    assert issubclass(ToolFatalError, ToolError)
    assert issubclass(NoTransitionError, RunError)
    assert not issubclass(FsmKernelError, (ValueError, RuntimeError))
