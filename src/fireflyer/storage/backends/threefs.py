"""3FS's native USRBIO client (``hf3fs_fuse.io``), used when its Python binding imports.

UNTESTED: 3FS cannot run on the machines this project is built on. This is written
against 3FS's documented USRBIO Python API (``make_iovec``, ``make_ioring``,
``register_fd``/``deregister_fd``, ``ioring.prepare``/``submit``/``wait``). Reads go
through a shared-memory iovec and an I/O ring straight to the FUSE daemon's queue,
bypassing FUSE's per-request size limit; writes, listing and metadata use the mount
as a POSIX directory (:class:`LocalBackend`), which is what 3FS's FUSE mount is.
"""

from __future__ import annotations

import os
import threading

from fireflyer.storage.backends.base import RetryConfig
from fireflyer.storage.backends.local import LocalBackend


def usrbio_available() -> bool:
    try:
        import hf3fs_fuse.io  # noqa: F401
    except ImportError:
        return False
    return True


class ThreeFSBackend(LocalBackend):
    """A directory on a 3FS mount, read with USRBIO."""

    name = "3fs"
    positional_reads = False  # record reads go through read_range, i.e. the USRBIO ring

    def __init__(self, root: str | os.PathLike, *, mount_point: str | None = None, buffer_bytes: int = 64 << 20,
                 ring_entries: int = 64, retry: RetryConfig | None = None) -> None:
        super().__init__(root, retry=retry, create=True)
        try:
            from hf3fs_fuse import io as h3io
        except ImportError:
            raise ImportError("the 3FS backend needs 3FS's USRBIO Python binding (hf3fs_fuse); use LocalBackend on "
                              "the 3FS mount instead") from None
        from multiprocessing.shared_memory import SharedMemory

        self._io = h3io
        self.mount_point = mount_point or h3io.extract_mount_point(self.root)
        self._buffer_bytes = buffer_bytes
        self._shm = SharedMemory(size=buffer_bytes, create=True)
        self._iov = h3io.make_iovec(self._shm, self.mount_point, 0, -1)
        self._shm.unlink()  # the iovec keeps the mapping; the name is not needed any more
        self._ring = h3io.make_ioring(self.mount_point, ring_entries, True, 0)
        self._lock = threading.Lock()  # one iovec and ring: reads take turns

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        out = bytearray()
        fd = os.open(self.local_path(key), os.O_RDONLY)
        self._io.register_fd(fd)
        try:
            with self._lock:
                while len(out) < length:
                    n = min(self._buffer_bytes, length - len(out))
                    self._ring.prepare(self._iov[:n], True, fd, offset + len(out))
                    results = self._ring.submit().wait(min_results=1)
                    got = results[0].result
                    if got < 0:
                        raise OSError(-got, os.strerror(-got), self.local_path(key))
                    if got == 0:
                        break
                    out += bytes(self._iov[:got])
        finally:
            self._io.deregister_fd(fd)
            os.close(fd)
        return bytes(out)

    def _read(self, key: str) -> bytes:
        return self._read_range(key, 0, os.stat(self.local_path(key)).st_size)

    def close(self) -> None:
        self._ring = None
        self._iov = None
        self._shm.close()
