"""Bounded waits for the tests: a condition polled until it holds, or an AssertionError naming what never came."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float = 60.0, what: str = "the condition", poll: float = 0.02,
               detail: Callable[[], str] | None = None) -> T:
    """``pred()``'s first true value, polled every ``poll`` seconds; AssertionError past ``timeout`` (followed by
    ``detail()``, what the caller knows of the state it waited on, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come within {timeout:.0f}s" + (f"; {detail()}" if detail else ""))
        time.sleep(poll)
