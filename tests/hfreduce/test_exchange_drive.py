"""A synchronous exchange's drive, in the compiled core and in Python, over real rings and sockets.

One process plays both ranks: two views of one mailbox region, or the two ends of a
socket pair, each side driving its claimed channel on its own thread, one side in the
compiled core and the other in Python, or both in one of them. What is sent must arrive
bit for bit (sizes 0 to beyond the ring, direct reads of the sender's memory, wrapping),
and what goes wrong must raise what the Python loop raises: a frame that is not the
expected one (CollectiveMismatch), a lost link, a peer's error frame, a garbled ring
frame, a peer that never sends (CollectiveTimeout), and a frame of another call ahead of
this one, which the channel's thread sorts out.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from fireflyer.hfreduce.compiled import CORE
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout, ConnectionLost, HFReduceError
from fireflyer.hfreduce.transport.channels import RingIn, RingOut, TcpIn, TcpOut
from fireflyer.hfreduce.transport.endpoints import Inbox, Outbox
from fireflyer.hfreduce.transport.links import Link
from fireflyer.hfreduce.transport.mailbox import Mailboxes, MailboxShape
from fireflyer.hfreduce.transport.progress import drive, steps_in_python
from fireflyer.hfreduce.transport.transfers import COLLECTIVE, Kind, Op, Transfer, digest

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
needs_core = pytest.mark.skipif(CORE is None, reason="the compiled core is not built here")

RING = 8192
DIRECT = 4096  # payloads from here up go as direct reads (root may read its own process)
SIZES = [0, 1, 39, 40, 4095, 4096, RING - 40, RING, 3 * RING + 7, 100_003]
WAYS = [(True, True), (True, False), (False, True), (False, False)]
WAY_IDS = ["core-core", "core-python", "python-core", "python-python"]


class Owner:
    """What the channels and the drive ask of an exchange, for one side."""

    secret = b"s" * 32
    addresses: dict = {}
    listener = None

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.errors: list[BaseException] = []

    def describe(self, rank: int) -> str:
        return f"rank {rank}"

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]

    def stopped(self) -> bool:
        return bool(self.errors)

    def expect(self, tr: Transfer, dig: bytes, nbytes: int) -> None:
        if dig != tr.digest or nbytes != tr.data.numel():
            raise CollectiveMismatch(f"mismatch: {nbytes} bytes")

    def failed(self, exc: BaseException) -> BaseException:
        self.errors.append(exc)
        return exc


def _op(timeout: float = 20.0) -> Op:
    return Op(0, "test", time.monotonic() + timeout, timeout, [], [], lambda op: None)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _call(ex: Owner, sends: list, recvs: list, compiled: bool, key: int, timeout: float = 20.0,
          dig=None) -> Op:
    """One synchronous call of ``ex``'s: ``sends`` and ``recvs`` are (box, tensor) pairs, all claimed and driven."""
    op = _op(timeout)
    claimed_out, claimed_in = [], []
    for box, data in sends:
        tr = Transfer(op, box.peer, True, (COLLECTIVE, key), data, dig or digest(Kind.ALL_TO_ALL, torch.uint8,
                                                                                   data.numel()), f"rank {ex.rank}")
        op.add(tr)
        assert box.claim(steps_in_python(compiled))
        claimed_out.append((box, tr))
    for box, data in recvs:
        tr = Transfer(op, box.peer, False, (COLLECTIVE, key), data, digest(Kind.ALL_TO_ALL, torch.uint8,
                                                                           data.numel()), f"rank {ex.rank}")
        op.add(tr)
        if box.claim(tr.key, steps_in_python(compiled)):
            claimed_in.append((box, tr))
        else:
            box.post(tr)
    drive(ex, op, claimed_out, claimed_in, compiled=compiled)
    op.done(None)
    return op


