"""TCP links between the nodes' rails: authenticated connections and framed, abortable transfers.

Every connection starts with a mutual HMAC-SHA256 challenge on the job's secret, so
a process outside the job can neither join a tree nor have its bytes summed. After
that a link carries frames: a fixed header that describes the collective and the
chunk, then the payload, sent straight from and received straight into the arena
(no intermediate copies in Python). All socket calls use short time slices, so an
abort or a deadline interrupts them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

from fireflyer.hfreduce.errors import CollectiveTimeout, ConnectionLost, HFReduceError, PeerFailure, error_from_text

log = logging.getLogger("fireflyer.hfreduce")

_HELLO = struct.Struct("<4sII")  # magic, rank, tag
_HELLO_MAGIC = b"HFRc"
_NONCE = 32
_SLICE = 0.05  # seconds between abort checks in a blocking socket call
SOCKET_BUFFER = 4 << 20

# Frame header: kind, collective sequence, chunk index, payload bytes, descriptor digest.
FRAME = struct.Struct("<IIqq16s")
DATA = 0x44415441
ERROR = 0x4552524F


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Read exactly ``n`` bytes from a socket with a short timeout set, or fail at ``deadline``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if time.monotonic() > deadline:
            raise TimeoutError("handshake timed out")
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            continue
        if k == 0:
            raise ConnectionError("peer closed during handshake")
        got += k
    return bytes(buf)


class Listener:
    """Accepts authenticated connections from the job's ranks for the life of the group.

    A connection whose HMAC fails is refused and logged. Accepted connections wait in
    a mailbox keyed by (peer rank, tag) until :meth:`take` claims them.
    """

    def __init__(self, host: str, secret: bytes, rank: int, handshake_timeout: float = 10.0) -> None:
        self._secret = secret
        self._rank = rank
        self._handshake_timeout = handshake_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self._sock.settimeout(_SLICE)
        self.address = self._sock.getsockname()
        self._mailbox: dict[tuple[int, int], socket.socket] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.refused = 0
        self._thread = threading.Thread(target=self._serve, name=f"hfreduce-listen-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        deadline = time.monotonic() + self._handshake_timeout
        conn.settimeout(_SLICE)
        try:
            nonce = os.urandom(_NONCE)
            conn.sendall(nonce)
            magic, rank, tag = _HELLO.unpack(recv_exact(conn, _HELLO.size, deadline))
            their_nonce = recv_exact(conn, _NONCE, deadline)
            mac = recv_exact(conn, 32, deadline)
            want = _mac(self._secret, b"client", nonce, str(rank).encode(), str(tag).encode(), str(self._rank).encode())
            if magic != _HELLO_MAGIC or not hmac.compare_digest(mac, want):
                raise PermissionError("bad credentials")
            conn.sendall(_mac(self._secret, b"server", their_nonce, str(self._rank).encode()))
        except (OSError, ValueError, struct.error, PermissionError) as exc:
            with self._cond:
                self.refused += 1
            log.warning("hfreduce rank %d refused a connection from %s:%s: %s", self._rank, peer[0], peer[1], exc)
            conn.close()
            return
        _tune(conn)
        with self._cond:
            old = self._mailbox.pop((rank, tag), None)
            self._mailbox[(rank, tag)] = conn
            self._cond.notify_all()
        if old is not None:
            old.close()

    def take(self, rank: int, tag: int, deadline: float, check: Callable[[], None]) -> socket.socket:
        with self._cond:
            while (rank, tag) not in self._mailbox:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"rank {rank} did not connect to rank {self._rank} (tag {tag}) in time")
                check()
                self._cond.wait(_SLICE)
            return self._mailbox.pop((rank, tag))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=2)
        with self._cond:
            for conn in self._mailbox.values():
                conn.close()
            self._mailbox.clear()


def connect(host: str, port: int, *, my_rank: int, peer_rank: int, tag: int, secret: bytes, deadline: float) -> socket.socket:
    """Connect to ``peer_rank``'s listener and prove membership of the job; retries until ``deadline``."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(_SLICE * 20)
        try:
            sock.connect((host, port))
            sock.settimeout(_SLICE)
            nonce = recv_exact(sock, _NONCE, deadline)
            mine = os.urandom(_NONCE)
            mac = _mac(secret, b"client", nonce, str(my_rank).encode(), str(tag).encode(), str(peer_rank).encode())
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, my_rank, tag) + mine + mac)
            reply = recv_exact(sock, 32, deadline)
            if not hmac.compare_digest(reply, _mac(secret, b"server", mine, str(peer_rank).encode())):
                sock.close()
                raise HFReduceError(f"rank {peer_rank} at {host}:{port} failed authentication; is it part of this job?")
            _tune(sock)
            return sock
        except (OSError, TimeoutError, ConnectionError) as exc:
            last = exc
            sock.close()
            time.sleep(0.05)
    raise CollectiveTimeout(f"cannot connect to rank {peer_rank} at {host}:{port}: {last}")


