"""Mailboxes: one-way byte rings in shared memory, one for every ordered pair of a node's local ranks.

Point-to-point transfers and all-to-all between ranks of one node go through these
rings instead of sockets: the sender copies its bytes into the ring of (sender,
receiver) and the receiver copies them out, straight into its tensor. One copy on
each side, no kernel in between, and the two copies overlap piece by piece.

The node's rings live in one region of anonymous shared memory (``memfd``) that
local rank 0 makes at start-up and hands to the other local ranks as a descriptor
(:mod:`fireflyer.hfreduce.transport.fdshare`), as for the arena; where memfd is missing, a
``/dev/shm`` file unlinked as soon as every local rank has mapped it. Pages are only
touched by the pairs that talk, so an unused ring costs address space, not memory.

Layout (``L`` local ranks, rings of ``ring_bytes``)::

    header | control[L][L] (head and tail, each on its own cache line) | ring[L][L]

``head`` counts the bytes the sender has written, ``tail`` those the receiver has
consumed; each is written by its owner only, as a 32-bit counter compared modulo
2**32, and waited on with a futex. On x86-64 (total store order) a counter written
after the bytes it announces is never seen before those bytes.

Large transfers skip the ring's two copies where the kernel allows it: the sender
writes only a frame naming its process and the payload's address, the receiver copies
the payload straight out of the sender's memory (``process_vm_readv``, cross-memory
attach, as OpenMPI's vader does) and answers on the pair's ``ack`` word; only then is
the sender's buffer free. Where the kernel refuses (``ptrace_scope``), the receiver
answers so and the payload follows through the ring, for this pair from then on.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.transport.arena import map_shared
from fireflyer.hfreduce.config import read_int
from fireflyer.hfreduce.transport import fdshare
from fireflyer.hfreduce.transport import futex
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.transport.procs import pid_alive
from fireflyer.fsutil import unlink_quietly
from fireflyer.errors import UserError

MAGIC = 0x48465842  # "HFXB"
_HEADER = struct.Struct("<IIQ")  # magic, local_size, ring_bytes
_LINE = 64
_PAGE = 4096
_MASK = 0xFFFFFFFF
_ACK_COUNT = 0x7FFFFFFF
_SLICE = 0.05  # seconds between failure checks while a ring waits
PIECE = 1 << 20  # bytes copied between two announcements, so sender and receiver overlap
DEFAULT_RING_BYTES = 4 << 20
RING_ENV = names.MAILBOX_BYTES


def ring_bytes_for(local_size: int) -> int:
    """The ring size: ``FIREFLYER_HFREDUCE_MAILBOX_BYTES``, else 4 MiB, smaller for many local ranks.

    Every local rank of a node must use the same value (the region's header checks it).
    """
    value = read_int(RING_ENV, None, "a whole number of bytes")
    if value is not None:
        if not _PAGE <= value <= 1 << 30 or value % _PAGE:
            raise UserError(f"{RING_ENV} must be a multiple of {_PAGE} between {_PAGE} and {1 << 30}, got {value}")
        return value
    # at most about 16 MiB of rings into each rank, whatever the node's size
    per_peer = (16 << 20) // max(1, local_size - 1)
    return max(512 << 10, min(DEFAULT_RING_BYTES, per_peer // _PAGE * _PAGE))


@dataclass(frozen=True)
class MailboxShape:
    local_size: int
    ring_bytes: int

    def pair(self, src: int, dst: int) -> int:
        return src * self.local_size + dst

    def head_index(self, pair: int) -> int:
        """Index of a ring's head counter in int32 units from the region's start."""
        return (_PAGE + pair * 3 * _LINE) // 4

    def tail_index(self, pair: int) -> int:
        return (_PAGE + pair * 3 * _LINE + _LINE) // 4

    def ack_index(self, pair: int) -> int:
        """The receiver's answers to the sender's direct reads (see :meth:`Ring.wait_ack`)."""
        return (_PAGE + pair * 3 * _LINE + 2 * _LINE) // 4

    @property
    def control_bytes(self) -> int:
        return _align(_PAGE + self.local_size**2 * 3 * _LINE, _PAGE)

    def ring_offset(self, pair: int) -> int:
        return self.control_bytes + pair * self.ring_bytes

    @property
    def total_bytes(self) -> int:
        return self.control_bytes + self.local_size**2 * self.ring_bytes


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _i32(value: int) -> int:
    value &= _MASK
    return value - (1 << 32) if value >= 1 << 31 else value


class Mailboxes:
    """The mapped region of one node's rings (see the module docstring)."""

    def __init__(self, shape: MailboxShape, fd: int) -> None:
        self.shape = shape
        self._mm, self._words, self._base = map_shared(fd, shape.total_bytes, shape.control_bytes)
        self._rings: list[Ring] = []

    @classmethod
    def open(cls, *, store, node: int, local_rank: int, local_size: int, secret: bytes, name: str,
             timeout: float, private: bool) -> "Mailboxes":
        """Make (local rank 0) or map (the others) the node's region. Collective among the node's ranks."""
        shape = MailboxShape(local_size, ring_bytes_for(local_size))
        key = f"exchange/mailboxes/{node}"
        deadline = time.monotonic() + timeout
        private = private and fdshare.SUPPORTED
        if local_rank == 0:
            if private:
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, shape.total_bytes)
                    server = fdshare.FdServer(name, fd, secret, local_size - 1)
                    box = cls(shape, os.dup(fd))
                finally:
                    os.close(fd)
                box._server = server
            else:
                box = cls(shape, _create_file(name, shape))
            struct.pack_into("<IIQ", box._mm, 0, MAGIC, local_size, shape.ring_bytes)
            store.set(key, json.dumps({"name": name, "private": private}))
        else:
            try:
                store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
            except Exception as exc:  # torch raises its own store error flavours
                raise CollectiveTimeout(f"local rank 0 of node {node} never shared its mailboxes") from exc
            info = json.loads(store.get(key))
            if info["private"]:
                fd = fdshare.fetch_fd(info["name"], secret, deadline)
            else:
                fd = os.open(os.path.join("/dev/shm", info["name"]), os.O_RDWR)
            if os.fstat(fd).st_size < shape.total_bytes:
                os.close(fd)
                raise HFReduceError("the node's mailboxes are smaller than this rank expects; do all local ranks set "
                                    f"the same {RING_ENV}?")
            box = cls(shape, fd)
            magic, size, ring = _HEADER.unpack_from(box._mm, 0)
            if (magic, size, ring) != (MAGIC, local_size, shape.ring_bytes):
                box.close()
                raise HFReduceError(f"the node's mailboxes have another shape ({size} ranks, rings of {ring} bytes) "
                                    f"than this rank expects; do all local ranks set the same {RING_ENV}?")
        if not private and store.add(f"{key}/attached", 1) == local_size:
            unlink_quietly(os.path.join("/dev/shm", info["name"] if local_rank else name))
        return box

    _server: fdshare.FdServer | None = None

    def ring(self, src: int, dst: int, peer_desc: str) -> "Ring":
        ring = Ring(self, self.shape.pair(src, dst), peer_desc)
        self._rings.append(ring)
        return ring

    def wake_all(self) -> None:
        """Wake every waiter of this process's rings (they re-check for failure and close)."""
        for ring in self._rings:
            ring.wake()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for ring in self._rings:
            ring.data = None  # type: ignore[assignment]
        self._rings = []
        self._words = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


def _create_file(name: str, shape: MailboxShape) -> int:
    path = os.path.join("/dev/shm", name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise HFReduceError(f"cannot create the node's mailboxes {path}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, shape.total_bytes)
    except OSError as exc:
        os.close(fd)
        unlink_quietly(path)
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise HFReduceError(f"/dev/shm has no room for {shape.total_bytes >> 20} MiB of mailboxes; lower "
                                f"{RING_ENV}") from None
        raise
    return fd


class Ring:
    """One direction between two local ranks. Exactly one thread writes it, and one (in the peer) reads it.

    ``check`` (called between waits) raises to abandon a transfer; a wait past ``deadline``
    raises :class:`CollectiveTimeout` naming the peer and ``what`` was going on.
    """

    def __init__(self, box: Mailboxes, pair: int, peer_desc: str) -> None:
        shape = box.shape
        self._box = box
        self._mm = box._mm
        self._words = box._words
        self._head_i, self._tail_i = shape.head_index(pair), shape.tail_index(pair)
        self._ack_i = shape.ack_index(pair)
        self._head_addr = box._base + 4 * self._head_i
        self._tail_addr = box._base + 4 * self._tail_i
        self._ack_addr = box._base + 4 * self._ack_i
        self._offset = shape.ring_offset(pair)
        self._size = shape.ring_bytes
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8, count=self._size, offset=self._offset)
        self.peer_desc = peer_desc
        # This side's own counter, unbounded (only its low 32 bits are shared).
        self._head = self._words[self._head_i] & _MASK
        self._tail = self._words[self._tail_i] & _MASK
        self._acks = (self._words[self._ack_i] & _MASK) >> 1  # direct reads asked for (sender) or answered (receiver)

    # -- for the compiled core's drive (``_core/exchange.c``), which moves the ring's bytes itself -----
    def layout(self) -> tuple[int, int, int, int, int]:
        """Addresses of the head, tail and ack words and of the ring's bytes, and the ring's size."""
        return self._head_addr, self._tail_addr, self._ack_addr, self._box._base + self._offset, self._size

    def counters(self, sending: bool) -> tuple[int, int]:
        """This side's own counter (the head when ``sending``, else the tail) and its direct reads asked for
        or answered."""
        return (self._head if sending else self._tail), self._acks

    def set_counters(self, sending: bool, count: int, acks: int) -> None:
        """Take back the counters a compiled drive moved (it published what it wrote or consumed itself)."""
        if sending:
            self._head = count
        else:
            self._tail = count
        self._acks = acks

    # -- waiting -------------------------------------------------------------------
    def _sleep(self, index: int, addr: int, seen: int, check: Callable[[], None], deadline: float, what: str) -> None:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"timed out waiting for {self.peer_desc} while {what}")
        futex.wait(addr, seen, min(_SLICE, left))

    def wake(self) -> None:
        futex.wake(self._head_addr)
        futex.wake(self._tail_addr)
        futex.wake(self._ack_addr)

    # -- direct reads (cross-memory attach) ------------------------------------------------
    def ask(self) -> None:
        """The sender wrote a frame that asks the receiver to read its payload straight from the sender's
        memory; :meth:`answered` tells when it has."""
        self._acks += 1

    def answered(self) -> bool | None:
        """None while the receiver has not answered the last :meth:`ask`; then True (it read the payload;
        the buffer is free again) or False (it could not: the payload must follow through the ring)."""
        word = self._words[self._ack_i]
        if ((word & _MASK) >> 1) != self._acks & _ACK_COUNT:
            return None
        return bool(word & 1)

    def wait_ack(self, check: Callable[[], None], deadline: float, what: str) -> bool:
        while True:
            word = self._words[self._ack_i]
            got = self.answered()
            if got is not None:
                return got
            self._sleep(self._ack_i, self._ack_addr, word, check, deadline, what)

    def answer(self, ok: bool) -> None:
        """The receiver's side of :meth:`ask`."""
        self._acks += 1
        self._words[self._ack_i] = _i32(((self._acks & _ACK_COUNT) << 1) | int(ok))
        futex.wake(self._ack_addr)

    # -- without waiting (a caller that drives several rings at once) -----------------------
    def put_some(self, raw: bytes | None, tensor: torch.Tensor | None, done: int, publish: bool = True) -> int:
        """Append what fits now of ``raw`` or ``tensor`` from byte ``done`` on (at most a piece); the bytes written.
        ``publish=False`` leaves them unannounced until the next publishing call (one wake-up for both)."""
        n = len(raw) if raw is not None else tensor.numel()
        free = self.free()
        if free <= 0 or done >= n:
            return 0
        k = self._copy_in(raw, tensor, done, n, free)
        if publish:
            self._publish_head()
        return k

    def available(self) -> int:
        """Bytes the receiver may read now."""
        return (self._words[self._head_i] - self._tail) & _MASK

    def peek(self, n: int) -> bytes | None:
        """The next ``n`` bytes without consuming them, or None until they are all there."""
        if self.available() < n:
            return None
        out = bytearray(n)
        done = 0
        while done < n:
            off = (self._tail + done) % self._size
            k = min(n - done, self._size - off)
            out[done : done + k] = self._mm[self._offset + off : self._offset + off + k]
            done += k
        return bytes(out)

    def skip(self, n: int, publish: bool = True) -> None:
        """Consume ``n`` bytes already seen with :meth:`peek` (``publish=False``: tell the sender later)."""
        self._tail += n
        if publish:
            self._words[self._tail_i] = _i32(self._tail)
            futex.wake(self._tail_addr)

    def take_some(self, tensor: torch.Tensor, done: int) -> int:
        """Copy what is there now into ``tensor`` from byte ``done`` on (at most a piece); the bytes read."""
        avail = self.available()
        n = tensor.numel()
        if not avail or done >= n:
            return 0
        k = self._copy_out(None, tensor, done, n, avail)
        self.skip(k)
        return k

    def word(self, which: str) -> tuple[int, int]:
        """(address, current value) of the ``head``, ``tail`` or ``ack`` word, for a futex wait on it."""
        i = {"head": self._head_i, "tail": self._tail_i, "ack": self._ack_i}[which]
        return self._box._base + 4 * i, self._words[i]

    # -- the sender's side -------------------------------------------------------------
    def free(self) -> int:
        """Bytes the sender may write now without waiting."""
        return self._size - ((self._head - self._words[self._tail_i]) & _MASK)

    def write(self, header: bytes, payload: torch.Tensor | None, check: Callable[[], None], deadline: float,
              what: str) -> None:
        """Append ``header`` and then ``payload`` (flat contiguous uint8, or None) to the ring."""
        self._put(memoryview(header), None, check, deadline, what)
        if payload is not None and payload.numel():
            self._put(None, payload, check, deadline, what)
        self._publish_head()

    def _put(self, raw: memoryview | None, tensor: torch.Tensor | None, check, deadline: float, what: str) -> None:
        n = len(raw) if raw is not None else tensor.numel()
        done = 0
        words, size = self._words, self._size
        while done < n:
            tail = words[self._tail_i]
            free = size - ((self._head - tail) & _MASK)
            if free <= 0:
                self._publish_head()  # what is written must be seen before this side sleeps
                self._sleep(self._tail_i, self._tail_addr, tail, check, deadline, what)
                continue
            k = self._copy_in(raw, tensor, done, n, free)
            done += k
            if k >= PIECE // 4:  # announce big pieces at once; small ones with the frame's end
                self._publish_head()

    def _publish_head(self) -> None:
        value = _i32(self._head)
        if self._words[self._head_i] != value:
            self._words[self._head_i] = value
            futex.wake(self._head_addr)

    # -- the receiver's side -----------------------------------------------------------
    def read_bytes(self, n: int, check: Callable[[], None], deadline: float, what: str) -> bytes:
        out = bytearray(n)
        self._take(memoryview(out), None, check, deadline, what)
        return bytes(out)

    def read_into(self, dst: torch.Tensor, check: Callable[[], None], deadline: float, what: str) -> None:
        """Consume ``dst.numel()`` bytes into ``dst`` (flat contiguous uint8)."""
        if dst.numel():
            self._take(None, dst, check, deadline, what)

    def _take(self, raw: memoryview | None, tensor: torch.Tensor | None, check, deadline: float, what: str) -> None:
        n = len(raw) if raw is not None else tensor.numel()
        done = 0
        words = self._words
        while done < n:
            head = words[self._head_i]
            avail = (head - self._tail) & _MASK
            if avail == 0:
                self._sleep(self._head_i, self._head_addr, head, check, deadline, what)
                continue
            k = self._copy_out(raw, tensor, done, n, avail)
            self.skip(k)
            done += k

    # -- the copies both sides' loops share ---------------------------------------------
    def _copy_in(self, raw, tensor: torch.Tensor | None, done: int, n: int, free: int) -> int:
        """Copy what fits (at most ``free`` bytes, up to the ring's end, a piece) of ``raw`` or ``tensor``
        from byte ``done`` on into the ring at the head, and move the head on (unannounced); the bytes copied."""
        off = self._head % self._size
        k = min(n - done, free, self._size - off, PIECE)
        if raw is not None:
            start = self._offset + off
            self._mm[start : start + k] = raw[done : done + k]
        else:
            self.data[off : off + k].copy_(tensor[done : done + k])
        self._head += k
        return k

    def _copy_out(self, raw, tensor: torch.Tensor | None, done: int, n: int, avail: int) -> int:
        """Copy what is there (at most ``avail`` bytes, up to the ring's end, a piece) from the tail into
        ``raw`` or ``tensor`` from byte ``done`` on, without consuming it (:meth:`skip` does); the bytes copied."""
        off = self._tail % self._size
        k = min(n - done, avail, self._size - off, PIECE)
        if raw is not None:
            start = self._offset + off
            raw[done : done + k] = self._mm[start : start + k]
        else:
            tensor[done : done + k].copy_(self.data[off : off + k])
        return k


