"""Filesystem helpers every part may use (torch-free): atomic writes and directory fsync."""

from __future__ import annotations

import json
import os
from typing import IO, Any, Callable


def fsync_dir(path: str) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[IO[bytes]], object], *, tmp_name: str | None = None) -> None:
    """Write via a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: readers see the old file or the whole new one, never a torn one.

    ``tmp_name`` names the temporary file (in the same folder) where ``path.tmp.PID`` would
    be mistaken for a finished file by whoever scans the folder."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, tmp_name) if tmp_name else f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(d)


def atomic_write_bytes(path: str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON, written atomically."""
    atomic_write(os.fspath(path), lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode() + b"\n"))


def private_dir(path: str | os.PathLike) -> None:
    """Make ``path`` (and its parents) a directory only its owner can enter (0700).

    An existing directory of ours with wider permissions is narrowed; one that belongs to
    another user is left alone (we could not change it, and it is not ours to judge).
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)


def private_file(path: str | os.PathLike) -> None:
    """Narrow an existing file of ours to owner read and write (0600)."""
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o600)