def _rings(direct: int = DIRECT):
    shape = MailboxShape(2, RING)
    fd = os.memfd_create("test-drive", os.MFD_CLOEXEC)
    os.ftruncate(fd, shape.total_bytes)
    a, b = Mailboxes(shape, os.dup(fd)), Mailboxes(shape, fd)
    exa, exb = Owner(0), Owner(1)
    out = Outbox(exa, 1, RingOut(a.ring(0, 1, "rank 1"), direct))
    into = Inbox(exb, 0, RingIn(b.ring(0, 1, "rank 0"), os.getpid()))
    return (exa, out), (exb, into), (a, b)


def _sockets():
    s1, s2 = socket.socketpair()
    exa, exb = Owner(0), Owner(1)
    tout, tin = TcpOut(exa, 1), TcpIn(exb, 0)
    tout.link, tin.link = Link(s1, 1, "rank 1"), Link(s2, 0, "rank 0")
    return (exa, Outbox(exa, 1, tout)), (exb, Inbox(exb, 0, tin)), (s1, s2)


def _both(send_side, recv_side, payloads: list[torch.Tensor], ways: tuple[bool, bool], **kw) -> list[torch.Tensor]:
    """The sender's calls on a thread, the receiver's here, one call per payload; what arrived."""
    (exa, out), (exb, into) = send_side, recv_side
    got = [torch.full_like(p, 7) for p in payloads]

    def send() -> None:
        for i, p in enumerate(payloads):
            _call(exa, [(out, p)], [], ways[0], i, **kw)

    th = threading.Thread(target=send)
    th.start()
    for i, g in enumerate(got):
        op = _call(exb, [], [(into, g)], ways[1], i, **kw)
        op.future.wait()
    th.join(30)
    assert not th.is_alive()
    assert not exa.errors and not exb.errors, (exa.errors, exb.errors)
    return got


