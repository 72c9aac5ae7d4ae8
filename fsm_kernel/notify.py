"""Webhook notifications (`notify:` in a workflow or a scheduler config): a person hears when a
run ends, fails or waits for them, or a scheduler's dispatch fails.

`Notifier` is a watcher like the CLI's progress printer: when a run it watches ends or
suspends, it POSTs to each webhook whose `on:` matches, in the background (the run is never
delayed, and a webhook that is down, slow or failing never fails it), retried with backoff
(1 s, 2 s, 4 s ... after a failed attempt: a connection error, a timeout, any status but 2xx;
`timeout_seconds` is a deadline for the whole attempt, the answer's last byte included).
Each attempt is recorded in the run's log as a `notify.attempted` event (the URL as scheme and
host only: a Slack webhook URL is a secret) after the run's ending. A child run
(workflow.call, workflow.map) notifies nobody: its parent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import Clock, Event, EventStore, EventType, SystemClock
from fsm_kernel.redact import redact, redact_data, register_secret
from fsm_kernel.tools.mcp_client import expand
from fsm_kernel.workflow.spec import NotifySpec

__all__ = ["DispatchNotifier", "Notification", "Notifier", "payload"]

logger = logging.getLogger(__name__)

_ANSWER_CHARS = 500
_GRACE_SECONDS = 15.0
"""How long closing waits for deliveries still being tried (a CLI process exits after it)."""
_FIRST_BACKOFF = 1.0


@dataclass(frozen=True, kw_only=True)
class Notification:
    """What a webhook is told."""

    event: str
    """ended, failed, waiting or dispatch_failed."""
    run_id: str | None
    workflow: str
    status: str
    """ended, waiting, or failed (a dispatch)."""
    reason: str | None = None
    answer: str = ""
    error: str | None = None
    waiting_for: dict[str, Any] | None = None
    agent_id: str | None = None
    dispatch_id: str | None = None

    def hint(self) -> str:
        if self.run_id is None:
            return "fsm-kernel dispatches CONFIG"
        if self.event == "waiting":
            return (
                f"fsm-kernel runs show {self.run_id}; answer with fsm-kernel resume {self.run_id}"
            )
        return f"fsm-kernel runs show {self.run_id}"


def payload(note: Notification, fmt: str) -> dict[str, Any]:
    """The JSON body of the POST: fsm-kernel's own fields, or a Slack message."""
    answer = note.answer if len(note.answer) <= _ANSWER_CHARS else note.answer[:_ANSWER_CHARS] + "…"
    if fmt == "slack":
        who = f"agent {note.agent_id}" if note.agent_id else f"run {note.run_id}"
        head = {
            "ended": f"{note.workflow} {who} ended: {note.reason}",
            "failed": f"{note.workflow} {who} failed: {note.reason}",
            "waiting": f"{note.workflow} {who} waits for a person",
            "dispatch_failed": f"dispatch of {who} ({note.workflow}) failed",
        }[note.event]
        lines = [f"*{head}*"]
        if note.error:
            lines.append(f"error: {note.error}")
        if answer:
            lines.append(f"answer: {answer}")
        if note.waiting_for:
            lines.append(
                f"waiting for: {note.waiting_for.get('kind')} in {note.waiting_for.get('state')}"
            )
        lines.append(f"`{note.hint()}`")
        return {"text": redact("\n".join(lines))}
    body: dict[str, Any] = {
        "event": note.event,
        "run_id": note.run_id,
        "workflow": note.workflow,
        "status": note.status,
        "reason": note.reason,
        "answer": answer,
        "error": note.error,
        "hint": note.hint(),
    }
    if note.waiting_for is not None:
        body["waiting_for"] = note.waiting_for
    if note.agent_id is not None:
        body["agent_id"] = note.agent_id
        body["dispatch_id"] = note.dispatch_id
    result: dict[str, Any] = redact_data(body)
    return result


