"""This rank's two ends of each channel: the :class:`Outbox` it sends through and the :class:`Inbox` it receives from.

An outbox sends transfers in the order they were posted: on the caller's thread when
that needs no wait, else on the outbox's own thread. An inbox's thread reads whenever a
receive is posted; a frame whose receive is not posted yet (another tag, or a call
that overtook it) is kept in memory until it is. So async calls never block their
caller, and two ranks that both send first never deadlock: the receiving threads
drain while the sending ones fill. A synchronous call may *claim* an idle end and
drive it itself (:mod:`~fireflyer.hfreduce.transport.progress`); whoever drives an end holds
it, its thread between frames or a driving caller for its whole call.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
import torch

from fireflyer.hfreduce.transport.channels import Owner
from fireflyer.hfreduce.transport.transfers import Transfer


class Outbox:
    """This rank's sending side towards one peer. Transfers go in the order they are posted: by the
    caller when that needs no wait, else by this outbox's thread, or by a caller that drives it."""

    def __init__(self, ex: Owner, peer: int, transport) -> None:
        self._ex, self.peer, self.transport = ex, peer, transport
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._busy = 0  # transfers queued for the thread or in its hands, and driving callers
        self._wire = threading.Lock()  # held by whoever writes the transport: the thread, or a driving caller
        self._nonblocking = False  # the driving caller made the transport non-blocking (undone on release)
        self.thread: threading.Thread | None = None

    def post(self, tr: Transfer) -> None:
        """Called under the exchange's lock, so posts keep the caller's order."""
        done, error = False, None
        with self._lock:
            if not self._busy:
                try:
                    done = self.transport.send_now(tr)
                except BaseException as exc:  # noqa: BLE001
                    error = exc
            if not done and error is None:
                self._busy += 1
        if error is not None:
            self._ex.failed(error)
            return
        if done:
            tr.op.done(tr)
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"hfreduce-{self._ex.rank}-to-{self.peer}",
                                           daemon=True)
            self.thread.start()
        self._queue.put(tr)

    def claim(self, nonblocking: bool = True) -> bool:
        """For a driving caller: the channel, if nothing is ahead of it (call :meth:`release` after);
        ``nonblocking``: the caller steps it in Python, so its socket must not block meanwhile."""
        with self._lock:
            if self._busy or not self.transport.inline or not self._wire.acquire(blocking=False):
                return False
            self._busy += 1
        self._nonblocking = nonblocking
        if nonblocking:
            self.transport.driving(True)
        return True

    def release(self) -> None:
        if self._nonblocking:
            self.transport.driving(False)
        with self._lock:
            self._busy -= 1
            self._wire.release()

    def _run(self) -> None:
        torch.set_num_threads(1)
        ex = self._ex
        while True:
            tr = self._queue.get()
            if tr is None:
                return
            try:
                with self._wire:
                    if not tr.op.settled:
                        ex.check()
                        self.transport.send(tr, ex.check, tr.what)
            except BaseException as exc:  # noqa: BLE001 - every failure fails the group, and so this call
                ex.failed(exc)
                return
            finally:
                with self._lock:
                    self._busy -= 1
            tr.op.done(tr)

    def stop(self, text: str | None) -> None:
        self._queue.put(None)
        if text is not None:
            self.transport.abort(text)


