"""The ``/dev/shm`` segments a test leaves behind, told apart from those of the tests running beside it.

The suite runs test files side by side (``pytest -n``), so a segment that appeared while a test ran may belong
to another file's ranks. Every segment hfreduce names ends in its creator's pid (``fireflyer-hfr-...-<pid>``), as
torch's begin with it (``torch_<pid>_...``): a segment whose creator is alive and outside this session's processes
(its mark, :mod:`fireflyer.lifetime`) is another test's, and is left out. One whose creator is gone, or is one of
this session's, is this test's."""

from __future__ import annotations

import os
import re
import time

from fireflyer import lifetime
from fireflyer.hfreduce.transport.procs import pid_alive

SHM_DIR = "/dev/shm"
PREFIXES = ("fireflyer", "torch")
_PID = (re.compile(r"^fireflyer.*-(\d+)$"), re.compile(r"^torch_(\d+)_"))


def segments(prefixes: tuple[str, ...] = PREFIXES) -> set[str]:
    """The names in ``/dev/shm`` that begin with one of ``prefixes`` (none where there is no ``/dev/shm``)."""
    if not os.path.isdir(SHM_DIR):
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)}


def creator(name: str) -> int | None:
    """The pid a segment's name gives for the process that made it, or None where the name gives none."""
    for pattern in _PID:
        found = pattern.match(name)
        if found:
            return int(found.group(1))
    return None


def ours(names: set[str]) -> set[str]:
    """Those of ``names`` made by this session's processes, or by processes now gone."""
    session = set(lifetime.marked(os.environ.get(lifetime.MARK, "")))

    def mine(name: str) -> bool:
        pid = creator(name)
        if pid is None or pid == os.getpid() or pid in session:
            return True
        return not pid_alive(pid)  # a creator that is gone (or a zombie) left it: counted

    return {name for name in names if mine(name)}


def new_since(before: set[str], prefixes: tuple[str, ...] = PREFIXES) -> set[str]:
    """The segments made since ``before`` was read by this session's processes, or by processes now gone."""
    return ours(segments(prefixes) - before)


def left_behind(before: set[str], prefixes: tuple[str, ...] = PREFIXES, *, settle: float = 5.0) -> set[str]:
    """:func:`new_since`, once it is empty or ``settle`` seconds have passed (a segment of a process that is
    ending goes with it a moment later)."""
    deadline = time.monotonic() + settle
    left = new_since(before, prefixes)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = new_since(before, prefixes)
    return left
