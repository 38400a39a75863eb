"""A task's log as server-sent events, fed by :meth:`PlatformApi.follow` in a thread of its own.

``follow`` blocks between polls and holds a SQLite connection, which may only be used
by the thread that opened it, so one thread opens the API, runs ``follow`` and hands
chunks over a bounded queue; the event loop turns them into ``data:`` events, one per
log line. The stream ends with ``event: end`` (its data: the chain's outcome) when the
chain finishes or is held, or when it has run ``limit`` seconds (data ``timeout``:
reconnect to go on). When the client goes away, Starlette cancels the generator, and
the thread sees the stop flag at ``follow``'s next poll.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from fireflyer.platform.scheduler.api import ApiError, PlatformApi

log = logging.getLogger("fireflyer.platform.server")

KEEPALIVE_S = 15.0
_QUEUE_CHUNKS = 256


def event(data: str, name: str | None = None) -> str:
    head = f"event: {name}\n" if name else ""
    return head + "".join(f"data: {line}\n" for line in (data.split("\n") if data else [""])) + "\n"


def _lines(text: str) -> list[str]:
    # Every line break a log may carry (\n, \r\n, a bare \r from a progress bar) ends a line.
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


async def log_events(open_api: Callable[[], PlatformApi], task_id: int, *, rank: int, limit: float,
                     poll: float = 0.2, followers: set[threading.Thread] | None = None) -> AsyncIterator[str]:
    """The events; ``followers`` holds this stream's thread for as long as it runs (to count open streams)."""
    chunks: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=_QUEUE_CHUNKS)
    stop = threading.Event()

    def put(item: tuple[str, str]) -> bool:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        final = ("end", "timeout")
        try:
            final = follow()
        finally:
            if followers is not None:
                followers.discard(threading.current_thread())
        put(final)

    def follow() -> tuple[str, str]:
        final = ("end", "timeout")
        try:
            with open_api() as api:
                for chunk in api.follow(task_id, rank=rank, poll=poll, timeout=limit):
                    if stop.is_set():
                        return final
                    if chunk and not put(("data", chunk)):
                        return final
                if not stop.is_set():
                    latest = api.describe(task_id)
                    if latest["state"] in ("finished", "held"):
                        final = ("end", latest["outcome"])
        except ApiError as exc:
            final = ("end", f"error: {exc.args[0] if exc.args else exc}")
        except Exception:  # the stream is already under way: end it, and leave the traceback in the log
            log.exception("following the log of task %s failed", task_id)
            final = ("end", "error: the server could not read the log (see its log)")
        return final

    thread = threading.Thread(target=pump, name=f"follow-{task_id}", daemon=True)
    if followers is not None:
        followers.add(thread)
    thread.start()
    deadline = time.monotonic() + limit
    partial = ""
    quiet_since = time.monotonic()
    try:
        while True:
            out = []
            ended = None
            try:
                while ended is None:
                    kind, text = chunks.get_nowait()
                    if kind == "end":
                        ended = text
                    else:
                        *done, partial = _lines(partial + text)
                        out.extend(event(line) for line in done)
            except queue.Empty:
                pass
            if ended is not None or time.monotonic() >= deadline:
                if partial:
                    out.append(event(partial))
                out.append(event(ended if ended is not None else "timeout", "end"))
                yield "".join(out)
                return
            if out:
                quiet_since = time.monotonic()
                yield "".join(out)
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
