"""Futex waits and wakes on a 32-bit word (a ctypes int32 stands in for an arena flag)."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time

import pytest

from fireflyer.hfreduce.transport import futex

GUARD = 5.0  # seconds; only a guard against hangs, never a performance claim


def test_wait_returns_at_once_when_the_word_differs() -> None:
    word = ctypes.c_int32(3)
    start = time.monotonic()
    futex.wait(ctypes.addressof(word), 4, timeout=30.0)
    assert time.monotonic() - start < GUARD
    assert word.value == 3


@pytest.mark.parametrize("timeout", [0.05, 0.0, -1.0])
def test_wait_returns_after_the_timeout_when_the_word_is_equal(timeout: float) -> None:
    word = ctypes.c_int32(-7)
    start = time.monotonic()
    futex.wait(ctypes.addressof(word), -7, timeout=timeout)
    elapsed = time.monotonic() - start
    assert 0 <= elapsed < GUARD
    assert word.value == -7


def test_wake_without_waiters_is_harmless() -> None:
    word = ctypes.c_int32(0)
    futex.wake(ctypes.addressof(word))
    assert word.value == 0


@pytest.mark.parametrize("waiters", [1, 3])
def test_wake_wakes_threads_waiting_on_the_word(waiters: int) -> None:
    word = ctypes.c_int32(0)
    addr = ctypes.addressof(word)
    seen: list[int] = []
    ready = threading.Barrier(waiters + 1)

    def waiter() -> None:
        ready.wait(timeout=GUARD)
        deadline = time.monotonic() + GUARD
        # The usual futex loop: re-check after every return (spurious wake-ups are allowed).
        while word.value == 0 and time.monotonic() < deadline:
            futex.wait(addr, 0, timeout=GUARD)
        seen.append(word.value)

    threads = [threading.Thread(target=waiter) for _ in range(waiters)]
    for t in threads:
        t.start()
    ready.wait(timeout=GUARD)
    time.sleep(0.05)  # let the waiters go to sleep in the kernel
    word.value = 42
    futex.wake(addr)
    for t in threads:
        t.join(timeout=GUARD)
    assert not any(t.is_alive() for t in threads)
    assert seen == [42] * waiters


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"), reason="Linux futex only"
)
def test_real_futex_is_used_on_linux() -> None:
    assert futex.HAVE_FUTEX == (not os.environ.get("FIREFLYER_NO_FUTEX"))


def test_fallback_without_futex_sleeps_briefly_and_wake_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(futex, "_libc", None)
    word = ctypes.c_int32(1)
    start = time.monotonic()
    futex.wait(ctypes.addressof(word), 1, timeout=30.0)  # polls: returns after a short sleep, not 30 s
    assert time.monotonic() - start < GUARD
    futex.wake(ctypes.addressof(word))
    assert word.value == 1
