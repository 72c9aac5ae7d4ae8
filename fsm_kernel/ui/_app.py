"""The run viewer's ASGI app: Starlette routes rendering Jinja2 templates (autoescaped), a little
JavaScript for live updates and filtering, and `post_action`, through which every
state-changing request goes (CSRF-checked form POSTs).

Routes:
    GET  /                                   runs (filters workflow, status, q; before/after)
    GET  /runs/table                         the runs table alone (the page refreshes it)
    GET  /runs/{run_id}                      a run: header, waiting question, diagram, timeline
    GET  /runs/{run_id}/head                 {"seq": last seq} (a live page polls it)
    GET  /runs/{run_id}/parts                the run page's parts, rendered, as JSON
    GET  /runs/{run_id}/events/{seq}         one event as JSON (redacted)
    GET  /workflows                          stock and recently used workflows
    GET  /workflows/stock/{name}             a stock workflow: diagram and YAML
    GET  /workflows/run/{run_id}             the workflow file a run used
    GET  /scheduler                          dispatches by cycle (with --scheduler)
    GET  /scheduler/table                    the dispatches alone (the page refreshes it)
    POST /scheduler/dispatches/{id}/cancel   cancel a dispatch (as `dispatches --cancel`)
    POST /runs/{run_id}/answer               answer a waiting run (as `resume --approve ...`)

A run waiting for a person shows its question in _run_waiting.html with the forms that answer
it (approve, reject with a reason, or input), posting to `answer_run`.

Every page is a plain (not async) function, so Starlette renders it on its thread pool: a page
that is slow to read or render (a run with a huge reply) never holds up the event loop, and the
other pages are answered meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fsm_kernel.errors import RunNotFoundError, StoreConflictError
from fsm_kernel.protocol import RunFilter
from fsm_kernel.ui._answers import AnswerRejected, Resumes, parse_answer
from fsm_kernel.ui._dispatches import group_cycles
from fsm_kernel.ui._reader import UiReader, status_class, stock_workflows
from fsm_kernel.ui._security import (
    CSRF_FIELD,
    MAX_FORM_BYTES,
    CsrfError,
    Guard,
    GuardSettings,
    parse_form,
)
from fsm_kernel.ui._timeline import clip, pretty

__all__ = ["FormHandler", "create_app", "post_action"]

STATIC = Path(__file__).resolve().parent / "static"
_MAX_PARAM = 200

FormHandler = Callable[[Request, dict[str, str]], Response]
"""A POST's work: the request and its form fields (CSRF already checked); runs on a thread."""


