"""Record shards: samples addressable at random, read in O(1), checked on every read.

A dataset is a folder (or key prefix on any :class:`~fireflyer.storage.backends.Backend`)::

    dataset.json           manifest: record count, records per shard, shards, how to decode
    shard-00000.rec        the records' bytes back to back
    shard-00000.idx        header (magic, count, data bytes, CRC-32 of the entries), then one
                           16-byte entry per record: offset (u64), length (u32), CRC-32 (u32)
    ...

Every shard but the last holds exactly ``records_per_shard`` records, so sample ``i`` is
record ``i % records_per_shard`` of shard ``i // records_per_shard``: one index lookup
and one positional read (``os.pread``; ``os.preadv`` for runs of neighbours in a batch),
or one ranged GET on an object store.

Writes are append-only and atomic: a shard's data and index are written to temporary
files, fsynced and renamed, and only then is the manifest (itself replaced atomically)
extended to name it. A crash loses at most the shard being written; data already in the
manifest is never torn. Opening a dataset checks that every shard named exists, that
each index is intact and agrees with its data file's size and the manifest's count.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from fireflyer.storage.backends import Backend, LocalBackend, open_backend
from fireflyer.storage.errors import CorruptRecord, DatasetError, NotFound
from fireflyer.fsutil import durable_replace
from fireflyer.errors import UserError, UserTypeError

MANIFEST = "dataset.json"
_MAGIC = b"FFRIDX1\x00"
_HEADER = struct.Struct("<8sQQI")  # magic, records, data bytes, CRC-32 of the entries
ENTRY = np.dtype([("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")])
FORMAT_VERSION = 1


def _shard_name(n: int) -> str:
    return f"shard-{n:05d}"


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    records_per_shard: int = 4096
    """Records in every shard but the last; sample i lives in shard i // records_per_shard."""

    def __post_init__(self) -> None:
        if not 1 <= self.records_per_shard <= 1 << 31:
            raise UserError(f"records_per_shard must be in 1..2**31, got {self.records_per_shard}")


