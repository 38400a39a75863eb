"""The arena as a descriptor: anonymous shared memory handed to authenticated local ranks."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from typing import Iterator

import pytest

from fireflyer.hfreduce.transport import fdshare
from fireflyer.hfreduce.transport.arena import Arena, ArenaShape
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.testing.users import NOBODY, refused_as

pytestmark = pytest.mark.skipif(not fdshare.SUPPORTED, reason="needs memfd_create and SCM_RIGHTS (Linux)")

SHAPE = ArenaShape(local_size=2, chunk_bytes=4096, depth=2)
SECRET = b"s" * 32


def _name() -> str:
    return f"fireflyer-hfr-test-{uuid.uuid4().hex[:8]}-{os.getpid()}"


@contextlib.contextmanager
def served() -> Iterator[tuple[str, Arena, fdshare.FdServer]]:
    """A private arena served to one client under a fresh name."""
    name = _name()
    arena, share = Arena.create_private(name, SHAPE)
    server = fdshare.FdServer(name, share, SECRET, clients=1)
    os.close(share)
    try:
        yield name, arena, server
    finally:
        server.close()
        arena.close()


def test_a_private_arena_is_shared_through_the_server_and_leaves_no_file():
    with served() as (name, arena, server):
        peer = Arena.from_fd(name, SHAPE, fdshare.fetch_fd(name, SECRET, time.monotonic() + 5))
        arena.publish("in", 0, 7)
        assert peer.read_flag("in", 0) == 7  # the same memory
        peer.bytes[-1] = 42
        assert int(arena.bytes[-1]) == 42
        assert not any(f.startswith(name) for f in os.listdir("/dev/shm"))
        peer.close()


def test_a_process_without_the_secret_is_refused_and_logged(caplog):
    with served() as (name, arena, server):
        with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
            with pytest.raises(HFReduceError, match="refused to share the arena"):
                fdshare.fetch_fd(name, b"wrong secret", time.monotonic() + 0.5)
        assert server.refused >= 1
        assert any("refused a local process" in r.getMessage() for r in caplog.records)
        assert SECRET.decode() not in caplog.text
        fd = fdshare.fetch_fd(name, SECRET, time.monotonic() + 5)  # the real rank still gets it
        os.close(fd)


def test_fetch_without_a_server_times_out():
    with pytest.raises(CollectiveTimeout, match="share the arena"):
        fdshare.fetch_fd(_name(), SECRET, time.monotonic() + 0.2)


def test_a_mismatched_shape_is_refused():
    name = _name()
    arena, share = Arena.create_private(name, SHAPE)
    try:
        other = ArenaShape(local_size=2, chunk_bytes=8192, depth=2)
        with pytest.raises(Exception, match="smaller|different shape"):
            Arena.from_fd(name, other, share)
    finally:
        arena.close()


def test_idle_connections_cannot_hold_up_a_real_rank():
    """Handshakes run concurrently: three connections that never answer do not delay the rank that does."""
    import socket

    idle = []
    with served() as (name, arena, server):
        try:
            for _ in range(3):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + name)
                idle.append(s)
            # each idle handshake holds on for 5 s; one at a time, the real rank would wait 15 s
            fd = fdshare.fetch_fd(name, SECRET, time.monotonic() + 3.0)
            os.close(fd)
        finally:  # before the server closes, which waits for its handshakes
            for s in idle:
                s.close()


def test_an_impostor_server_that_cannot_prove_the_secret_is_refused():
    """A process that binds the arena's name first and hands out its own memory is not believed."""
    import socket
    import threading

    name = _name()
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind("\0" + name)
    impostor.listen(1)
    fake = os.memfd_create("fake")

    def serve() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.recv(64)  # the client's proof and nonce: the impostor cannot answer the nonce
            socket.send_fds(conn, [b"\0" * 32], [fake])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        with pytest.raises(HFReduceError, match="could not prove the job's secret"):
            fdshare.fetch_fd(name, SECRET, time.monotonic() + 3)
    finally:
        th.join(5)
        impostor.close()
        os.close(fake)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_process_of_another_user_is_refused_by_its_credentials(caplog):
    with served() as (name, arena, server):
        with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
            # another user who somehow knows the secret, and still gets nothing
            assert refused_as(NOBODY, lambda: fdshare.fetch_fd(name, SECRET, time.monotonic() + 2), HFReduceError)
        assert server.refused >= 1
        assert any("uid 65534 is not this job's user" in r.getMessage() for r in caplog.records)
        fd = fdshare.fetch_fd(name, SECRET, time.monotonic() + 5)  # the job's own rank still gets it
        os.close(fd)
