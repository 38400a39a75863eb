"""The platform's HTTP API and dashboard: FastAPI over :class:`~fireflyer.platform.api.PlatformApi`.

Each request is authenticated by its bearer token (:mod:`.auth`), then opens a
``PlatformApi`` for the token's user: it sees and controls only their own tasks, an
admin everything. Routes are plain ``def`` functions, so FastAPI runs each in its
thread pool, and each opens and closes its own SQLite connection there (SQLite's
connections belong to one thread). :class:`ApiError` statuses become the response's
status with ``{"detail": message}``; anything unexpected is logged and becomes a 500
with the same shape, but the tests (schemathesis included) hold that none happens.

Nothing here logs a request's headers, so tokens never reach the log; uvicorn's access
log shows the method, path and query only, and the API takes tokens in headers only.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path as FsPath
from typing import Any

from fastapi import Body, Depends, FastAPI, Path, Query, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic_core import to_json
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fireflyer.platform.api import MAX_LIMIT, ApiError, PlatformApi
from fireflyer.platform.layout import Home
from fireflyer.platform.server import models as m
from fireflyer.platform.server.auth import FailedLogins, User, Users
from fireflyer.platform.server.sse import log_events
from fireflyer.platform.store import storage_problem

log = logging.getLogger("fireflyer.platform.server")

STATIC = FsPath(__file__).with_name("static")
STREAM_LIMIT_S = 3600.0
"""The longest one log stream runs; a client that wants more reconnects."""
STREAMS_PER_USER = 16
"""Log streams one user may have open at once (each holds a thread while it runs)."""
MAX_BODY = 1 << 20
"""Bytes a request body may have (a submit with a long command and environment is a few KB)."""
RESERVATION_S = 10.0
"""Seconds an admitted stream holds its place before it starts (a client that left at once frees it then)."""

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Scripts only from our own files, never inline: an escaped-wrong task name still cannot run.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                               "form-action 'self'",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    words = {400: "bad input", 401: "no valid token", 403: "not allowed for this user", 404: "no such task or node",
             409: "the task's state does not allow it",
             429: "too many failed logins from this address, or too many open log streams for this user",
             503: "the platform's state cannot be used now (a full or failing disk): retry later"}
    return {c: {"model": m.Error, "description": words[c]} for c in codes}


AUTH = (401, 429, 503)
SSE_EVENT = {
    "type": "object", "required": ["data"],
    "description": "one event (Open API 3.1: the schema describes each event): a log line, or the end",
    "properties": {"event": {"type": "string", "enum": ["message", "end"],
                             "description": "absent (a log line: 'message'), or 'end' once: the chain finished or "
                                            "is held (data: its outcome), or the stream ran its limit (data: "
                                            "'timeout'; reconnect to go on)"},
                   "data": {"type": "string", "description": "a log line (without its line break)"}}}


def create_app(home: Home, *, failed_logins: FailedLogins | None = None, stream_limit: float = STREAM_LIMIT_S,
               streams_per_user: int = STREAMS_PER_USER, poll: float = 0.2, docs: bool = False,
               max_body: int = MAX_BODY) -> FastAPI:
    """The API over the platform in ``home`` (its database must exist: ``fireflyer platform start``).

    ``docs`` serves Swagger UI at ``/docs``; it loads its scripts from a CDN, on the dashboard's
    origin, so it is off unless asked for (``/openapi.json`` is always served)."""
    limiter = failed_logins or FailedLogins()
    if home.db.exists():
        Users(home.db).close()  # the users table, made once here; requests only read it
    followers: dict[str, set[threading.Thread]] = {}  # each user's open log streams, by their threads
    reserved: dict[str, dict[object, float]] = {}  # each user's streams admitted but not started yet
    bearer = HTTPBearer(auto_error=False, description="a token from 'fireflyer platform user add NAME'")
    app = FastAPI(title="fireflyer platform", version="1",
                  description="HAI-style time-shared scheduling: tasks, nodes and the cluster, per user.",
                  docs_url="/docs" if docs else None, redoc_url=None,
                  swagger_ui_oauth2_redirect_url="/docs/oauth2-redirect" if docs else None)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": str(exc.args[0]) if exc.args else type(exc).__name__},
                            status_code=exc.status, headers={"Retry-After": "5"} if exc.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        # Starlette names only the first route that matched the path; a path such as /api/tasks has two
        # (GET, POST), and Allow must list every method it takes.
        allowed = sorted({method for route in app.routes if isinstance(route, APIRoute)
                          and route.path_regex.match(request.url.path) for method in route.methods})
        return JSONResponse({"detail": exc.detail}, status_code=405, headers={"Allow": ", ".join(allowed)})

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own body, but ASCII-escaped: the errors echo the input, which may hold a lone surrogate
        # that UTF-8 cannot encode (and the default response would fail with a 500).
        body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
        return Response(body, status_code=422, media_type="application/json")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"detail": "internal error; the server's log has the traceback"}, status_code=500)

    @app.exception_handler(sqlite3.OperationalError)
    async def storage(request: Request, exc: Exception) -> JSONResponse:
        """A full or failing disk under the users table (the API's own store answers 503 itself): 503 too."""
        problem = storage_problem(exc, home.db)
        if problem is None:
            return await unexpected(request, exc)
        log.warning("%s %s: %s", request.method, request.url.path, problem)
        return JSONResponse({"detail": str(problem)}, status_code=503, headers={"Retry-After": "5"})

    app.add_middleware(_SecurityHeaders, docs=(app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url))
    app.add_middleware(_BodyLimit, max_body=max_body)

    # ------------------------------------------------------------------ who is asking
    def caller(request: Request, _: HTTPAuthorizationCredentials | None = Security(bearer)) -> User:
        header = request.headers.get("authorization")
        user = None
        if header is None:
            # No credentials is not a failed login (a page opened before signing in): plain 401.
            raise HTTPException(401, "missing Authorization header: send 'Authorization: Bearer <token>' "
                                     "(an admin makes tokens with 'fireflyer platform user add NAME')",
                                headers={"WWW-Authenticate": "Bearer"})
        scheme, _sep, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            problem = "malformed Authorization header: expected 'Bearer <token>'"
        else:
            with Users(home.db, create=False) as users:
                user = users.authenticate(token.strip())
            problem = ("unknown token" if user is None else
                       "revoked token: ask an admin for a new one ('fireflyer platform user token NAME')")
        if user is not None and user.active:
            return user
        address = request.client.host if request.client else "unknown"
        wait = limiter.retry_after(address)
        if wait is not None:
            raise HTTPException(429, f"too many failed logins from {address}; retry in {math.ceil(wait)} s",
                                headers={"Retry-After": str(max(1, math.ceil(wait)))})
        limiter.fail(address)
        raise HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ routes
    @app.get("/api/health", response_model=m.Health, tags=["server"])
    def health() -> dict[str, Any]:
        """Whether the server is up (no token needed)."""
        return {"ok": True}

    @app.get("/api/me", response_model=m.Me, responses=_errors(*AUTH), tags=["server"])
    def me(user: User = Depends(caller)) -> dict[str, Any]:
        """The token's user."""
        return {"user": user.name, "admin": user.admin}

    @app.get("/api/tasks", response_model=m.TaskPage, responses=_errors(400, 403, *AUTH), tags=["tasks"])
    def tasks(user: User = Depends(caller),
              all: bool = Query(False, description="finished chains too (default: active ones only)"),
              owner: str | None = Query(None, alias="user", max_length=256,
                                        description="only this user's tasks (others' need an admin)"),
              state: m.TaskState | None = Query(None),
              priority: str | None = Query(None, max_length=32, description="a priority name or number"),
              limit: int = Query(100, ge=1, le=MAX_LIMIT),
              offset: int = Query(0, ge=0, le=m.MAX_ID)) -> Any:
        """Chains (their latest attempt): running first, then queued by priority, then held, then finished
        (newest first). A user sees only their own."""
        with _open(home, user) as p:
            page = p.tasks(all=all, user=owner, state=state, priority=priority, limit=limit, offset=offset)
        # Up to 10,000 tasks: straight to JSON bytes (pydantic-core, in Rust), skipping the response model's
        # validation, which would cost more than the listing itself; the model still documents the shape,
        # and the schemathesis test checks the two agree.
        return Response(to_json(page), media_type="application/json")

    @app.post("/api/tasks", status_code=201, response_model=m.Task, responses=_errors(400, 403, *AUTH),
              tags=["tasks"])
    def submit(body: m.Submit, user: User = Depends(caller)) -> Any:
        """Queue a task of whole nodes, as the caller (an admin may name another ``user``)."""
        with _open(home, user) as p:
            return p.submit(**body.model_dump())

    task_id_path = Path(ge=1, le=m.MAX_ID, description="the task's (chain's) id; any attempt's id works too")

    @app.get("/api/tasks/{task_id}", response_model=m.TaskDetail, responses=_errors(400, 403, 404, *AUTH),
             tags=["tasks"])
    def describe(task_id: int = task_id_path, user: User = Depends(caller)) -> Any:
        """A chain's latest attempt, every attempt, and its history of events."""
        with _open(home, user) as p:
            return p.describe(task_id)

    @app.get("/api/tasks/{task_id}/logs", response_model=m.Logs, responses=_errors(400, 403, 404, *AUTH),
             tags=["tasks"])
    def logs(task_id: int = task_id_path, user: User = Depends(caller),
             rank: int = Query(0, ge=0, le=m.MAX_RANKS),
             attempt: int | None = Query(None, ge=0, le=m.MAX_ID, description="default: the latest that ran"),
             tail: int | None = Query(None, ge=1, le=100_000,
                                      description="only the last lines (default: the whole log)")) -> Any:
        """One rank's log of one attempt."""
        with _open(home, user) as p:
            return p.logs(task_id, rank=rank, attempt=attempt, tail=tail)

    @app.get("/api/tasks/{task_id}/logs/stream", response_class=StreamingResponse, tags=["tasks"],
             responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                              "description": "'data: <line>' events as the log grows, then 'event: end'"},
                        **_errors(400, 403, 404, *AUTH)})
    async def stream(task_id: int = task_id_path, user: User = Depends(caller),
                     rank: int = Query(0, ge=0, le=m.MAX_RANKS)) -> StreamingResponse:
        """Follow a rank's log across the chain's attempts, as server-sent events."""
        from starlette.concurrency import run_in_threadpool

        def check() -> None:  # refuse with a status before the stream starts, not in the middle of it
            with _open(home, user) as p:
                p.log_path(task_id, rank=rank)

        await run_in_threadpool(check)
        # Count and reserve in one step of the event loop (no await in between), so concurrent
        # requests cannot all pass the count before any of their streams has started.
        mine = followers.setdefault(user.name, set())
        pending = reserved.setdefault(user.name, {})
        now = time.monotonic()
        for old in [t for t, at in pending.items() if now - at > RESERVATION_S]:
            del pending[old]  # a response that never started streaming (its client left at once)
        if len(mine) + len(pending) >= streams_per_user:
            raise HTTPException(429, f"{user.name} has {len(mine) + len(pending)} log streams open already; "
                                     "close one first", headers={"Retry-After": "5"})
        ticket = object()
        pending[ticket] = now
        events = log_events(lambda: _open(home, user), task_id, rank=rank, limit=stream_limit, poll=poll,
                            followers=mine)

        async def counted() -> AsyncIterator[str]:
            pending.pop(ticket, None)  # from here the stream's thread counts (log_events adds it at once)
            async for chunk in events:
                yield chunk

        return StreamingResponse(counted(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _request(action: str) -> Any:
        def act(task_id: int = task_id_path, user: User = Depends(caller)) -> Any:
            with _open(home, user) as p:
                return getattr(p, action)(task_id)

        act.__name__ = action
        act.__doc__ = {"suspend": "Save and hold a running task; it waits for resume.",
                       "resume": "Queue a held task again, in its old place.",
                       "stop": "Stop a task for good (it is not requeued)."}[action]
        return act

    for action in ("suspend", "resume", "stop"):
        app.post(f"/api/tasks/{{task_id}}/{action}", response_model=m.Task,
                 responses=_errors(400, 403, 404, 409, *AUTH), tags=["tasks"])(_request(action))

    @app.get("/api/nodes", response_model=list[m.Node], responses=_errors(*AUTH), tags=["nodes"])
    def nodes(user: User = Depends(caller)) -> Any:
        """Every node, its zone and state, and the chain it runs."""
        with _open(home, user) as p:
            return p.nodes()

    node_path = Path(min_length=1, max_length=256, description="the node's name")

    @app.post("/api/nodes/{name}/drain", response_model=m.Drained, responses=_errors(400, 403, 404, *AUTH),
              tags=["nodes"])
    def drain(name: str = node_path, body: m.Drain | None = Body(None), user: User = Depends(caller)) -> Any:
        """Take a node out of scheduling (admins); its task is suspended and moves elsewhere."""
        with _open(home, user) as p:
            return p.drain(name, (body or m.Drain()).reason)

    @app.post("/api/nodes/{name}/undrain", response_model=m.Drained, responses=_errors(400, 403, 404, *AUTH),
              tags=["nodes"])
    def undrain(name: str = node_path, user: User = Depends(caller)) -> Any:
        """Return a drained node to scheduling (admins)."""
        with _open(home, user) as p:
            return p.undrain(name)

    @app.get("/api/overview", response_model=m.Overview, responses=_errors(400, *AUTH), tags=["cluster"])
    def overview(user: User = Depends(caller),
                 hours: float = Query(24.0, gt=0, le=24 * 30, description="the utilisation history's span"),
                 buckets: int = Query(96, ge=1, le=1000, description="points in the history")) -> Any:
        """Nodes by state, utilisation now and over time, the queue by priority, quota use (a user's own rows
        unless admin)."""
        with _open(home, user) as p:
            return p.overview(hours=hours, buckets=buckets)

    if STATIC.is_dir():
        app.router.routes.append(_Dashboard("/", app=StaticFiles(directory=STATIC, html=True), name="dashboard"))
    return app


class _SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response (plain ASGI: a 4 MB task list passes straight through)."""

    def __init__(self, app: ASGIApp, docs: tuple[str | None, ...]) -> None:
        self.app, self.docs = app, docs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        docs = scope["path"] in self.docs

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for key, value in SECURITY_HEADERS.items():
                    if key not in headers and not (docs and key == "Content-Security-Policy"):
                        headers.append(key, value)  # (the API docs page, Swagger UI, runs an inline script)
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _BodyLimit:
    """Refuses a request body over ``max_body`` bytes with 413, whether it says its length or streams it."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            return await self._refuse(send)
        messages: list[Message] = []
        size = 0
        while True:  # a submit is small: read it whole, counting, then hand it on
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed() -> Message:
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body over {self.max_body} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _Dashboard(Mount):
    """The static dashboard at ``/``, but never under ``/api/``: a wrong method or path there gets the API's
    own answer (405 with the route's ``Allow``, or a JSON 404), not the file server's."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and (scope["path"] + "/").startswith("/api/"):
            return Match.NONE, {}
        return super().matches(scope)


def _open(home: Home, user: User) -> PlatformApi:
    return PlatformApi(home, user=user.name, admin=user.admin)