@needs_core
@pytest.mark.parametrize("ways", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("channel", ["ring", "ring-nodirect", "tcp"])
def test_every_size_arrives_bit_for_bit_whichever_side_drives_in_the_core(channel, ways):
    payloads = [_bytes(n, i) for i, n in enumerate(SIZES)]
    if channel == "tcp":
        send_side, recv_side, keep = _sockets()
    else:
        send_side, recv_side, keep = _rings(DIRECT if channel == "ring" else 0)
    got = _both(send_side, recv_side, payloads, ways)
    for p, g in zip(payloads, got):
        assert torch.equal(p, g), f"{p.numel()} bytes"
    del keep


@needs_core
def test_one_compiled_drive_moves_both_ends_of_a_ring_beyond_its_size():
    """A call that sends and receives through the same ring (a rank's all-to-all to itself, in effect) in one
    compiled run: the sender fills the ring, the receiver drains it, pass after pass."""
    (exa, out), (exb, into), keep = _rings(0)
    data = _bytes(10 * RING + 3, 5)
    got = torch.zeros_like(data)
    op = _op()
    trs = [Transfer(op, 1, True, (COLLECTIVE, 0), data, digest(Kind.ALL_TO_ALL, torch.uint8, data.numel()), "r0"),
           Transfer(op, 0, False, (COLLECTIVE, 0), got, digest(Kind.ALL_TO_ALL, torch.uint8, data.numel()), "r1")]
    for tr in trs:
        op.add(tr)
    assert out.claim() and into.claim((COLLECTIVE, 0))
    drive(exa, op, [(out, trs[0])], [(into, trs[1])], compiled=True)
    op.done(None)
    assert op.future.done() and not exa.errors
    assert torch.equal(data, got)
    del keep


@needs_core
@pytest.mark.parametrize("compiled", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("channel", ["ring", "tcp"])
def test_a_frame_of_another_size_is_a_mismatch_before_a_byte_lands(channel, compiled):
    send_side, recv_side, keep = _sockets() if channel == "tcp" else _rings()
    (exa, out), (exb, into) = send_side, recv_side
    _call(exa, [(out, _bytes(64, 1))], [], compiled, 0, dig=digest(Kind.ALL_TO_ALL, torch.uint8, 64))
    got = torch.full((32,), 7, dtype=torch.uint8)
    _call(exb, [], [(into, got)], compiled, 0, timeout=5)
    assert exb.errors and isinstance(exb.errors[0], CollectiveMismatch), exb.errors
    assert torch.all(got == 7)
    del keep


@needs_core
@pytest.mark.parametrize("compiled", [True, False], ids=["core", "python"])
def test_a_frame_of_another_call_first_goes_to_the_channel_thread(compiled):
    """Call 1's receive meets call 0's frame first: the thread keeps that frame aside and lands call 1's; call 0's
    receive, posted later, takes the kept frame."""
    (exa, out), (exb, into), keep = _rings()
    first, second = _bytes(100, 1), _bytes(5000, 2)
    _call(exa, [(out, first)], [], compiled, 0)
    th = threading.Thread(target=_call, args=(exa, [(out, second)], [], compiled, 1))
    th.start()
    got1 = torch.zeros_like(second)
    op1 = _call(exb, [], [(into, got1)], compiled, 1)
    op1.future.wait()
    got0 = torch.zeros_like(first)
    op0 = _call(exb, [], [(into, got0)], compiled, 0)
    op0.future.wait()
    th.join(30)
    assert not exa.errors and not exb.errors, (exa.errors, exb.errors)
    assert torch.equal(got0, first) and torch.equal(got1, second)
    into.stop(False)
    del keep


@needs_core
@pytest.mark.parametrize("compiled", [True, False], ids=["core", "python"])
def test_a_closed_link_and_a_peer_error_frame_raise_by_name(compiled):
    (exa, out), (exb, into), socks = _sockets()
    out.transport.link.send_error("rank 0 failed: the peer's own words")
    got = torch.zeros(16, dtype=torch.uint8)
    _call(exb, [], [(into, got)], compiled, 0, timeout=5)
    assert exb.errors and "the peer's own words" in str(exb.errors[0]), exb.errors

    (exa, out), (exb, into), socks = _sockets()
    socks[0].close()
    _call(exb, [], [(into, got)], compiled, 0, timeout=5)
    assert exb.errors and isinstance(exb.errors[0], ConnectionLost), exb.errors
    assert "rank 0" in str(exb.errors[0])


@needs_core
@pytest.mark.parametrize("compiled", [True, False], ids=["core", "python"])
def test_a_garbled_ring_frame_and_a_silent_peer_raise(compiled):
    (exa, out), (exb, into), (a, b) = _rings()
    a.ring(0, 1, "rank 1").write(b"\xff" * 40, None, lambda: None, time.monotonic() + 5, "garbling")
    _call(exb, [], [(into, torch.zeros(8, dtype=torch.uint8))], compiled, 0, timeout=5)
    assert exb.errors and "garbled frame from rank 0" in str(exb.errors[0]), exb.errors

    (exa, out), (exb, into), keep = _rings()
    t0 = time.monotonic()
    _call(exb, [], [(into, torch.zeros(8, dtype=torch.uint8))], compiled, 0, timeout=0.3)
    assert exb.errors and isinstance(exb.errors[0], CollectiveTimeout), exb.errors
    assert "timed out waiting for rank 0" in str(exb.errors[0])
    assert time.monotonic() - t0 < 30  # bounded by the deadline, not a hang (no timing asserted beyond that)


@needs_core
def test_the_group_failing_elsewhere_stops_a_compiled_drive():
    """Nothing arrives, and another thread fails the group: the drive notices between its slices."""
    (exa, out), (exb, into), keep = _rings()
    threading.Timer(0.2, exb.failed, args=(HFReduceError("failed elsewhere"),)).start()
    _call(exb, [], [(into, torch.zeros(8, dtype=torch.uint8))], True, 0, timeout=60)
    assert exb.errors and "failed elsewhere" in str(exb.errors[0])
