"""One rank's shard file in safetensors format, written in parallel chunks and verified on read.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes back to back. The header
is planned up front from the tensors' sizes, so every byte's place in the file is known
before anything is written: writer threads then ``pwrite`` disjoint chunks at once, and
the manifest can record each tensor's file offset and checksum. Files written here open
with the ``safetensors`` library as well.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fireflyer.checkpoint.errors import CorruptCheckpoint
from fireflyer.errors import UserTypeError

# torch dtype <-> safetensors dtype name
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
_ALIGN = 8


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in its shard file."""

    name: str
    dtype: str  # safetensors name, e.g. "F32"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    crc32: int = 0

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "crc32": self.crc32}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Entry":
        """An entry as a manifest records it; CorruptCheckpoint if its fields do not describe a tensor."""
        try:
            e = cls(name, d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"], d["crc32"])
            ints = [*e.shape, e.offset, e.nbytes, e.crc32]
            ok = (isinstance(name, str) and e.dtype in _FROM_ST and all(type(n) is int and n >= 0 for n in ints)
                  and math.prod(e.shape) * _FROM_ST[e.dtype].itemsize == e.nbytes)
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"tensor entry {name!r} is malformed ({type(exc).__name__}: {exc})") from None
        if not ok:
            raise CorruptCheckpoint(f"tensor entry {name!r} does not describe a tensor: {d!r}")
        return e


def st_dtype(dtype: torch.dtype) -> str:
    try:
        return _ST_DTYPES[dtype]
    except KeyError:
        raise UserTypeError(f"checkpoints cannot hold {dtype} tensors; supported: {sorted(map(str, _ST_DTYPES))}") from None


def st_itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name`` (e.g. 4 for ``"F32"``)."""
    return _FROM_ST[name].itemsize


def plan(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[Entry]]:
    """The file's header bytes (length prefix included) and every tensor's absolute place."""
    ranges, entries_rel = {}, []
    pos = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        ranges[name] = {"dtype": st_dtype(t.dtype), "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        entries_rel.append((name, st_dtype(t.dtype), tuple(t.shape), pos, nbytes))
        pos += nbytes
    header = json.dumps(ranges, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % _ALIGN)  # data starts 8-byte aligned, as safetensors expects
    prefix = struct.pack("<Q", len(header)) + header
    base = len(prefix)
    return prefix, [Entry(n, d, s, base + off, nb) for n, d, s, off, nb in entries_rel]


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write(path: str, tensors: dict[str, torch.Tensor], *, threads: int = 4, chunk_bytes: int = 64 << 20) -> list[Entry]:
    """Write ``tensors`` (contiguous CPU tensors) to ``path`` and fsync it; returns entries with checksums.

    Chunks of at most ``chunk_bytes`` go out on ``threads`` threads with ``os.pwrite``; each
    tensor's CRC-32 is computed by the thread that writes its first chunk, from memory.
    """
    prefix, entries = plan(tensors)
    views = {name: _bytes_of(t) for name, t in tensors.items()}
    jobs = []  # (offset in file, memoryview)
    for e in entries:
        view = views[e.name]
        for lo in range(0, e.nbytes, chunk_bytes):
            jobs.append((e.offset + lo, view[lo : lo + chunk_bytes]))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = entries[-1].offset + entries[-1].nbytes if entries else len(prefix)
        if total:
            # Reserve the blocks up front: a full disk fails here, before any write, and the
            # file's blocks are allocated together rather than in the writers' order.
            os.posix_fallocate(fd, 0, total)
        _pwrite_all(fd, memoryview(prefix), 0)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpt-write") as pool:
            crcs = pool.map(lambda e: zlib.crc32(views[e.name]), entries)
            for f in [pool.submit(_pwrite_all, fd, view, off) for off, view in jobs]:
                f.result()
            entries = [Entry(e.name, e.dtype, e.shape, e.offset, e.nbytes, crc) for e, crc in zip(entries, crcs)]
        os.fsync(fd)
    finally:
        os.close(fd)
    return entries


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read(path: str, entries: list[Entry], *, verify: bool = True, threads: int = 4) -> dict[str, torch.Tensor]:
    """Read the tensors of ``entries`` from ``path`` in parallel; raise CorruptCheckpoint naming what is wrong."""
    try:  # never through a symbolic link: a checkpoint's files are its own
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CorruptCheckpoint(f"{path} is missing or unreadable ({exc.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        _check(path, entries, size)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpt-read") as pool:
            tensors = list(pool.map(lambda e: _read_one(fd, path, e, verify), entries))
    finally:
        os.close(fd)
    return {e.name: t for e, t in zip(entries, tensors)}


def _check(path: str, entries: list[Entry], size: int) -> None:
    for e in entries:
        if e.dtype not in _FROM_ST:
            raise CorruptCheckpoint(f"{path}: tensor {e.name!r} has unknown dtype {e.dtype!r}")
        if e.offset + e.nbytes > size:
            raise CorruptCheckpoint(f"{path} is truncated: tensor {e.name!r} needs bytes up to "
                                    f"{e.offset + e.nbytes}, the file has {size}")


def _read_one(fd: int, path: str, e: Entry, verify: bool) -> torch.Tensor:
    dtype = _FROM_ST[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    out = torch.empty(e.nbytes, dtype=torch.uint8)  # not zero-filled, unlike a bytearray: one pass less
    view, got = memoryview(out.numpy()).cast("B"), 0
    while got < e.nbytes:
        n = os.preadv(fd, [view[got:]], e.offset + got)
        if n == 0:
            raise CorruptCheckpoint(f"{path} is truncated inside tensor {e.name!r}")
        got += n
    if verify and zlib.crc32(view) != e.crc32:
        raise CorruptCheckpoint(f"{path}: tensor {e.name!r} fails its checksum (bytes {e.offset}.."
                                f"{e.offset + e.nbytes} changed on disk)")
    return out.view(dtype).reshape(e.shape)
