"""The platform's HTTP server: an API over :mod:`fireflyer.platform.scheduler.api` with per-user tokens, and a dashboard.

``fireflyer platform serve`` runs it; ``fireflyer platform user add NAME`` makes tokens.
:mod:`.auth` keeps users and tokens, :mod:`.app` is the FastAPI application (its routes are :mod:`.routes`), :mod:`.sse`
streams logs, and ``static/`` holds the dashboard. Needs the ``server`` extra
(FastAPI, uvicorn); nothing else in fireflyer imports it.
"""
