"""One small interface for where bytes live: a local (or mounted 3FS/Lustre/NFS) directory,
an S3-compatible object store, or 3FS's native USRBIO client.

Public methods validate the key, retry transient failures with exponential backoff, and
raise :class:`~fireflyer.storage.errors.BackendError` naming the key once retries are
spent (:class:`~fireflyer.storage.errors.NotFound` at once for a missing object).
Subclasses fill in the private hooks only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fireflyer.storage.errors import BackendError, NotFound
from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """How a backend retries a failing call."""

    attempts: int = 4
    """Tries in all, the first included."""
    backoff: float = 0.05
    """Seconds before the first retry; doubled each time."""
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise UserError(f"attempts must be at least 1, got {self.attempts}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise UserError("backoff and max_backoff must not be negative")


def check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise UserError(f"an object key must be a non-empty string, got {key!r}")
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UserError(f"object key {key!r} must be relative, with no empty, '.' or '..' parts")
    return key


class Backend:
    """Where shards and checkpoints are stored, addressed by ``/``-separated keys."""

    name = "backend"
    positional_reads = False
    """True where :meth:`local_path` files are best read with ``os.pread`` (a POSIX mount)."""

    def __init__(self, *, retry: RetryConfig | None = None) -> None:
        self.retry = retry or RetryConfig()
        self.retries = 0  # retries taken so far (all calls)

    # -- public, guarded ---------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object."""
        return self._call("read", check_key(key), lambda: self._read(key))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only at the object's end)."""
        if offset < 0 or length < 0:
            raise UserError(f"offset and length must not be negative, got {offset}, {length}")
        if length == 0:
            return b""
        return self._call("read", check_key(key), lambda: self._read_range(key, offset, length))

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` atomically: readers see the old object or the new one, whole."""
        payload = bytes(data) if isinstance(data, bytearray) else data
        self._call("write", check_key(key), lambda: self._write(key, payload))

    def size(self, key: str) -> int:
        return self._call("stat", check_key(key), lambda: self._size(key))

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except NotFound:
            return False

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix ending in ``/``, or empty), sorted."""
        return sorted(self._call("list", prefix or "(root)", lambda: self._list(prefix)))

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        try:
            self._call("delete", check_key(key), lambda: self._delete(key))
        except NotFound:
            pass

    def upload(self, key: str, path: str) -> None:
        """Store the local file ``path`` under ``key`` (atomically, like :meth:`write`)."""
        self._call("write", check_key(key), lambda: self._upload(key, path))

    def download(self, key: str, path: str) -> None:
        """Copy ``key`` to the local file ``path`` (temporary file, fsync, rename)."""
        self._call("read", check_key(key), lambda: self._download(key, path))

    def local_path(self, key: str) -> str | None:
        """A POSIX path holding ``key``'s bytes, where the backend has one (for positional reads)."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry loop ----------------------------------------------------------------
    def _call(self, op: str, key: str, fn):
        delay = self.retry.backoff
        last: BaseException | None = None
        for attempt in range(self.retry.attempts):
            try:
                return fn()
            except NotFound:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                missing = self._not_found(exc)
                if missing:
                    raise NotFound(f"{self.name}: {key!r} does not exist", key=key) from None
                if not self._transient(exc):
                    raise BackendError(f"{self.name}: {op} of {key!r} failed: {type(exc).__name__}: {exc}",
                                       key=key) from exc
                last = exc
            if attempt + 1 < self.retry.attempts:
                self.retries += 1
                time.sleep(min(delay, self.retry.max_backoff))
                delay *= 2
        raise BackendError(f"{self.name}: {op} of {key!r} failed after {self.retry.attempts} tries: "
                           f"{type(last).__name__}: {last}", key=key) from last

    # -- hooks -------------------------------------------------------------------------
    def _not_found(self, exc: BaseException) -> bool:
        return isinstance(exc, FileNotFoundError)

    def _transient(self, exc: BaseException) -> bool:
        """Worth retrying (a timeout, a dropped connection, a busy server)."""
        return isinstance(exc, (TimeoutError, ConnectionError, InterruptedError, BlockingIOError))

    def _upload(self, key: str, path: str) -> None:
        with open(path, "rb") as f:
            self._write(key, f.read())

    def _download(self, key: str, path: str) -> None:
        from fireflyer.fsutil import atomic_write

        data = self._read(key)
        atomic_write(path, lambda f: f.write(data))

    def _read(self, key: str) -> bytes:
        raise NotImplementedError

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def _write(self, key: str, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def _size(self, key: str) -> int:
        raise NotImplementedError

    def _list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError
