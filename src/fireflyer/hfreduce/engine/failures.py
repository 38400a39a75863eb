"""Failure propagation and diagnosis: the first failure anywhere reaches every rank, naming its cause.

A rank's first failure is its error for good (a failed group never computes with fewer
ranks). :meth:`Failures.fail` records it and passes it on at once: into the node's arena
(the abort word, which wakes every local waiter), then to every registered stage (the
tree links send an error frame to their neighbours and close; the exchange fails), and
into the job's store, where a rank that only saw a closed connection (a symptom) finds
the root cause. Every wait calls :meth:`Failures.check`, which raises what the rank, its
node or a dead local peer (noticed by its pid) has to say.

Across nodes a group also has a watch (:mod:`~fireflyer.hfreduce.engine.watch`, :meth:`Failures.attach`):
the first error is published through it, every rank with a collective in flight fails with
it at once, and the others with their next call.

Diagnosis: the engine's threads note whom they block on right now (:meth:`Failures.waiting`),
so a timeout names the culprit rather than a peer's symptom and the flight recorder shows
it; on failure the recorder is dumped in the background. A timeout found on this rank (not
passed on by another) is first checked against the other ranks' positions (through the
watch): a rank that never called the collective is the one it names, not a live rank that
was relaying for it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from fireflyer.hfreduce.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    HFReduceError,
    PeerFailure,
    error_from_text,
    error_to_text,
    fresh,
)
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder
from fireflyer.hfreduce.transport.procs import pid_alive
from fireflyer.hfreduce.plans.plan import Descriptor, Plan

if TYPE_CHECKING:
    import torch.distributed

    from fireflyer.hfreduce.transport.arena import Arena
    from fireflyer.hfreduce.engine.watch import Watch


class Collective(Protocol):
    """What a diagnosis reads of the collective in flight (a :class:`~fireflyer.hfreduce.engine.jobs.Job`,
    which is built on :class:`Failures` and so is named here only by what it offers)."""

    @property
    def seq(self) -> int: ...

    @property
    def plan(self) -> Plan: ...

_log = logging.getLogger("fireflyer.hfreduce")
_LIVENESS = 0.05  # seconds between checks that the local peers' processes still exist
_PATIENCE = 1.0  # seconds a timed-out rank waits for the other ranks' positions before it names a culprit


class Failures:
    """The failure state of one communicator, and whom its threads wait on (see the module docstring).

    ``members`` and ``pids`` are the node's global ranks and every rank's pid; ``running``
    says which collective the engine executes now (None: none).
    """

    def __init__(self, *, rank: int, members: list[int], pids: list[int], describe: Callable[[int], str],
                 store: "torch.distributed.Store", arena: Arena, flight: FlightRecorder,
                 running: Callable[[], Collective | None]) -> None:
        self.rank = rank
        self._members = members
        self._local_rank = members.index(rank)
        self._pids = pids
        self._describe = describe
        self._store = store
        self._arena: Arena | None = arena
        self._flight = flight
        self._running = running
        self._error: HFReduceError | None = None
        self._lock = threading.Lock()
        self._stages: list[Callable[[HFReduceError, str], None]] = []
        self._last_liveness = 0.0
        self._watch: Watch | None = None
        # What each engine thread is blocked on right now: thread id -> (seq, group ranks, what).
        self._waits: dict[int, tuple[int, list[int], str]] = {}

    @property
    def error(self) -> HFReduceError | None:
        """The error that failed the communicator, or None while it is healthy."""
        return self._error

    def on_failure(self, tell: Callable[[HFReduceError, str], None]) -> None:
        """Have ``tell(error, text)`` pass this rank's first failure on (``text``: the error as sent)."""
        self._stages.append(tell)

    def attach(self, watch: "Watch") -> None:
        """Publish failures through the group's watch (several nodes), and take the news it brings."""
        self._watch = watch

    def detach(self) -> None:
        """Forget the arena (it is being unmapped) and the watch: from now on failures stay on this rank."""
        self._arena = None
        self._watch = None

    # ------------------------------------------------------------------ propagation
    def fail(self, exc: BaseException) -> HFReduceError:
        """Record this rank's first failure and pass it to every neighbour; return the error to raise."""
        if not isinstance(exc, HFReduceError):
            exc = HFReduceError(f"hfreduce {self._describe(self.rank)}: {type(exc).__name__}: {exc}")
        if getattr(exc, "secondary", False):
            exc = self._root_cause(exc)
        if isinstance(exc, CollectiveTimeout) and not exc.relayed and self._error is None:
            exc = self._blame(exc)
        if self._error is None:
            self._publish_root_cause(exc)  # first writer wins, so a primary cause seen earlier stays
        with self._lock:
            first = self._error is None
            if first:
                self._error = exc
        if first:
            text = error_to_text(exc)
            arena = self._arena
            if arena is not None:
                arena.abort(text)
            for tell in self._stages:
                tell(exc, text)
            self._dump_flight(exc)
        return self._error

    def check(self) -> None:
        """Raise if this rank or its node has failed, or a local peer has died."""
        if self._error is not None:
            raise fresh(self._error)
        arena = self._arena
        if arena is not None and arena.aborted():
            raise error_from_text(arena.abort_message(), HFReduceError)
        watch = self._watch
        if watch is not None and watch.pending is not None:  # news that came while this rank was idle
            raise fresh(watch.pending)
        now = time.monotonic()
        if now - self._last_liveness > _LIVENESS:
            self._last_liveness = now
            for r in self._members:
                if r != self.rank and not pid_alive(self._pids[r]):
                    running = self._running()
                    raise self.peer_died(r, running.seq if running is not None else None)

    def peer_died(self, r: int, seq: int | None) -> PeerFailure:
        """The error for local peer ``r``'s death; the flight recorder names it in collective ``seq``, as the
        culprit rather than a peer's symptom."""
        if seq is not None:
            self._flight.waiting(seq, [r], f"rank {r} (pid {self._pids[r]}) died")
        return PeerFailure(f"{self._describe(r)}, pid {self._pids[r]}, died")

    def _root_cause(self, symptom: HFReduceError, patience: float = 1.0) -> HFReduceError:
        """A closed connection is a symptom: give the rank that saw the cause a moment to report it.

        The report arrives through another thread of this rank (an error frame), the node's
        arena, or the job's store, where the first rank to fail leaves its error.
        """
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if self._error is not None:
                return self._error
            arena = self._arena
            if arena is not None and arena.aborted():
                return error_from_text(arena.abort_message(), HFReduceError)
            text = self._store_error()
            if text:
                return error_from_text(text, HFReduceError)
            time.sleep(0.02)
        return symptom

    def _store_error(self) -> str | None:
        result: list = []

        def look() -> None:
            try:
                if self._store.check(["error"]):
                    result.append(self._store.get("error").decode())
            except Exception:  # noqa: BLE001 - the store may be gone with a dead rank
                pass

        th = threading.Thread(target=look, daemon=True)
        th.start()
        th.join(0.2)
        return result[0] if result else None

    def _publish_root_cause(self, exc: HFReduceError) -> None:
        watch = self._watch
        if watch is not None:
            if not exc.relayed:  # a relayed error is in the store already
                watch.publish(error_to_text(exc))
            return

        def put() -> None:
            try:
                self._store.compare_set("error", "", error_to_text(exc))
            except Exception:  # noqa: BLE001 - best effort
                pass

        threading.Thread(target=put, daemon=True).start()

    def _blame(self, timeout: CollectiveTimeout) -> HFReduceError:
        """A collective timed out here: if a rank never called it, the error names that rank.

        Every rank's watch answers how many of the group's collectives its rank has called. The
        oldest collective in flight here that some rank has not called is the one everyone waits
        for, and those ranks are the culprits; where every rank that answered has called them all,
        the ranks that did not answer are. Otherwise the timeout keeps its own words (whom this
        rank's threads waited on). Without a watch (one node, where every wait is on the culprit
        itself) it is left as it is.
        """
        flying = self._flight.open_collectives()
        if self._watch is None or not flying:
            return timeout
        answers, silent = self._watch.positions(_PATIENCE)
        if self._error is not None:  # another rank's report came meanwhile
            return timeout
        me = self._describe(self.rank)
        for seq, op in flying:
            late = [r for r, called in sorted(answers.items()) if called <= seq]
            if late:
                who = "; ".join(f"{self._describe(r)} never called it ("
                                + (f"the last collective it called is #{answers[r] - 1})" if answers[r] else
                                   "it has called none of the group's collectives)") for r in late)
                self._flight.waiting(seq, late, "ranks that never called it")
                return CollectiveTimeout(f"{op} (#{seq}) did not finish within its timeout on {me}: {who}")
        if silent and answers:
            seq, op = flying[0]
            who = ", ".join(self._describe(r) for r in silent)
            self._flight.waiting(seq, silent, "ranks that did not answer")
            return CollectiveTimeout(
                f"{op} (#{seq}) did not finish within its timeout on {me}: every rank that answered had called it, "
                f"but {who} did not answer (dead, stopped, or hung outside hfreduce)")
        return timeout

    # ------------------------------------------------------------------ whom the threads wait on
    def waiting(self, seq: int, ranks: list[int], what: str) -> None:
        """Note that this thread now blocks on ``ranks`` for collective ``seq`` (for timeouts and the flight recorder)."""
        ranks = [r for r in ranks if r != self.rank]  # a rank's own threads are never the one it waits for
        if ranks:
            self._waits[threading.get_ident()] = (seq, ranks, what)
            self._flight.waiting(seq, ranks, what)
            remote = next((r for r in ranks if r not in self._members), None)
            arena = self._arena
            if remote is not None and arena is not None:  # for the local peers' timeouts, which wait on this rank
                arena.note_remote_wait(self._local_rank, remote)

    def done_waiting(self) -> None:
        self._waits.pop(threading.get_ident(), None)

    def waited_on(self, seq: int) -> list[tuple[list[int], str]]:
        """Whom the engine's threads are blocked on for collective ``seq`` right now, and for what."""
        return [(ranks, what) for s, ranks, what in list(self._waits.values()) if s == seq]

    def behind(self, seq: int, but: int | None = None) -> str:
        """What the threads wait on for collective ``seq`` (leaving out waits on rank ``but``), as a timeout says it."""
        return "; ".join(f"{', '.join(self._describe(r) for r in rs)} ({what})"
                         for rs, what in self.waited_on(seq) if but not in rs)

    def time_out(self, seq: int, desc: str, seconds: float) -> HFReduceError:
        """Collective ``seq`` overran a caller's deadline: fail the group with a CollectiveTimeout naming whom it waited for.

        Returns the error to raise (an earlier failure, if the group had already failed).
        """
        waits = self.waited_on(seq)
        remote = bool(waits) and all(r not in self._members for rs, _ in waits for r in rs)
        if remote:
            # Waiting on another node only: the rank that waits on the real culprit reports
            # it on its own (earlier) clock; give its error a moment to arrive, as the engine's
            # own deadlines do (the tree deadline).
            patience = time.monotonic() + min(2.0, 0.25 * seconds)
            while self._error is None and time.monotonic() < patience:
                if self._aborted():
                    break
                time.sleep(0.01)
        if self._error is not None:
            return self._error
        if self._aborted():
            return self.fail(error_from_text(self._arena.abort_message(), HFReduceError))
        running = self._running()
        waits = self.waited_on(seq)
        if waits:
            ranks = sorted({r for rs, _ in waits for r in rs})
            whom = "; ".join(f"{', '.join(self._describe(r) for r in rs)} to finish {what}" for rs, what in waits)
            detail = f"it was waiting for {whom} (ranks {ranks})"
        elif running is not None and running.seq < seq:
            detail = f"it was still queued behind collective #{running.seq} ({running.plan.desc})"
        elif running is not None and running.seq == seq:
            detail = "it was running on this rank and waiting on no peer"
        else:
            detail = "it had not started on this rank"
        return self.fail(CollectiveTimeout(
            f"{desc} (#{seq}) did not finish within the caller's timeout of {seconds:g}s on "
            f"{self._describe(self.rank)}: {detail}"
        ))

    def _aborted(self) -> bool:
        arena = self._arena
        return arena is not None and arena.aborted()

    # ------------------------------------------------------------------ the flight recorder
    def _dump_flight(self, exc: HFReduceError) -> None:
        """Write the flight recorder in the background: a slow disk must not delay the error's way to
        the caller. A process that exits right away still waits (a bounded time) for the dump."""
        th = threading.Thread(target=self._write_flight, args=(exc,), name=f"flight-dump-{self.rank}", daemon=True)
        _pending_dumps[:] = [t for t in _pending_dumps if t.is_alive()] + [th]
        th.start()

    def _write_flight(self, exc: HFReduceError) -> None:
        try:
            path = self._flight.dump(f"{type(exc).__name__}: {exc}")
        except Exception as dump_error:  # noqa: BLE001 - diagnosis must never mask the failure
            _log.warning("hfreduce could not write its flight recorder dump: %s", dump_error)
            return
        if path is not None:
            _log.warning("hfreduce %s failed; flight recorder dump: %s (read with: fireflyer hfreduce trace %s)",
                         self._describe(self.rank), path, path.parent)


def mismatch(job: Collective, me: str, who: str, theirs: Descriptor, their_seq: int) -> CollectiveMismatch:
    """The error of ``me`` running ``job`` while ``who`` called ``theirs`` (its collective #``their_seq``)."""
    return CollectiveMismatch(
        f"collective mismatch: {me} called {job.plan.desc} (#{job.seq}) but {who} called {theirs} (#{their_seq})"
    )


_pending_dumps: list[threading.Thread] = []
_DUMP_WAIT = 10.0  # seconds an exiting process waits, at most, for its flight recorder dumps


@atexit.register
def _finish_dumps() -> None:
    deadline = time.monotonic() + _DUMP_WAIT
    for th in _pending_dumps:
        th.join(max(0.0, deadline - time.monotonic()))