class RecordWriter:
    """Append records to a dataset; ``close()`` (or leaving the ``with`` block) commits the last shard.

    Records stream into a spool file (beside the shards on a POSIX backend, so the commit
    is a rename; in the temporary directory otherwise, then uploaded), so a shard never has
    to fit in memory. Opening an existing dataset appends to it: new records get the next
    ids. A short last shard is completed under a new name and swapped in by the manifest,
    and the old files are removed only after that: a reader, or a crash, never sees a
    shard half rewritten.
    """

    def __init__(self, root: str | os.PathLike | Backend, *, records_per_shard: int | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self.backend = open_backend(root)
        try:
            manifest = json.loads(self.backend.read(MANIFEST))
        except NotFound:
            manifest = None
        if manifest is None:
            cfg = WriterConfig(records_per_shard=records_per_shard or WriterConfig().records_per_shard)
            self.manifest: dict[str, Any] = {"version": FORMAT_VERSION, "records": 0,
                                             "records_per_shard": cfg.records_per_shard, "shards": [],
                                             "generation": 0, "meta": meta or {}}
        else:
            self.manifest = manifest
            if records_per_shard is not None and records_per_shard != manifest["records_per_shard"]:
                raise UserError(f"the dataset at {self.backend!r} has {manifest['records_per_shard']} records per "
                                 f"shard; append with the same (or leave records_per_shard unset)")
            if meta is not None and meta != manifest.get("meta", {}):
                raise UserError("meta differs from the dataset's; appending records of another kind is refused")
        self.rps = int(self.manifest["records_per_shard"])
        self._entries: list[tuple[int, int, int]] = []
        self._size = 0
        self._spool: Any = None
        self._spool_path = ""
        self._name = ""
        self._replaces: dict[str, Any] | None = None
        self._closed = False
        shards = self.manifest["shards"]
        if shards and shards[-1]["records"] < self.rps:  # complete the short last shard under a new name
            last = shards[-1]
            entries = _read_index(self.backend, last, self.rps)
            self.manifest["generation"] = int(self.manifest.get("generation", 0)) + 1
            self._replaces = last
            self._open_spool(len(shards) - 1)
            self._spool.write(self.backend.read(last["data"]))
            self._entries = [(int(e["offset"]), int(e["length"]), int(e["crc"])) for e in entries]
            self._size = int(last["bytes"])

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def count(self) -> int:
        """Records written so far (committed or not)."""
        committed = int(self.manifest["records"]) - (int(self._replaces["records"]) if self._replaces else 0)
        return committed + len(self._entries)

    def _open_spool(self, n: int) -> None:
        gen = int(self.manifest.get("generation", 0))
        self._name = _shard_name(n) + (f".{gen}" if self._replaces is not None else "")
        local = self.backend.local_path(f"{self._name}.rec")
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._spool_path = f"{local}.tmp.{os.getpid()}"
            self._spool = open(self._spool_path, "wb")
        else:
            fd, self._spool_path = tempfile.mkstemp(prefix="fireflyer-records-", suffix=".rec")
            self._spool = os.fdopen(fd, "wb")

    def append(self, record: bytes | bytearray | memoryview) -> int:
        """Add one record; returns its sample id."""
        if self._closed:
            raise UserError("this RecordWriter is closed")
        data = bytes(record)
        if len(data) >= 1 << 32:
            raise UserError(f"a record must be under 4 GiB, got {len(data)} bytes")
        sid = self.count
        if self._spool is None:
            self._open_spool(len(self.manifest["shards"]))
        self._spool.write(data)
        self._entries.append((self._size, len(data), zlib.crc32(data)))
        self._size += len(data)
        if len(self._entries) == self.rps:
            self._flush()
        return sid

    def extend(self, records: Iterable[bytes]) -> None:
        for r in records:
            self.append(r)

    def _flush(self) -> None:
        if self._spool is None:
            return
        name = self._name
        entries = np.array(self._entries, dtype=ENTRY)
        body = entries.tobytes()
        header = _HEADER.pack(_MAGIC, len(entries), self._size, zlib.crc32(body))
        self._spool.flush()
        os.fsync(self._spool.fileno())
        self._spool.close()
        self._spool = None
        local = self.backend.local_path(f"{name}.rec")
        try:  # data first, then its index, then the manifest that names them
            if local is not None:
                durable_replace(self._spool_path, local)
            else:
                self.backend.upload(f"{name}.rec", self._spool_path)
        finally:
            if os.path.exists(self._spool_path):
                os.unlink(self._spool_path)
        self.backend.write(f"{name}.idx", header + body)
        shard = {"data": f"{name}.rec", "index": f"{name}.idx", "records": len(entries), "bytes": self._size}
        old = self._replaces
        if old is not None:
            self.manifest["shards"][-1] = shard
            self.manifest["records"] += len(entries) - int(old["records"])
        else:
            self.manifest["shards"].append(shard)
            self.manifest["records"] += len(entries)
        self.backend.write(MANIFEST, json.dumps(self.manifest, indent=1).encode())
        if old is not None and old["data"] != shard["data"]:  # no longer named: safe to remove
            self.backend.delete(old["data"])
            self.backend.delete(old["index"])
        self._replaces = None
        self._entries = []
        self._size = 0

    def close(self) -> None:
        """Commit the last (short) shard and the manifest."""
        if self._closed:
            return
        self._flush()
        if not self.manifest["shards"]:
            self.backend.write(MANIFEST, json.dumps(self.manifest, indent=1).encode())
        self._closed = True

    def abort(self) -> None:
        """Drop the records not yet committed (the dataset stays as the manifest last said)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None
            if os.path.exists(self._spool_path):
                os.unlink(self._spool_path)
        self._closed = True


def _read_index(backend: Backend, shard: dict[str, Any], rps: int) -> np.ndarray:
    """A shard's index, checked against itself, the manifest and the data file's size."""
    try:
        raw = backend.read(shard["index"])
    except NotFound:
        raise DatasetError(f"index {shard['index']} of shard {shard['data']} is missing in {backend!r}") from None
    if len(raw) < _HEADER.size:
        raise DatasetError(f"index {shard['index']} is truncated ({len(raw)} bytes)")
    magic, count, data_bytes, crc = _HEADER.unpack_from(raw)
    body = raw[_HEADER.size:]
    if magic != _MAGIC:
        raise DatasetError(f"{shard['index']} is not a fireflyer record index (bad magic)")
    if len(body) != count * ENTRY.itemsize or zlib.crc32(body) != crc:
        raise DatasetError(f"index {shard['index']} is damaged (its entries fail their checksum or are truncated)")
    if count != shard["records"] or count > rps:
        raise DatasetError(f"index {shard['index']} lists {count} records but the manifest says {shard['records']}")
    entries = np.frombuffer(body, dtype=ENTRY)
    try:
        size = backend.size(shard["data"])
    except NotFound:
        raise DatasetError(f"shard {shard['data']} named in {MANIFEST} is missing in {backend!r}") from None
    end = int(entries["offset"][-1]) + int(entries["length"][-1]) if count else 0
    if size != data_bytes or end != data_bytes or size != shard["bytes"]:
        raise DatasetError(f"index {shard['index']} disagrees with shard {shard['data']}: the index covers "
                           f"{end} bytes (header says {data_bytes}), the file has {size}")
    if count > 1 and not np.all(entries["offset"][1:] == entries["offset"][:-1] + entries["length"][:-1]):
        raise DatasetError(f"index {shard['index']} has overlapping or gapped records")
    return entries


class RecordReader:
    """Random access to a record dataset: ``read(i)``, ``read_many(ids)``; thread-safe."""

    def __init__(self, root: str | os.PathLike | Backend, *, threads: int = 4) -> None:
        if threads < 1:
            raise UserError(f"threads must be at least 1, got {threads}")
        if isinstance(root, Backend) or "://" in os.fspath(root):
            self.backend = open_backend(root)
        elif os.path.isdir(root):
            self.backend = LocalBackend(root, create=False)
        else:
            raise DatasetError(f"record dataset {os.fspath(root)!r} does not exist (no such directory)")
        try:
            self.manifest = json.loads(self.backend.read(MANIFEST))
        except NotFound:
            raise DatasetError(f"{self.backend!r} holds no record dataset ({MANIFEST} is missing)") from None
        except ValueError as exc:
            raise DatasetError(f"{MANIFEST} in {self.backend!r} is not valid JSON ({exc})") from None
        if self.manifest.get("version") != FORMAT_VERSION:
            raise DatasetError(f"{MANIFEST} has format version {self.manifest.get('version')!r}; this reader "
                               f"reads version {FORMAT_VERSION}")
        self.rps = int(self.manifest["records_per_shard"])
        self.shards = self.manifest["shards"]
        for s in self.shards[:-1]:
            if s["records"] != self.rps:
                raise DatasetError(f"shard {s['data']} has {s['records']} records; every shard but the last must have "
                                   f"{self.rps}")
        self.indexes = [_read_index(self.backend, s, self.rps) for s in self.shards]
        total = sum(int(s["records"]) for s in self.shards)
        if total != self.manifest["records"]:
            raise DatasetError(f"{MANIFEST} says {self.manifest['records']} records but its shards hold {total}")
        self._len = total
        self.meta: dict[str, Any] = self.manifest.get("meta", {})
        self.threads = threads
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._local = self.backend.positional_reads and all(self.backend.local_path(s["data"]) for s in self.shards)

    def __len__(self) -> int:
        return self._len

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def locate(self, i: int) -> tuple[int, int, int, int]:
        """(shard number, offset, length, crc) of sample ``i``."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise UserTypeError(f"a sample id must be an int, got {type(i).__name__}")
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} is outside 0..{self._len - 1}")
        s, j = divmod(int(i), self.rps)
        e = self.indexes[s][j]
        return s, int(e["offset"]), int(e["length"]), int(e["crc"])

    def _fd(self, s: int) -> int:
        fd = self._fds.get(s)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(s)
                if fd is None:
                    path = self.backend.local_path(self.shards[s]["data"])
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        name = self.shards[s]["data"]
                        raise DatasetError(f"shard {name} disappeared from {self.backend!r}") from None
                    self._fds[s] = fd
        return fd

    def _check(self, s: int, offset: int, data: bytes | bytearray | memoryview, crc: int, length: int,
               sample: int) -> None:
        name = self.shards[s]["data"]
        where = f"record {sample} (at offset {offset} of shard {name} in {self.backend!r})"
        if len(data) != length:
            raise CorruptRecord(f"{where} is truncated ({len(data)} of {length} bytes)", shard=name, offset=offset,
                                record=sample)
        if zlib.crc32(data) != crc:
            raise CorruptRecord(f"{where} fails its CRC-32 checksum (the bytes on storage are damaged)", shard=name,
                                offset=offset, record=sample)

    def read(self, i: int) -> bytes:
        """Sample ``i``'s bytes, checksum verified."""
        s, offset, length, crc = self.locate(i)
        if self._local:
            data = os.pread(self._fd(s), length, offset)
        else:
            data = self.backend.read_range(self.shards[s]["data"], offset, length)
        self._check(s, offset, data, crc, length, int(i))
        return data

    def read_many(self, ids: Sequence[int]) -> list[bytes]:
        """Many samples at once, in the order asked: neighbours in a shard are read with one
        ``preadv`` (one ranged GET on an object store), runs spread over the thread pool."""
        locs = [self.locate(i) for i in ids]
        order = sorted(range(len(ids)), key=lambda k: int(ids[k]))
        runs: list[list[int]] = []  # positions in ids, one run per stretch of neighbouring records
        for k in order:
            if runs:
                prev, cur = locs[runs[-1][-1]], locs[k]
                if int(ids[k]) == int(ids[runs[-1][-1]]):  # the same sample asked twice
                    runs[-1].append(k)
                    continue
                if cur[0] == prev[0] and cur[1] == prev[1] + prev[2] and len(runs[-1]) < 64:
                    runs[-1].append(k)
                    continue
            runs.append([k])
        out: list[bytes | None] = [None] * len(ids)

        def do(run: list[int]) -> None:
            uniq: list[int] = []
            for k in run:
                if not uniq or int(ids[k]) != int(ids[uniq[-1]]):
                    uniq.append(k)
            s, start = locs[uniq[0]][0], locs[uniq[0]][1]
            if self._local:
                bufs = [bytearray(locs[k][2]) for k in uniq]
                got = os.preadv(self._fd(s), bufs, start)
                if got != sum(len(b) for b in bufs):  # a short read: cut each buffer to what arrived
                    left = got
                    for b in bufs:
                        keep = max(0, min(len(b), left))
                        left -= len(b)
                        del b[keep:]
                pieces: list[bytes | bytearray] = bufs
            else:
                total = locs[uniq[-1]][1] + locs[uniq[-1]][2] - start
                blob = self.backend.read_range(self.shards[s]["data"], start, total)
                pieces = [blob[locs[k][1] - start:locs[k][1] - start + locs[k][2]] for k in uniq]
            by_id = {}
            for k, piece in zip(uniq, pieces, strict=True):
                self._check(s, locs[k][1], piece, locs[k][3], locs[k][2], int(ids[k]))
                by_id[int(ids[k])] = bytes(piece)
            for k in run:
                out[k] = by_id[int(ids[k])]

        if self.threads == 1 or len(runs) == 1:
            for run in runs:
                do(run)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="records")
            groups = [runs[k::self.threads] for k in range(min(self.threads, len(runs)))]  # one task per thread

            def do_group(group: list[list[int]]) -> None:
                for run in group:
                    do(run)

            for f in [self._pool.submit(do_group, g) for g in groups]:
                f.result(timeout=300)
        return out  # type: ignore[return-value]

    def decode(self, data: bytes) -> Any:
        """A record as the converter stored it: a numpy array for ``from_numpy`` datasets, bytes otherwise."""
        if self.meta.get("kind") == "numpy":
            return np.frombuffer(data, dtype=np.dtype(self.meta["dtype"])).reshape(self.meta["shape"])
        return data

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# -- conversion ----------------------------------------------------------------------


