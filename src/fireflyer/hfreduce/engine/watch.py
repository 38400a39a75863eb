"""The group's watch: news of a failure reaches every rank of a multi-node group at once, whatever it waits on.

Within a node a failure travels through the arena (the abort word), and a dead local peer
is noticed by its pid in every wait. Across nodes there is no such channel: the tree links
carry error frames only between tree neighbours, during a tree collective, and the
exchange opens its connections only when it first sends. A rank on another node that
waits for a connection the dead rank never opened, or for a relay that waits on it, would
learn of the death only at its timeout, and blame whoever it waited on.

So each rank of a multi-node group runs one thread that watches, on its own connection to
the job's store (``Store.clone()``, so that a caller blocked in a store wait never holds it
up):

- its node's other ranks, by pid, every tick (:data:`TICK`), whether this rank is in a
  collective or not: a death is published at once (below), and this rank fails with it if
  it has a collective in flight;
- the store's news counter: a failure published by any rank (the first error wins the
  ``error`` key, then the counter moves) fails this rank at once if it has a collective
  in flight, and otherwise its next one (:attr:`Watch.pending`);
- the questions of a rank whose collective timed out (:meth:`Watch.positions`): each watch
  answers with how many of the group's collectives its rank has called, so the asking
  rank can name the rank that never called the one it waits on, rather than a live rank
  that relays for it.

The store is read every tick while this rank's collectives are stalled (nothing settled
for :data:`STALL` seconds while one is in flight) and every :data:`SLOW` seconds
otherwise: about four round trips a second per rank and group in a running job. Whole
nodes that die at once, leaving no local witness, are still seen by their closed
connections or at the timeout.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

from fireflyer.hfreduce.errors import HFReduceError, PeerFailure, error_from_text
from fireflyer.hfreduce.transport.procs import pid_alive

TICK = 0.05  # seconds between looks at the local peers' pids (and at the store while stalled)
STALL = 0.2  # seconds without a collective settling, while one is in flight, before the store is read every tick
SLOW = 0.25  # seconds between reads of the store otherwise
_ERROR, _NEWS, _ASKS = "error", "watch/news", "watch/asks"
_log = logging.getLogger("fireflyer.hfreduce")


class Watch:
    """The watch of one rank of one group (see the module docstring).

    ``members`` and ``pids``: the rank's node and every rank's pid. ``progress()`` says how many
    records are in flight on this rank and how many have settled so far; ``position()`` how many
    of the group's collectives it has called; ``died(r)`` makes the error for local peer ``r``'s
    death; ``adopt(error)`` fails this rank with an error found here.
    """

    def __init__(self, *, rank: int, world_size: int, store, members: list[int], pids: list[int],
                 progress: Callable[[], tuple[int, int]], position: Callable[[], int],
                 died: Callable[[int], PeerFailure], adopt: Callable[[BaseException], object]) -> None:
        self.rank = rank
        self.world_size = world_size
        try:
            self._store = store.clone()  # a connection of its own: the caller's may be blocked in a wait
        except Exception:  # noqa: BLE001 - a store without clone(): share it
            self._store = store
        self._peers = [r for r in members if r != rank]
        self._pids = pids
        self._progress = progress
        self._position = position
        self._died = died
        self._adopt = adopt
        self.pending: HFReduceError | None = None  # news that came while this rank had nothing in flight
        self._outbox: list[str] = []  # this rank's own first error, to publish
        self._mine: set[int] = set()  # the questions this rank asked
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hfreduce-watch-{rank}", daemon=True)

    def start(self) -> None:
        _live.add(self)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (it ends within a tick, or once a store call it is in returns)."""
        self._stop.set()
        self._wake.set()
        _live.discard(self)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ what the rank asks of it
    def publish(self, text: str) -> None:
        """Put this rank's first failure (``"Class|message"``) in the store for every rank, from the watch's
        thread: the failing thread never waits on the store."""
        with self._lock:
            self._outbox.append(text)
        self._wake.set()

    def positions(self, patience: float) -> tuple[dict[int, int], list[int]]:
        """Ask every rank how many of the group's collectives it has called; returns the answers by rank, and
        the ranks that gave none within ``patience`` seconds (dead, stopped, or their store unreachable).

        The asking runs on a thread of its own, waited for ``patience`` (and a second): a store whose host is
        stopped (SIGSTOP) holds every call until the host resumes (TCPStore's client honours its timeout in
        waits only), and the timed-out rank must not wait for it (it would hang as long as the host is stopped).
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        box: list[dict[int, int]] = []
        done = threading.Event()
        threading.Thread(target=self._ask, args=(others, patience, box, done), name=f"hfreduce-ask-{self.rank}",
                         daemon=True).start()
        done.wait(patience + 1.0)
        answers = box[0] if box else {}
        return answers, [r for r in others if r not in answers]

    def _ask(self, others: list[int], patience: float, box: list[dict[int, int]], done: threading.Event) -> None:
        store, answers = self._store, {}
        try:
            k = store.add(_ASKS, 1)
            with self._lock:
                self._mine.add(k)
            store.add(_NEWS, 1)
            deadline = time.monotonic() + patience
            while store.add(f"watch/answered/{k}", 0) < len(others) and time.monotonic() < deadline:
                time.sleep(0.02)
            for r in others:
                key = f"watch/answer/{k}/{r}"
                if store.check([key]):
                    answers[r] = int(store.get(key))
        except Exception as exc:  # noqa: BLE001 - the store is gone: no one answers
            _log.debug("hfreduce %d: no positions from the store: %s", self.rank, exc)
        box.append(answers)
        done.set()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        news = answered = 0
        last_read = 0.0
        settled, since = -1, time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            in_flight, done = self._progress()
            if done != settled or not in_flight:
                settled, since = done, now
            stalled = in_flight and now - since >= STALL
            try:
                self._send_outbox()
                self._look_at_peers(bool(in_flight))
                if stalled or now - last_read >= SLOW:
                    last_read = now
                    count = self._store.add(_NEWS, 0)
                    if count != news:
                        news = count
                        answered = self._read_news(answered, bool(in_flight))
                pending = self.pending
                if in_flight and pending is not None:
                    self._adopt(pending)  # the rank's error from now on: check() need not raise it again
                    self.pending = None
            except Exception as exc:  # noqa: BLE001 - the store went away (its host died): keep watching the pids
                _log.debug("hfreduce %d: the watch could not reach the store: %s", self.rank, exc)
            self._wake.wait(TICK)
            self._wake.clear()
        try:  # a rank that failed and at once closed its group: its error still reaches the others
            self._send_outbox()
        except Exception as exc:  # noqa: BLE001 - the store went away
            _log.debug("hfreduce %d: the watch could not publish on its way out: %s", self.rank, exc)

    def _send_outbox(self) -> None:
        with self._lock:
            texts, self._outbox = self._outbox, []
        for text in texts:
            # the first error anywhere wins the key; only the winner needs to tell the others it is there
            if self._store.compare_set(_ERROR, "", text).decode(errors="replace") == text:
                self._store.add(_NEWS, 1)

    def _look_at_peers(self, busy: bool) -> None:
        for r in self._peers:
            if r not in self._dead and not pid_alive(self._pids[r]):
                self._dead.add(r)
                error = self._died(r)
                if busy:
                    self._adopt(error)  # fails this rank, which publishes it (through the outbox)
                else:
                    self.pending = self.pending or error
                    self.publish(f"{type(error).__name__}|{error}")
                self._send_outbox()

    def _read_news(self, answered: int, busy: bool) -> int:
        store = self._store
        if store.check([_ERROR]):
            error = error_from_text(store.get(_ERROR).decode(errors="replace"), HFReduceError)
            if busy:
                self._adopt(error)
            else:
                self.pending = self.pending or error
        asked = store.add(_ASKS, 0)
        for k in range(answered + 1, asked + 1):
            with self._lock:
                mine = k in self._mine
            if not mine:
                store.set(f"watch/answer/{k}/{self.rank}", str(self._position()))
                store.add(f"watch/answered/{k}", 1)
        return max(answered, asked)


_live: "weakref.WeakSet[Watch]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """A process that exits without destroying its groups: stop the watches while the interpreter still runs,
    so that none is inside a call of the store's C++ client when the process tears down the store (which
    would abort the process)."""
    for watch in list(_live):
        watch.close(timeout=1.0)
