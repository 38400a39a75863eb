"""What a communicator knows about its own state, for callers and for diagnosis.

Mixed into :class:`~fireflyer.hfreduce.engine.Communicator`: whether it failed, whom its
threads are blocked on right now (for timeouts that name the culprit, and for the
flight recorder), the recording of each collective, and the dump on failure.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, error_from_text
from fireflyer.hfreduce.reduce import Kind

if TYPE_CHECKING:
    from fireflyer.hfreduce.engine import Job

_log = logging.getLogger("fireflyer.hfreduce")


class Diagnosis:
    """State and diagnosis of one communicator (see the module docstring)."""

    @property
    def error(self) -> HFReduceError | None:
        """The error that failed this communicator, or None while it is healthy."""
        return self._error

    def alive(self) -> bool:
        """Whether the engine thread still runs (it stops only at close)."""
        return self._worker.is_alive()

    def set_timeout(self, seconds: float) -> None:
        """Change the default timeout of collectives submitted from now on."""
        self.config = dataclasses.replace(self.config, timeout=float(seconds))

    def _record(self, job: Job) -> None:
        plan = job.plan
        trace = plan.trace
        if trace is None:  # the direct API: sizes as torch's analyzer expects them, from the flat buffer
            desc, w = plan.desc, self.world_size
            whole, part = [[desc.numel]], [[desc.numel // w]]
            dtype = [str(desc.dtype).replace("torch.", "")]
            ins, outs = {Kind.ALLGATHER: (part, whole), Kind.REDUCE_SCATTER: (whole, part)}.get(desc.kind, (whole, whole))
            trace = (ins, dtype, outs, dtype)
        self.flight.record(job.seq, plan.desc.kind.name.lower(), input_sizes=trace[0], input_dtypes=trace[1],
                           output_sizes=trace[2], output_dtypes=trace[3],
                           timeout_s=plan.timeout or self.config.timeout)

    def _waiting(self, job: Job, ranks: list[int], what: str) -> None:
        """Note that this thread now blocks on ``ranks`` (for timeouts and the flight recorder)."""
        ranks = [r for r in ranks if r != self.rank]  # a rank's own threads are never the one it waits for
        if ranks:
            self._waits[threading.get_ident()] = (job.seq, ranks, what)
            self.flight.waiting(job.seq, ranks, what)

    def _done_waiting(self) -> None:
        self._waits.pop(threading.get_ident(), None)

    def waited_on(self, seq: int) -> list[tuple[list[int], str]]:
        """Whom the engine's threads are blocked on for collective ``seq`` right now, and for what."""
        return [(ranks, what) for s, ranks, what in list(self._waits.values()) if s == seq]

    def time_out(self, seq: int, desc: str, seconds: float) -> HFReduceError:
        """Collective ``seq`` overran a caller's deadline: fail the group with a CollectiveTimeout naming whom it waited for.

        Returns the error to raise (an earlier failure, if the group had already failed).
        """
        waits = self.waited_on(seq)
        remote = bool(waits) and all(r not in self.members for rs, _ in waits for r in rs)
        if remote:
            # Waiting on another node only: the rank that waits on the real culprit reports
            # it on its own (earlier) clock; give its error a moment to arrive, as the engine's
            # own deadlines do (the tree deadline).
            patience = time.monotonic() + min(2.0, 0.25 * seconds)
            while self._error is None and time.monotonic() < patience:
                if self._arena is not None and self._arena.aborted():
                    break
                time.sleep(0.01)
        if self._error is not None:
            return self._error
        if self._arena is not None and self._arena.aborted():
            return self._fail(error_from_text(self._arena.abort_message(), HFReduceError))
        running = self._running
        waits = self.waited_on(seq)
        if waits:
            ranks = sorted({r for rs, _ in waits for r in rs})
            whom = "; ".join(f"{', '.join(self.describe(r) for r in rs)} to finish {what}" for rs, what in waits)
            detail = f"it was waiting for {whom} (ranks {ranks})"
        elif running is not None and running.seq < seq:
            detail = f"it was still queued behind collective #{running.seq} ({running.plan.desc})"
        elif running is not None and running.seq == seq:
            detail = "it was running on this rank and waiting on no peer"
        else:
            detail = "it had not started on this rank"
        return self._fail(CollectiveTimeout(
            f"{desc} (#{seq}) did not finish within the caller's timeout of {seconds:g}s on "
            f"{self.describe(self.rank)}: {detail}"
        ))

    def _dump_flight(self, exc: HFReduceError) -> None:
        """Write the flight recorder in the background: a slow disk must not delay the error's way to
        the caller. A process that exits right away still waits (a bounded time) for the dump."""
        th = threading.Thread(target=self._write_flight, args=(exc,), name=f"flight-dump-{self.rank}", daemon=True)
        _pending_dumps[:] = [t for t in _pending_dumps if t.is_alive()] + [th]
        th.start()

    def _write_flight(self, exc: HFReduceError) -> None:
        try:
            path = self.flight.dump(f"{type(exc).__name__}: {exc}")
        except Exception as dump_error:  # noqa: BLE001 - diagnosis must never mask the failure
            _log.warning("hfreduce could not write its flight recorder dump: %s", dump_error)
            return
        if path is not None:
            _log.warning("hfreduce %s failed; flight recorder dump: %s (read with: fireflyer hfreduce trace %s)",
                         self.describe(self.rank), path, path.parent)


_pending_dumps: list[threading.Thread] = []
_DUMP_WAIT = 10.0  # seconds an exiting process waits, at most, for its flight recorder dumps


@atexit.register
def _finish_dumps() -> None:
    deadline = time.monotonic() + _DUMP_WAIT
    for th in _pending_dumps:
        th.join(max(0.0, deadline - time.monotonic()))
