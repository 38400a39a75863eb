"""The platform's HTTP API and dashboard: the FastAPI app over :class:`~fireflyer.platform.scheduler.api.PlatformApi`,
with its error handlers and middleware; the routes are :mod:`.routes`.

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
import sqlite3
from pathlib import Path as FsPath

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fireflyer.platform.scheduler.api import ApiError
from fireflyer.platform.layout import Home
from fireflyer.platform.server.auth import FailedLogins, Users
from fireflyer.platform.server.routes import Served, router
from fireflyer.platform.state.store import storage_problem

log = logging.getLogger("fireflyer.platform.server")

STATIC = FsPath(__file__).with_name("static")
STREAM_LIMIT_S = 3600.0
"""The longest one log stream runs; a client that wants more reconnects."""
STREAMS_PER_USER = 16
"""Log streams one user may have open at once (each holds a thread while it runs)."""
MAX_BODY = 1 << 20
"""Bytes a request body may have (a submit with a long command and environment is a few KB)."""

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Scripts only from our own files, never inline: an escaped-wrong task name still cannot run.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                               "form-action 'self'",
}


def create_app(home: Home, *, failed_logins: FailedLogins | None = None, stream_limit: float = STREAM_LIMIT_S,
               streams_per_user: int = STREAMS_PER_USER, poll: float = 0.2, docs: bool = False,
               max_body: int = MAX_BODY) -> FastAPI:
    """The API over the platform in ``home`` (its database must exist: ``fireflyer platform start``).

    ``docs`` serves Swagger UI at ``/docs``; it loads its scripts from a CDN, on the dashboard's
    origin, so it is off unless asked for (``/openapi.json`` is always served)."""
    if home.db.exists():
        Users(home.db).close()  # the users table, made once here; requests only read it
    app = FastAPI(title="fireflyer platform", version="1",
                  description="HAI-style time-shared scheduling: tasks, nodes and the cluster, per user.",
                  docs_url="/docs" if docs else None, redoc_url=None,
                  swagger_ui_oauth2_redirect_url="/docs/oauth2-redirect" if docs else None)
    app.state.served = Served(home, failed_logins or FailedLogins(), stream_limit=stream_limit,
                              streams_per_user=streams_per_user, poll=poll)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(sqlite3.OperationalError, _storage)
    app.add_middleware(_SecurityHeaders, docs=(app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url))
    app.add_middleware(_BodyLimit, max_body=max_body)
    app.include_router(router)
    if STATIC.is_dir():
        app.router.routes.append(_Dashboard("/", app=StaticFiles(directory=STATIC, html=True), name="dashboard"))
    return app


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse({"detail": str(exc.args[0]) if exc.args else type(exc).__name__},
                        status_code=exc.status, headers={"Retry-After": "5"} if exc.status == 503 else None)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code != 405:
        return await http_exception_handler(request, exc)
    # Starlette names only the first route that matched the path; a path such as /api/tasks has two
    # (GET, POST), and Allow must list every method it takes.
    allowed = sorted({method for route in router.routes if isinstance(route, APIRoute)
                      and route.path_regex.match(request.url.path) for method in route.methods})
    return JSONResponse({"detail": exc.detail}, status_code=405, headers={"Allow": ", ".join(allowed)})


async def _invalid(_: Request, exc: RequestValidationError) -> Response:
    # FastAPI's own body, but ASCII-escaped: the errors echo the input, which may hold a lone surrogate
    # that UTF-8 cannot encode (and the default response would fail with a 500).
    body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
    return Response(body, status_code=422, media_type="application/json")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": "internal error; the server's log has the traceback"}, status_code=500)


async def _storage(request: Request, exc: Exception) -> JSONResponse:
    """A full or failing disk under the users table (the API's own store answers 503 itself): 503 too."""
    problem = storage_problem(exc, request.app.state.served.home.db)
    if problem is None:
        return await _unexpected(request, exc)
    log.warning("%s %s: %s", request.method, request.url.path, problem)
    return JSONResponse({"detail": str(problem)}, status_code=503, headers={"Retry-After": "5"})


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
