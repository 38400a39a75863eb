"""A local POSIX directory: the default, and also what a 3FS, Lustre or NFS mount looks like."""

from __future__ import annotations

import os
import shutil

from fireflyer.storage.backends.base import Backend, RetryConfig
from fireflyer.fsutil import atomic_write


class LocalBackend(Backend):
    """Keys are paths under ``root``; writes go through a temporary file, fsync and rename."""

    name = "local"
    positional_reads = True

    def __init__(self, root: str | os.PathLike, *, retry: RetryConfig | None = None, create: bool = True) -> None:
        super().__init__(retry=retry)
        self.root = os.path.abspath(os.fspath(root))
        if create:
            os.makedirs(self.root, exist_ok=True)
        elif not os.path.isdir(self.root):
            raise FileNotFoundError(f"storage root {self.root} is not a directory")

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    def local_path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _read(self, key: str) -> bytes:
        with open(self.local_path(key), "rb") as f:
            return f.read()

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        fd = os.open(self.local_path(key), os.O_RDONLY)
        try:
            out = bytearray()
            while len(out) < length:
                chunk = os.pread(fd, length - len(out), offset + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)
        finally:
            os.close(fd)

    def _write(self, key: str, data: bytes | memoryview) -> None:
        atomic_write(self.local_path(key), lambda f: f.write(data))

    def _upload(self, key: str, path: str) -> None:
        def copy(dst):
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)

        atomic_write(self.local_path(key), copy)

    def _download(self, key: str, path: str) -> None:
        def copy(dst):
            with open(self.local_path(key), "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)

        atomic_write(path, copy)

    def _size(self, key: str) -> int:
        return os.stat(self.local_path(key)).st_size

    def _list(self, prefix: str) -> list[str]:
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""  # walk only below the prefix's folder
        base = self.local_path(folder) if folder else self.root
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if ".tmp." in name:
                    continue  # an atomic write in progress
                rel = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if rel.startswith(prefix):
                    out.append(rel)
        return out

    def _delete(self, key: str) -> None:
        os.unlink(self.local_path(key))
