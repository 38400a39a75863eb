"""The platform's API over HTTP: what the CLI uses with ``--server URL`` (token from ``FIREFLYER_TOKEN``).

Same methods and the same data as :class:`fireflyer.platform.scheduler.api.PlatformApi`, so every
command prints the same thing locally and remotely. Only the standard library: a CLI
that talks to a server needs no web stack installed.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

from fireflyer.platform import env as names
from fireflyer.platform.scheduler.api import Api, ApiError, Conflict, Forbidden, NotFound, Unavailable

TIMEOUT_S = 30.0
_BY_STATUS = {403: Forbidden, 404: NotFound, 409: Conflict, 503: Unavailable}


class Unauthorized(ApiError):
    status = 401


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the server's origin: the bearer token never goes to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            raise ApiError(f"the platform server redirected to another origin ({new.scheme}://{new.netloc}); "
                           f"not sending the token there: point --server / {names.SERVER} at the final address")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


class RemoteApi(Api):
    def __init__(self, url: str, token: str | None, *, timeout: float = TIMEOUT_S) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ApiError(f"--server must be an http(s) URL such as http://127.0.0.1:8080, got {url!r}")
        if not token:
            raise Unauthorized(f"no token: set {names.TOKEN} (an admin creates one with 'fireflyer platform user add')")
        self.base = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def close(self) -> None:
        pass

    def __enter__(self) -> "RemoteApi":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    # ------------------------------------------------------------------ transport
    def _open(self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None,
              timeout: float | None = None, accept: str = "application/json") -> Any:
        q = {k: (int(v) if isinstance(v, bool) else v) for k, v in (query or {}).items() if v is not None}
        url = f"{self.base}{path}" + (f"?{urllib.parse.urlencode(q)}" if q else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": accept,
            **({"Content-Type": "application/json"} if data is not None else {})})
        try:
            return _OPENER.open(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            detail = _detail(exc)
            raise (Unauthorized if exc.code == 401 else _BY_STATUS.get(exc.code, ApiError))(
                f"{detail} (HTTP {exc.code})" if exc.code >= 500 else detail) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(f"cannot reach the platform server at {self.base}: {reason}") from None

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        with self._open(method, path, **kw) as resp:
            return json.loads(resp.read().decode())

    # ------------------------------------------------------------------ the API
    def me(self) -> dict[str, Any]:
        return self._json("GET", "/api/me")

    def submit(self, *, nodes: int, command: list[str], priority: str | int = "NORMAL", group: str = "default",
               name: str = "", ranks_per_node: int | None = None, env: dict[str, str] | None = None,
               request_id: str | None = None, cwd: str | None = None, user: str | None = None,
               fault_tolerant: bool = False) -> dict[str, Any]:
        return self._json("POST", "/api/tasks", body={
            "nodes": nodes, "command": command, "priority": priority, "group": group, "name": name,
            "ranks_per_node": ranks_per_node, "env": env or {}, "request_id": request_id, "cwd": cwd, "user": user,
            **({"fault_tolerant": True} if fault_tolerant else {})})

    def tasks(self, *, all: bool = False, user: str | None = None, state: str | None = None,
              priority: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return self._json("GET", "/api/tasks", query={"all": all, "user": user, "state": state,
                                                      "priority": priority, "limit": limit, "offset": offset})

    def describe(self, task_id: int) -> dict[str, Any]:
        return self._json("GET", f"/api/tasks/{task_id}")

    def logs(self, task_id: int, *, rank: int = 0, attempt: int | None = None,
             tail: int | None = None) -> dict[str, Any]:
        return self._json("GET", f"/api/tasks/{task_id}/logs", query={"rank": rank, "attempt": attempt, "tail": tail})

    def follow(self, task_id: int, *, rank: int = 0, poll: float = 0.2,
               timeout: float | None = None) -> Iterator[str]:
        """Server-sent events: one ``data:`` line per log line, ``event: end`` when the chain is done."""
        resp = self._open("GET", f"/api/tasks/{task_id}/logs/stream", query={"rank": rank},
                          timeout=max(self.timeout, 3600.0) if timeout is None else timeout,
                          accept="text/event-stream")
        with resp:
            event = "message"
            for raw in resp:
                line = raw.decode(errors="replace").rstrip("\r\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    if event == "end":
                        return
                    yield line[5:].removeprefix(" ") + "\n"
                elif not line:
                    if event == "end":
                        return
                    event = "message"

    def suspend(self, task_id: int) -> dict[str, Any]:
        return self._json("POST", f"/api/tasks/{task_id}/suspend")

    def resume(self, task_id: int) -> dict[str, Any]:
        return self._json("POST", f"/api/tasks/{task_id}/resume")

    def stop(self, task_id: int) -> dict[str, Any]:
        return self._json("POST", f"/api/tasks/{task_id}/stop")

    def nodes(self) -> list[dict[str, Any]]:
        return self._json("GET", "/api/nodes")

    def drain(self, node: str, reason: str = "drained by an admin") -> dict[str, Any]:
        return self._json("POST", f"/api/nodes/{urllib.parse.quote(node, safe='')}/drain", body={"reason": reason})

    def undrain(self, node: str) -> dict[str, Any]:
        return self._json("POST", f"/api/nodes/{urllib.parse.quote(node, safe='')}/undrain")

    def overview(self, *, hours: float = 24.0, buckets: int = 96) -> dict[str, Any]:
        return self._json("GET", "/api/overview", query={"hours": hours})


def _detail(exc: urllib.error.HTTPError) -> str:
    """The server's one-line reason from its JSON body, or the status line."""
    try:
        body = json.loads(exc.read().decode() or "{}")
    except (ValueError, OSError):
        return f"HTTP {exc.code} {exc.reason}"
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # a validation error: name the first field that failed
        first = detail[0] if detail else {}
        where = ".".join(str(p) for p in first.get("loc", [])[1:]) if isinstance(first, dict) else ""
        msg = first.get("msg", "invalid request") if isinstance(first, dict) else str(first)
        return f"{where}: {msg}" if where else msg
    return str(detail) if detail else f"HTTP {exc.code} {exc.reason}"