class Link:
    """One authenticated TCP connection to a tree neighbour.

    Each direction has one sending thread at a time; frames never interleave. ``check``
    is called between time slices and raises to abandon a transfer.
    """

    def __init__(self, sock: socket.socket, peer_rank: int, peer_desc: str) -> None:
        self.sock = sock
        self.sock.settimeout(_SLICE)
        self.peer_rank = peer_rank
        self.peer_desc = peer_desc
        self.send_lock = threading.Lock()
        self._header = bytearray(FRAME.size)

    def lost(self, what: str) -> ConnectionLost:
        return ConnectionLost(f"lost the connection to {self.peer_desc} while {what} (the process died or aborted)")

    def send_all(self, data: memoryview, check: Callable[[], None], deadline: float, what: str) -> None:
        sent, n = 0, len(data)
        while sent < n:
            try:
                sent += self.sock.send(data[sent:])
            except socket.timeout:
                check()
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"timed out sending to {self.peer_desc} while {what}") from None
            except OSError as exc:
                raise self.lost(what) from exc

    def recv_all(self, into: memoryview, check: Callable[[], None], deadline: float, what: str) -> None:
        got, n = 0, len(into)
        while got < n:
            try:
                k = self.sock.recv_into(into[got:])
            except socket.timeout:
                check()
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"timed out waiting for {self.peer_desc} while {what}") from None
                continue
            except OSError as exc:
                raise self.lost(what) from exc
            if k == 0:
                raise self.lost(what)
            got += k

    def send_frame(self, seq: int, chunk: int, digest: bytes, payload: memoryview, check, deadline: float, what: str) -> None:
        head = FRAME.pack(DATA, seq & 0xFFFFFFFF, chunk, len(payload), digest)
        with self.send_lock:
            self.send_all(memoryview(head), check, deadline, what)
            if len(payload):
                self.send_all(payload, check, deadline, what)

    def recv_header(self, check, deadline: float, what: str) -> tuple[int, int, int, int, bytes]:
        self.recv_all(memoryview(self._header), check, deadline, what)
        kind, seq, chunk, nbytes, digest = FRAME.unpack(self._header)
        if kind == ERROR:
            raise self.error_frame(nbytes, check, what)
        if kind != DATA:
            raise PeerFailure(f"garbled frame from {self.peer_desc} while {what}")
        return kind, seq, chunk, nbytes, digest

    def error_frame(self, nbytes: int, check, what: str) -> HFReduceError:
        """The failure a neighbour sent (an ERROR frame whose header said ``nbytes`` of text follow)."""
        msg = bytearray(max(0, min(nbytes, 1 << 16)))
        try:
            self.recv_all(memoryview(msg), check, time.monotonic() + 2.0, what)
        except HFReduceError:
            pass
        return error_from_text(msg.decode(errors="replace") or f"{self.peer_desc} aborted")

    def send_error(self, message: str) -> None:
        """Best effort: tell the neighbour why this rank is aborting, if no frame is half sent."""
        if not self.send_lock.acquire(timeout=0.2):
            return
        try:
            data = message.encode()[:4096]
            self.sock.settimeout(0.5)
            self.sock.sendall(FRAME.pack(ERROR, 0, 0, len(data), b"\0" * 16) + data)
        except OSError:
            pass
        finally:
            try:
                self.sock.settimeout(_SLICE)
            except OSError:
                pass
            self.send_lock.release()

    def shutdown(self) -> None:
        """End both directions: a transfer blocked on the link (in Python or in the core) returns at once.

        The descriptor stays open until :meth:`close`, so a compiled run still holding its number
        never reads or writes a descriptor the process has since reused."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()
