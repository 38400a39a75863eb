"""The node's mailboxes: byte rings between two local ranks, and direct reads of a peer's memory.

One process plays both sides of a ring (the sender's and the receiver's view of the
same shared region), in threads where one side must wait for the other.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from fireflyer.hfreduce.transport import mailbox
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.transport.mailbox import Mailboxes, MailboxShape, read_remote, ring_bytes_for

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")


def _region(ring_bytes: int = 8192, local_size: int = 2) -> tuple[Mailboxes, Mailboxes]:
    """The same region mapped twice: the sender's view and the receiver's."""
    shape = MailboxShape(local_size, ring_bytes)
    fd = os.memfd_create("test-mailbox", os.MFD_CLOEXEC)
    os.ftruncate(fd, shape.total_bytes)
    return Mailboxes(shape, os.dup(fd)), Mailboxes(shape, fd)


def _ok() -> None:
    pass


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_the_shape_keeps_every_counter_on_its_own_cache_line():
    shape = MailboxShape(3, 4096)
    indices = [f(p) for p in range(9) for f in (shape.head_index, shape.tail_index, shape.ack_index)]
    assert len({i * 4 // 64 for i in indices}) == len(indices)
    assert shape.ring_offset(0) >= max(indices) * 4 + 4 and shape.ring_offset(0) % 4096 == 0
    assert shape.total_bytes == shape.ring_offset(8) + 4096


def test_frames_pass_in_order_through_a_ring_they_wrap_around_many_times():
    a, b = _region(8192)
    out, into = a.ring(0, 1, "rank 1"), b.ring(0, 1, "rank 0")
    sizes = [0, 1, 7, 4093, 8192, 20011, 3, 65536]
    sent = [_bytes(n, i) for i, n in enumerate(sizes)]

    def send() -> None:
        for i, t in enumerate(sent):
            out.write(i.to_bytes(4, "little"), t, _ok, time.monotonic() + 10, "sending")

    th = threading.Thread(target=send)
    th.start()
    for i, t in enumerate(sent):
        assert int.from_bytes(into.read_bytes(4, _ok, time.monotonic() + 10, "reading"), "little") == i
        got = torch.empty_like(t)
        into.read_into(got, _ok, time.monotonic() + 10, "reading")
        assert torch.equal(got, t)
    th.join(5)
    assert not th.is_alive()


def test_the_non_blocking_side_moves_only_what_fits_and_peeks_without_consuming():
    a, b = _region(4096)
    out, into = a.ring(1, 0, "rank 0"), b.ring(1, 0, "rank 1")
    assert into.peek(4) is None and into.available() == 0
    data = _bytes(6000, 3)
    assert out.put_some(b"head", None, 0) == 4
    assert into.peek(4) == b"head" and into.peek(4) == b"head"  # peeking twice consumes nothing
    moved = out.put_some(None, data, 0)
    assert moved == 4096 - 4 and out.free() == 0 and out.put_some(None, data, moved) == 0
    into.skip(4)
    got = torch.empty_like(data)
    k = into.take_some(got, 0)
    assert k == moved
    while k < data.numel():
        k2 = out.put_some(None, data, k)
        k += into.take_some(got, k)
        assert k2 or k == data.numel()
    assert torch.equal(got, data)


def test_a_full_ring_times_out_naming_the_peer_and_a_check_aborts_the_wait():
    a, _ = _region(4096)
    out = a.ring(0, 1, "rank 1 (node 0, local rank 1)")
    with pytest.raises(CollectiveTimeout, match="rank 1 .* while sending it"):
        out.write(b"", _bytes(10000), _ok, time.monotonic() + 0.2, "sending it")

    def boom() -> None:
        raise HFReduceError("the group failed")

    with pytest.raises(HFReduceError, match="the group failed"):
        out.write(b"", _bytes(10000), boom, time.monotonic() + 10, "sending")


def test_acks_answer_each_ask_in_turn():
    a, b = _region(4096)
    out, into = a.ring(0, 1, "rank 1"), b.ring(0, 1, "rank 0")
    out.ask()
    assert out.answered() is None
    into.answer(True)
    assert out.answered() is True
    out.ask()
    assert out.answered() is None
    threading.Timer(0.05, into.answer, args=(False,)).start()
    assert out.wait_ack(_ok, time.monotonic() + 5, "waiting") is False


def test_a_direct_read_copies_from_a_process_memory():
    src = _bytes(3 << 20, 9)
    dst = torch.zeros_like(src)
    if not read_remote(os.getpid(), src.data_ptr(), dst, _ok, "itself"):
        pytest.skip("this kernel does not allow process_vm_readv here")
    assert torch.equal(src, dst)


def test_a_refused_direct_read_says_so_and_a_bad_address_raises(monkeypatch):
    dst = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(HFReduceError, match="reading 16 bytes from nobody"):
        read_remote(os.getpid(), 8, dst, _ok, "nobody")  # address 8 is never mapped
    monkeypatch.setattr(mailbox, "_vm_readv", None)
    assert read_remote(os.getpid(), dst.data_ptr(), dst, _ok, "x") is False


def test_a_direct_read_from_a_process_that_died_is_a_peer_failure():
    """A peer that exits while its bytes are read is reported as a dead peer (by name), not an I/O error."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid names no process now
    dst = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(PeerFailure, match=r"rank 5 \(node 1, local rank 1\) \(pid \d+\) died"):
        read_remote(child.pid, dst.data_ptr(), dst, _ok, "rank 5 (node 1, local rank 1)")


def test_ring_size_from_the_environment_is_checked(monkeypatch):
    monkeypatch.delenv(mailbox.RING_ENV, raising=False)
    assert ring_bytes_for(2) == 4 << 20 and ring_bytes_for(64) == 512 << 10
    monkeypatch.setenv(mailbox.RING_ENV, "65536")
    assert ring_bytes_for(8) == 65536
    for bad in ("lots", "1000", "0"):
        monkeypatch.setenv(mailbox.RING_ENV, bad)
        with pytest.raises(ValueError, match=mailbox.RING_ENV):
            ring_bytes_for(2)
