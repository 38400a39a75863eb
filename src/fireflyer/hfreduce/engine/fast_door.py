"""The fast door: ``dist.all_reduce`` of a small CPU tensor on one node, as one call of the compiled core.

The same protocol, descriptors, flight record and errors as the general path, with none
of its bookkeeping: no plan or job unless the core hands the collective back (a
descriptor it does not judge, or a registered peer buffer), when the node stage's Python
loop finishes it from there.
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


class FastDoor:
    """The door for one communicator on one node whose core is built (see the module docstring).

    ``timeout()`` is the communicator's default timeout, in seconds.
    """

    def __init__(self, *, node: NodeStage, jobs: Jobs, failures: Failures, flight: FlightRecorder,
                 timeout: Callable[[], float]) -> None:
        self._node = node
        self._jobs = jobs
        self._failures = failures
        self._flight = flight
        self._timeout = timeout
        self._fast: dict = {}  # (dtype, shape, op) -> what the door packs for the core, and its trace

    def allreduce_now(self, tensor: torch.Tensor, op: Op, timeout: float | None) -> bool:
        """True when it ran (its error raised otherwise); False when it is not a collective this door
        takes, or the engine is busy (the caller then takes the general path)."""
        node, jobs = self._node, self._jobs
        if jobs.closed or self._failures.error is not None:
            return False
        key = (tensor.dtype, tensor.shape, op)
        fast = self._fast.get(key)
        if fast is None:
            dtype, numel, cfg = tensor.dtype, tensor.numel(), node.config
            if dtype not in CORE_DTYPES or numel * dtype.itemsize > min(cfg.oneshot_bytes, cfg.chunk_bytes):
                return False
            check_op(op, dtype)
            desc = Descriptor(Kind.ALLREDUCE, dtype, numel, op)
            if len(self._fast) > 1024:
                self._fast.clear()
            # The flight record keeps the trace's lists: one pair per shape, so a call leaves none behind.
            sizes, dtypes = trace_of([tensor])
            fast = self._fast[key] = (desc, desc.pack() + bytes(SHARED_EXT.size), DTYPES[dtype],
                                      DTYPES[acc_dtype(dtype, op)], node.world_size if op == Op.AVG else 0,
                                      numel, (sizes, dtypes, sizes, dtypes))
        if not tensor.is_contiguous() or tensor.is_cuda or (node.shared is not None and
                                                             node.shared.locate(tensor) is not None):
            return False
        if timeout is not None and not timeout > 0:
            raise UserError(f"a collective's timeout must be positive seconds, got {timeout}")
        desc, packed, dtype_code, acc_code, divisor, numel, trace = fast
        seconds = timeout or self._timeout()
        seq = jobs.claim(lambda seq: self._flight.record(seq, "allreduce", input_sizes=trace[0],
                                                         input_dtypes=trace[1], output_sizes=trace[2],
                                                         output_dtypes=trace[3], timeout_s=seconds))
        if seq is None:
            return False
        try:
            g = node.chunk
            node.chunk += 1
            deadline = time.monotonic() + seconds
            self._flight.started(seq)
            node.arena.write_descriptor(node.local_rank, seq.to_bytes(8, "little") + packed, g % node.config.depth)
            ptr = tensor.data_ptr()
            rc, stage, k, chunk, _ = node.core.node_run(node.core_comm, job_spec(
                mode=ONESHOT, first_chunk=g, nchunks=1, elems=max(1, numel), numel=numel, dtype=dtype_code,
                op=int(op), acc_dtype=acc_code, divisor=divisor, src=ptr, dst=ptr, deadline_ns=int(deadline * 1e9),
                late_deadline_ns=int(deadline * 1e9), seq=seq, desc_bytes=DESCRIPTOR_BYTES,
                ext_bytes=SHARED_EXT.size, resume=0, self_registered=0, peer_in=0, peer_out=0, tree=int(node.tree)))
            if rc == CORE_DONE:
                self._flight.completed(seq)
                return True
            flat = tensor.view(-1)
            plan = Plan(desc, sources=[(0, flat)], sinks=[(0, flat)], world_size=node.world_size, timeout=timeout,
                        trace=trace, seq=seq)
            job = Job(plan=plan, future=None, first_chunk=g, nchunks=1, elems=max(1, numel), seq=seq,
                      timeout=seconds, deadline=deadline, tree_deadline=deadline, own=flat)
            if rc != CORE_NEED_PYTHON:
                raise node.core_failure(job, rc, stage, k, chunk)
            jobs.running = job
            node.pipeline(job, True, Staged.CHUNK_0_IN, None)  # a mismatch, or a registered peer
            jobs.running = None
            self._flight.completed(seq)
            return True
        except BaseException as exc:  # noqa: BLE001 - as a job's failure: every one reaches the caller
            error = self._failures.fail(exc)
            jobs.running = None
            self._flight.failed(seq, str(error))
            if not isinstance(exc, Exception):  # Ctrl-C stays Ctrl-C, a stop a stop; the group has failed all the same
                raise
            raise fresh(error) from None
        finally:
            jobs.release()
