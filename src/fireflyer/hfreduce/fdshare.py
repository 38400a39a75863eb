"""Hand the node's arena to its local ranks as a file descriptor, never as a file.

Local rank 0 makes the arena with ``memfd_create``: anonymous shared memory that
exists only while some process holds it, so no crash at any moment can leave it
behind, and the size limit of /dev/shm (64 MiB in a default Docker container)
does not apply. Rank 0 serves the descriptor on an abstract Unix socket; a local
rank proves it belongs to the job (HMAC on the job's secret, as for TCP links)
and receives the descriptor with SCM_RIGHTS.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time

from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.transport import recv_exact

log = logging.getLogger("fireflyer.hfreduce")

_NONCE = 32
_SLICE = 0.05

SUPPORTED = hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"arena|" + nonce, hashlib.sha256).digest()


def _address(name: str) -> str:
    return "\0" + name  # the abstract namespace: no file on disk, gone with the socket


class FdServer:
    """Serves ``fd`` to ``clients`` authenticated local ranks, then stops. ``close()`` stops it earlier."""

    def __init__(self, name: str, fd: int, secret: bytes, clients: int) -> None:
        self._fd = os.dup(fd)
        self._secret = secret
        self._left = clients
        self.refused = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(name))
        self._sock.listen(64)
        self._sock.settimeout(_SLICE)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hfreduce-arena-fd", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self._left > 0 and not self._closed.is_set():
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                with conn:
                    if self._hand_over(conn):
                        self._left -= 1
        except OSError:
            pass
        finally:
            self._release()

    def _hand_over(self, conn: socket.socket) -> bool:
        conn.settimeout(_SLICE)
        deadline = time.monotonic() + 5.0
        try:
            nonce = os.urandom(_NONCE)
            conn.sendall(nonce)
            if not hmac.compare_digest(recv_exact(conn, 32, deadline), _mac(self._secret, nonce)):
                raise PermissionError("bad credentials")
            socket.send_fds(conn, [b"K"], [self._fd])
            return True
        except (OSError, TimeoutError, PermissionError) as exc:
            self.refused += 1
            log.warning("hfreduce refused a local process asking for the arena: %s", exc)
            return False

    def _release(self) -> None:
        try:
            self._sock.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)


def fetch_fd(name: str, secret: bytes, deadline: float) -> int:
    """Receive the arena's descriptor from local rank 0, retrying until it serves or ``deadline`` passes."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_SLICE)
        try:
            sock.connect(_address(name))
            nonce = recv_exact(sock, _NONCE, deadline)
            sock.sendall(_mac(secret, nonce))
            while True:
                try:
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                    break
                except socket.timeout:
                    if time.monotonic() > deadline:
                        raise
            if not fds:
                raise HFReduceError("local rank 0 refused to share the arena; is this rank part of the job?")
            return fds[0]
        except (OSError, TimeoutError, ConnectionError) as exc:
            last = exc
            time.sleep(0.01)
        finally:
            sock.close()
    raise CollectiveTimeout(f"timed out waiting for local rank 0 to share the arena ({last})")
