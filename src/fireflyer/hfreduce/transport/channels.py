"""Channels: how transfers travel between two ranks, one channel per direction.

- Within a node, a ring of the node's mailboxes (:mod:`~fireflyer.hfreduce.transport.mailbox`). A
  big payload goes as its address, and the receiver reads it straight from the sender's
  memory (one copy), where the kernel allows it.
- Across nodes, an authenticated TCP connection
  (:class:`~fireflyer.hfreduce.transport.links.Link`), opened by the sender on its first transfer
  to the receiver's listener.

Every frame is a :data:`~fireflyer.hfreduce.transport.links.FRAME` header (kind, key space, key,
bytes, digest) and its payload. Each channel can be driven three ways: a part that never
waits, on the caller's thread (``send_now``: an ``isend`` whose bytes fit returns done);
fully, waiting as needed, on the channel's own thread (``send``, ``header``/``payload``;
:mod:`~fireflyer.hfreduce.transport.endpoints`); and in non-blocking steps (``step``) by a caller
that drives several channels at once (:mod:`~fireflyer.hfreduce.transport.progress`), in Python or in the
compiled core, to which each channel describes itself (``core_kind``, ``core_fields``, ``core_back``).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Protocol

import torch

from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.transport.mailbox import Ring, read_remote
from fireflyer.hfreduce.transport.transfers import Transfer
from fireflyer.hfreduce.transport.links import DATA, FRAME, Link, Listener, connect


class Owner(Protocol):
    """What the channels, the endpoints (:mod:`~fireflyer.hfreduce.transport.endpoints`) and the progress loop
    (:mod:`~fireflyer.hfreduce.transport.progress`) ask of the :class:`~fireflyer.hfreduce.transport.exchange.Exchange`
    that owns them; named here, so that none of them imports the exchange that imports them."""

    rank: int
    secret: bytes
    addresses: dict[int, tuple[str, int]]
    """Every remote peer's listening address."""
    listener: Listener | None

    def describe(self, rank: int) -> str:
        """``rank`` in words, for messages."""

    def check(self) -> None:
        """Raise if the group has failed or the exchange is closed."""

    def stopped(self) -> bool:
        """Whether the group has failed or the exchange is closed."""

    def expect(self, tr: Transfer, dig: bytes, nbytes: int) -> None:
        """Raise CollectiveMismatch unless an arriving frame (digest, size) is the one ``tr`` expects."""

    def failed(self, exc: BaseException) -> HFReduceError:
        """A transfer failed with ``exc``: fail the group; return the error to raise."""

DIRECT = 0x44495243  # a ring frame whose payload the receiver reads from the sender's memory
_ADDRESS = struct.Struct("<Q")
INLINE_BYTES = 1 << 20  # the most a caller copies into a ring itself in send_now (more: the sending thread)
TAG = 0x5858  # the listener tag of exchange connections
_HEAD, _BODY, _ACK, DONE = 0, 1, 2, 3  # Transfer.stage (the compiled core's too: _core/exchange.h)
RING_OUT, RING_IN, TCP_OUT, TCP_IN = 1, 2, 3, 4  # core_kind: the compiled core's hfx_item kinds
_NO_RING = (0, 0, 0, 0, 0, 0, 0)


class Foreign(Exception):
    """A driving caller found a frame for another call ahead of its own on a channel."""


def _nonblocking(link: Link, on: bool, saved: list) -> None:
    """Switch a link's socket to non-blocking (``on``) and back to the timeout it had (kept in ``saved``)."""
    try:
        if on:
            saved[:] = [link.sock.gettimeout()]
            link.sock.setblocking(False)
        elif saved:
            link.sock.settimeout(saved.pop())
    except OSError:  # closed under us: the failure that closed it is reported on its own
        pass


def _writable(sock: socket.socket) -> bool:
    return bool(select.select([], [sock], [], 0)[1])


# -- rings -------------------------------------------------------------------------------------


def _put_all(ring: Ring, raw: bytes, publish: bool = True) -> None:
    """Append ``raw``, for which the ring has room (it may wrap around the ring's end)."""
    done = 0
    while done < len(raw):
        done += ring.put_some(raw, None, done, publish)


class RingOut:
    """Sending through a ring of the node's mailboxes."""

    inline = True

    def __init__(self, ring: Ring, direct_bytes: int) -> None:
        self.ring = ring
        self._direct = direct_bytes  # 0: never; set to 0 when the receiver could not read this process

    def _head(self, tr: Transfer) -> bytes:
        n = tr.data.numel()
        if self._direct and n >= self._direct:
            return FRAME.pack(DIRECT, tr.key[0], tr.key[1], n, tr.digest) + _ADDRESS.pack(tr.data.data_ptr())
        return FRAME.pack(DATA, tr.key[0], tr.key[1], n, tr.digest)

    def send_now(self, tr: Transfer) -> bool:
        """What needs no wait, on the caller's thread: True when the transfer is done. A direct frame
        goes out at once; its answer is left to the sending thread (``tr.stage``)."""
        head = self._head(tr)
        direct = len(head) > FRAME.size
        n = 0 if direct else tr.data.numel()
        if n > INLINE_BYTES or self.ring.free() < len(head) + n:
            return False
        _put_all(self.ring, head)
        if direct:
            self.ring.ask()
            tr.stage = _ACK
            return False
        while tr.pos < n:  # it fits: this never waits
            tr.pos += self.ring.put_some(None, tr.data, tr.pos)
        tr.stage = DONE
        return True

    def send(self, tr: Transfer, check, what: str) -> None:
        """All of it, waiting as needed (the sending thread), from wherever ``send_now`` left it."""
        deadline = tr.op.deadline
        if tr.stage == _HEAD:
            head = self._head(tr)
            if len(head) == FRAME.size:
                self.ring.write(head, tr.data, check, deadline, what)
                return
            self.ring.write(head, None, check, deadline, what)
            self.ring.ask()
        if self.ring.wait_ack(check, deadline, what):
            return
        self._direct = 0
        self.ring.write(b"", tr.data, check, deadline, what)

    def step(self, tr: Transfer) -> bool:
        """As much as goes without waiting (a driving caller); True when something moved."""
        ring = self.ring
        if tr.stage == _HEAD:
            head = self._head(tr)
            free = ring.free()
            if free < len(head):
                return False
            n = tr.data.numel()
            small = len(head) == FRAME.size and 0 < n <= free - len(head)
            _put_all(ring, head, publish=not small)  # a small frame: its payload's copy announces both at once
            if len(head) > FRAME.size:
                ring.ask()
                tr.stage = _ACK
            elif small:
                while tr.pos < n:
                    tr.pos += ring.put_some(None, tr.data, tr.pos)
                tr.stage = DONE
            else:
                tr.stage = _BODY if tr.data.numel() else DONE
            return True
        if tr.stage == _ACK:
            got = ring.answered()
            if got is None:
                return False
            if got:
                tr.stage = DONE
            else:
                self._direct, tr.stage = 0, _BODY if tr.data.numel() else DONE
            return True
        k = ring.put_some(None, tr.data, tr.pos)
        tr.pos += k
        if tr.pos >= tr.data.numel():
            tr.stage = DONE
        return k > 0

    def sleep_on(self, tr: Transfer) -> tuple[int, int]:
        return self.ring.word("ack" if tr.stage == _ACK else "tail")

    core_kind = RING_OUT

    def core_fields(self) -> tuple[int, ...]:
        """For the compiled core: the ring's words and bytes, this side's counters, the direct-read threshold,
        no socket."""
        return (*self.ring.layout(), *self.ring.counters(True), self._direct, -1)

    def core_back(self, count: int, acks: int, direct: int) -> None:
        """Take back what a compiled drive moved: the counters, and a direct threshold it dropped to 0."""
        self.ring.set_counters(True, count, acks)
        self._direct = direct

    def driving(self, on: bool) -> None:
        pass

    def abort(self, text: str) -> None:
        self.ring.wake()  # local peers learn the cause from the node's arena


class RingIn:
    """Receiving from a ring of the node's mailboxes."""

    inline = True

    def __init__(self, ring: Ring, peer_pid: int) -> None:
        self.ring = ring
        self._pid = peer_pid
        self._address: int | None = None  # of the frame just read, when it asks for a direct read

    def _parse(self, raw: bytes, what: str | Transfer) -> tuple[int, int, int, int, bytes]:
        kind, space, key, nbytes, dig = FRAME.unpack(raw)
        if kind not in (DATA, DIRECT):
            raise self.garbled(what if isinstance(what, str) else what.what)
        return kind, space, key, nbytes, dig

    def garbled(self, what: str) -> HFReduceError:
        """The error of a frame of no known kind."""
        return HFReduceError(f"garbled frame from {self.ring.peer_desc} in the node's mailboxes while {what}")

    def header(self, check, deadline: float, what: str) -> tuple[int, int, int, bytes]:
        kind, space, key, nbytes, dig = self._parse(self.ring.read_bytes(FRAME.size, check, deadline, what), what)
        if kind == DIRECT:
            (self._address,) = _ADDRESS.unpack(self.ring.read_bytes(_ADDRESS.size, check, deadline, what))
        return space, key, nbytes, dig

    def payload(self, dst: torch.Tensor, check, deadline: float, what: str) -> None:
        address, self._address = self._address, None
        if address is not None and self._read_direct(address, dst, check):
            return
        self.ring.read_into(dst, check, deadline, what)

    def _read_direct(self, address: int, dst: torch.Tensor, check) -> bool:
        ok = read_remote(self._pid, address, dst, check, self.ring.peer_desc)
        self.ring.answer(ok)
        return ok

    def step(self, tr: Transfer, ex: Owner) -> bool:
        ring = self.ring
        if tr.stage == _HEAD:
            raw = ring.peek(FRAME.size)
            if raw is None:
                return False
            kind, space, key, nbytes, dig = self._parse(raw, tr)
            if (space, key) != tr.key:
                raise Foreign
            size = FRAME.size + (_ADDRESS.size if kind == DIRECT else 0)
            raw = ring.peek(size)
            if raw is None:
                return False
            ex.expect(tr, dig, nbytes)
            if kind == DIRECT:
                ring.skip(size)
                ok = self._read_direct(_ADDRESS.unpack(raw[FRAME.size:])[0], tr.data, ex.check)
                tr.stage = DONE if ok or not nbytes else _BODY
                return True
            # the payload's first piece announces the header's bytes free too (one wake-up for both)
            ring.skip(size, publish=not nbytes or ring.available() < size + min(nbytes, 1))
            tr.stage = _BODY if nbytes else DONE
            return True
        k = ring.take_some(tr.data, tr.pos)
        tr.pos += k
        if tr.pos >= tr.data.numel():
            tr.stage = DONE
        return k > 0

    def sleep_on(self, tr: Transfer) -> tuple[int, int]:
        return self.ring.word("head")

    core_kind = RING_IN

    def core_fields(self) -> tuple[int, ...]:
        """For the compiled core: the ring's words and bytes, this side's counters, the sender's pid, no socket."""
        return (*self.ring.layout(), *self.ring.counters(False), self._pid, -1)

    def core_back(self, count: int, acks: int, direct: int) -> None:
        self.ring.set_counters(False, count, acks)

    def driving(self, on: bool) -> None:
        pass

    def abort(self) -> None:
        self.ring.wake()


# -- TCP ---------------------------------------------------------------------------------------


class TcpOut:
    """The sending side of a connection to a peer on another node, opened on the first transfer."""

    def __init__(self, ex: Owner, peer: int) -> None:
        self._ex, self._peer = ex, peer
        self.link: Link | None = None
        self._saved: list = []

    @property
    def inline(self) -> bool:
        return self.link is not None

    @staticmethod
    def _frame(tr: Transfer) -> tuple[bytes, memoryview]:
        payload = memoryview(tr.data.numpy()) if tr.data.numel() else memoryview(b"")
        return FRAME.pack(DATA, tr.key[0], tr.key[1], len(payload), tr.digest), payload

    def _push(self, tr: Transfer) -> bool:
        """``sendmsg`` what is left while the socket takes it; True when something went."""
        link = self.link
        head, payload = self._frame(tr)
        h, total, moved = len(head), len(head) + len(payload), False
        while tr.pos < total:
            pos = tr.pos
            parts = [memoryview(head)[pos:], payload] if pos < h else [payload[pos - h:]]
            try:
                tr.pos += link.sock.sendmsg([p for p in parts if len(p)])
            except (BlockingIOError, socket.timeout):
                break
            except OSError as exc:
                raise link.lost(tr.what) from exc
            moved = True
        if tr.pos >= total:
            tr.stage = DONE
        return moved

    def send_now(self, tr: Transfer) -> bool:
        # the socket is in timeout mode here: send only what it takes at once, then leave the rest to the thread
        if self.link is None or not _writable(self.link.sock):
            return False
        head, payload = self._frame(tr)
        parts = [head, payload] if len(payload) else [head]
        with self.link.send_lock:
            try:
                tr.pos = self.link.sock.sendmsg(parts)
            except (BlockingIOError, socket.timeout):
                return False
            except OSError as exc:
                raise self.link.lost(tr.what) from exc
        if tr.pos >= len(head) + len(payload):
            tr.stage = DONE
        return tr.stage == DONE

    def driving(self, on: bool) -> None:
        """A driving caller's steps must never wait: the socket is non-blocking meanwhile."""
        _nonblocking(self.link, on, self._saved)

    def send(self, tr: Transfer, check, what: str) -> None:
        if self.link is None:
            self.link = Link(self._connect(tr, check), self._peer, self._ex.describe(self._peer))
            if self._ex.stopped():  # closed or failed while connecting
                self.link.close()
                check()
        head, payload = self._frame(tr)
        pos = tr.pos
        with self.link.send_lock:
            if pos < len(head):
                self.link.send_all(memoryview(head)[pos:], check, tr.op.deadline, what)
                pos = len(head)
            if pos - len(head) < len(payload):
                self.link.send_all(payload[pos - len(head):], check, tr.op.deadline, what)

    def _connect(self, tr: Transfer, check) -> socket.socket:
        """Connect in attempts of a second, checking the group in between, until the call's deadline."""
        host, port = self._ex.addresses[self._peer]
        while True:
            check()
            try:
                return connect(host, port, my_rank=self._ex.rank, peer_rank=self._peer, tag=TAG,
                               secret=self._ex.secret, deadline=min(tr.op.deadline, time.monotonic() + 1.0))
            except CollectiveTimeout:
                if time.monotonic() >= tr.op.deadline:
                    raise CollectiveTimeout(f"cannot connect to {self._ex.describe(self._peer)} at {host}:{port} "
                                            f"while {tr.what}") from None

    def step(self, tr: Transfer) -> bool:
        return self._push(tr)

    def sleep_on(self, tr: Transfer) -> socket.socket:
        return self.link.sock

    core_kind = TCP_OUT

    def core_fields(self) -> tuple[int, ...]:
        """For the compiled core: no ring, the link's socket (non-blocking while driven)."""
        return (*_NO_RING, 0, self.link.sock.fileno())

    def core_back(self, count: int, acks: int, direct: int) -> None:
        pass

    def abort(self, text: str) -> None:
        # shut down, not closed: a compiled drive may still hold the descriptor's number (the exchange closes it)
        if self.link is not None:
            self.link.send_error(text)
            self.link.shutdown()


class TcpIn:
    """The receiving side of a connection a peer on another node opened to this rank's listener."""

    def __init__(self, ex: Owner, peer: int) -> None:
        self._ex, self._peer = ex, peer
        self.link: Link | None = None
        self._header = bytearray(FRAME.size)
        self._saved: list = []

    @property
    def inline(self) -> bool:
        return self.link is not None

    def header(self, check, deadline: float, what: str) -> tuple[int, int, int, bytes]:
        if self.link is None:
            try:
                sock = self._ex.listener.take(self._peer, TAG, deadline, check)
            except CollectiveTimeout:
                raise CollectiveTimeout(f"timed out waiting for {self._ex.describe(self._peer)} to connect while "
                                        f"{what}") from None
            self.link = Link(sock, self._peer, self._ex.describe(self._peer))
        _, space, key, nbytes, dig = self.link.recv_header(check, deadline, what)
        return space, key, nbytes, dig

    def payload(self, dst: torch.Tensor, check, deadline: float, what: str) -> None:
        if dst.numel():
            self.link.recv_all(memoryview(dst.numpy()), check, deadline, what)

    def driving(self, on: bool) -> None:
        _nonblocking(self.link, on, self._saved)

    def step(self, tr: Transfer, ex: Owner) -> bool:
        link = self.link
        if tr.stage == _HEAD:
            try:
                raw = link.sock.recv(FRAME.size, socket.MSG_PEEK)
            except (BlockingIOError, socket.timeout):
                return False
            except OSError as exc:
                raise link.lost(tr.what) from exc
            if not raw:
                raise link.lost(tr.what)
            if len(raw) < FRAME.size:
                return False
            kind, space, key, nbytes, dig = FRAME.unpack(raw)
            if kind != DATA:
                link.recv_header(ex.check, tr.op.deadline, tr.what)  # raises the peer's error, or "garbled"
            if (space, key) != tr.key:
                raise Foreign
            ex.expect(tr, dig, nbytes)
            link.sock.recv_into(self._header, FRAME.size)  # all there (peeked): consumed without waiting
            tr.stage = _BODY if nbytes else DONE
            return True
        view, n, moved = memoryview(tr.data.numpy()), tr.data.numel(), False
        while tr.pos < n:  # drain what has arrived
            try:
                k = link.sock.recv_into(view[tr.pos:])
            except (BlockingIOError, socket.timeout):
                break
            except OSError as exc:
                raise link.lost(tr.what) from exc
            if not k:
                raise link.lost(tr.what)
            tr.pos += k
            moved = True
        if tr.pos >= n:
            tr.stage = DONE
        return moved

    def sleep_on(self, tr: Transfer) -> socket.socket:
        return self.link.sock

    core_kind = TCP_IN
    core_fields = TcpOut.core_fields
    core_back = TcpOut.core_back

    def abort(self) -> None:
        if self.link is not None:
            self.link.shutdown()
