"""Filesystem helpers every part may use (torch-free): atomic writes and directory fsync."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path
from typing import IO, Any, Callable

from fireflyer.errors import CannotWrite, NotPermitted, UserError


def fsync_dir(path: str) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike) -> None:
    """``os.makedirs(path, exist_ok=True)``, with a refusal raised as :class:`CannotWrite` (which names the path)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CannotWrite(path, exc) from exc


def atomic_write(path: str, write: Callable[[IO[bytes]], object], *, tmp_name: str | None = None) -> None:
    """Write via a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: readers see the old file or the whole new one, never a torn one.

    ``tmp_name`` names the temporary file (in the same folder) where ``path.tmp.PID`` would
    be mistaken for a finished file by whoever scans the folder. A refusal of the system
    (no such folder, a full disk) is raised as :class:`CannotWrite`, keeping its errno."""

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    _replace_with(path, fill, tmp_name, synced=True)


def atomic_write_file(path: str, fill: Callable[[str], object], *, tmp_name: str | None = None) -> None:
    """:func:`atomic_write` for a writer that needs a file *name*, not a file object (a download
    to a path): ``fill(tmp_path)`` makes the temporary file beside ``path``, which is then
    fsynced, renamed over ``path``, and the directory fsynced."""
    _replace_with(path, fill, tmp_name, synced=False)


def _replace_with(path: str, fill: Callable[[str], object], tmp_name: str | None, *, synced: bool) -> None:
    d = os.path.dirname(os.path.abspath(path))
    make_dirs(d)
    tmp = os.path.join(d, tmp_name) if tmp_name else f"{path}.tmp.{os.getpid()}"
    try:
        fill(tmp)
        if not synced:
            fd = os.open(tmp, os.O_RDWR)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        fsync_dir(d)
    except BaseException as exc:
        unlink_quietly(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CannotWrite):
            raise CannotWrite(path, exc) from exc
        raise


def unlink_quietly(path: str | os.PathLike) -> None:
    """Remove ``path``; nothing to remove is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def durable_replace(src: str, dst: str) -> None:
    """Rename a finished file ``src`` over ``dst`` and fsync the directory that now holds it.

    ``src``'s content must already be on disk (its writer fsynced it): then ``dst`` is the
    old file or the whole new one, also after a crash. A folder moves the same way (to a
    ``dst`` that does not exist, or is an empty folder), and stays moved after a crash."""
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def atomic_write_bytes(path: str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def write_json(path: str | os.PathLike, data: Any, *, indent: int = 1, sort_keys: bool = False) -> Path:
    """``data`` as indented JSON at ``path``, atomically (:func:`atomic_write` through a hidden temporary
    file beside it): a reader sees the old file or the new one, never half of one. The project's one JSON
    writer; ``data`` is serialised before any file is made, so a value JSON cannot hold leaves nothing."""
    path = Path(path)
    text = json.dumps(data, indent=indent, sort_keys=sort_keys).encode() + b"\n"
    atomic_write(str(path), lambda f: f.write(text), tmp_name=f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    return path


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


def open_beneath(root: str | os.PathLike, relative: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of ``root/relative`` that follows no symbolic link below ``root``.

    For a privileged process that writes into a directory another user owns (a task's
    attempt folder): that user may swap any folder or file in it for a link to somewhere
    else, and this call then fails with ``OSError`` (ELOOP or ENOTDIR) instead of writing
    there. ``root`` itself must be a real directory (its parent is the caller's).
    """
    parts = [p for p in relative.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise UserError(f"not a plain relative path: {relative!r}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_owned(path: str | os.PathLike, uid: int) -> int:
    """A read-only descriptor of a regular file owned by ``uid``, opened without following a final link.

    For reading what another user's process wrote (a task's status or log) as a privileged
    process: a link, or a file of anybody else (``/etc/shadow`` put there by a hard link),
    raises ``PermissionError``; ``FileNotFoundError`` when there is nothing there.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the file should be
            raise NotPermitted(f"{path} is a link, not a file of uid {uid}") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        os.close(fd)
        raise NotPermitted(f"{path} is not a file of uid {uid}")
    return fd


def read_owned(path: str | os.PathLike, uid: int, *, limit: int = 1 << 20) -> bytes:
    """The bytes of :func:`open_owned`'s file; ``PermissionError`` past ``limit`` bytes as well."""
    fd = open_owned(path, uid)
    try:
        data = os.read(fd, limit + 1)
        if len(data) > limit or os.read(fd, 1):
            raise NotPermitted(f"{path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)
