"""An in-process object store: no local paths, whole-object writes, ranged reads (like S3).

For tests and examples that need a non-POSIX backend without a server; it can also
inject failures (``fail_next``) to exercise the retry path.
"""

from __future__ import annotations

import threading

from fireflyer.storage.backends.base import Backend, RetryConfig


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, *, retry: RetryConfig | None = None) -> None:
        super().__init__(retry=retry)
        self.objects: dict[str, bytes] = {}
        self.calls: dict[str, int] = {}
        self.fail_next = 0
        """Fail this many of the next calls with a ConnectionError (a transient fault)."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryBackend({len(self.objects)} objects)"

    def _tick(self, op: str) -> None:
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            if self.fail_next > 0:
                self.fail_next -= 1
                raise ConnectionError("injected transient failure")

    def _get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise FileNotFoundError(key) from None

    def _read(self, key: str) -> bytes:
        self._tick("read")
        return self._get(key)

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        self._tick("read_range")
        return self._get(key)[offset:offset + length]

    def _write(self, key: str, data: bytes | memoryview) -> None:
        self._tick("write")
        self.objects[key] = bytes(data)

    def _size(self, key: str) -> int:
        self._tick("size")
        return len(self._get(key))

    def _list(self, prefix: str) -> list[str]:
        self._tick("list")
        return [k for k in self.objects if k.startswith(prefix)]

    def _delete(self, key: str) -> None:
        self._tick("delete")
        self._get(key)
        del self.objects[key]
