"""The node stage: a collective as a pipeline over chunks of a flat buffer, through the node's arena.

1. stage-in   every local rank copies its chunk into its slot of the node's arena
              (D2H on a copy stream for CUDA tensors);
2. reduce     local rank k sums slice k of the chunk across all slots, in one pass;
3. trees      with several nodes, rail r (local rank r of every node) allreduces
              slice r of the node's partial over a double binary tree of nodes
              (``engine/trees.py``; this stage hands it each chunk's half through :class:`TreeChunk`);
4. stage-out  every local rank copies the finished chunk back (H2D for CUDA).

Local ranks hand chunks to each other through the arena's counters (:meth:`Arena.publish`,
:meth:`Arena.wait`), every wait with the collective's deadline. Before its first chunk
each rank writes a descriptor of the collective into the arena, and every rank checks
that all its local peers called the same one. A rank whose input lives in a registered
buffer (``transport/registered.py``) stages nothing in: its peers read the buffer directly.

On one node a small collective runs one-shot: every rank stages in all of its input and
reduces all of it into its own result, with no second handoff. Where the plan is one it
takes, the compiled core (``_core/node.c``, the same protocol) runs the whole stage in
one call; the Python loop here is the reference, and runs what the core hands back.
"""

from __future__ import annotations

import ctypes
import enum
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType

import torch

from fireflyer.hfreduce.transport.arena import STAGES, Arena, Flag
from fireflyer.hfreduce.config import HFReduceConfig
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, error_from_text, fresh
from fireflyer.hfreduce.engine.failures import Failures, mismatch
from fireflyer.hfreduce.engine.jobs import Job
from fireflyer.hfreduce.plans.plan import DESCRIPTOR_BYTES, DTYPES, Descriptor, Op, Plan, acc_dtype, chunk_elems
from fireflyer.hfreduce.engine.slice_reducer import SliceReducer
from fireflyer.hfreduce.transport.registered import SharedBuffers
from fireflyer.hfreduce.plans.topology import split
from fireflyer.hfreduce.engine.trees import SELF_GRACE, TreeChunk

REMOTE_WAIT_GRACE = 1.0
"""Seconds a local timeout waits for the peer's tree stage to name the remote rank it is stuck on."""

_SLICE = 0.05  # seconds between checks while waiting for the stage-out thread
_OUT_GRACE = SELF_GRACE  # a wait on the tree stage's result outlasts the tree stage's own deadline
SHARED_EXT = struct.Struct("<qq")  # after a rank's descriptor: registered buffer (index + 1, bit 62: in place), byte offset
_IN_PLACE = 1 << 62
COMM_FIELDS = ("base", "local_size", "local_rank", "depth", "chunk_bytes", "control_bytes", "red_bytes",
               "flags_offset", "pid_offset", "desc_offset", "abort_offset", "rails", "spin", "yields")
"""_core/node.h's ``hfr_comm``, field by field in its order (all int64; a test reads the header and compares)."""
_COMM = struct.Struct(f"<{len(COMM_FIELDS)}q")


def comm_spec(**fields: int) -> bytes:
    """One ``hfr_comm`` for the compiled core, every field by name (:data:`COMM_FIELDS`, each exactly once)."""
    if set(fields) != set(COMM_FIELDS):
        raise TypeError(f"hfr_comm needs exactly {', '.join(COMM_FIELDS)}; got {', '.join(sorted(fields))}")
    return _COMM.pack(*(fields[name] for name in COMM_FIELDS))
JOB_FIELDS = ("mode", "first_chunk", "nchunks", "elems", "numel", "dtype", "op", "acc_dtype", "divisor", "src", "dst",
              "deadline_ns", "late_deadline_ns", "seq", "desc_bytes", "ext_bytes", "resume", "self_registered",
              "peer_in", "peer_out", "tree")
"""_core/node.h's ``hfr_job``, field by field in its order (all int64; a test reads the header and compares)."""
_JOB = struct.Struct(f"<{len(JOB_FIELDS)}q")


