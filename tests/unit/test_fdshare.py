"""The arena as a descriptor: anonymous shared memory handed to authenticated local ranks."""

from __future__ import annotations

import logging
import os
import time
import uuid

import pytest

from fireflyer.hfreduce import fdshare
from fireflyer.hfreduce.arena import Arena, ArenaShape
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError

pytestmark = pytest.mark.skipif(not fdshare.SUPPORTED, reason="needs memfd_create and SCM_RIGHTS (Linux)")

SHAPE = ArenaShape(local_size=2, chunk_bytes=4096, depth=2)
SECRET = b"s" * 32


def _name() -> str:
    return f"fireflyer-hfr-test-{uuid.uuid4().hex[:8]}-{os.getpid()}"


def test_a_private_arena_is_shared_through_the_server_and_leaves_no_file():
    name = _name()
    arena, share = Arena.create_private(name, SHAPE)
    server = fdshare.FdServer(name, share, SECRET, clients=1)
    os.close(share)
    try:
        peer = Arena.from_fd(name, SHAPE, fdshare.fetch_fd(name, SECRET, time.monotonic() + 5))
        arena.publish("in", 0, 7)
        assert peer.read_flag("in", 0) == 7  # the same memory
        peer.bytes[-1] = 42
        assert int(arena.bytes[-1]) == 42
        assert not any(f.startswith(name) for f in os.listdir("/dev/shm"))
        peer.close()
    finally:
        server.close()
        arena.close()


def test_a_process_without_the_secret_is_refused_and_logged(caplog):
    name = _name()
    arena, share = Arena.create_private(name, SHAPE)
    server = fdshare.FdServer(name, share, SECRET, clients=1)
    os.close(share)
    try:
        with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
            with pytest.raises(HFReduceError, match="refused to share the arena"):
                fdshare.fetch_fd(name, b"wrong secret", time.monotonic() + 0.5)
        assert server.refused >= 1
        assert any("refused a local process" in r.getMessage() for r in caplog.records)
        assert SECRET.decode() not in caplog.text
        fd = fdshare.fetch_fd(name, SECRET, time.monotonic() + 5)  # the real rank still gets it
        os.close(fd)
    finally:
        server.close()
        arena.close()


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
