"""The node's shared-memory arena: chunk slots, result buffers and the flags that hand chunks between local ranks.

One arena per node and process group, a POSIX shared-memory file created with
mode 0600 by local rank 0 and mapped by every local rank. It is unlinked as soon as
every local rank has mapped it (the mappings keep it alive), so a crash at any
later moment leaves nothing behind in /dev/shm.

Layout (``depth`` pipeline buffers, ``L`` local ranks, chunk of ``chunk_bytes``)::

    control | in[depth][L] | red[depth] (2 chunks each) | out[depth]

``in[b][k]``   local rank k's stage-in copy of the chunk in buffer b
``red[b]``     the node's partial sum (accumulation dtype) on its way into the trees
``out[b]``     the finished chunk that every local rank copies out

Flags are monotonically increasing chunk counters (int32, compared modulo 2**32),
one per local rank and stage, each on its own cache line, written only by their
owner. On x86-64 (total store order) a counter written after the data it
announces is never seen before that data. The stages hand chunks over through
:meth:`Arena.publish` and :meth:`Arena.wait` only; neither touches a flag word itself.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from fireflyer.hfreduce.transport import futex
from fireflyer.hfreduce.errors import HFReduceError
from fireflyer.hfreduce.transport.procs import pid_alive
from fireflyer.fsutil import unlink_quietly

SHM_DIR = "/dev/shm"
NAME_PREFIX = "fireflyer-hfr-"
MAGIC = 0x48465231  # "HFR1"

class Flag(str, enum.Enum):
    """The four flags each local rank raises per chunk, in the arena's order: its input staged ``IN``, its
    slice ``RED``uced, the node's result ``OUT`` of the trees, and ``DONE`` reading its peers' buffers. A
    member equals (and hashes as) its string, which the flight recorder and the messages print."""

    IN = "in"
    RED = "red"
    OUT = "out"
    DONE = "done"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


STAGES = tuple(Flag)
SLICE = 0.05  # seconds a wait sleeps on a flag between liveness checks
RED_FACTOR = 2  # red buffers are twice a chunk: room for fp16/bf16 chunks accumulated in fp32
_LINE = 64  # bytes per flag: one cache line each, so owners never share a line
_DESC_BYTES = 64
_ABORT_MSG_BYTES = 2048
_HEADER = struct.Struct("<IIIIQ")  # magic, local_size, depth, reserved, chunk_bytes


@dataclass(frozen=True)
class ArenaShape:
    local_size: int
    chunk_bytes: int
    depth: int

    @property
    def flags_offset(self) -> int:
        return 4096

    @property
    def remote_wait_offset(self) -> int:
        """One int32 per local rank (after the header, in the first page): the remote rank its tree
        stage last blocked on, plus one (0: none yet)."""
        return 1024

    def flag_index(self, stage: str, local_rank: int) -> int:
        """Index of a flag in int32 units from the start of the arena."""
        return (self.flags_offset + (STAGES.index(stage) * self.local_size + local_rank) * _LINE) // 4

    @cached_property
    def pid_offset(self) -> int:
        return self.flags_offset + len(STAGES) * self.local_size * _LINE

    @cached_property
    def desc_offset(self) -> int:
        return self.pid_offset + self.local_size * 8

    def desc_slot(self, buf: int, local_rank: int) -> int:
        """Where a local rank's descriptor of the collective whose first chunk is in ``buf`` lives.

        One slot per pipeline buffer: a rank writes its next collective's descriptor into the
        slot of that collective's first buffer, which its peers have finished with (it waited
        for that before staging in), so a fast rank never overwrites a descriptor a slow peer
        has yet to check, and no call needs a trailing barrier."""
        return self.desc_offset + (buf * self.local_size + local_rank) * _DESC_BYTES

    @cached_property
    def abort_offset(self) -> int:
        return _align(self.desc_offset + self.depth * self.local_size * _DESC_BYTES, _LINE)

    @cached_property
    def control_bytes(self) -> int:
        return _align(self.abort_offset + _LINE + _ABORT_MSG_BYTES, 4096)

    def in_offset(self, buf: int, local_rank: int) -> int:
        return self.control_bytes + (buf * self.local_size + local_rank) * self.chunk_bytes

    @cached_property
    def red_bytes(self) -> int:
        """A partial-sum buffer holds a chunk in fp32 even when the data is 16-bit."""
        return RED_FACTOR * self.chunk_bytes

    def red_offset(self, buf: int) -> int:
        return self.control_bytes + self.depth * self.local_size * self.chunk_bytes + buf * self.red_bytes

    def out_offset(self, buf: int) -> int:
        return self.control_bytes + self.depth * (self.local_size * self.chunk_bytes + self.red_bytes) + buf * self.chunk_bytes

    @cached_property
    def total_bytes(self) -> int:
        return self.control_bytes + self.depth * ((self.local_size + 1) * self.chunk_bytes + self.red_bytes)


def map_shared(fd: int, total_bytes: int, control_bytes: int) -> tuple[mmap.mmap, ctypes.Array, int]:
    """Map a node's shared region from ``fd`` (closed here): the mapping, its int32 control words, their address."""
    try:
        mm = mmap.mmap(fd, total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    words = (ctypes.c_int32 * (control_bytes // 4)).from_buffer(mm)
    return mm, words, ctypes.addressof(words)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def arena_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Arena:
    """A mapped arena. Create with :meth:`create` (local rank 0) or :meth:`attach` (the others)."""

    def __init__(self, name: str, shape: ArenaShape, fd: int) -> None:
        self.name = name
        self.shape = shape
        self._mm, self._words, self._base = map_shared(fd, shape.total_bytes, shape.control_bytes)
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._pinned = False
        self.private = False
        self._index = {(st, k): shape.flag_index(st, k) for st in STAGES for k in range(shape.local_size)}
        self._abort_word = shape.abort_offset // 4

    # -- life cycle -----------------------------------------------------------------
    @classmethod
    def create(cls, name: str, shape: ArenaShape) -> "Arena":
        path = arena_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise HFReduceError(f"shared-memory arena {path} already exists; another job uses the same name") from None
        except OSError as exc:
            raise HFReduceError(f"cannot create shared-memory arena {path}: {exc.strerror}") from None
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, shape.total_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise HFReduceError(
                        f"/dev/shm has no room for a {shape.total_bytes / 2**20:.1f} MiB arena; "
                        "enlarge /dev/shm (e.g. docker --shm-size) or lower chunk_bytes/depth"
                    ) from None
                os.ftruncate(fd, shape.total_bytes)
        except BaseException:
            os.close(fd)
            unlink_quietly(path)
            raise
        arena = cls(name, shape, fd)
        arena._mm[:_HEADER.size] = _HEADER.pack(MAGIC, shape.local_size, shape.depth, 0, shape.chunk_bytes)
        return arena

    @classmethod
    def create_private(cls, name: str, shape: ArenaShape) -> tuple["Arena", int]:
        """An arena in anonymous shared memory (``memfd_create``); returns it and a descriptor to share.

        Nothing appears in /dev/shm, and the memory is gone with the last process holding it.
        """
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, shape.total_bytes)
            try:
                os.posix_fallocate(fd, 0, shape.total_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise HFReduceError(
                        f"no memory for a {shape.total_bytes / 2**20:.1f} MiB arena; lower chunk_bytes or depth"
                    ) from None
            share = os.dup(fd)
        except BaseException:
            os.close(fd)
            raise
        arena = cls(name, shape, fd)
        arena.private = True
        arena._mm[: _HEADER.size] = _HEADER.pack(MAGIC, shape.local_size, shape.depth, 0, shape.chunk_bytes)
        return arena, share

    @classmethod
    def from_fd(cls, name: str, shape: ArenaShape, fd: int) -> "Arena":
        """Map an arena received as a descriptor from local rank 0 (takes ownership of ``fd``)."""
        if os.fstat(fd).st_size < shape.total_bytes:
            os.close(fd)
            raise HFReduceError("the shared arena is smaller than this rank expects; do all local ranks use one config?")
        arena = cls(name, shape, fd)
        arena.private = True
        arena._check_header()
        return arena

    def _check_header(self) -> None:
        magic, local_size, depth, _, chunk_bytes = _HEADER.unpack(bytes(self._mm[: _HEADER.size]))
        shape = self.shape
        if (magic, local_size, depth, chunk_bytes) != (MAGIC, shape.local_size, shape.depth, shape.chunk_bytes):
            self.close()
            raise HFReduceError(f"arena {self.name} has a different shape; do all local ranks use the same hfreduce config?")

    @classmethod
    def attach(cls, name: str, shape: ArenaShape, timeout: float) -> "Arena":
        path = arena_path(name)
        deadline = time.monotonic() + timeout
        while True:
            while True:
                try:
                    fd = os.open(path, os.O_RDWR)
                    if os.fstat(fd).st_size >= shape.total_bytes:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise HFReduceError(f"timed out after {timeout:.0f}s waiting for local rank 0 to create arena {path}")
                time.sleep(0.005)
            arena = cls(name, shape, fd)
            magic, local_size, depth, _, chunk_bytes = _HEADER.unpack(bytes(arena._mm[:_HEADER.size]))
            if magic != 0:
                break
            arena.close()  # sized but the creator has not written the header yet
            if time.monotonic() > deadline:
                raise HFReduceError(f"timed out after {timeout:.0f}s waiting for arena {path} to be initialised")
            time.sleep(0.005)
        if (magic, local_size, depth, chunk_bytes) != (MAGIC, shape.local_size, shape.depth, shape.chunk_bytes):
            arena.close()
            raise HFReduceError(f"arena {path} has a different shape; do all local ranks use the same hfreduce config?")
        return arena

    def unlink(self) -> None:
        if not self.private:
            unlink_quietly(arena_path(self.name))

    def close(self) -> None:
        self.unpin()
        self.bytes = None  # type: ignore[assignment]
        self._words = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass

    # -- CUDA ------------------------------------------------------------------------
    def pin(self) -> None:
        """Page-lock the mapping so D2H/H2D copies into it run asynchronously on copy engines."""
        if self._pinned or not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.bytes.data_ptr(), self.shape.total_bytes, 0)
        torch.cuda.check_error(err)
        self._pinned = True

    def unpin(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self._pinned = False

    # -- flags -----------------------------------------------------------------------
    @property
    def base_address(self) -> int:
        """Where the mapping starts in this process (for the compiled core, which reads the flags itself)."""
        return self._base

    def flag_address(self, stage: str, local_rank: int) -> int:
        return self._base + 4 * self._index[stage, local_rank]

    def read_flag(self, stage: str, local_rank: int) -> int:
        return self._words[self._index[stage, local_rank]] & 0xFFFFFFFF

    def publish(self, stage: Flag, local_rank: int, value: int) -> None:
        """Announce that ``local_rank`` has finished ``stage`` of chunks up to ``value`` (exclusive), and wake its waiters."""
        i = self._index[stage, local_rank]
        self._words[i] = _to_i32(value)
        futex.wake(self._base + 4 * i)

    def wait(self, stage: Flag, local_ranks: Iterable[int], target: int, deadline: float,
             check: Callable[[], None], timed_out: Callable[[int], BaseException], *,
             blocked: Callable[[int], None] | None = None, unblocked: Callable[[], None] | None = None) -> None:
        """Block until every local rank in ``local_ranks`` has published ``stage`` up to ``target``.

        A flag not there yet is slept on (its futex) in slices of :data:`SLICE`, with ``check()``
        between them (it raises when the node has failed or a peer died). Past ``deadline``
        (``time.monotonic`` seconds) it raises ``timed_out(k)``, the caller's error for the local
        rank k still missing. ``blocked(k)`` hears when the wait for k has to sleep, ``unblocked()``
        when k arrived after all (who waits on whom, for diagnosis); a raise leaves it blocked.
        """
        words, index = self._words, self._index
        for k in local_ranks:
            i = index[stage, k]
            if ((words[i] - target) & 0xFFFFFFFF) < 0x80000000:  # the common case: already there
                continue
            if blocked is not None:
                blocked(k)
            addr = self._base + 4 * i
            while True:
                value = words[i]
                if ((value - target) & 0xFFFFFFFF) < 0x80000000:
                    break
                if check_unless(check, lambda: reached(words[i], target)):  # noqa: B023 - called at once
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timed_out(k)
                futex.wait(addr, value, min(SLICE, left))
            if unblocked is not None:
                unblocked()

    def note_remote_wait(self, local_rank: int, rank: int) -> None:
        """``local_rank``'s tree stage now blocks on global rank ``rank`` of another node."""
        self._words[self.shape.remote_wait_offset // 4 + local_rank] = rank + 1

    def remote_wait(self, local_rank: int) -> int | None:
        """The remote rank ``local_rank``'s tree stage last blocked on (None: none yet), for a local timeout's message."""
        value = self._words[self.shape.remote_wait_offset // 4 + local_rank]
        return value - 1 if value > 0 else None

    def set_pid(self, local_rank: int, pid: int) -> None:
        struct.pack_into("<q", self._mm, self.shape.pid_offset + 8 * local_rank, pid)

    def pid(self, local_rank: int) -> int:
        return struct.unpack_from("<q", self._mm, self.shape.pid_offset + 8 * local_rank)[0]

    def write_descriptor(self, local_rank: int, desc: bytes, buf: int = 0) -> None:
        assert len(desc) <= _DESC_BYTES
        off = self.shape.desc_slot(buf, local_rank)
        self._mm[off : off + len(desc)] = desc

    def descriptor_address(self, buf: int, local_rank: int) -> int:
        """The address of local rank ``local_rank``'s descriptor in buffer ``buf`` (in this process's mapping)."""
        return self._base + self.shape.desc_slot(buf, local_rank)

    descriptor_bytes = _DESC_BYTES
    """Bytes of one rank's descriptor slot."""

    def descriptor(self, local_rank: int, size: int, buf: int = 0) -> bytes:
        off = self.shape.desc_slot(buf, local_rank)
        return bytes(self._mm[off : off + size])

    # -- abort -----------------------------------------------------------------------
    @property
    def abort_address(self) -> int:
        return self._base + self.shape.abort_offset

    def aborted(self) -> bool:
        return self._words[self._abort_word] != 0

    def abort(self, message: str) -> None:
        """Record the first failure on this node and wake every local waiter."""
        if self.aborted():
            return
        data = message.encode()[: _ABORT_MSG_BYTES - 4]
        off = self.shape.abort_offset + _LINE
        struct.pack_into("<I", self._mm, off, len(data))
        self._mm[off + 4 : off + 4 + len(data)] = data
        self._words[self.shape.abort_offset // 4] = 1
        futex.wake(self.abort_address)
        for stage in STAGES:
            for k in range(self.shape.local_size):
                futex.wake(self.flag_address(stage, k))

    def abort_message(self) -> str:
        off = self.shape.abort_offset + _LINE
        (n,) = struct.unpack_from("<I", self._mm, off)
        return bytes(self._mm[off + 4 : off + 4 + min(n, _ABORT_MSG_BYTES - 4)]).decode(errors="replace")


def _to_i32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def reached(value: int, target: int) -> bool:
    """Whether counter ``value`` has reached ``target``, modulo 2**32."""
    return ((value - target) & 0xFFFFFFFF) < (1 << 31)


def check_unless(check: Callable[[], None], done: Callable[[], bool]) -> bool:
    """A wait's failure check, between its looks at what it waits for.

    Returns False when ``check()`` passed. When it raised but ``done()`` has come true
    meanwhile (a peer delivered, then died or failed the group), returns True: the delivery
    counts and the wait is over. Otherwise the failure propagates.
    """
    try:
        check()
    except BaseException:
        if done():
            return True
        raise
    return False


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove arenas whose creating process no longer exists (left by a whole node being SIGKILLed at start-up)."""
    removed = []
    for name in sorted(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else []:
        if not name.startswith(NAME_PREFIX):
            continue
        try:
            pid = int(name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            unlink_quietly(os.path.join(shm_dir, name))
            removed.append(name)
    return removed
