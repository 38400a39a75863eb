"""The remote CLI's transport: a bearer token never follows a redirect to another origin."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from fireflyer.platform.scheduler.api import ApiError
from fireflyer.platform.commands.remote import RemoteApi


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict] = []
    redirect_to: str | None = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
        if self.redirect_to and not self.path.startswith("/v2"):
            self.send_response(302)
            self.send_header("Location", self.redirect_to + self.path)
            self.end_headers()
            return
        body = json.dumps({"user": "alice", "admin": False}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _serve(host: str, handler: type) -> tuple[http.server.HTTPServer, str]:
    server = http.server.HTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


def _handlers():
    class Final(_Recorder):
        seen: list[dict] = []

    class Hop(_Recorder):
        seen: list[dict] = []

    return Hop, Final


def test_a_redirect_to_another_origin_is_refused_and_gets_no_token():
    Hop, Final = _handlers()
    final, final_url = _serve("127.0.0.2", Final)
    Hop.redirect_to = final_url
    hop, hop_url = _serve("127.0.0.1", Hop)
    try:
        with pytest.raises(ApiError, match="redirected to another origin"):
            RemoteApi(hop_url, "ff_secret_token_value").me()
        assert Hop.seen and Hop.seen[0]["authorization"] == "Bearer ff_secret_token_value"
        assert Final.seen == []  # the other host never heard from us, let alone saw the token
    finally:
        hop.shutdown()
        final.shutdown()


def test_a_redirect_within_the_same_origin_is_followed_with_the_token():
    Hop, _ = _handlers()
    server, url = _serve("127.0.0.1", Hop)
    Hop.redirect_to = url + "/v2"
    try:
        assert RemoteApi(url, "ff_t0ken_value_here").me()["user"] == "alice"
        assert [s["path"] for s in Hop.seen] == ["/api/me", "/v2/api/me"]
        assert all(s["authorization"] == "Bearer ff_t0ken_value_here" for s in Hop.seen)
    finally:
        server.shutdown()


def test_both_apis_implement_every_method_of_the_protocol():
    import inspect

    from fireflyer.platform.scheduler.api import Api, PlatformApi

    wanted = [n for n, v in vars(Api).items() if inspect.isfunction(v) and (not n.startswith("_") or n in (
        "__enter__", "__exit__"))]
    assert {"submit", "tasks", "describe", "logs", "follow", "drain", "close"} <= set(wanted)
    for cls in (PlatformApi, RemoteApi):
        for name in wanted:
            assert name in vars(cls), f"{cls.__name__} does not implement Api.{name}"
            theirs = inspect.signature(getattr(cls, name)).parameters
            for param in inspect.signature(getattr(Api, name)).parameters.values():
                assert param.name in theirs, f"{cls.__name__}.{name} takes no {param.name}"
