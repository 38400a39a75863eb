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
"""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING

from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.transport import futex
from fireflyer.hfreduce.transport.channels import DONE, Foreign, Owner
from fireflyer.hfreduce.config import read
from fireflyer.hfreduce.errors import CollectiveTimeout
from fireflyer.hfreduce.transport.transfers import Op, Transfer

if TYPE_CHECKING:
    from fireflyer.hfreduce.transport.endpoints import Inbox, Outbox

# Microseconds of polling before a sleep (FIREFLYER_HFREDUCE_SPIN_US): a peer running on another core
# delivers within them without a wake-up; on an oversubscribed machine they cost the peers' CPU.
_SPIN_S = float(read(names.SPIN_US, "50")) * 1e-6
_NAP = 0.002  # seconds of one sleep; the wait ends early when the channel it watches moves
_MIXED_NAP = 0.0002  # with both rings and sockets pending: a socket wakes the wait, a ring is polled this often


def drive(ex: Owner, op: Op, sends: list[tuple["Outbox", Transfer]], recvs: list[tuple["Inbox", Transfer]]) -> None:
    """Move the claimed transfers of ``op``; every channel is released before this returns."""
    active: list[tuple[object, Transfer, bool]] = [(box, tr, True) for box, tr in sends] + \
        [(box, tr, False) for box, tr in recvs]
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
