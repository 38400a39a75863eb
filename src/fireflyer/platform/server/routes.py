"""The HTTP API's routes, one router: who is asking (:func:`caller`), then one plain function per route.

Every route but ``/api/health`` depends on :func:`caller`, which turns the request's bearer token into a
:class:`~fireflyer.platform.server.auth.User`; the route then opens a
:class:`~fireflyer.platform.scheduler.api.PlatformApi` for that user, which sees and controls only their own tasks
(an admin everything). What one app shares between requests (its home, the failed-login limiter, the open
log streams) is its :class:`Served`, on ``app.state.served``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Security
from fastapi.exceptions import HTTPException
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic_core import to_json

from fireflyer.platform.scheduler.api import MAX_LIMIT, PlatformApi
from fireflyer.platform.layout import Home
from fireflyer.platform.server import models as m
from fireflyer.platform.server.auth import FailedLogins, User, Users
from fireflyer.platform.server.sse import log_events

RESERVATION_S = 10.0
"""Seconds an admitted stream holds its place before it starts (a client that left at once frees it then)."""


@dataclass
class Served:
    """What one app's requests share."""

    home: Home
    limiter: FailedLogins
    stream_limit: float
    """The longest one log stream runs, in seconds."""
    streams_per_user: int
    poll: float
    """How often a log stream looks for new lines, in seconds."""
    followers: dict[str, set[threading.Thread]] = field(default_factory=dict)
    """Each user's open log streams, by their threads."""
    reserved: dict[str, dict[object, float]] = field(default_factory=dict)
    """Each user's streams admitted but not started yet, with when."""

    def open(self, user: User) -> PlatformApi:
        return PlatformApi(self.home, user=user.name, admin=user.admin)


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
BEARER = HTTPBearer(auto_error=False, description="a token from 'fireflyer platform user add NAME'")
TASK_ID = Path(ge=1, le=m.MAX_ID, description="the task's (chain's) id; any attempt's id works too")
NODE = Path(min_length=1, max_length=256, description="the node's name")

router = APIRouter()


def served(request: Request) -> Served:
    return request.app.state.served


def caller(request: Request, _: HTTPAuthorizationCredentials | None = Security(BEARER)) -> User:
    """The user whose token the request carries; 401 without a valid one, 429 after too many failures from its
    address."""
    here = served(request)
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
        with Users(here.home.db, create=False) as users:
            user = users.authenticate(token.strip())
        problem = ("unknown token" if user is None else
                   "revoked token: ask an admin for a new one ('fireflyer platform user token NAME')")
    if user is not None and user.active:
        return user
    address = request.client.host if request.client else "unknown"
    wait = here.limiter.retry_after(address)
    if wait is not None:
        raise HTTPException(429, f"too many failed logins from {address}; retry in {math.ceil(wait)} s",
                            headers={"Retry-After": str(max(1, math.ceil(wait)))})
    here.limiter.fail(address)
    raise HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})


@router.get("/api/health", response_model=m.Health, tags=["server"])
def health() -> dict[str, Any]:
    """Whether the server is up (no token needed)."""
    return {"ok": True}


@router.get("/api/me", response_model=m.Me, responses=_errors(*AUTH), tags=["server"])
def me(user: User = Depends(caller)) -> dict[str, Any]:
    """The token's user."""
    return {"user": user.name, "admin": user.admin}


@router.get("/api/tasks", response_model=m.TaskPage, responses=_errors(400, 403, *AUTH), tags=["tasks"])
def tasks(request: Request, user: User = Depends(caller),
          all: bool = Query(False, description="finished chains too (default: active ones only)"),
          owner: str | None = Query(None, alias="user", max_length=256,
                                    description="only this user's tasks (others' need an admin)"),
          state: m.TaskState | None = Query(None),
          priority: str | None = Query(None, max_length=32, description="a priority name or number"),
          limit: int = Query(100, ge=1, le=MAX_LIMIT),
          offset: int = Query(0, ge=0, le=m.MAX_ID)) -> Any:
    """Chains (their latest attempt): running first, then queued by priority, then held, then finished
    (newest first). A user sees only their own."""
    with served(request).open(user) as p:
        page = p.tasks(all=all, user=owner, state=state, priority=priority, limit=limit, offset=offset)
    # Up to 10,000 tasks: straight to JSON bytes (pydantic-core, in Rust), skipping the response model's
    # validation, which would cost more than the listing itself; the model still documents the shape,
    # and the schemathesis test checks the two agree.
    return Response(to_json(page), media_type="application/json")


@router.post("/api/tasks", status_code=201, response_model=m.Task, responses=_errors(400, 403, *AUTH),
             tags=["tasks"])
def submit(request: Request, body: m.Submit, user: User = Depends(caller)) -> Any:
    """Queue a task of whole nodes, as the caller (an admin may name another ``user``)."""
    with served(request).open(user) as p:
        return p.submit(**body.model_dump())


@router.get("/api/tasks/{task_id}", response_model=m.TaskDetail, responses=_errors(400, 403, 404, *AUTH),
            tags=["tasks"])
def describe(request: Request, task_id: int = TASK_ID, user: User = Depends(caller)) -> Any:
    """A chain's latest attempt, every attempt, and its history of events."""
    with served(request).open(user) as p:
        return p.describe(task_id)