def shown_url(url: str) -> str:
    """What a log may say of a webhook URL: its scheme and host (the path may be a secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")


class Notifier:
    """Tells the webhooks about the runs it watches (see the module's text).

    Args:
        hooks: the webhooks (a workflow's `notify:`, and a scheduler config's).
        store: where attempts are recorded (in the run's log); None records nothing.
        is_success: whether a termination reason is a success (the workflow's own reasons).
        workflow: the workflow's name, for runs whose start it did not see (a resume).
    """

    def __init__(
        self,
        hooks: Sequence[NotifySpec],
        *,
        store: EventStore | None,
        is_success: Callable[[str], bool],
        workflow: str = "",
        environ: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        sleep: Callable[[float], Any] | None = None,
    ) -> None:
        self.hooks = list(hooks)
        self.store = store
        self.is_success = is_success
        self.workflow = workflow
        self.environ = os.environ if environ is None else environ
        self.clock = clock or SystemClock()
        self.sleep = sleep or asyncio.sleep
        self._children: set[str] = set()
        self._workflows: dict[str, str] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._write = asyncio.Lock()

    def __call__(self, item: Any) -> None:
        if not isinstance(item, Event):
            return
        note = self._note(item)
        if note is not None:
            self.send(note)

    def _note(self, event: Event) -> Notification | None:
        data = event.data
        if event.type == EventType.RUN_STARTED:
            if data.get("parent_run_id"):
                self._children.add(event.run_id)
            self._workflows[event.run_id] = str(data.get("workflow") or "")
            return None
        if event.run_id in self._children:
            return None
        workflow = self._workflows.get(event.run_id, self.workflow)
        if event.type == EventType.RUN_SUSPENDED:
            return Notification(
                event="waiting",
                run_id=event.run_id,
                workflow=workflow,
                status="waiting",
                waiting_for=dict(data.get("waiting_for") or {}),
            )
        if event.type == EventType.RUN_TERMINATED:
            reason = str(data.get("reason"))
            return Notification(
                event="ended" if self.is_success(reason) else "failed",
                run_id=event.run_id,
                workflow=workflow,
                status="ended",
                reason=reason,
                answer=str(data.get("answer") or ""),
                error=data.get("error"),
            )
        return None

    def send(self, note: Notification) -> None:
        """POST `note` to every hook that wants it, in the background (on the running loop)."""
        wanted = [
            hook
            for hook in self.hooks
            if note.event in hook.on or (note.event == "failed" and "ended" in hook.on)
        ]
        for hook in wanted:
            task = asyncio.get_running_loop().create_task(self._deliver(hook, note))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _deliver(self, hook: NotifySpec, note: Notification) -> None:
        try:
            url = expand(hook.url, self.environ, "notify url")
            headers = {
                k: expand(v, self.environ, f"notify header {k}") for k, v in hook.headers.items()
            }
        except FsmKernelError as exc:
            await self._record(note, hook, 1, None, str(exc), final=True)
            return
        register_secret(url if urlsplit(url).path not in ("", "/") else None)
        body = payload(note, hook.format)
        attempts = hook.retries + 1
        async with httpx.AsyncClient(timeout=hook.timeout_seconds) as client:
            for attempt in range(1, attempts + 1):
                status, error = await _post(client, url, body, headers, hook.timeout_seconds)
                ok = status is not None and 200 <= status < 300
                await self._record(
                    note, hook, attempt, status, error, final=ok or attempt == attempts
                )
                if ok:
                    return
                if attempt < attempts:
                    await self.sleep(_FIRST_BACKOFF * 2 ** (attempt - 1))
        logger.warning(
            "notify %s: %s about run %s failed %d times",
            shown_url(url),
            note.event,
            note.run_id,
            attempts,
        )

    async def _record(
        self,
        note: Notification,
        hook: NotifySpec,
        attempt: int,
        status: int | None,
        error: str | None,
        *,
        final: bool,
    ) -> None:
        data: dict[str, Any] = {
            "url": shown_url(hook.url) if "://" in hook.url else "(from the environment)",
            "event": note.event,
            "format": hook.format,
            "attempt": attempt,
            "status": status,
            "ok": status is not None and 200 <= status < 300,
            "final": final,
        }
        if error:
            data["error"] = error
        if not self._records() or note.run_id is None:
            logger.info("notify attempt: %s", data)
            return
        async with self._write:  # one writer at a time: each takes the next seq
            try:
                await asyncio.to_thread(self._append, note.run_id, data)
            except Exception as exc:  # the log is busy or gone: the attempt still happened
                logger.warning("could not record a notify attempt of run %s: %s", note.run_id, exc)

    def _records(self) -> bool:
        """Whether attempts go to the runs' logs (else to the log lines)."""
        return self.store is not None

    @contextlib.contextmanager
    def _opened(self) -> Iterator[EventStore]:
        """The store the attempts are appended to (in a thread)."""
        assert self.store is not None
        yield self.store

    def _append(self, run_id: str, data: dict[str, Any]) -> None:
        with self._opened() as store:
            _append_attempt(store, run_id, data, self.clock)

    async def aclose(self, grace: float = _GRACE_SECONDS) -> None:
        """Wait up to `grace` seconds for deliveries still being tried, then give them up."""
        pending = list(self._pending)
        if not pending:
            return
        _, left = await asyncio.wait(pending, timeout=grace)
        for task in left:
            task.cancel()
        if left:
            logger.warning("gave up %d notification(s) still being tried", len(left))
            await asyncio.gather(*left, return_exceptions=True)


class DispatchNotifier(Notifier):
    """A scheduler's notifier of failed dispatches: attempts go to the failed run's log (the
    store opened for each record), or to the log lines when the dispatch never started a run."""

    def __init__(self, hooks: Sequence[NotifySpec], store_location: str) -> None:
        super().__init__(hooks, store=None, is_success=lambda _: False)
        self.store_location = store_location

    def failed(
        self,
        *,
        agent_id: str,
        dispatch_id: str,
        workflow: str,
        run_id: str | None,
        reason: str | None,
        error: str | None,
    ) -> None:
        """Tell the hooks that want `dispatch_failed` (in the background)."""
        self.send(
            Notification(
                event="dispatch_failed",
                run_id=run_id,
                workflow=workflow,
                status="failed",
                reason=reason,
                error=error,
                agent_id=agent_id,
                dispatch_id=dispatch_id,
            )
        )

    def _records(self) -> bool:
        return True

    @contextlib.contextmanager
    def _opened(self) -> Iterator[EventStore]:
        from fsm_kernel.store import open_store

        with open_store(self.store_location) as store:
            yield store


def _append_attempt(store: EventStore, run_id: str, data: dict[str, Any], clock: Clock) -> None:
    """A `notify.attempted` event after the run's last one (a resume may append meanwhile:
    then the next free seq is taken)."""
    for _ in range(3):
        events = store.read(run_id)
        last = events[-1] if events else None
        event = Event(
            run_id=run_id,
            seq=(last.seq if last else 0) + 1,
            type=EventType.NOTIFY_ATTEMPTED,
            timestamp=clock.now(),
            iteration=last.iteration if last else 0,
            state=last.state if last else None,
            data=redact_data(data),
        )
        try:
            store.append([event])
            return
        except FsmKernelError:
            continue


async def _post(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    seconds: float,
) -> tuple[int | None, str | None]:
    """(status, error) of one POST: a status for any answer, an error for no answer or 2xx
    missing. The whole attempt (connecting, sending, the answer's last byte) must end within
    `seconds`: httpx's own timeout is per read, and a receiver that trickles its answer would
    hold the attempt for as long as it liked."""
    try:
        async with asyncio.timeout(seconds):
            response = await client.post(url, json=body, headers=headers)
    except (httpx.TimeoutException, TimeoutError):
        return None, "timed out"
    except httpx.HTTPError as exc:
        return None, redact(f"{type(exc).__name__}: {exc}")[:200]
    if 200 <= response.status_code < 300:
        return response.status_code, None
    return response.status_code, f"HTTP {response.status_code}"