def from_numpy(array: np.ndarray, root: str | os.PathLike | Backend, *, records_per_shard: int = 4096) -> int:
    """One record per row of ``array`` (C order); ``RecordReader.decode`` gives the rows back."""
    a = np.ascontiguousarray(array)
    if a.ndim < 1 or a.dtype.hasobject:
        raise UserError("from_numpy needs an array of at least one dimension with a plain (non-object) dtype")
    meta = {"kind": "numpy", "dtype": a.dtype.str, "shape": list(a.shape[1:])}
    with RecordWriter(root, records_per_shard=records_per_shard, meta=meta) as w:
        for row in a:
            w.append(row.tobytes())
    return len(a)


def from_folder(folder: str | os.PathLike, root: str | os.PathLike | Backend, *, records_per_shard: int = 4096,
                pattern: Callable[[str], bool] | None = None) -> list[str]:
    """One record per file under ``folder`` (sorted relative paths); returns the names in id order,
    which are also stored as ``names.json`` beside the shards."""
    base = os.fspath(folder)
    if not os.path.isdir(base):
        raise UserError(f"{base!r} is not a directory")
    names = []
    for dirpath, _, files in os.walk(base):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), base).replace(os.sep, "/")
            if pattern is None or pattern(rel):
                names.append(rel)
    names.sort()
    backend = open_backend(root)
    if backend.exists(MANIFEST):
        raise UserError(f"{backend!r} already holds records; convert a folder into an empty location")
    with RecordWriter(backend, records_per_shard=records_per_shard, meta={"kind": "files"}) as w:
        for rel in names:
            with open(os.path.join(base, *rel.split("/")), "rb") as f:
                w.append(f.read())
    backend.write("names.json", json.dumps(names).encode())
    return names
