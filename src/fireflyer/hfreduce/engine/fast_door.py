"""The fast door: ``dist.all_reduce`` of a small CPU tensor on one node, as one call of the compiled core.

The same protocol, descriptors, flight record and errors as the general path, with none
of its bookkeeping: no plan or job unless the core hands the collective back (a
descriptor it does not judge, or a registered peer buffer), when the node stage's Python
loop finishes it from there.

A call goes through four steps, each a method, so that the C++ door (``backend/door.cpp``)
can follow them without Python and this module keeps the rules:

1. :meth:`FastDoor.slot`: what the door packs for the core for this dtype, shape and op (kept per shape);
2. :meth:`FastDoor.enter`: the collective's number, flight record and deadline, when the engine is free;
3. the descriptor and the core's run (:meth:`FastDoor.run` here, ``door.cpp`` in C++);
4. :meth:`FastDoor.done` when the core finished it, else :meth:`FastDoor.settle` (a mismatch or a registered
   peer finished in Python, or the failure raised).

The C++ door asks :meth:`FastDoor.slot` once per shape and does steps 2 to 4 itself: it claims the
engine with the jobs' own locks and numbers (:attr:`FastDoor.parts`), and records the collective in a
ring of its own that the flight recorder merges (:class:`~fireflyer.hfreduce.diagnosis.flight.Ledger`).
What the core does not finish it hands back: :meth:`FastDoor.adopt` moves the record to the flight
recorder, then :meth:`FastDoor.settle` settles it as the Python door's. Where the tensor is a
registered buffer, or the recorder keeps Python stacks, it calls :meth:`FastDoor.enter` and
:meth:`FastDoor.done` instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fireflyer.hfreduce.errors import fresh
from fireflyer.hfreduce.engine.failures import Failures
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder, trace_of
from fireflyer.hfreduce.engine.jobs import Job, Jobs
from fireflyer.hfreduce.engine.node_stage import (
    CORE_DONE,
    CORE_DTYPES,
    CORE_NEED_PYTHON,
    ONESHOT,
    SHARED_EXT,
    NodeStage,
    Staged,
    job_spec,
)
from fireflyer.hfreduce.plans.plan import DESCRIPTOR_BYTES, DTYPES, Descriptor, Kind, Op, Plan, acc_dtype, check_op
from fireflyer.errors import UserError

Ticket = tuple[int, int, int, "float | None", float]
"""What :meth:`FastDoor.enter` hands out: (seq, the group's chunk number, deadline in CLOCK_MONOTONIC ns,
the call's own timeout or None, the seconds it runs under)."""


class Slot:
    """What the door keeps for one (dtype, shape, op): the descriptor, its packed bytes, the core's job without
    the per-call fields (``job``: an ``hfr_job`` whose first chunk, addresses, deadlines and seq are 0) and the
    flight record's trace."""

    __slots__ = ("desc", "packed", "job", "trace", "numel", "op", "dtype", "acc", "divisor", "tree")

    def __init__(self, desc: Descriptor, trace: tuple, *, divisor: int, tree: bool) -> None:
        self.desc = desc
        self.packed = desc.pack() + bytes(SHARED_EXT.size)
        self.trace = trace
        self.numel = desc.numel
        self.op = desc.op
        self.dtype = DTYPES[desc.dtype]
        self.acc = DTYPES[acc_dtype(desc.dtype, desc.op)]
        self.divisor = divisor
        self.tree = int(tree)
        self.job = self.spec(0, 0, 0, 0)

    def spec(self, first_chunk: int, ptr: int, deadline_ns: int, seq: int) -> bytes:
        """The core's ``hfr_job`` for one call, in place at ``ptr``."""
        return job_spec(mode=ONESHOT, first_chunk=first_chunk, nchunks=1, elems=max(1, self.numel), numel=self.numel,
                        dtype=self.dtype, op=int(self.op), acc_dtype=self.acc, divisor=self.divisor, src=ptr, dst=ptr,
                        deadline_ns=deadline_ns, late_deadline_ns=deadline_ns, seq=seq, desc_bytes=DESCRIPTOR_BYTES,
                        ext_bytes=SHARED_EXT.size, resume=0, self_registered=0, peer_in=0, peer_out=0, tree=self.tree)


class FastDoor:
    """The door for one communicator on one node whose core is built (see the module docstring).

    ``timeout()`` is the communicator's default timeout, in seconds.
    """

    MAX_SLOTS = 1024
    """Shapes kept at once; past it the door starts its list again."""

    def __init__(self, *, node: NodeStage, jobs: Jobs, failures: Failures, flight: FlightRecorder,
                 timeout: Callable[[], float]) -> None:
        self._node = node
        self._jobs = jobs
        self._failures = failures
        self._flight = flight
        self._timeout = timeout
        self._slots: dict[tuple, Slot | None] = {}  # (dtype, shape, op) -> its slot, None where the door declines

    # ------------------------------------------------------------------ for the C++ door
    @property
    def descriptor_address(self) -> tuple[int, int, int, int, int]:
        """Where the descriptors lie: (address of buffer 0's, bytes per rank's descriptor, ranks per buffer,
        this rank's index, buffers); rank ``k``'s in buffer ``b`` is at ``address + (b * ranks + k) * bytes``."""
        node = self._node
        return (node.arena.descriptor_address(0, 0), node.arena.descriptor_bytes, node.local_size,
                node.local_rank, node.config.depth)

    @property
    def core_comm(self) -> bytes:
        """The core's ``hfr_comm`` for this communicator."""
        return self._node.core_comm

    @property
    def parts(self) -> tuple[Jobs, Failures, NodeStage, FlightRecorder]:
        """What the C++ door claims and records with itself, as :meth:`enter` and :meth:`done` do: the jobs,
        the failures, the node stage and the flight recorder."""
        return self._jobs, self._failures, self._node, self._flight

    def default_timeout(self) -> float:
        """The communicator's timeout, in seconds: a call's when it gives none."""
        return self._timeout()

    def adopt(self, slot: Slot, seq: int, seconds: float) -> None:
        """Collective ``seq``, claimed and recorded by the C++ door, which did not finish: the flight recorder
        takes its record over (scheduled and started), so that :meth:`settle` settles it as its own."""
        self._record(slot, seq, seconds)
        self._flight.started(seq)

    def _record(self, slot: Slot, seq: int, seconds: float) -> None:
        """Collective ``seq``, of ``slot``'s shape, enters the flight recorder (scheduled)."""
        trace = slot.trace
        self._flight.record(seq, "allreduce", input_sizes=trace[0], input_dtypes=trace[1], output_sizes=trace[2],
                            output_dtypes=trace[3], timeout_s=seconds)

    # ------------------------------------------------------------------ the four steps
    def slot(self, tensor: torch.Tensor, op: Op) -> Slot | None:
        """What the door packs for ``tensor``'s dtype and shape and ``op``; None where it does not take them
        (a dtype the core lacks, or more than one chunk). An op the dtype cannot take raises, as on every path."""
        key = (tensor.dtype, tensor.shape, op)
        try:
            return self._slots[key]
        except KeyError:
            pass
        dtype, numel, cfg = tensor.dtype, tensor.numel(), self._node.config
        slot = None
        if dtype in CORE_DTYPES and numel * dtype.itemsize <= min(cfg.oneshot_bytes, cfg.chunk_bytes):
            check_op(op, dtype)
            # The flight record keeps the trace's lists: one pair per shape, so a call leaves none behind.
            sizes, dtypes = trace_of([tensor])
            slot = Slot(Descriptor(Kind.ALLREDUCE, dtype, numel, op), (sizes, dtypes, sizes, dtypes),
                        divisor=self._node.world_size if op == Op.AVG else 0, tree=self._node.tree)
        if len(self._slots) >= self.MAX_SLOTS:
            self._slots.clear()
        self._slots[key] = slot
        return slot

    def enter(self, slot: Slot, ptr: int, nbytes: int, timeout: float | None) -> Ticket | None:
        """Number the collective and record it, when the engine is free and the group has not failed; None
        otherwise, or where the bytes at ``ptr`` are a registered buffer (the general path takes it then)."""
        node, jobs = self._node, self._jobs
        if jobs.closed or self._failures.error is not None:
            return None
        if node.shared is not None and node.shared.locate_bytes(ptr, nbytes) is not None:
            return None
        if timeout is not None and not timeout > 0:
            raise UserError(f"a collective's timeout must be positive seconds, got {timeout}")
        seconds = timeout or self._timeout()
        seq = jobs.claim(lambda seq: self._record(slot, seq, seconds))
        if seq is None:
            return None
        g = node.chunk
        node.chunk += 1
        self._flight.started(seq)
        return seq, g, int((time.monotonic() + seconds) * 1e9), timeout, seconds

    def run(self, slot: Slot, ptr: int, ticket: Ticket) -> tuple[int, int, int, int]:
        """Step 3 in Python: the descriptor, then the core's run; (rc, stage, local rank, chunk) as the core left
        them. Raises what interrupted it (Ctrl-C)."""
        node = self._node
        seq, g, deadline_ns = ticket[0], ticket[1], ticket[2]
        node.arena.write_descriptor(node.local_rank, seq.to_bytes(8, "little") + slot.packed, g % node.config.depth)
        rc, stage, k, chunk, _ = node.core.node_run(node.core_comm, slot.spec(g, ptr, deadline_ns, seq))
        return rc, stage, k, chunk

    def done(self, seq: int) -> None:
        """Step 4 when the core finished collective ``seq``."""
        try:
            self._flight.completed(seq)
        finally:
            self._jobs.release()

    def settle(self, slot: Slot, tensor: torch.Tensor, ticket: Ticket, rc: int, stage: int, k: int, chunk: int,
               interrupt: BaseException | None = None) -> None:
        """Step 4 where the core did not finish (``rc`` not done): finish in Python what it handed back
        (need-Python), or fail the group with what stopped it (its named error, raised; ``interrupt``, raised as
        it is)."""
        node, jobs = self._node, self._jobs
        seq, g, deadline_ns, timeout, seconds = ticket
        try:
            if interrupt is not None:
                raise interrupt
            deadline = deadline_ns / 1e9
            flat = tensor.view(-1)
            plan = Plan(slot.desc, sources=[(0, flat)], sinks=[(0, flat)], world_size=node.world_size,
                        timeout=timeout, trace=slot.trace, seq=seq)
            job = Job(plan=plan, future=None, first_chunk=g, nchunks=1, elems=max(1, slot.numel), seq=seq,
                      timeout=seconds, deadline=deadline, tree_deadline=deadline, own=flat)
            if rc != CORE_NEED_PYTHON:
                raise node.core_failure(job, rc, stage, k, chunk)
            jobs.running = job
            node.pipeline(job, True, Staged.CHUNK_0_IN, None)  # a mismatch, or a registered peer
            jobs.running = None
            self._flight.completed(seq)
        except BaseException as exc:  # noqa: BLE001 - as a job's failure: every one reaches the caller
            error = self._failures.fail(exc)
            jobs.running = None
            self._flight.failed(seq, str(error))
            if not isinstance(exc, Exception):  # Ctrl-C stays Ctrl-C, a stop a stop; the group has failed all the same
                raise
            raise fresh(error) from None
        finally:
            jobs.release()

    # ------------------------------------------------------------------ the Python door
    def allreduce_now(self, tensor: torch.Tensor, op: Op, timeout: float | None) -> bool:
        """True when it ran (its error raised otherwise); False when it is not a collective this door
        takes, or the engine is busy (the caller then takes the general path)."""
        if tensor.is_cuda or not tensor.is_contiguous():
            return False
        slot = self.slot(tensor, op)
        if slot is None:
            return False
        ptr = tensor.data_ptr()
        ticket = self.enter(slot, ptr, slot.numel * tensor.element_size(), timeout)
        if ticket is None:
            return False
        try:
            rc, stage, k, chunk = self.run(slot, ptr, ticket)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C inside the core's wait
            self.settle(slot, tensor, ticket, 0, 0, 0, 0, interrupt=exc)
            raise  # settle raised it already; for the type checker
        if rc == CORE_DONE:
            self.done(ticket[0])
        else:
            self.settle(slot, tensor, ticket, rc, stage, k, chunk)
        return True