@router.get("/api/tasks/{task_id}/logs", response_model=m.Logs, responses=_errors(400, 403, 404, *AUTH),
            tags=["tasks"])
def logs(request: Request, task_id: int = TASK_ID, user: User = Depends(caller),
         rank: int = Query(0, ge=0, le=m.MAX_RANKS),
         attempt: int | None = Query(None, ge=0, le=m.MAX_ID, description="default: the latest that ran"),
         tail: int | None = Query(None, ge=1, le=100_000,
                                  description="only the last lines (default: the whole log)")) -> Any:
    """One rank's log of one attempt."""
    with served(request).open(user) as p:
        return p.logs(task_id, rank=rank, attempt=attempt, tail=tail)


@router.get("/api/tasks/{task_id}/logs/stream", response_class=StreamingResponse, tags=["tasks"],
            responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                             "description": "'data: <line>' events as the log grows, then 'event: end'"},
                       **_errors(400, 403, 404, *AUTH)})
async def stream(request: Request, task_id: int = TASK_ID, user: User = Depends(caller),
                 rank: int = Query(0, ge=0, le=m.MAX_RANKS)) -> StreamingResponse:
    """Follow a rank's log across the chain's attempts, as server-sent events."""
    from starlette.concurrency import run_in_threadpool

    here = served(request)

    def check() -> None:  # refuse with a status before the stream starts, not in the middle of it
        with here.open(user) as p:
            p.log_path(task_id, rank=rank)

    await run_in_threadpool(check)
    # Count and reserve in one step of the event loop (no await in between), so concurrent
    # requests cannot all pass the count before any of their streams has started.
    mine = here.followers.setdefault(user.name, set())
    pending = here.reserved.setdefault(user.name, {})
    now = time.monotonic()
    for old in [t for t, at in pending.items() if now - at > RESERVATION_S]:
        del pending[old]  # a response that never started streaming (its client left at once)
    if len(mine) + len(pending) >= here.streams_per_user:
        raise HTTPException(429, f"{user.name} has {len(mine) + len(pending)} log streams open already; "
                                 "close one first", headers={"Retry-After": "5"})
    ticket = object()
    pending[ticket] = now
    events = log_events(lambda: here.open(user), task_id, rank=rank, limit=here.stream_limit, poll=here.poll,
                        followers=mine)

    async def counted() -> AsyncIterator[str]:
        pending.pop(ticket, None)  # from here the stream's thread counts (log_events adds it at once)
        async for chunk in events:
            yield chunk

    return StreamingResponse(counted(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/api/tasks/{task_id}/suspend", response_model=m.Task, responses=_errors(400, 403, 404, 409, *AUTH),
             tags=["tasks"])
def suspend(request: Request, task_id: int = TASK_ID, user: User = Depends(caller)) -> Any:
    """Save and hold a running task; it waits for resume."""
    with served(request).open(user) as p:
        return p.suspend(task_id)


@router.post("/api/tasks/{task_id}/resume", response_model=m.Task, responses=_errors(400, 403, 404, 409, *AUTH),
             tags=["tasks"])
def resume(request: Request, task_id: int = TASK_ID, user: User = Depends(caller)) -> Any:
    """Queue a held task again, in its old place."""
    with served(request).open(user) as p:
        return p.resume(task_id)


@router.post("/api/tasks/{task_id}/stop", response_model=m.Task, responses=_errors(400, 403, 404, 409, *AUTH),
             tags=["tasks"])
def stop(request: Request, task_id: int = TASK_ID, user: User = Depends(caller)) -> Any:
    """Stop a task for good (it is not requeued)."""
    with served(request).open(user) as p:
        return p.stop(task_id)


@router.get("/api/nodes", response_model=list[m.Node], responses=_errors(*AUTH), tags=["nodes"])
def nodes(request: Request, user: User = Depends(caller)) -> Any:
    """Every node, its zone and state, and the chain it runs."""
    with served(request).open(user) as p:
        return p.nodes()


@router.post("/api/nodes/{name}/drain", response_model=m.Drained, responses=_errors(400, 403, 404, *AUTH),
             tags=["nodes"])
def drain(request: Request, name: str = NODE, body: m.Drain | None = Body(None), user: User = Depends(caller)) -> Any:
    """Take a node out of scheduling (admins); its task is suspended and moves elsewhere."""
    with served(request).open(user) as p:
        return p.drain(name, (body or m.Drain()).reason)


@router.post("/api/nodes/{name}/undrain", response_model=m.Drained, responses=_errors(400, 403, 404, *AUTH),
             tags=["nodes"])
def undrain(request: Request, name: str = NODE, user: User = Depends(caller)) -> Any:
    """Return a drained node to scheduling (admins)."""
    with served(request).open(user) as p:
        return p.undrain(name)


@router.get("/api/overview", response_model=m.Overview, responses=_errors(400, *AUTH), tags=["cluster"])
def overview(request: Request, user: User = Depends(caller),
             hours: float = Query(24.0, gt=0, le=24 * 30, description="the utilisation history's span"),
             buckets: int = Query(96, ge=1, le=1000, description="points in the history")) -> Any:
    """Nodes by state, utilisation now and over time, the queue by priority, quota use (a user's own rows
    unless admin)."""
    with served(request).open(user) as p:
        return p.overview(hours=hours, buckets=buckets)