def job_spec(*, mode: int, first_chunk: int, nchunks: int, elems: int, numel: int, dtype: int, op: int,
             acc_dtype: int, divisor: int, src: int, dst: int, deadline_ns: int, late_deadline_ns: int, seq: int,
             desc_bytes: int, ext_bytes: int, resume: int, self_registered: int, peer_in: int, peer_out: int,
             tree: int) -> bytes:
    """One ``hfr_job`` for the compiled core, every field by name (its parameters are :data:`JOB_FIELDS`, in
    order; a plain function, so the small collectives' door pays no more than the pack)."""
    return _JOB.pack(mode, first_chunk, nchunks, elems, numel, dtype, op, acc_dtype, divisor, src, dst, deadline_ns,
                     late_deadline_ns, seq, desc_bytes, ext_bytes, resume, self_registered, peer_in, peer_out, tree)


_PIPELINE, _NODE_STAGE, ONESHOT = 1, 2, 3


class Staged(enum.Enum):
    """How far the compiled core took a collective's node stage (:meth:`NodeStage.run_core`)."""

    DONE = "done"
    """all of it"""
    CHUNK_0_IN = "chunk 0 staged in"
    """chunk 0 staged in and every descriptor seen; the Python loop checks them and goes on (a descriptor
    the core does not judge, or a registered buffer)"""
CORE_DONE, CORE_NEED_PYTHON, _CORE_TIMEOUT, _CORE_ABORTED, _CORE_PEER_DEAD = 0, 1, 2, 3, 4
CORE_DTYPES = frozenset(DTYPES)


