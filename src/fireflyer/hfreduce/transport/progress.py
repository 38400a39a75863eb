"""A synchronous exchange call drives its own channels, on the caller's thread.

``dist.all_to_all_single`` (or ``gather``, ``scatter``) without ``async_op`` blocks its
caller anyway, so the caller moves the bytes itself instead of handing each transfer
to a channel thread and waiting for them all: one pass after another, it pushes into
every channel what the channel takes now and pulls out of every channel what has
arrived, and only when nothing moved does it wait briefly on one of them. No handoff
between threads, and on a node's rings no wake-up but the peer's.

It drives only the channels it can claim, those with nothing queued ahead of this
call; the others, and a receive that meets a frame of another call first, go to the
channel threads as usual. Every wait has the call's deadline and checks the group's
failure state, as the threads' waits do.

Where hfreduce's compiled core is built, the passes run there (``_core/exchange.c``: the
same frames, ring counters and direct reads, with the GIL released), in slices of at most
10 ms between which this module checks the group and the deadline; what needs Python (a
frame of another call, a mismatch, a lost link, a peer's error) comes back here and is
handled as the Python loop handles it. ``compiled=False`` (the config's ``core_exchange``)
keeps the loop here; ranks may mix the two.
"""

from __future__ import annotations

import os
import select
import struct
import time
from typing import TYPE_CHECKING

from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.compiled import CORE
from fireflyer.hfreduce.transport import futex
from fireflyer.hfreduce.transport.channels import DONE, Foreign, Owner, RingIn
from fireflyer.hfreduce.transport.mailbox import remote_read_failure
from fireflyer.hfreduce.config import read
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.transport.transfers import Op, Transfer

if TYPE_CHECKING:
    from fireflyer.hfreduce.transport.endpoints import Inbox, Outbox

# Microseconds of polling before a sleep (FIREFLYER_HFREDUCE_SPIN_US): a peer running on another core
# delivers within them without a wake-up; on an oversubscribed machine they cost the peers' CPU.
_SPIN_S = float(read(names.SPIN_US, "50")) * 1e-6
_NAP = 0.002  # seconds of one sleep; the wait ends early when the channel it watches moves
_MIXED_NAP = 0.0002  # with both rings and sockets pending: a socket wakes the wait, a ring is polled this often


def steps_in_python(compiled: bool) -> bool:
    """Whether :func:`drive` with ``compiled`` steps the channels in Python, so that a claimed socket must be
    non-blocking meanwhile (the compiled core's system calls never block, whatever the socket's mode)."""
    return not (compiled and CORE is not None)


def drive(ex: Owner, op: Op, sends: list[tuple["Outbox", Transfer]], recvs: list[tuple["Inbox", Transfer]],
          compiled: bool = True) -> None:
    """Move the claimed transfers of ``op`` (in the compiled core where it is built and ``compiled``); every
    channel is released before this returns."""
    active: list[tuple[object, Transfer, bool]] = [(box, tr, True) for box, tr in sends] + \
        [(box, tr, False) for box, tr in recvs]
    if steps_in_python(compiled):
        _drive_here(ex, op, active)
    else:
        _drive_compiled(ex, op, active)


def _drive_here(ex: Owner, op: Op, active: list[tuple[object, Transfer, bool]]) -> None:
    idle = 0
    try:
        while active:
            moved = False
            for item in list(active):
                box, tr, sending = item
                try:
                    moved |= box.transport.step(tr) if sending else box.transport.step(tr, ex)
                except Foreign:  # another call's frame first: the channel's thread sorts it out
                    active.remove(item)
                    box.release(hand_over=tr)
                    moved = True
                    continue
                if tr.stage == DONE:
                    active.remove(item)
                    box.release()
                    op.done(tr)
            if moved:
                idle = 0
                continue
            idle += 1
            ex.check()
            if time.monotonic() > op.deadline:
                _, tr, _ = active[0]
                raise CollectiveTimeout(f"timed out waiting for {ex.describe(tr.peer)} while {tr.what}")
            if idle == 1:
                spin_until = time.perf_counter() + _SPIN_S
            if time.perf_counter() < spin_until:
                continue  # a peer running on another core is about to deliver: a sleep would cost more
            _nap(active)
    except BaseException as exc:  # noqa: BLE001 - the group fails, and this call with it
        for box, _, _ in active:
            box.release()
        active = []
        ex.failed(exc)