# -- cross-memory attach: one copy from a peer's memory into ours ------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_vm_readv = None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _vm_readv = _libc.process_vm_readv
    _vm_readv.restype = ctypes.c_ssize_t
    _vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                          ctypes.c_ulong, ctypes.c_ulong]
except (OSError, AttributeError):  # pragma: no cover - not Linux, or an old libc
    _vm_readv = None

_REMOTE_PIECE = 16 << 20  # bytes per system call, so a failure is noticed between pieces
_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSYS)


def read_remote(pid: int, address: int, dst: torch.Tensor, check: Callable[[], None], peer_desc: str) -> bool:
    """Copy ``dst.numel()`` bytes from ``address`` in process ``pid`` into ``dst`` (``process_vm_readv``).

    False (nothing copied) when the kernel does not let this process read the peer's memory
    (``kernel.yama.ptrace_scope`` >= 1 between sibling processes, or seccomp); the caller then
    takes the bytes through the ring. Raises on anything else.
    """
    if _vm_readv is None:
        return False
    n, done, base = dst.numel(), 0, dst.data_ptr()
    while done < n:
        k = min(n - done, _REMOTE_PIECE)
        local, remote = _IoVec(base + done, k), _IoVec(address + done, k)
        got = _vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else 0
            if done == 0 and err in _REFUSED:
                return False
            raise remote_read_failure(pid, k, err, check, peer_desc)
        done += got
        if done < n:
            check()
    return True


def remote_read_failure(pid: int, nbytes: int, err: int, check: Callable[[], None], peer_desc: str) -> HFReduceError:
    """Why reading ``nbytes`` from ``pid`` failed with ``err`` (0: nothing read): the group's own failure where it
    has one (raised), the peer's death, or the error itself."""
    check()
    if err == errno.ESRCH or not pid_alive(pid):  # the liveness check looks only now and then
        return PeerFailure(f"{peer_desc} (pid {pid}) died while this rank was reading {nbytes} bytes from it")
    return HFReduceError(f"reading {nbytes} bytes from {peer_desc} (pid {pid}) failed: "
                         f"{os.strerror(err) if err else 'nothing read'}")
