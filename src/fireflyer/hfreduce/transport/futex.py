"""Blocking waits on 32-bit words in shared memory, across processes.

On Linux this is the futex system call through ctypes: a waiter sleeps in the
kernel until the word changes or a timeout passes, so the local ranks of a node
hand chunks to each other in tens of microseconds without spinning on the CPU
they share. Elsewhere it falls back to a short sleep loop.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

from fireflyer.hfreduce.config import read
from fireflyer.hfreduce.env import NO_FUTEX

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None
if sys.platform.startswith("linux") and _SYS_FUTEX is not None and not read(NO_FUTEX):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    except OSError:  # pragma: no cover - exotic libc
        _libc = None

HAVE_FUTEX = _libc is not None
_INT_MAX = 2**31 - 1


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the int32 at ``address`` equals ``expected``, for at most ``timeout`` seconds.

    May return early (spurious wake-ups, signals); callers re-check their condition.
    """
    if _libc is None:
        time.sleep(min(timeout, 50e-6))
        return
    timeout = max(timeout, 0.0)
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(expected),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )


def wake(address: int) -> None:
    """Wake every waiter sleeping on the int32 at ``address``."""
    if _libc is None:
        return
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_INT_MAX),
        None,
        None,
        ctypes.c_int(0),
    )