def _nap(active: list) -> None:
    """Sleep a little, waking early when what a pending transfer waits for moves.

    Only rings: a futex wait on the first one's word. Only sockets: a ``select`` on all of
    them. Both: a short ``select``, so a ring that moves meanwhile is seen soon too.
    """
    words, socks_r, socks_w = [], [], []
    for box, tr, sending in active:
        what = box.transport.sleep_on(tr)
        if isinstance(what, tuple):
            words.append(what)
        else:
            (socks_w if sending else socks_r).append(what)
    if not socks_r and not socks_w:
        address, value = words[0]
        futex.wait(address, value, _NAP)
    else:
        select.select(socks_r, socks_w, [], _MIXED_NAP if words else _NAP)


# -- in the compiled core ------------------------------------------------------------------------

# _core/exchange.h's hfx_item: kind, stage, pos, data, nbytes, space, key, digest; head, tail and ack
# addresses, ring, ring_bytes, count, acks, direct, fd; got_kind, got_space, got_key, got_nbytes,
# got_digest; err.
_ITEM = struct.Struct("<7q16s9q4q16sq")
# Byte offsets of the stage (then pos), and of count, acks and direct: what a drive changes.
_STAGE_AT = struct.calcsize("<q")
_BACK_AT = struct.calcsize("<7q16s5q")
_PROGRESS = struct.Struct("<2q")
_BACK = struct.Struct("<3q")
_NO_DIGEST = bytes(16)
_SLICE_NS = 10_000_000  # the longest a compiled drive runs before the group and the deadline are checked
(_ALL_DONE, _AGAIN, _FOREIGN, _MISMATCH, _LOST, _ERROR_FRAME, _GARBLED, _REMOTE) = range(8)


def _drive_compiled(ex: Owner, op: Op, active: list[tuple[object, Transfer, bool]]) -> None:
    """The passes of :func:`_drive_here` in the compiled core, in slices; the same handling of what comes back."""
    items = bytearray(_ITEM.size * len(active))
    for i, (box, tr, _) in enumerate(active):
        t = box.transport
        _ITEM.pack_into(items, i * _ITEM.size, t.core_kind, tr.stage, tr.pos, tr.data.data_ptr(), tr.data.numel(),
                        tr.key[0], tr.key[1], tr.digest, *t.core_fields(), 0, 0, 0, 0, _NO_DIGEST, 0)
    left = set(range(len(active)))  # items still the caller's: neither finished nor handed to a thread
    spin_ns = int(_SPIN_S * 1e9)
    try:
        while left:
            rc, index = CORE.exchange_drive(items, _SLICE_NS, spin_ns)
            for i in list(left):
                box, tr, _ = active[i]
                at = i * _ITEM.size
                tr.stage, tr.pos = _PROGRESS.unpack_from(items, at + _STAGE_AT)
                box.transport.core_back(*_BACK.unpack_from(items, at + _BACK_AT))
                if tr.stage == DONE:
                    left.discard(i)
                    box.release()
                    op.done(tr)
            if rc == _ALL_DONE or (rc == _AGAIN and not left):
                return
            if rc == _AGAIN:
                ex.check()
                if time.monotonic() > op.deadline:
                    tr = active[min(left)][1]
                    raise CollectiveTimeout(f"timed out waiting for {ex.describe(tr.peer)} while {tr.what}")
                continue
            box, tr, _ = active[index]
            if rc == _FOREIGN:  # another call's frame first: the channel's thread sorts it out
                left.discard(index)
                struct.pack_into("<q", items, index * _ITEM.size + _STAGE_AT, DONE)
                box.release(hand_over=tr)
                continue
            _raise(ex, box, tr, rc, _ITEM.unpack_from(items, index * _ITEM.size))
    except BaseException as exc:  # noqa: BLE001 - the group fails, and this call with it
        for i in left:
            active[i][0].release()
        ex.failed(exc)


def _raise(ex: Owner, box, tr: Transfer, rc: int, fields: tuple) -> None:
    """Raise what stopped a compiled drive at ``tr``, as the Python loop raises it."""
    got_nbytes, got_digest, err = fields[20], fields[21], fields[22]
    if rc == _MISMATCH:
        ex.expect(tr, got_digest, got_nbytes)
    elif rc == _LOST:
        raise box.transport.link.lost(tr.what) from (OSError(err, os.strerror(err)) if err else None)
    elif rc == _ERROR_FRAME:
        box.transport.link.recv_header(ex.check, tr.op.deadline, tr.what)  # raises the peer's error, or "garbled"
    elif rc == _GARBLED and isinstance(box.transport, RingIn):
        raise box.transport.garbled(tr.what)
    elif rc == _REMOTE:
        raise remote_read_failure(fields[15], got_nbytes, err, ex.check, box.transport.ring.peer_desc)
    raise HFReduceError(f"the compiled exchange stopped with code {rc} while {tr.what}")
