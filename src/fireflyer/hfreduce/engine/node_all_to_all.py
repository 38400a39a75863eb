"""``all_to_all_single`` within one node, through the arena in one shot (the compiled core).

Small exchanges between the ranks of one node cost handoffs more than bytes: through the
exchange's rings every rank announces each piece to, and wakes, each of its peers. Here
every rank copies its split table and its whole input into its slot of one arena buffer
and raises one flag; then each copies the pieces meant for it straight from the peers'
slots into its output (``HFR_MODE_ALL_TO_ALL`` in ``_core/node.h``). One handoff for the
whole collective, as for the one-shot allreduce, and the same descriptor check, deadlines,
liveness checks and abort word.

It runs in the engine's order, as a job, so a synchronous call on one rank and an
``async_op`` one on another meet in the same place. An input that does not fit its slot
(the chunk less the split table) is known to every rank after the handoff; then all of
them move the bytes through the exchange together, under the exchange collective number
reserved when the call was made, so they match whatever else the exchange carries.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

import torch

from fireflyer.hfreduce.transport.arena import check_unless
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.engine.node_stage import CORE_DONE, CORE_NEED_PYTHON, SHARED_EXT, job_spec
from fireflyer.hfreduce.plans.plan import DESCRIPTOR_BYTES, DTYPES, Descriptor, Kind, Op, Plan
from fireflyer.hfreduce.transport.transfers import COLLECTIVE, Kind as Digest, dest_bytes, digest, source_bytes

if TYPE_CHECKING:
    from fireflyer.hfreduce.engine.communicator import Communicator
    from fireflyer.hfreduce.engine.jobs import Job

MODE = 4  # HFR_MODE_ALL_TO_ALL
_SPLIT_MISMATCH, _TOO_BIG = 6, 7
_WAIT_SLICE = 0.0005  # seconds between looks at a fallback exchange's future


def header_bytes(local_size: int) -> int:
    """HFR_A2A_HEADER: the fits word and the send offsets and lengths, rounded to a cache line."""
    return (local_size * 16 + 8 + 63) // 64 * 64


def plan(comm: "Communicator", output: torch.Tensor, input: torch.Tensor, out_rows: list[int],
         in_rows: list[int], *, even: bool) -> Plan | None:
    """The job for this call when it can go through the arena, else None (take the exchange).

    ``out_rows``/``in_rows``: rows (dim 0) per rank, already checked. ``even``: no split sizes were
    given, so every rank's input has the same size in a well-formed call and one that does not fit
    skips the arena at once; uneven ones always try it (only the handoff tells who fits).
    """
    node = comm.node_stage
    if comm.num_nodes != 1 or comm.local_size < 2 or node is None or node.core_comm is None or \
            comm.exchange is None or input.dtype not in DTYPES or output.dtype != input.dtype or \
            input.is_cuda or output.is_cuda or not input.is_contiguous() or not output.is_contiguous():
        return None
    L = comm.local_size
    nbytes = input.numel() * input.element_size()
    if even and header_bytes(L) + nbytes > node.shape.chunk_bytes:
        return None
    row_in, row_out = input.element_size() * _row(input), output.element_size() * _row(output)
    table = (ctypes.c_int64 * (4 * L))()
    off = 0
    for r, rows in enumerate(in_rows):
        table[r], table[L + r] = off, rows * row_in
        off += rows * row_in
    off = 0
    for r, rows in enumerate(out_rows):
        table[2 * L + r], table[3 * L + r] = off, rows * row_out
        off += rows * row_out
    number = comm.exchange.reserve(1)  # the exchange collective a fallback would be, numbered in call order
    desc = Descriptor(Kind.ALL_TO_ALL, input.dtype, 0, Op.SUM)
    flat_in, flat_out = input.view(-1), output.view(-1)
    return Plan(desc, sources=[(0, flat_in)], sinks=[(0, flat_out)], world_size=comm.world_size, result=[output],
                run=lambda job: _run(comm, job, input, output, table, in_rows, out_rows, number))


def _row(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _run(comm: "Communicator", job: "Job", input: torch.Tensor, output: torch.Tensor, table, in_rows: list[int],
         out_rows: list[int], number: int) -> None:
    node = comm.node_stage
    timeout = job.plan.timeout or comm.config.timeout
    job.first_chunk, job.nchunks = node.chunk, 1
    node.chunk += 1
    job.timeout = timeout
    job.deadline = job.tree_deadline = time.monotonic() + timeout
    comm.flight.started(job.seq)
    node.write_descriptor(job)
    nbytes = input.numel() * input.element_size()
    deadline_ns = int(job.deadline * 1e9)
    code = DTYPES[input.dtype]
    spec = job_spec(mode=MODE, first_chunk=job.first_chunk, nchunks=1, elems=1, numel=nbytes, dtype=code,
                    op=int(Op.SUM), acc_dtype=code, divisor=0, src=input.data_ptr(), dst=output.data_ptr(),
                    deadline_ns=deadline_ns, late_deadline_ns=deadline_ns, seq=job.seq, desc_bytes=DESCRIPTOR_BYTES,
                    ext_bytes=SHARED_EXT.size, resume=0, self_registered=0, peer_in=ctypes.addressof(table),
                    peer_out=0, tree=0)
    rc, stage, k, got, _ = node.core.node_run(node.core_comm, spec)
    if rc == CORE_DONE:
        return
    L = comm.local_size
    if rc == _SPLIT_MISMATCH:
        them, me = comm.describe(node.members[k]), comm.describe(comm.rank)
        raise CollectiveMismatch(f"all_to_all_single mismatch: {them} sends {got} bytes to {me}, which expects "
                                 f"{table[3 * L + k]} bytes from it (its output_split_sizes)")
    if rc == CORE_NEED_PYTHON:
        node._check_descriptors(job)  # raises the mismatch, naming both calls
        raise HFReduceError(f"all_to_all_single on {comm.describe(comm.rank)}: the node's ranks disagree on it")
    if rc != _TOO_BIG:
        raise node.core_failure(job, rc, stage, k, 0)
    _through_exchange(comm, job, input, output, in_rows, out_rows, number)


def _through_exchange(comm: "Communicator", job: "Job", input: torch.Tensor, output: torch.Tensor,
                      in_rows: list[int], out_rows: list[int], number: int) -> None:
    """Some rank's input did not fit its slot: every rank sends through the exchange, keyed ``number``."""
    ex, me = comm.exchange, comm.rank
    if input.data_ptr() < output.data_ptr() + output.numel() * output.element_size() and \
            output.data_ptr() < input.data_ptr() + input.numel() * input.element_size():
        input = input.clone()  # in place: the rows sent must not be overwritten by the rows received
    finish: list = []
    src, dst = source_bytes(input), dest_bytes(output, finish)
    key = (COLLECTIVE, number)
    sends, recvs = [], []
    off_in = off_out = 0
    row_in, row_out = input.element_size() * _row(input), output.element_size() * _row(output)
    for r in range(comm.world_size):
        n_in, n_out = in_rows[r] * row_in, out_rows[r] * row_out
        piece_in, piece_out = src[off_in : off_in + n_in], dst[off_out : off_out + n_out]
        off_in, off_out = off_in + n_in, off_out + n_out
        if r == me:
            piece_out.copy_(piece_in)  # the lengths agreed in the handoff
            continue
        sends.append((r, key, piece_in, digest(Digest.ALL_TO_ALL, torch.uint8, n_in)))
        recvs.append((r, key, piece_out, digest(Digest.ALL_TO_ALL, torch.uint8, n_out)))
    op = ex.post("all_to_all_single", sends=sends, recvs=recvs,
                 timeout=max(1e-3, job.deadline - time.monotonic()), record=job.seq)
    give_up = job.deadline + 2.0  # the exchange's own deadline ends the call first
    while not op.future.done():
        if check_unless(comm.check, op.future.done):  # it finished first: a failure after is not this call's
            break
        if time.monotonic() > give_up:
            raise CollectiveTimeout(f"all_to_all_single timed out on {comm.describe(me)} in the exchange")
        time.sleep(_WAIT_SLICE)
    op.future.value()  # raises the call's error
    for fn in finish:
        fn()
