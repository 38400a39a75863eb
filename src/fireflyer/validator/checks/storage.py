"""Storage bandwidth on a given path: write with fsync, read back, verify, delete.

Paper §VII-B runs a storage bandwidth stress test (the artifact uses fio). This check writes
one file in 4 MiB chunks, each chunk a random block stamped with its index (so a chunk read
back from the wrong offset is caught), fsyncs it, evicts it from the page cache, reads it
back and compares every byte. Eviction uses ``posix_fadvise(DONTNEED)`` on the file, plus
``/proc/sys/vm/drop_caches`` when running as root; without root the read figure may
partly come from memory, and the report says so.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings, SkipCheck

CHUNK = 4 << 20


def _chunk(block: bytes, index: int) -> bytes:
    return index.to_bytes(8, "little") + block[8:]


def _drop_page_cache(fd: int, procfs_root: str) -> str:
    """Evict the file's pages; return how (for the report)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if os.geteuid() != 0:
        return "fadvise (not root: reads may be partly cached)"
    try:
        os.sync()
        with open(Path(procfs_root) / "sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "fadvise+drop_caches"
    except OSError as exc:
        return f"fadvise (drop_caches refused: {exc.strerror}; reads may be partly cached)"


class StorageBandwidth(Check):
    """Sequential write (fsync'd) and read bandwidth of one file on ``path``, content verified."""

    name = "storage"
    title = "Storage bandwidth"
    metrics: ClassVar[dict[str, str]] = {"write": "MB/s", "read": "MB/s"}
    params: ClassVar[dict[str, Any]] = {"path": "", "size_mb": 256, "quick_size_mb": 16}
    budget_s = 60.0
    quick_budget_s = 1.0

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        directory = Path(ctx.options.storage_path or ctx.param("path") or tempfile.gettempdir())
        if not directory.is_dir():
            raise SkipCheck(f"storage path {directory} is not a directory")
        if not os.access(directory, os.W_OK):
            raise SkipCheck(f"no permission to write in {directory}")
        size_mb = ctx.options.storage_mb or ctx.param("quick_size_mb" if ctx.quick else "size_mb")
        chunks = max(1, size_mb * (1 << 20) // CHUNK)
        block = os.urandom(CHUNK)
        path = directory / f".fireflyer-validate-{os.getpid()}-{time.monotonic_ns()}.tmp"
        try:
            written = 0
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for i in range(chunks):
                    view = memoryview(_chunk(block, i))
                    while view:
                        view = view[os.write(fd, view):]
                    written += 1
                    if ctx.time_left() < 0.3 * ctx.budget_s and written >= 2:
                        break  # keep time to read back
                os.fsync(fd)
                write_s = time.perf_counter() - t0
                evicted = _drop_page_cache(fd, ctx.options.procfs_root)
            finally:
                os.close(fd)
            wrong_chunks = 0
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                for i in range(written):
                    data = f.read(CHUNK)
                    if data != _chunk(block, i):
                        wrong_chunks += 1
                tail = f.read(1)
            read_s = time.perf_counter() - t0
        finally:
            path.unlink(missing_ok=True)
        nbytes = written * CHUNK
        out.metric("write", nbytes / write_s / 1e6)
        out.metric("read", nbytes / read_s / 1e6)
        out.details.update(path=str(directory), bytes=nbytes, cache_eviction=evicted, wrong_chunks=wrong_chunks)
        if written < chunks:
            out.note(f"wrote {written} of {chunks} chunks within the budget")
        if wrong_chunks or tail:
            out.fail(f"{wrong_chunks} of {written} chunks read back differ from what was written"
                     + (" and the file is longer than written" if tail else ""))
        if "partly cached" in evicted:
            out.note(evicted)