class StageOut:
    """One collective's stage-out on the stage-out thread: ``done`` when it is over, ``error`` if it failed."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class NodeStage:
    """Stage-in, reduce and stage-out of one local rank, in Python or in the compiled ``core``.

    ``members`` are the node's global ranks; ``rails`` how many of them take part in the
    trees. ``core`` is the compiled module (None: the Python reference throughout).
    """

    def __init__(self, *, arena: Arena, config: HFReduceConfig, rank: int, world_size: int, members: list[int],
                 num_nodes: int, rails: int, describe: Callable[[int], str], failures: Failures,
                 shared: SharedBuffers | None, core: ModuleType | None) -> None:
        self.arena = arena
        self.shape = arena.shape
        self.config = config  # its chunk_bytes, depth and oneshot_bytes, which never change
        self.rank = rank
        self.world_size = world_size
        self.members = members
        self.local_rank = members.index(rank)
        self.local_size = len(members)
        self.num_nodes = num_nodes
        self.rails = rails
        self.shared = shared
        self.core = core
        self.tree = config.order == "canonical"
        """Whether the reduce combines the node's slots in the canonical pairwise tree (local ranks hold
        consecutive group ranks in order, so it is the subtree of the tree over the group's ranks)."""
        self.chunk = 0  # the number of the node's next chunk: what the arena's counters count
        self._describe = describe
        self._failures = failures
        self._reducer = SliceReducer(compiled=core is not None)
        self._views: dict = {}
        self._elems: dict = {}  # (dtype, op) -> elements per chunk
        self._copy_stream = None
        self.core_comm = self._pack_comm() if core is not None else None
        # Several nodes: a thread stages out what the trees finish, so reducing the next chunks
        # never waits on the network.
        self._out_queue: queue.Queue | None = None
        self._out_thread: threading.Thread | None = None
        if num_nodes > 1:
            self._out_queue = queue.Queue()
            self._out_thread = threading.Thread(target=self._out_loop, name=f"hfreduce-{rank}-out", daemon=True)
            self._out_thread.start()

    def stop(self) -> None:
        """Let the stage-out thread end once it is through the jobs it holds."""
        if self._out_queue is not None:
            self._out_queue.put(None)

    def close(self) -> None:
        if self._out_thread is not None:
            self._out_thread.join(timeout=2)

    # ------------------------------------------------------------------ a collective
    def prepare(self, job: Job, timeout: float) -> None:
        """Place ``job`` in the node's chunk sequence and set its deadlines (``timeout`` seconds from now)."""
        desc = job.plan.desc
        elems = self._elems.get((desc.dtype, desc.op))
        if elems is None:
            red = self.shape.red_bytes if self.num_nodes > 1 else None
            elems = self._elems[desc.dtype, desc.op] = chunk_elems(self.config.chunk_bytes, desc.dtype, desc.op,
                                                                   red_bytes=red)
        job.elems = elems
        job.nchunks = max(1, -(-desc.numel // job.elems))
        job.first_chunk = self.chunk
        job.own = _own_source(job.plan)
        job.shared = self._registered(job.plan)
        job.timeout = timeout
        job.deadline = time.monotonic() + timeout
        job.tree_deadline = job.deadline + min(2.0, 0.25 * timeout)
        self.chunk += job.nchunks
        if job.stream_event is not None:
            self._cuda_prepare(job)

    def run(self, job: Job) -> None:
        """Run the node stage of a prepared ``job`` (its tree stage, if any, already has it)."""
        desc = job.plan.desc
        # One node: stage each chunk out right after reducing it, while it is still in cache.
        # Several nodes: the stage-out thread does, as the trees finish each chunk.
        staged_out = StageOut() if self._out_queue is not None else None
        if staged_out is not None:
            self._out_queue.put((job, staged_out))
        # One node, one small chunk, no registered buffer anywhere (known once every local
        # rank's descriptor is in): one shot.
        oneshot = self.num_nodes == 1 and job.plan.dense and job.nchunks == 1 and \
            desc.numel * desc.dtype.itemsize <= min(self.config.oneshot_bytes, self.config.chunk_bytes)
        staged = self.run_core(job, oneshot) if self.core_comm is not None else None
        self.pipeline(job, oneshot, staged, staged_out)

    def pipeline(self, job: Job, oneshot: bool, staged: Staged | None, staged_out: StageOut | None) -> None:
        """The Python loop over the chunks, from the start or from where the core stopped (``staged``)."""
        depth, L, lr, arena = self.config.depth, self.local_size, self.local_rank, self.arena
        all_local, rails = range(L), range(self.rails)
        for c in range(job.nchunks if staged is not Staged.DONE else 0):
            g = job.first_chunk + c
            if not (c == 0 and staged is Staged.CHUNK_0_IN):
                self._wait(Flag.RED, all_local, g - depth + 1, job)
                if c == 0:
                    self.write_descriptor(job)
                self._stage_in(job, c, whole=oneshot)
                arena.publish(Flag.IN, lr, g + 1)
                self._wait(Flag.IN, all_local, g + 1, job)
            if c == 0:
                self._check_descriptors(job)
                oneshot = oneshot and job.peer_in is None
                if staged is Staged.CHUNK_0_IN and not oneshot and \
                        self.run_core(job, False, resume=True) is Staged.DONE:
                    break  # registered buffers: the core goes on with them from here
            if oneshot:
                self._reduce_oneshot(job)
                arena.publish(Flag.RED, lr, g + 1)  # done reading this buffer's slots
                arena.publish(Flag.DONE, lr, g + 1)  # and never wrote its out buffer
            elif self.num_nodes == 1:
                self._wait(Flag.DONE, all_local, g - depth + 1, job)
                self._reduce(job, c, final=True)
                arena.publish(Flag.RED, lr, g + 1)  # on one node "red" also means "out" is ready
                self._stage_out(job, c)
            else:
                self._wait(Flag.OUT, rails, g - depth + 1, job, late=True)
                self._reduce(job, c, final=False)
                arena.publish(Flag.RED, lr, g + 1)
        if staged_out is None:
            return
        # The stage-out thread's own waits notice a failed group. Once it has staged this
        # collective out, the result is in place, and a failure after that (a peer's next
        # call failing the group) is not this collective's: it returns.
        while not staged_out.done.wait(_SLICE):
            if time.monotonic() > job.tree_deadline + 2 * _OUT_GRACE:  # the stage-out's own waits give up first
                raise CollectiveTimeout(f"{job.plan.desc} timed out on {self._describe(self.rank)} waiting for its "
                                        "stage-out")
        if staged_out.error is not None:
            raise fresh(staged_out.error)

    def _out_loop(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._out_queue.get()
            if item is None:
                return
            job, staged_out = item
            try:
                for c in range(job.nchunks):
                    self._stage_out(job, c)
            except BaseException as exc:  # noqa: BLE001
                staged_out.error = self._failures.fail(exc)
            staged_out.done.set()

    # ------------------------------------------------------------------ handoffs
    def _wait(self, stage: str, local_ranks: Iterable[int], target: int, job: Job, *, late: bool = False) -> None:
        """Until every local rank in ``local_ranks`` has published ``stage`` up to ``target``.

        ``late`` waits use the tree deadline: what they wait for depends on other nodes,
        whose own errors should arrive before this rank gives up on its own account.
        """
        deadline = job.tree_deadline if late else job.deadline
        if stage == Flag.OUT:
            # 'out' is published by a rail's tree threads, which wait on other nodes directly:
            # let them time out first, so the error names the rank really missing.
            deadline += _OUT_GRACE
        failures = self._failures
        self.arena.wait(stage, local_ranks, target, deadline, failures.check,
                        lambda k: self.timed_out(job, stage, k, target),
                        blocked=lambda k: failures.waiting(
                            job.seq, [self.members[k]],
                            f"'{stage}' of chunk {target - 1 - job.first_chunk} of {job.nchunks}"),
                        unblocked=failures.done_waiting)

    def timed_out(self, job: Job, stage: str, k: int, target: int) -> CollectiveTimeout:
        """The timeout of a wait for local rank ``k``'s ``stage`` to reach ``target``, naming whom it waited for."""
        whom = f"{self._describe(self.members[k])} to finish '{stage}' of chunk {target - 1 - job.first_chunk} " \
               f"of {job.nchunks}"
        behind = self._failures.behind(job.seq, but=self.members[k])
        if behind:  # what this rank's other threads (its trees) were stuck on: closer to the cause
            whom += "; its tree stage was waiting for " + behind
        elif k != self.local_rank and self.num_nodes > 1:
            remote = self._remote_wait(k)  # what that local rank's trees were stuck on, if anything
            if remote is not None:
                whom += f", whose tree stage last waited for {self._describe(remote)}"
        return CollectiveTimeout(
            f"{job.plan.desc} (#{job.seq}) timed out after {job.timeout:g}s "
            f"on {self._describe(self.rank)} waiting for {whom}"
        )

    def _remote_wait(self, k: int, grace: float = REMOTE_WAIT_GRACE) -> int | None:
        """The remote rank local rank ``k``'s tree stage is blocked on, waiting up to ``grace`` seconds for
        it to say: on a loaded host that stage may reach its blocking wait a little after this rank's
        own wait ran out, and the message should name the cause, not only the messenger."""
        deadline = time.monotonic() + grace
        while True:
            remote = self.arena.remote_wait(k)
            if remote is not None or time.monotonic() >= deadline:
                return remote
            time.sleep(0.02)

    # The tree stage's view of the node (trees.NodeSide).
    def tree_chunk(self, job: Job, t: int, c: int) -> TreeChunk:
        desc, b = job.plan.desc, self._buf(job, c)
        c0, c1 = self._chunk_range(job, c)
        r0, r1 = split(c1 - c0, self.rails, self.local_rank)
        h0, h1 = split(r1 - r0, 2, t)
        h0, h1 = r0 + h0, r0 + h1
        return TreeChunk(index=c, number=job.first_chunk + c, half=(h0, h1),
                         red=self._view(self.shape.red_offset(b), acc_dtype(desc.dtype, desc.op), h0, h1),
                         out=self._view(self.shape.out_offset(b), desc.dtype, h0, h1))

    def wait_reduced(self, job: Job, chunk: TreeChunk) -> None:
        c0, c1 = self._chunk_range(job, chunk.index)
        owners = [k for k in range(self.local_size) if _overlaps(split(c1 - c0, self.local_size, k), chunk.half)]
        self._wait(Flag.RED, owners, chunk.number + 1, job, late=True)

    def wait_out_free(self, job: Job, chunk: TreeChunk) -> None:
        self._wait(Flag.DONE, range(self.local_size), chunk.number - self.config.depth + 1, job, late=True)

    def publish_out(self, chunk: TreeChunk) -> None:
        self.arena.publish(Flag.OUT, self.local_rank, chunk.number + 1)

    # ------------------------------------------------------------------ where a chunk lives
    def _chunk_range(self, job: Job, c: int) -> tuple[int, int]:
        lo = c * job.elems
        return lo, min(job.plan.desc.numel, lo + job.elems)

    def _buf(self, job: Job, c: int) -> int:
        return (job.first_chunk + c) % self.config.depth

    def _view(self, offset: int, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """A typed view of arena bytes; cached, since the same slices recur chunk after chunk."""
        key = (offset, dtype, lo, hi)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 4096:
                self._views.clear()
            size = dtype.itemsize
            view = self._views[key] = self.arena.bytes[offset + lo * size : offset + hi * size].view(dtype)
        return view

    def _registered(self, plan: Plan) -> tuple[int, int, bool] | None:
        """(buffer, byte offset, in place) when this rank's only input is a registered buffer."""
        if not plan.dense or len(plan.sources) != 1 or plan.sources[0][0] != 0:
            return None
        src = plan.sources[0][1]
        if src.numel() != plan.desc.numel:
            return None
        found = self.shared.locate(src) if self.shared is not None else None
        if found is None:
            return None
        in_place = len(plan.sinks) == 1 and plan.sinks[0][0] == 0 and plan.sinks[0][1].data_ptr() == src.data_ptr() \
            and plan.sinks[0][1].numel() == src.numel() and plan.sinks[0][1].dtype == src.dtype
        return found[0], found[1], in_place

    # ------------------------------------------------------------------ descriptors
    def write_descriptor(self, job: Job) -> None:
        """This rank's view of the collective, in the slot of its first buffer (see ArenaShape.desc_slot)."""
        index, offset, in_place = job.shared or (-1, 0, False)
        ext = SHARED_EXT.pack((index + 1) | (_IN_PLACE if in_place else 0), offset)
        self.arena.write_descriptor(self.local_rank, job.seq.to_bytes(8, "little") + job.plan.desc.pack() + ext,
                                    self._buf(job, 0))

    def _check_descriptors(self, job: Job) -> None:
        size, b = 8 + DESCRIPTOR_BYTES, self._buf(job, 0)
        mine = self.arena.descriptor(self.local_rank, size, b)
        registered = []
        for k in range(self.local_size):
            raw = self.arena.descriptor(k, size + SHARED_EXT.size, b)
            theirs = raw[:size]
            their_seq = int.from_bytes(theirs[:8], "little")
            if theirs != mine and their_seq <= job.seq:  # a rank ahead of us already checked against us
                raise mismatch(job, self._describe(self.rank), self._describe(self.members[k]),
                               Descriptor.unpack(theirs[8:]), their_seq)
            registered.append(SHARED_EXT.unpack(raw[size:]))
        if not any(word for word, _ in registered):
            return
        desc = job.plan.desc
        job.peer_in, job.peer_out = [None] * self.local_size, [None] * self.local_size
        for k, (word, offset) in enumerate(registered):
            if word and self.arena.descriptor(k, 8, b) != job.seq.to_bytes(8, "little"):
                raise HFReduceError(f"{self._describe(self.members[k])} moved past collective #{job.seq} before "
                                    "this rank read where its registered input lives")
            if word:
                view = self.shared.peer_view((word & ~_IN_PLACE) - 1, k, offset, desc.numel, desc.dtype)
                job.peer_in[k] = view
                if word & _IN_PLACE and self.num_nodes == 1:
                    job.peer_out[k] = view

    # ------------------------------------------------------------------ stage-in, reduce, stage-out
    def _stage_in(self, job: Job, c: int, *, whole: bool = False) -> None:
        """Copy this rank's part of chunk ``c`` into its slot: all of it (``whole``: one shot, where every
        rank reads every slot), else all but its own slice, which its reduce reads from the source."""
        if job.shared is not None:
            return  # the other local ranks read this rank's registered buffer directly
        c0, c1 = self._chunk_range(job, c)
        slot = self.shape.in_offset(self._buf(job, c), self.local_rank)
        dtype = job.plan.desc.dtype
        own = job.own
        if own is not None and not whole:
            # Only the other local ranks read this slot; our own slice goes straight into the reduce.
            s0, s1 = split(c1 - c0, self.local_size, self.local_rank)
            if s0 > 0:
                self._copy(self._view(slot, dtype, 0, s0), own[c0 : c0 + s0])
            if s1 < c1 - c0:
                self._copy(self._view(slot, dtype, s1, c1 - c0), own[c0 + s1 : c1])
            return
        for off, src in job.plan.sources:
            lo, hi = max(c0, off), min(c1, off + src.numel())
            if lo < hi:
                self._copy(self._view(slot, dtype, lo - c0, hi - c0), src[lo - off : hi - off])

    def _stage_out(self, job: Job, c: int) -> None:
        g = job.first_chunk + c
        if self.num_nodes == 1:
            self._wait(Flag.RED, range(self.local_size), g + 1, job)
        else:
            self._wait(Flag.OUT, range(self.rails), g + 1, job, late=True)
        c0, c1 = self._chunk_range(job, c)
        out = self.shape.out_offset(self._buf(job, c))
        dtype = job.plan.desc.dtype
        if job.peer_out is not None and job.peer_out[self.local_rank] is not None:
            self.arena.publish(Flag.DONE, self.local_rank, g + 1)  # every slice's owner wrote it here already
            return
        for off, dst in job.plan.sinks:
            lo, hi = max(c0, off), min(c1, off + dst.numel())
            if lo < hi:
                self._copy(dst[lo - off : hi - off], self._view(out, dtype, lo - c0, hi - c0))
        self._cuda_sync()
        self.arena.publish(Flag.DONE, self.local_rank, g + 1)

    def _reduce(self, job: Job, c: int, *, final: bool) -> None:
        """Reduce this local rank's slice of chunk ``c`` across the node's slots."""
        desc, b = job.plan.desc, self._buf(job, c)
        c0, c1 = self._chunk_range(job, c)
        s0, s1 = split(c1 - c0, self.local_size, self.local_rank)
        if s0 == s1:
            return
        if final:
            target = self._view(self.shape.out_offset(b), desc.dtype, s0, s1)
        else:
            target = self._view(self.shape.red_offset(b), acc_dtype(desc.dtype, desc.op), s0, s1)
        if not job.plan.dense:
            self._gather_slice(job, b, c0, s0, s1, target)
            return
        peer_in = job.peer_in
        inputs = [
            peer_in[k][c0 + s0 : c0 + s1] if peer_in is not None and peer_in[k] is not None
            else self._view(self.shape.in_offset(b, k), desc.dtype, s0, s1)
            for k in range(self.local_size)
        ]
        own = job.own
        if own is not None:
            inputs[self.local_rank] = own[c0 + s0 : c0 + s1]
        self._reducer.reduce(target, inputs, desc.op, divisor=self.world_size if final and desc.op == Op.AVG else 0,
                             tree=self.tree)
        if final and job.peer_out is not None:
            for dst in job.peer_out:  # one node, registered in place: the result goes straight home
                if dst is not None:
                    dst[c0 + s0 : c0 + s1].copy_(target)

    def _reduce_oneshot(self, job: Job) -> None:
        """One shot: reduce the whole chunk from every slot into this rank's own result, then its sinks."""
        desc, b = job.plan.desc, self._buf(job, 0)
        n = desc.numel
        inputs = [self._view(self.shape.in_offset(b, k), desc.dtype, 0, n) for k in range(self.local_size)]
        if job.own is not None:
            inputs[self.local_rank] = job.own
        result = torch.empty(n, dtype=desc.dtype)  # never an input: the reference reduces input by input
        self._reducer.reduce(result, inputs, desc.op, divisor=self.world_size if desc.op == Op.AVG else 0,
                             tree=self.tree)
        for off, dst in job.plan.sinks:
            self._copy(dst, result[off : off + dst.numel()])
        self._cuda_sync()

    def _gather_slice(self, job: Job, b: int, c0: int, s0: int, s1: int, target: torch.Tensor) -> None:
        """Collectives with one contributor per element: copy each owner's range, zero what other nodes own."""
        dtype = job.plan.desc.dtype
        for lo, hi, owner in job.plan.owners:
            a, z = max(lo, c0 + s0), min(hi, c0 + s1)
            if a >= z:
                continue
            piece = target[a - c0 - s0 : z - c0 - s0]
            if owner in self.members:
                k = self.members.index(owner)
                piece.copy_(self._view(self.shape.in_offset(b, k), dtype, a - c0, z - c0))
            else:
                piece.view(torch.uint8).zero_()

    # ------------------------------------------------------------------ the compiled core
    def _pack_comm(self) -> bytes:
        shape, base = self.shape, self.arena.base_address
        return comm_spec(base=base, local_size=self.local_size, local_rank=self.local_rank, depth=shape.depth,
                         chunk_bytes=shape.chunk_bytes, control_bytes=shape.control_bytes, red_bytes=shape.red_bytes,
                         flags_offset=shape.flags_offset, pid_offset=shape.pid_offset, desc_offset=shape.desc_offset,
                         abort_offset=shape.abort_offset, rails=self.rails, spin=self.config.spin,
                         yields=self.config.yields)

    def run_core(self, job: Job, oneshot: bool, *, resume: bool = False) -> Staged | None:
        """Run the node stage of ``job`` in the compiled core, when its plan is one the core takes.

        Returns None (not taken: the Python loop runs it all), :attr:`Staged.DONE`, or :attr:`Staged.CHUNK_0_IN`
        (a descriptor the core does not judge, or a registered buffer: the Python loop checks the
        descriptors, then hands the rest back with ``resume``, the registered buffers mapped)."""
        plan, desc = job.plan, job.plan.desc
        own = job.own
        if own is None or job.stream_event is not None or desc.dtype not in CORE_DTYPES \
                or own.numel() != desc.numel or own.dtype != desc.dtype or not own.is_contiguous():
            return None
        if self.num_nodes == 1:
            sink = plan.sinks[0][1] if len(plan.sinks) == 1 and plan.sinks[0][0] == 0 else None
            if sink is None or sink.numel() != desc.numel or sink.dtype != desc.dtype or sink.is_cuda or \
                    not sink.is_contiguous():
                return None
            mode, dst = (ONESHOT if oneshot else _PIPELINE), sink.data_ptr()
        else:
            mode, dst = _NODE_STAGE, 0
        acc = acc_dtype(desc.dtype, desc.op)
        divisor = self.world_size if desc.op == Op.AVG and self.num_nodes == 1 else 0
        late = job.tree_deadline + (_OUT_GRACE if self.num_nodes > 1 else 0.0)
        peer_in = _addresses(job.peer_in) if resume else None
        peer_out = _addresses(job.peer_out) if resume and self.num_nodes == 1 else None
        spec = job_spec(mode=mode, first_chunk=job.first_chunk, nchunks=job.nchunks, elems=job.elems,
                        numel=desc.numel, dtype=DTYPES[desc.dtype], op=int(desc.op), acc_dtype=DTYPES[acc],
                        divisor=divisor, src=own.data_ptr(), dst=dst, deadline_ns=int(job.deadline * 1e9),
                        late_deadline_ns=int(late * 1e9), seq=job.seq, desc_bytes=DESCRIPTOR_BYTES,
                        ext_bytes=SHARED_EXT.size, resume=int(resume), self_registered=int(job.shared is not None),
                        peer_in=ctypes.addressof(peer_in) if peer_in is not None else 0,
                        peer_out=ctypes.addressof(peer_out) if peer_out is not None else 0, tree=int(self.tree))
        if not resume:
            self.write_descriptor(job)
        if self.num_nodes > 1:  # the trees' threads name what this one waits for in their own timeouts
            self._failures.waiting(job.seq, [r for r in self.members if r != self.rank],
                                   "the node stage (compiled core)")
        rc, stage, k, chunk, was_late = self.core.node_run(self.core_comm, spec)
        if self.num_nodes > 1:
            self._failures.done_waiting()
        if rc == CORE_DONE:
            return Staged.DONE
        if rc == CORE_NEED_PYTHON:
            return Staged.CHUNK_0_IN
        raise self.core_failure(job, rc, stage, k, chunk)

    def core_failure(self, job: Job, rc: int, stage: int, k: int, chunk: int) -> HFReduceError:
        """The error of a core run that stopped with ``rc`` while waiting for local rank ``k``'s ``stage``."""
        stage_name = STAGES[stage] if 0 <= stage < len(STAGES) else "?"
        if rc == _CORE_ABORTED:
            return error_from_text(self.arena.abort_message(), HFReduceError)
        if rc == _CORE_PEER_DEAD:
            return self._failures.peer_died(self.members[k], job.seq)
        if rc == _CORE_TIMEOUT:
            return self.timed_out(job, stage_name, k, job.first_chunk + chunk + 1)
        return HFReduceError(f"hfreduce's compiled core failed on {job.plan.desc}: error {rc} ({_core_error(rc)})")

    # ------------------------------------------------------------------ CUDA
    def _cuda_prepare(self, job: Job) -> None:
        """Pin the arena once and order this collective's copies after the caller's stream."""
        self.arena.pin()
        device = next(t.device for _, t in job.plan.sources + job.plan.sinks if t.is_cuda)
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device=device)
        self._copy_stream.wait_event(job.stream_event)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host copies run inline; D2H and H2D run on the copy stream (copy engines, no kernels)."""
        if dst.is_cuda or src.is_cuda:
            stream = self._copy_stream
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            if src.is_cuda:  # D2H must land before the flag announces it
                stream.synchronize()
        else:
            dst.copy_(src)

    def _cuda_sync(self) -> None:
        """Wait for queued H2D copies before the arena buffer they read from is reused."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()


def _own_source(plan: Plan) -> torch.Tensor | None:
    """The CPU tensor this rank reduces its own slice from directly, skipping its slot."""
    if plan.dense and len(plan.sources) == 1 and plan.sources[0][0] == 0 and not plan.sources[0][1].is_cuda:
        return plan.sources[0][1]
    return None


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] or (a == b)


def _addresses(tensors: list | None) -> "ctypes.Array | None":
    """Each local rank's registered buffer as an address (0: none), for the core; None when no rank has one."""
    if tensors is None or not any(t is not None for t in tensors):
        return None
    return (ctypes.c_int64 * len(tensors))(*[0 if t is None else t.data_ptr() for t in tensors])


def _core_error(rc: int) -> str:
    return {-1: "unknown dtype", -2: "an op the dtype cannot take", -3: "bad output dtype", -4: "bad argument",
            -5: "a misaligned pointer"}.get(rc, "unknown")