class Inbox:
    """This rank's receiving side from one peer: posted receives by key, and frames that came before theirs.

    Its thread reads whenever a receive is posted; a frame whose receive is not posted yet
    (another tag, or a call that overtook it) is kept in memory until it is.
    """

    def __init__(self, ex: Owner, peer: int, transport) -> None:
        self._ex, self.peer, self.transport = ex, peer, transport
        self._cond = threading.Condition()
        self._posted: dict[tuple[int, int], deque[Transfer]] = {}
        self._waiting = 0  # posted receives not yet matched
        self._reading = False  # the thread is on the wire, or a driving caller holds it
        self._nonblocking = False  # the driving caller made the transport non-blocking (undone on release)
        self._early: dict[tuple[int, int], deque[tuple[bytes, torch.Tensor]]] = {}
        self._stop = False
        self.thread: threading.Thread | None = None

    def post(self, tr: Transfer) -> None:
        with self._cond:
            early = self._early.get(tr.key)
            if early:
                dig, data = early.popleft()
                if not early:
                    del self._early[tr.key]
            else:
                self._wait_for(tr)
                return
        self._land(tr, dig, data)

    def _wait_for(self, tr: Transfer) -> None:  # under the lock
        self._posted.setdefault(tr.key, deque()).append(tr)
        self._waiting += 1
        if self.thread is None and self.transport is not None:
            self.thread = threading.Thread(target=self._run, daemon=True,
                                           name=f"hfreduce-{self._ex.rank}-from-{self.peer}")
            self.thread.start()
        self._cond.notify_all()

    def claim(self, key: tuple[int, int], nonblocking: bool = True) -> bool:
        """For a driving caller: the channel, if nothing is posted ahead and no frame for ``key`` came early
        (``nonblocking`` as for :meth:`Outbox.claim`)."""
        with self._cond:
            if self._waiting or self._reading or key in self._early or self.transport is None \
                    or not self.transport.inline:
                return False
            self._reading = True
        self._nonblocking = nonblocking
        if nonblocking:
            self.transport.driving(True)
        return True

    def release(self, hand_over: Transfer | None = None) -> None:
        """Give the channel back; ``hand_over``: a receive the caller could not finish (a frame of another call
        was ahead of it, untouched), which the thread takes from here."""
        if self._nonblocking:
            self.transport.driving(False)
        with self._cond:
            self._reading = False
            if hand_over is not None:
                self._wait_for(hand_over)
            elif self._waiting:  # receives posted meanwhile: the thread reads from here (else it sleeps on)
                self._cond.notify_all()

    def deliver(self, key: tuple[int, int], dig: bytes, data: torch.Tensor, copy: bool = True) -> None:
        """A whole frame (sent to itself, or read before its receive was posted): into its posted receive,
        or kept (``copy``: as a copy) until one is posted. One decision under the lock, so neither is lost."""
        with self._cond:
            tr = self._match_locked(key)
            if tr is None:
                self._early.setdefault(key, deque()).append((dig, data.clone() if copy else data))
                return
        self._land(tr, dig, data)

    def _match_locked(self, key: tuple[int, int]) -> Transfer | None:
        posted = self._posted.get(key)
        if not posted:
            return None
        tr = posted.popleft()
        if not posted:
            del self._posted[key]
        self._waiting -= 1
        return tr

    def _land(self, tr: Transfer, dig: bytes, data: torch.Tensor) -> None:
        try:
            self._ex.expect(tr, dig, data.numel())
            if data.numel():
                tr.data.copy_(data)
        except BaseException as exc:  # noqa: BLE001
            self._ex.failed(exc)
            return
        tr.op.done(tr)

    def _run(self) -> None:
        torch.set_num_threads(1)
        ex = self._ex
        while True:
            with self._cond:
                while (not self._waiting or self._reading) and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._reading = True
                first = min((q[0] for q in self._posted.values()), key=lambda t: t.op.deadline)
            tr = None
            try:
                space, key, nbytes, dig = self.transport.header(ex.check, first.op.deadline, first.what)
                with self._cond:
                    tr = self._match_locked((space, key))
                if tr is None:  # a frame whose receive is not posted yet: keep it
                    early = torch.empty(nbytes, dtype=torch.uint8)
                    self.transport.payload(early, ex.check, first.op.deadline, first.what)
                    self.deliver((space, key), dig, early, copy=False)  # its receive may have come meanwhile
                else:
                    ex.expect(tr, dig, nbytes)
                    self.transport.payload(tr.data, ex.check, tr.op.deadline, tr.what)
            except BaseException as exc:  # noqa: BLE001 - every failure fails the group
                ex.failed(exc)
                return
            finally:
                with self._cond:
                    self._reading = False
            if tr is not None:
                tr.op.done(tr)

    def stop(self, failed: bool) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if failed and self.transport is not None:
            self.transport.abort()