@dataclass(frozen=True)
class Page:
    """How a template is rendered: its environment and what every page knows."""

    env: Environment
    has_scheduler: bool

    def html(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        return HTMLResponse(self.text(request, name, **context), status_code=status)

    def text(self, request: Request, name: str, **context: Any) -> str:
        csrf_token = getattr(request.state, "csrf_token", "")
        return self.env.get_template(name).render(
            request=request,
            has_scheduler=self.has_scheduler,
            csrf_field=Markup(  # the one place a form's CSRF token is written
                f'<input type="hidden" name="{CSRF_FIELD}" value="{csrf_token}">'
            ),
            **context,
        )


def _environment(reader: UiReader | None = None) -> Environment:
    """The templates' environment; run ids are shortened as `reader`'s store allows."""
    env = Environment(
        loader=PackageLoader("fsm_kernel.ui", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        ts=_ts,
        duration=_duration,
        num=lambda n: f"{int(n or 0):,}",
        short=reader.short_id if reader else str,  # the shortest unique prefix of a run id
        short_dispatch=lambda dispatch_id: str(dispatch_id)[:8],
        pretty=pretty,
        clip=clip,
        status_class=status_class,
        cut=lambda text, n=120: text if len(text) <= n else text[: n - 1] + "…",
    )
    env.globals["query"] = _query
    return env


def _ts(moment: datetime | None) -> str:
    if moment is None:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _query(**params: str | None) -> str:
    """`?a=1&b=2` of the parameters given (empty ones left out)."""
    kept = {k: v for k, v in params.items() if v}
    return "?" + urlencode(kept) if kept else ""


def _param(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value[:_MAX_PARAM] or None


def _filter(request: Request) -> RunFilter:
    return RunFilter(
        workflow=_param(request, "workflow"),
        status=_param(request, "status"),
        text=_param(request, "q"),
    )


def post_action(handler: FormHandler) -> Callable[[Request], Awaitable[Response]]:
    """A POST route's endpoint around `handler`: the body must be a form of at most
    MAX_FORM_BYTES carrying a valid CSRF token (see Csrf) from this origin; then `handler`
    runs on a thread (it may block on the store). The access token, when there is one, was
    checked by the Guard already, as for every request."""

    async def endpoint(request: Request) -> Response:
        page: Page = request.app.state.page
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            return page.html(request, "error.html", 415, message="send the form as a form")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return page.html(request, "error.html", 413, message="the form is too large")
        fields = parse_form(body)
        try:
            request.state.csrf.check(request.scope, fields)
        except CsrfError as exc:
            return page.html(request, "error.html", 403, message=str(exc))
        return await run_in_threadpool(handler, request, fields)

    return endpoint


# -- pages --------------------------------------------------------------------------------------


def _reader(request: Request) -> UiReader:
    reader: UiReader = request.app.state.reader
    return reader


def _page(request: Request) -> Page:
    page: Page = request.app.state.page
    return page


def runs(request: Request) -> Response:
    context = _runs_context(request)
    if context is None:
        return _not_found(request, "no such run to page from")
    return _page(request).html(request, "runs.html", **context)


def runs_table(request: Request) -> Response:
    context = _runs_context(request)
    if context is None:
        return _not_found(request, "no such run to page from")
    return _page(request).html(request, "_runs_table.html", **context)


def _runs_context(request: Request) -> dict[str, Any] | None:
    where = _filter(request)
    try:
        page = _reader(request).runs_page(
            where, before=_param(request, "before"), after=_param(request, "after")
        )
    except RunNotFoundError:
        return None
    filters = {"workflow": where.workflow, "status": where.status, "q": where.text}
    return {"page": page, "filters": filters, "now": datetime.now(UTC)}


def run_page(request: Request) -> Response:
    reader = _reader(request)
    wanted = request.path_params["run_id"]
    try:
        run_id = reader.find(wanted)
    except RunNotFoundError as exc:
        return _not_found(request, str(exc))
    if run_id != wanted:
        return RedirectResponse(f"/runs/{run_id}", status_code=303)
    view = reader.run(run_id)
    return _page(request).html(request, "run.html", run=view, parts=_run_parts(request, view))


def run_head(request: Request) -> Response:
    return JSONResponse({"seq": _reader(request).head(request.path_params["run_id"])})


def run_parts(request: Request) -> Response:
    try:
        view = _reader(request).run(request.path_params["run_id"])
    except RunNotFoundError as exc:
        return JSONResponse({"error": str(exc)}, status_code=404)
    return JSONResponse(
        {"seq": view.seq, "status": view.status, "live": view.is_live,
         "parts": _run_parts(request, view)}
    )  # fmt: skip


def _run_parts(request: Request, view: Any) -> dict[str, str]:
    page = _page(request)
    failed = None
    if view.waiting is not None:  # an answer from this viewer that did not take, if any
        failed = _resumes(request).failure(view.run_id, view.waiting.seq)
    return {
        name: page.text(request, f"_run_{name}.html", run=view, answer_failed=failed)
        for name in ("header", "waiting", "diagram", "timeline")
    }


def _resumes(request: Request) -> Resumes:
    resumes: Resumes = request.app.state.resumes
    return resumes


def run_event(request: Request) -> Response:
    try:
        seq = int(request.path_params["seq"])
    except ValueError:
        return JSONResponse({"error": "seq must be a number"}, status_code=400)
    event = _reader(request).event(request.path_params["run_id"], seq)
    if event is None:
        return JSONResponse({"error": "no such event"}, status_code=404)
    return Response(
        json.dumps(event.to_dict(), ensure_ascii=False, indent=2),
        media_type="application/json",
    )


def workflows(request: Request) -> Response:
    return _page(request).html(
        request,
        "workflows.html",
        stock=stock_workflows(),
        recent=_reader(request).recent_workflows(),
    )


def stock_workflow(request: Request) -> Response:
    loaded = _reader(request).stock_workflow(request.path_params["name"])
    if loaded is None:
        return _not_found(request, "no such stock workflow")
    return _workflow_page(request, loaded, run_id=None)


def run_workflow(request: Request) -> Response:
    reader = _reader(request)
    try:
        run_id = reader.find(request.path_params["run_id"])
    except RunNotFoundError as exc:
        return _not_found(request, str(exc))
    loaded = reader.workflow_of_run(run_id)
    if loaded is None:
        return _not_found(request, f"the workflow of run {run_id} is not on this machine")
    return _workflow_page(request, loaded, run_id=run_id)


def _workflow_page(request: Request, loaded: Any, *, run_id: str | None) -> Response:
    diagram = None
    if loaded.spec is not None:
        diagram = _reader(request).renderer.draw(loaded.spec)
    return _page(request).html(
        request, "workflow.html", loaded=loaded, diagram=diagram, run_id=run_id
    )


def scheduler(request: Request) -> Response:
    context = _scheduler_context(request)
    if context is None:
        return _not_found(request, "start the viewer with --scheduler CONFIG to see dispatches")
    return _page(request).html(request, "scheduler.html", **context)


def scheduler_table(request: Request) -> Response:
    context = _scheduler_context(request)
    if context is None:
        return _not_found(request, "no scheduler config")
    return _page(request).html(request, "_scheduler_table.html", **context)


def _scheduler_context(request: Request) -> dict[str, Any] | None:
    reader = _reader(request).dispatches
    if reader is None:
        return None
    return {
        "config": reader.config,
        "config_path": reader.config_path,
        "cycles": group_cycles(reader.recent()),
        "now": datetime.now(UTC),
    }


def cancel_dispatch(request: Request, fields: dict[str, str]) -> Response:
    """Cancel a pending dispatch, or ask the worker of a running one to stop it."""
    reader = _reader(request).dispatches
    if reader is None:
        return _not_found(request, "no scheduler config")
    dispatch_id = request.path_params["dispatch_id"]
    try:
        row = reader.cancel(dispatch_id)
    except StoreConflictError as exc:
        return _page(request).html(request, "error.html", 409, message=f"cannot cancel: {exc}")
    if row is None:
        return _not_found(request, f"no dispatch {dispatch_id} in this scheduler")
    return RedirectResponse(f"/scheduler#d-{dispatch_id}", status_code=303)


def answer_run(request: Request, fields: dict[str, str]) -> Response:
    """Answer the question a run waits on, exactly as `fsm-kernel resume` with the answer does;
    409 when the run no longer waits on the question the page showed (`seq`), or another
    answer to it is being resumed."""
    reader = _reader(request)
    run_id = request.path_params["run_id"]
    try:
        view = reader.run(run_id)
    except RunNotFoundError:
        return _not_found(request, f"no run {run_id}")
    page = _page(request)
    waiting = view.waiting
    if waiting is None or fields.get("seq") != str(waiting.seq):
        message = "the run no longer waits for that answer (reload the page)"
        return page.html(request, "error.html", 409, message=message)
    if reader.location is None:
        return page.html(request, "error.html", 409, message="the store's location is unknown")
    try:
        answer = parse_answer(fields, waiting.kind, waiting.events)
        _resumes(request).start(reader.location, view.run_id, waiting.seq, answer)
    except AnswerRejected as exc:
        return page.html(request, "error.html", exc.status, message=str(exc))
    return RedirectResponse(f"/runs/{view.run_id}", status_code=303)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = "no such page" if exc.status_code == 404 else str(exc.detail)
    return _page(request).html(request, "error.html", exc.status_code, message=message)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """The page of a bug; the Guard logs it (one line; the traceback at debug level)."""
    message = "internal error (the viewer's log has one line about it)"
    return _page(request).html(request, "error.html", 500, message=message)


def _not_found(request: Request, message: str) -> Response:
    return _page(request).html(request, "error.html", 404, message=message)


def create_app(
    reader: UiReader, guard: GuardSettings, *, extra_routes: list[Route] | None = None
) -> Guard:
    """The viewer's ASGI app over `reader`, behind the Guard (token, Host, headers, CSRF)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            reader.close()

    routes = [
        Route("/", runs),
        Route("/runs/table", runs_table),
        Route("/runs/{run_id}", run_page),
        Route("/runs/{run_id}/head", run_head),
        Route("/runs/{run_id}/parts", run_parts),
        Route("/runs/{run_id}/events/{seq}", run_event),
        Route("/workflows", workflows),
        Route("/workflows/stock/{name}", stock_workflow),
        Route("/workflows/run/{run_id}", run_workflow),
        Route("/scheduler", scheduler),
        Route("/scheduler/table", scheduler_table),
        Route("/runs/{run_id}/answer", post_action(answer_run), methods=["POST"]),
        Route(
            "/scheduler/dispatches/{dispatch_id}/cancel",
            post_action(cancel_dispatch),
            methods=["POST"],
        ),
        *(extra_routes or []),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.reader = reader
    app.state.page = Page(_environment(reader), has_scheduler=reader.dispatches is not None)
    app.state.resumes = Resumes(reader.waits_on)
    return Guard(app, guard)
