"""Hand the node's arena to its local ranks as a file descriptor, never as a file.

Local rank 0 makes the arena with ``memfd_create``: anonymous shared memory that
exists only while some process holds it, so no crash at any moment can leave it
behind, and the size limit of /dev/shm (64 MiB in a default Docker container)
does not apply. Rank 0 serves the descriptor on an abstract Unix socket; the kernel's peer
credentials must show the job's own user (or root) on both ends, both sides prove
the job's secret (HMAC, as for TCP links), and the descriptor travels with
SCM_RIGHTS.
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

from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.transport.links import recv_exact

log = logging.getLogger("fireflyer.hfreduce")

_NONCE = 32
_SLICE = 0.05
_HANDSHAKE = 5.0  # seconds one local process gets to prove itself
_MAX_PENDING = 32  # handshakes in progress at once; more connections wait in the listen queue

SUPPORTED = hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _mac(secret: bytes, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"arena|" + side + b"|" + nonce, hashlib.sha256).digest()


def _address(name: str) -> str:
    return "\0" + name  # the abstract namespace: no file on disk, gone with the socket


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel saw it connect."""
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def _trusted(uid: int) -> bool:
    """Only this job's own user (or root, which could read our memory anyway) may hold the arena."""
    return uid == os.getuid() or uid == 0


class FdServer:
    """Serves ``fd`` to ``clients`` authenticated local ranks, then stops. ``close()`` stops it earlier.

    Each connection is checked by the kernel's peer credentials (same uid, or root), then
    both sides prove the job's secret (the client first, then the server, with the
    descriptor), so neither a stranger nor an impostor server gets or hands out memory.
    Handshakes run concurrently: idle connections cannot hold up a real rank.
    """

    def __init__(self, name: str, fd: int, secret: bytes, clients: int) -> None:
        self._fd = os.dup(fd)
        self._secret = secret
        self._left = clients
        self._lock = threading.Lock()
        self._pending = threading.BoundedSemaphore(_MAX_PENDING)
        self.refused = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(name))
        self._sock.listen(64)
        self._sock.settimeout(_SLICE)
        self._closed = threading.Event()
        self._handshakes: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, name="hfreduce-arena-fd", daemon=True)
        self._thread.start()

    def _done(self) -> bool:
        with self._lock:
            return self._left <= 0

    def _serve(self) -> None:
        try:
            while not self._done() and not self._closed.is_set():
                if not self._pending.acquire(timeout=_SLICE):
                    continue
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    self._pending.release()
                    continue
                th = threading.Thread(target=self._handshake, args=(conn,), name="hfreduce-arena-fd-peer", daemon=True)
                self._handshakes = [t for t in self._handshakes if t.is_alive()] + [th]
                th.start()
        except OSError:
            pass
        finally:
            for th in self._handshakes:
                th.join(timeout=_HANDSHAKE)
            self._release()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            with conn:
                if self._hand_over(conn):
                    with self._lock:
                        self._left -= 1
        finally:
            self._pending.release()

    def _hand_over(self, conn: socket.socket) -> bool:
        conn.settimeout(_SLICE)
        deadline = time.monotonic() + _HANDSHAKE
        try:
            uid = peer_uid(conn)
            if not _trusted(uid):
                raise PermissionError(f"uid {uid} is not this job's user ({os.getuid()})")
            nonce = os.urandom(_NONCE)
            conn.sendall(nonce)
            proof = recv_exact(conn, 32, deadline)
            theirs = recv_exact(conn, _NONCE, deadline)
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", nonce)):
                raise PermissionError("bad credentials")
            with self._lock:
                if self._left <= 0 or self._fd < 0:
                    raise PermissionError("every local rank already has the arena")
                socket.send_fds(conn, [_mac(self._secret, b"server", theirs)], [self._fd])
            return True
        except (OSError, TimeoutError, PermissionError) as exc:
            with self._lock:
                self.refused += 1
            log.warning("hfreduce refused a local process asking for the arena: %s", exc)
            return False

    def _release(self) -> None:
        try:
            self._sock.close()
        finally:
            with self._lock:
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=_HANDSHAKE + 2)


def fetch_fd(name: str, secret: bytes, deadline: float) -> int:
    """Receive the arena's descriptor from local rank 0, retrying until it serves or ``deadline`` passes.

    The server must run as this job's user (or root) and prove the job's secret, or its
    descriptor is refused.
    """
    last: Exception | None = None
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_SLICE)
        try:
            sock.connect(_address(name))
            uid = peer_uid(sock)
            if not _trusted(uid):
                raise HFReduceError(f"the arena socket {name!r} belongs to uid {uid}, not this job's user; refused")
            nonce = recv_exact(sock, _NONCE, deadline)
            mine = os.urandom(_NONCE)
            sock.sendall(_mac(secret, b"client", nonce) + mine)
            while True:
                try:
                    proof, fds, _, _ = socket.recv_fds(sock, 32, 1)
                    break
                except socket.timeout:
                    if time.monotonic() > deadline:
                        raise
            if not fds:
                raise HFReduceError("local rank 0 refused to share the arena; is this rank part of the job?")
            if not hmac.compare_digest(proof, _mac(secret, b"server", mine)):
                for fd in fds:
                    os.close(fd)
                raise HFReduceError(f"the process serving the arena {name!r} could not prove the job's secret; refused")
            return fds[0]
        except HFReduceError:
            raise
        except (OSError, TimeoutError, ConnectionError) as exc:
            last = exc
            time.sleep(0.01)
        finally:
            sock.close()
    raise CollectiveTimeout(f"timed out waiting for local rank 0 to share the arena ({last})")
