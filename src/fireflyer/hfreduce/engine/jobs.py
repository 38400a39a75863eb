"""The job queue and the engine thread: a rank's collectives, numbered and run one at a time, in order.

Every collective gets the next number of its group (its ``seq``, which all ranks must
agree on) and runs to completion before the next one starts. :meth:`Jobs.submit` queues
one for the engine thread and returns its future. A small CPU collective with nothing
ahead of it runs in the caller's thread instead (``submit`` inline, :meth:`Jobs.run_now`,
and :meth:`Jobs.claim` for the compiled core's fast door): handing it to the engine
thread and back would cost more than the collective itself.

Two locks keep that ordered: ``submit_lock`` guards the numbering and ``pending`` (the
collectives submitted and not yet finished), ``exec_lock`` is held by whoever executes
one. A caller may run a collective itself only when nothing is pending, and a collective
stops counting as pending only once its future is settled, so futures complete in the
order their collectives were submitted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fireflyer.hfreduce.errors import HFReduceError, fresh
from fireflyer.hfreduce.engine.failures import Failures
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder
from fireflyer.hfreduce.plans.plan import Kind, Plan
from fireflyer.errors import UserError

INLINE_BYTES = 64 << 10  # CPU collectives up to this size run in the caller's thread when the engine is idle


@dataclass
class Job:
    """One collective in flight on this rank: its plan, its place in the chunk sequence, its deadlines."""

    plan: Plan
    future: torch.futures.Future | None  # None: run in the caller's thread, which takes the outcome
    first_chunk: int = 0
    nchunks: int = 1
    elems: int = 1
    seq: int = 0
    timeout: float = 0.0  # seconds it may take: the plan's, else the communicator's when it started
    deadline: float = 0.0
    tree_deadline: float = 0.0  # a little later, so the rank that saw the root cause reports it first
    stream_event: object = None
    own: torch.Tensor | None = None  # the CPU tensor this rank reduces its own slice from directly
    shared: tuple[int, int, bool] | None = None  # this rank's input is registered: (buffer, byte offset, in place)
    peer_in: list | None = None  # per local rank: its registered input, read directly instead of its arena slot
    peer_out: list | None = None  # per local rank: its registered in-place buffer, written directly (one node)


class Jobs:
    """The collectives of one communicator, in submission order (see the module docstring).

    ``execute(job)`` runs one to completion (raising its failure); ``stopped()`` is told when
    the engine thread ends, after :meth:`close`. ``timeout()`` is the communicator's default.

    ``seq``, ``pending``, ``submit_lock`` and ``exec_lock`` are the claim's state. The C++ door
    (``backend/door.cpp``) takes and gives back a claim with them exactly as :meth:`claim` and
    :meth:`release` do, so nothing else may change how they are used without changing it too.
    """

    def __init__(self, *, rank: int, world_size: int, flight: FlightRecorder, failures: Failures,
                 execute: Callable[[Job], None], stopped: Callable[[], None], timeout: Callable[[], float]) -> None:
        self.world_size = world_size
        self.seq = 0  # the number the next collective gets
        self.running: Job | None = None  # the collective being executed
        self.closed = False
        self._flight = flight
        self._failures = failures
        self._execute = execute
        self._stopped = stopped
        self._timeout = timeout
        self.submit_lock = threading.Lock()  # numbering and pending
        self.exec_lock = threading.Lock()  # held while a collective runs (the engine thread's, or a claim's)
        self.pending = 0  # collectives submitted and not yet finished
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"hfreduce-{rank}", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self._worker.start()

    def alive(self) -> bool:
        """Whether the engine thread still runs (it stops only at close)."""
        return self._worker.is_alive()

    def close(self, timeout: float) -> None:
        """Refuse new collectives, let the engine thread finish the queued ones, and stop it."""
        self.closed = True
        self._queue.put(None)
        self._worker.join(timeout=timeout)

    # ------------------------------------------------------------------ the doors in
    def submit(self, plan: Plan, *, inline: bool = True) -> torch.futures.Future:
        """Queue a collective; the future completes with the plan's result when every sink holds it.

        ``inline=False`` keeps even a small collective off the caller's thread.
        """
        fut: torch.futures.Future = torch.futures.Future()
        if self.closed:
            fut.set_exception(HFReduceError("hfreduce communicator is closed; create a new process group"))
            return fut
        error = self._failures.error
        if error is not None:
            fut.set_exception(fresh(error))  # a failed group stays failed: never compute with fewer ranks
            return fut
        _check_timeout(plan.timeout)
        job = Job(plan=plan, future=fut)
        cuda = [t for _, t in plan.sources + plan.sinks if t.is_cuda]
        if cuda:
            job.stream_event = torch.cuda.Event()
            job.stream_event.record(torch.cuda.current_stream(cuda[0].device))
        small = inline and not cuda and plan.desc.numel * plan.desc.dtype.itemsize <= INLINE_BYTES
        with self.submit_lock:
            job.seq = plan.seq = self.seq
            self.seq += 1
            self._record(job)
            inline = small and self.pending == 0
            self.pending += 1
            if inline:
                self.exec_lock.acquire()  # free: nothing is pending, so the engine thread is idle
            else:
                self._queue.put(job)
        if inline:
            try:
                self._run_job(job)
            finally:
                self.release()
        return fut

    def run_now(self, plan: Plan) -> bool:
        """Run a synchronous CPU collective in the caller's thread, at once, when nothing is ahead of it.

        True: it ran and its results are in place (its error raised otherwise, as a fresh copy).
        False: it did not run (CUDA, closed or failed, or the engine is busy); ``submit`` it instead.
        The door for a caller that would only wait for the result (``dist.all_reduce`` without
        ``async_op``): no future, and no handoff to the engine thread and back, which costs two
        wake-ups where ranks outnumber cores (measured in docs/hfreduce.md, "Why the defaults").
        Any size: the collective's own deadline bounds the wait as it does on the engine thread.
        """
        if self.closed or self._failures.error is not None:
            return False
        for _, t in plan.sources + plan.sinks:
            if t.is_cuda:
                return False
        _check_timeout(plan.timeout)
        job = Job(plan=plan, future=None)

        def number(seq: int) -> None:
            job.seq = plan.seq = seq
            self._record(job)

        if self.claim(number) is None:
            return False
        try:
            self._run_job(job)
        finally:
            self.release()
        return True

    def claim(self, record: Callable[[int], None]) -> int | None:
        """Take the engine for one collective run in the caller's thread, when nothing is pending.

        Returns the collective's number, after ``record(seq)`` has entered it in the flight
        recorder (in order, under the lock), or None when the engine is busy. The caller
        runs it and then calls :meth:`release`, whatever happens.
        """
        with self.submit_lock:
            if self.pending:
                return None
            seq = self.seq
            self.seq += 1
            record(seq)
            self.pending += 1
            self.exec_lock.acquire()  # free: nothing is pending, so the engine thread is idle
        return seq

    def number(self, record: Callable[[int], None]) -> int:
        """The next number of the group's collectives, for one that runs off the engine (across nodes by
        the exchange, or an all-to-all, gather or scatter): ``record(seq)`` enters it in the flight recorder
        under the lock, so the numbers follow the order of the calls, as the engine's own do."""
        with self.submit_lock:
            seq = self.seq
            self.seq += 1
            record(seq)
        return seq

    def number_plan(self, plan: Plan) -> int:
        """:meth:`number` for a collective the engine would run as ``plan``, recorded as it would record it."""
        def record(seq: int) -> None:
            plan.seq = seq
            self._record_plan(seq, plan)

        return self.number(record)

    def release(self) -> None:
        """The collective a caller ran itself is over (its outcome settled): later ones may run."""
        self.exec_lock.release()
        with self.submit_lock:
            self.pending -= 1

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        # One thread per rank: the local ranks already keep every core busy, and OpenMP
        # teams spinning in four processes at once would starve the handoffs. This only
        # changes this thread's setting, not the caller's.
        torch.set_num_threads(1)
        while True:
            job = self._queue.get()
            if job is None:
                self._stopped()
                return
            with self.exec_lock:
                self._run_job(job)
            with self.submit_lock:
                self.pending -= 1

    def _run_job(self, job: Job) -> None:
        """Run one collective to completion and settle its future. Callers hold ``_exec_lock``."""
        try:
            error = self._failures.error
            if error is not None:
                raise fresh(error)
            self.running = job
            self._execute(job)
            for fn in job.plan.on_done:
                fn()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            error = self._failures.fail(exc)
            self.running = None
            self._flight.failed(job.seq, str(error))
            if job.future is not None:
                job.future.set_exception(fresh(error))
            # Ctrl-C stays Ctrl-C, and a stop signal a stop (fireflyer.lifetime.Stopped): what interrupts the
            # caller's thread is not the collective's failure to report, though the group has failed all the same
            if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
                raise
            if job.future is None:  # run in the caller's thread: the caller raises it
                raise fresh(error) from None
        else:
            self.running = None
            self._flight.completed(job.seq)
            if job.future is not None:
                job.future.set_result(job.plan.result)

    def _record(self, job: Job) -> None:
        self._record_plan(job.seq, job.plan)

    def _record_plan(self, seq: int, plan: Plan) -> None:
        trace = plan.trace
        if trace is None:  # the direct API: sizes as torch's analyzer expects them, from the flat buffer
            desc, w = plan.desc, self.world_size
            whole, part = [[desc.numel]], [[desc.numel // w]]
            dtype = [str(desc.dtype).replace("torch.", "")]
            ins, outs = {Kind.ALLGATHER: (part, whole), Kind.REDUCE_SCATTER: (whole, part)}.get(desc.kind, (whole, whole))
            trace = (ins, dtype, outs, dtype)
        self._flight.record(seq, plan.desc.kind.name.lower(), input_sizes=trace[0], input_dtypes=trace[1],
                            output_sizes=trace[2], output_dtypes=trace[3],
                            timeout_s=plan.timeout or self._timeout())


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise UserError(f"a collective's timeout must be positive seconds, got {timeout}")
