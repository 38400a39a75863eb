"""Authenticated TCP links on 127.0.0.1, in one process (threads play the peers)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.transport.links import DATA, FRAME, Link, Listener, connect

SECRET = b"unit-test-secret-9f3c1e7d"
HOST = "127.0.0.1"
GUARD = 5.0  # seconds; a guard against hangs only


def _no_check() -> None:
    return None


def _deadline(seconds: float = GUARD) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def listener():
    lis = Listener(HOST, SECRET, rank=0, handshake_timeout=2.0)
    try:
        yield lis
    finally:
        lis.close()


@pytest.fixture
def tcp_pair():
    """Two connected TCP sockets over loopback."""
    server = socket.create_server((HOST, 0))
    a = socket.create_connection(server.getsockname(), timeout=GUARD)
    b, _ = server.accept()
    server.close()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def links(tcp_pair):
    a, b = tcp_pair
    return Link(a, peer_rank=1, peer_desc="rank 1 (node 1, local rank 0)"), Link(b, peer_rank=0, peer_desc="rank 0")


def _wait_until(cond, timeout: float = GUARD) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _secret_leaked(records: list[logging.LogRecord]) -> bool:
    forms = {SECRET, SECRET.decode(), SECRET.hex(), repr(SECRET)}
    for rec in records:
        text = rec.getMessage() + repr(rec.args) + (str(rec.exc_info) if rec.exc_info else "")
        if any(str(f) in text for f in forms):
            return True
    return False


# -- handshake ---------------------------------------------------------------------


def test_connect_with_the_right_secret_is_handed_to_take(listener) -> None:
    port = listener.address[1]
    client = connect(HOST, port, my_rank=3, peer_rank=0, tag=7, secret=SECRET, deadline=_deadline())
    try:
        server = listener.take(3, 7, _deadline(), _no_check)
        try:
            client.sendall(b"ping")
            server.settimeout(GUARD)
            assert server.recv(4) == b"ping"
            server.sendall(b"pong")
            client.settimeout(GUARD)
            assert client.recv(4) == b"pong"
            assert server.getpeername() == client.getsockname()
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            server.close()
    finally:
        client.close()
    assert listener.refused == 0


def test_take_keys_connections_by_rank_and_tag(listener) -> None:
    port = listener.address[1]
    socks = [
        connect(HOST, port, my_rank=r, peer_rank=0, tag=t, secret=SECRET, deadline=_deadline()) for r, t in [(1, 0), (1, 1), (2, 0)]
    ]
    try:
        for i, s in enumerate(socks):
            s.sendall(bytes([i]))
        got = {}
        for key in [(2, 0), (1, 1), (1, 0)]:
            conn = listener.take(*key, _deadline(), _no_check)
            conn.settimeout(GUARD)
            got[key] = conn.recv(1)[0]
            conn.close()
        assert got == {(1, 0): 0, (1, 1): 1, (2, 0): 2}
    finally:
        for s in socks:
            s.close()


def test_take_times_out_and_runs_check(listener) -> None:
    with pytest.raises(CollectiveTimeout, match="rank 5 did not connect to rank 0"):
        listener.take(5, 0, time.monotonic() + 0.2, _no_check)

    class Abort(Exception):
        pass

    def check() -> None:
        raise Abort

    with pytest.raises(Abort):
        listener.take(5, 0, _deadline(), check)


def test_wrong_secret_is_refused_logged_and_never_leaks_the_secret(listener, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="fireflyer.hfreduce")
    port = listener.address[1]
    with pytest.raises((CollectiveTimeout, HFReduceError)):
        connect(HOST, port, my_rank=1, peer_rank=0, tag=0, secret=b"wrong-secret", deadline=time.monotonic() + 0.4)
    assert _wait_until(lambda: listener.refused >= 1)
    assert _wait_until(lambda: any(r.levelno == logging.WARNING for r in caplog.records))
    warnings = [r for r in caplog.records if r.name == "fireflyer.hfreduce" and r.levelno == logging.WARNING]
    assert warnings
    assert all("127.0.0.1:" in r.getMessage() and "refused" in r.getMessage() for r in warnings)
    assert not _secret_leaked(caplog.records)
    assert not any("wrong-secret" in r.getMessage() + repr(r.args) for r in caplog.records)
    with pytest.raises(CollectiveTimeout):
        listener.take(1, 0, time.monotonic() + 0.1, _no_check)


def test_garbage_from_a_raw_socket_is_refused(listener, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fireflyer.hfreduce")
    raw = socket.create_connection(listener.address, timeout=GUARD)
    try:
        peer = raw.getsockname()
        nonce = b""
        while len(nonce) < 32:
            part = raw.recv(32 - len(nonce))
            assert part, "listener closed before sending its nonce"
            nonce += part
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
        try:
            reply = raw.recv(64)
        except ConnectionResetError:  # closed with our bytes unread
            reply = b""
        assert reply == b""  # refused: closed without a server proof
    finally:
        raw.close()
    assert _wait_until(lambda: listener.refused == 1)
    assert _wait_until(lambda: any(f"{peer[0]}:{peer[1]}" in r.getMessage() for r in caplog.records))
    assert not _secret_leaked(caplog.records)


def test_a_client_that_hangs_up_mid_handshake_is_refused(listener) -> None:
    raw = socket.create_connection(listener.address, timeout=GUARD)
    raw.sendall(b"HFRc")
    raw.close()
    assert _wait_until(lambda: listener.refused == 1)


def test_client_refuses_a_server_that_cannot_prove_the_secret() -> None:
    server = socket.create_server((HOST, 0))
    server.settimeout(GUARD)

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"n" * 32)
            conn.settimeout(GUARD)
            got = b""
            while len(got) < 12 + 32 + 32:
                part = conn.recv(256)
                if not part:
                    return
                got += part
            conn.sendall(b"\0" * 32)  # not the HMAC of the client's nonce
            conn.recv(1)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(HFReduceError, match="failed authentication"):
            connect(HOST, server.getsockname()[1], my_rank=1, peer_rank=0, tag=0, secret=SECRET, deadline=_deadline())
    finally:
        t.join(GUARD)
        server.close()


def test_connect_to_nobody_times_out() -> None:
    probe = socket.create_server((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens on this port now
    with pytest.raises(CollectiveTimeout, match=f"cannot connect to rank 4 at 127.0.0.1:{port}"):
        connect(HOST, port, my_rank=0, peer_rank=4, tag=0, secret=SECRET, deadline=time.monotonic() + 0.3)


# -- frames ------------------------------------------------------------------------


def test_frames_round_trip_including_empty_payloads(links) -> None:
    a, b = links
    digest = bytes(range(16))
    a.send_frame(5, 3, digest, memoryview(b"hello"), _no_check, _deadline(), "sending")
    a.send_frame(6, 4, digest, memoryview(b""), _no_check, _deadline(), "sending")
    a.send_frame(2**32 + 9, -1, b"\xff" * 16, memoryview(b"!"), _no_check, _deadline(), "sending")

    assert b.recv_header(_no_check, _deadline(), "receiving") == (DATA, 5, 3, 5, digest)
    buf = bytearray(5)
    b.recv_all(memoryview(buf), _no_check, _deadline(), "receiving")
    assert buf == b"hello"
    assert b.recv_header(_no_check, _deadline(), "receiving") == (DATA, 6, 4, 0, digest)
    kind, seq, chunk, nbytes, dig = b.recv_header(_no_check, _deadline(), "receiving")
    assert (kind, seq, chunk, nbytes, dig) == (DATA, 9, -1, 1, b"\xff" * 16)  # seq travels modulo 2**32
    one = bytearray(1)
    b.recv_all(memoryview(one), _no_check, _deadline(), "receiving")
    assert one == b"!"


def test_a_large_payload_streams_through(links) -> None:
    a, b = links
    payload = bytes(range(256)) * (16 << 10)  # 4 MiB, more than the socket buffers hold
    errors: list[BaseException] = []

    def send() -> None:
        try:
            a.send_frame(1, 0, b"d" * 16, memoryview(payload), _no_check, _deadline(), "sending")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    head = b.recv_header(_no_check, _deadline(), "receiving")
    into = bytearray(head[3])
    b.recv_all(memoryview(into), _no_check, _deadline(), "receiving")
    t.join(GUARD)
    assert errors == []
    assert head[3] == len(payload) and into == payload


def test_error_frame_raises_peer_failure_with_the_message(links) -> None:
    a, b = links
    a.send_error("rank 1 (node 1, local rank 0) failed: CUDA error: out of memory")
    with pytest.raises(PeerFailure, match="CUDA error: out of memory"):
        b.recv_header(_no_check, _deadline(), "receiving")


def test_empty_error_frame_names_the_peer(links) -> None:
    a, b = links
    b.send_error("")
    with pytest.raises(PeerFailure, match=r"rank 1 \(node 1, local rank 0\) aborted"):
        a.recv_header(_no_check, _deadline(), "receiving")


def test_garbled_frame_raises_peer_failure(links) -> None:
    a, b = links
    a.sock.sendall(FRAME.pack(0x12345678, 0, 0, 0, b"\0" * 16))
    with pytest.raises(PeerFailure, match="garbled frame from rank 0 while reducing"):
        b.recv_header(_no_check, _deadline(), "reducing")


def test_recv_all_raises_peer_failure_when_the_peer_closes(links) -> None:
    a, b = links
    a.sock.sendall(b"abc")
    a.close()
    buf = bytearray(10)
    with pytest.raises(PeerFailure, match="lost the connection to rank 0 while receiving chunk 3"):
        b.recv_all(memoryview(buf), _no_check, _deadline(), "receiving chunk 3")
    assert buf[:3] == b"abc"


def test_recv_all_times_out_at_the_deadline(links) -> None:
    _, b = links
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="timed out waiting for rank 0 while receiving"):
        b.recv_all(memoryview(bytearray(8)), _no_check, time.monotonic() + 0.3, "receiving")
    assert time.monotonic() - start < GUARD


def test_send_all_times_out_when_the_peer_stops_reading(links) -> None:
    a, _ = links
    big = memoryview(bytearray(64 << 20))  # far more than the loopback socket buffers hold
    with pytest.raises(CollectiveTimeout, match="timed out sending to rank 1"):
        a.send_all(big, _no_check, time.monotonic() + 0.3, "sending")


def test_a_raising_check_aborts_a_blocked_recv(links) -> None:
    _, b = links
    stop = threading.Event()

    class Aborted(Exception):
        pass

    def check() -> None:
        if stop.is_set():
            raise Aborted("the group aborted")

    timer = threading.Timer(0.1, stop.set)
    timer.start()
    try:
        with pytest.raises(Aborted):
            b.recv_all(memoryview(bytearray(8)), check, time.monotonic() + 60, "receiving")
    finally:
        timer.cancel()
    assert stop.is_set()
