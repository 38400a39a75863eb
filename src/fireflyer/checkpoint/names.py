"""File names read from a checkpoint's own files: plain names inside its step directory, or refused.

A manifest or part file names the files it points to. Those names come from disk, so
before one is joined to a directory (or to a backend key) it must be a plain name: no
separator, no ``..``, not absolute, no NUL, at most 255 characters, and only the
characters fireflyer itself writes.
"""

from __future__ import annotations

import re
from typing import Any

from fireflyer.checkpoint.errors import CorruptCheckpoint

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def plain_name(name: Any, field: str) -> str:
    """``name`` if it is a plain file name, else CorruptCheckpoint naming ``field``."""
    if not isinstance(name, str) or not _PLAIN.fullmatch(name):
        raise CorruptCheckpoint(f"{field} is {name!r}, not a plain file name inside the checkpoint directory "
                                "(no separators, '..', absolute paths or NUL); refusing to read it")
    return name
