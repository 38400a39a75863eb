"""The inter-node stage: each rail allreduces its slice of every chunk over two binary trees of nodes.

Rail r is local rank r of every node. For each of the two trees (NCCL's double
binary tree over nodes) a rail runs a reduce-up thread and a broadcast-down thread,
so chunk c can travel down while chunk c+1 is still being summed on its way up.
Tree t carries half t of the rail's slice. Partial sums travel in the accumulation
dtype; the root rounds once and sends the final dtype down.

The stage sees its node through a narrow interface, :class:`NodeSide`: per chunk, the
half it carries (:class:`TreeChunk`: the range and views of the node's partial and
result buffers), and three handoffs: wait for the node's partial of the half, wait for
the result buffer to be free, and announce the finished chunk. Deadlines are the
collective's tree deadline; liveness checks, failures and the note of whom a thread
waits on go through the communicator's :class:`~fireflyer.hfreduce.engine.failures.Failures`.

Where the compiled core is built, each thread hands its whole part of a collective (every
chunk of its tree and direction) to ``_core.tree_run`` instead: the same frames on the same
authenticated sockets and the same arena handoffs, in C with the GIL released, so a rank
running either interoperates with neighbours running the other. It measured 10-25% faster
than the loop here at 2x2 on loopback (4 KiB to 64 MiB). ``FIREFLYER_HFREDUCE_CORE_TREES=0``
keeps the loop, which also takes what the core does not (COPY, or no core built).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Protocol

import torch

from fireflyer.hfreduce.transport.arena import check_unless, reached
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.engine.failures import Failures, mismatch
from fireflyer.hfreduce.engine.jobs import Job
from fireflyer.hfreduce.plans.plan import DTYPES, Descriptor, Op, acc_dtype
from fireflyer.hfreduce.engine.slice_reducer import SliceReducer
from fireflyer.hfreduce.plans.topology import TreeLinks, tree_links
from fireflyer.hfreduce.transport.links import Link, Listener, connect

_SLICE = 0.05  # seconds between checks while the root waits for its own reduce-up
SELF_GRACE = 0.5  # seconds a wait on this rank's own threads outlasts their waits on other ranks
TREE_JOB = struct.Struct("<23q")  # _core/tree.h: hfr_tree_job
_UP, _DOWN = 1, 2
_CORE_TIMEOUT, _CORE_ABORTED, _CORE_PEER_DEAD = 2, 3, 4
_CORE_LOST, _CORE_MISMATCH, _CORE_ERROR_FRAME, _CORE_GARBLED = 8, 9, 10, 11
_NODE_FLAG, _OWN_REDUCE_UP = -2, -3


@dataclass(frozen=True)
class TreeChunk:
    """What one tree of a rail carries of one chunk: its half of the rail's slice, in the node's buffers."""

    index: int  # the chunk's place in its collective (what the frames carry)
    number: int  # its place in the node's chunk sequence (what the node's handoffs count)
    half: tuple[int, int]  # the half, as element offsets in the chunk
    red: torch.Tensor  # the node's partial of the half, in the accumulation dtype
    out: torch.Tensor  # where the half's result goes, in the collective's dtype


class NodeSide(Protocol):
    """What the tree stage needs of its node, chunk by chunk (the node stage provides it)."""

    def tree_chunk(self, job: Job, t: int, c: int) -> TreeChunk:
        """Tree ``t``'s half of chunk ``c`` of ``job``."""

    def wait_reduced(self, job: Job, chunk: TreeChunk) -> None:
        """Until the node's partial of ``chunk``'s half is complete (every local reducer of it is done)."""

    def wait_out_free(self, job: Job, chunk: TreeChunk) -> None:
        """Until ``chunk.out`` may be written (every local rank has staged out what it held before)."""

    def publish_out(self, chunk: TreeChunk) -> None:
        """Announce that this rail's whole slice of the chunk (both halves) is in the result buffer."""

    # For the compiled tree stage, which does the handoffs above itself, in the arena:
    core_comm: bytes | None
    """The arena's layout as the compiled core takes it (None: no core, the Python loop runs)."""

    def core_failure(self, job: Job, rc: int, stage: int, k: int, chunk: int) -> HFReduceError:
        """The error of a core wait on local rank ``k``'s flag ``stage`` that stopped with ``rc``."""


class TreeStage:
    """One rail rank's links to its neighbours in both trees, its four threads, and their work per chunk.

    ``rail_ranks[n]`` is the rank of this rail on node n; ``scratch_bytes`` sizes the buffers
    a child's partial is received into; ``compiled`` lets the kernels combine (see reducing.py);
    ``core`` (the compiled core module, or None) runs each tree's whole part of a collective in C
    (``_core/tree.c``: the same frames and handoffs, the GIL released) instead of the loop here.
    """

    def __init__(self, *, node: NodeSide, failures: Failures, rank: int, node_index: int, rail_ranks: list[int],
                 world_size: int, describe: Callable[[int], str], scratch_bytes: int, compiled: bool,
                 core: ModuleType | None = None,
                 links: Callable[[int, int, int], TreeLinks] = tree_links) -> None:
        self.rank = rank
        self._links = links
        self.listener: Listener | None = None
        self.links: list[Link] = []
        self._node = node
        self._failures = failures
        self._node_index = node_index
        self._rail_ranks = rail_ranks
        self._world_size = world_size
        self._describe = describe
        self._scratch_bytes = scratch_bytes
        self._compiled = compiled
        self._parents: list[Link | None] = [None, None]
        self._children: list[list[Link]] = [[], []]
        self._queues: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        self._signal = [threading.Condition(), threading.Condition()]
        self._root_ready = [0, 0]
        self._done = [0, 0]
        self._done_lock = threading.Lock()
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._core = core
        self._core_state = (ctypes.c_int32 * 4)()  # the compiled runs' root_ready[2] and done[2]

    @property
    def in_core(self) -> bool:
        """Whether this stage runs its trees in the compiled core."""
        return self._core is not None

    # ------------------------------------------------------------------ life cycle

    def connect(self, *, store: "torch.distributed.Store", host: str, secret: bytes, deadline: float) -> None:
        """Listen, connect to both parents, accept both trees' children, then start the four threads."""
        self.listener = Listener(host, secret, self.rank)
        store.set(f"addr/{self.rank}", json.dumps(self.listener.address))
        num_nodes = len(self._rail_ranks)
        for t in (0, 1):
            links = self._links(num_nodes, self._node_index, t)
            if links.parent >= 0:
                peer = self._rail_ranks[links.parent]
                key = f"addr/{peer}"
                store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                phost, pport = json.loads(store.get(key))
                sock = connect(phost, pport, my_rank=self.rank, peer_rank=peer, tag=t, secret=secret, deadline=deadline)
                self._parents[t] = Link(sock, peer, self._describe(peer))
                self.links.append(self._parents[t])
        for t in (0, 1):
            for child in self._links(num_nodes, self._node_index, t).children:
                peer = self._rail_ranks[child]
                sock = self.listener.take(peer, t, deadline, self._failures.check)
                link = Link(sock, peer, self._describe(peer))
                self._children[t].append(link)
                self.links.append(link)
        for t in (0, 1):
            for role in ("up", "down"):
                q: queue.Queue = queue.Queue()
                th = threading.Thread(target=self._loop, args=(t, role, q), name=f"hfreduce-{self.rank}-t{t}{role}",
                                      daemon=True)
                self._queues.append(q)
                self._threads.append(th)
                th.start()

    def start(self, job: Job) -> None:
        """Hand ``job`` to the four threads; they go through its chunks as the node reduces them."""
        for q in self._queues:
            q.put(job)

    def stop(self) -> None:
        """Let the threads end once they are through the jobs they hold."""
        for q in self._queues:
            q.put(None)

    def tell(self, error: HFReduceError, text: str) -> None:
        """Pass this rank's first failure to every tree neighbour, then drop the links and wake the threads."""
        for link in self.links:
            link.send_error(text)
        for link in self.links:
            link.shutdown()  # closed in close(), once no thread (nor a compiled run) uses them
        for cond in self._signal:
            with cond:
                cond.notify_all()

    def close(self) -> None:
        self.stop()  # again, harmlessly, in case the engine thread never got to it
        for link in self.links:
            link.shutdown()  # ends any transfer in flight, in Python or in the core
        for th in self._threads:
            th.join(timeout=2)
        if not any(th.is_alive() for th in self._threads):  # else a compiled run may still hold a descriptor
            for link in self.links:
                link.close()
            self.links = []
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # ------------------------------------------------------------------ per chunk
    def _loop(self, t: int, role: str, q: queue.Queue) -> None:
        torch.set_num_threads(1)
        reducer = SliceReducer(compiled=self._compiled)
        while True:
            job = q.get()
            if job is None:
                return
            if self._failures.error is not None:
                continue
            try:
                if self._runs_in_core(job):
                    self._run_core(job, t, role)
                    continue
                for c in range(job.nchunks):
                    chunk = self._node.tree_chunk(job, t, c)
                    if role == "up":
                        self._up(job, t, chunk, reducer)
                    else:
                        self._down(job, t, chunk)
            except BaseException as exc:  # noqa: BLE001
                self._failures.fail(exc)

    def _expect(self, link: Link, job: Job, c: int, nbytes: int, what: str) -> None:
        _, seq, chunk, got, digest = link.recv_header(self._failures.check, job.tree_deadline, what)
        error = self._frame_error(link, job, c, nbytes, seq, chunk, got, digest)
        if error is not None:
            raise error

    def _frame_error(self, link: Link, job: Job, c: int, nbytes: int, seq: int, chunk: int, got: int,
                     digest: bytes) -> CollectiveMismatch | None:
        """None when a data frame's header is for chunk ``c`` of ``job`` with ``nbytes`` payload bytes; else the mismatch."""
        if digest != job.plan.desc.pack():
            return mismatch(job, self._describe(self.rank), link.peer_desc, Descriptor.unpack(digest), seq)
        if seq != job.seq & 0xFFFFFFFF or chunk != c or got != nbytes:
            return CollectiveMismatch(
                f"collective mismatch: {link.peer_desc} sent collective #{seq} chunk {chunk} ({got} bytes) while "
                f"{self._describe(self.rank)} expected #{job.seq} chunk {c} ({nbytes} bytes) of {job.plan.desc}"
            )
        return None

    # ------------------------------------------------------------------ in the compiled core
    def _runs_in_core(self, job: Job) -> bool:
        # the core takes up to two children (a binomial tree's root over more than four nodes has more)
        return self._core is not None and self._node.core_comm is not None and job.plan.desc.op != Op.COPY \
            and all(len(children) <= 2 for children in self._children)

    def _run_core(self, job: Job, t: int, role: str) -> None:
        """Tree ``t``'s ``role`` of every chunk of ``job`` in one call of the core (see tree.h)."""
        desc = job.plan.desc
        acc = acc_dtype(desc.dtype, desc.op)
        parent, children = self._parents[t], self._children[t]
        scratch = [0, 0]
        room = 0
        if role == "up" and children:
            h0, h1 = self._node.tree_chunk(job, t, 0).half  # the first chunk is the largest
            for i in range(len(children)):
                buf = self._scratch_for(t, i, acc, h1 - h0)
                scratch[i] = buf.data_ptr()
            room = (h1 - h0) * acc.itemsize
        fds = [link.sock.fileno() for link in children] + [-1, -1]
        spec = TREE_JOB.pack(_UP if role == "up" else _DOWN, t, job.first_chunk, job.nchunks, job.elems, desc.numel,
                             DTYPES[desc.dtype], DTYPES[acc], int(desc.op), self._world_size, job.seq,
                             int(job.tree_deadline * 1e9), int((job.tree_deadline + SELF_GRACE) * 1e9),
                             parent.sock.fileno() if parent is not None else -1, len(children), fds[0], fds[1],
                             scratch[0], scratch[1], room, ctypes.addressof(self._core_state),
                             *struct.unpack("<qq", desc.pack()))
        # This thread is the only sender on these links; holding their locks keeps a failure's
        # error frame (tell) from cutting into a frame the core is sending.
        senders = ([parent] if parent is not None else []) if role == "up" else children
        waited = [link.peer_rank for link in (children if role == "up" else [parent] if parent is not None else [])]
        self._failures.waiting(job.seq, waited, f"tree {t}'s {'reduce-up' if role == 'up' else 'broadcast-down'} "
                               "(compiled core)")
        with contextlib.ExitStack() as held:
            for link in senders:
                held.enter_context(link.send_lock)
            rc, where, sending, c, stage, k, kind, seq, chunk, nbytes, digest = \
                self._core.tree_run(self._node.core_comm, spec)
        self._failures.done_waiting()
        if rc:
            raise self._core_error(job, t, role, rc, where, bool(sending), c, stage, k, seq, chunk, nbytes, digest)

    def _core_error(self, job: Job, t: int, role: str, rc: int, where: int, sending: bool, c: int, stage: int,
                    k: int, seq: int, chunk: int, nbytes: int, digest: bytes) -> BaseException:
        """The error a compiled run that stopped with ``rc`` means, in the words of the loop here."""
        desc = job.plan.desc
        if rc in (_CORE_ABORTED, _CORE_PEER_DEAD) or where == _NODE_FLAG:
            return self._node.core_failure(job, rc, stage, k, c)
        if where == _OWN_REDUCE_UP:
            behind = self._failures.behind(job.seq)
            return CollectiveTimeout(f"{desc} timed out on {self._describe(self.rank)} in tree {t}"
                                     + (f"; its reduce-up was waiting for {behind}" if behind else ""))
        if rc < 0 or where not in (-1, 0, 1):
            return HFReduceError(f"hfreduce's compiled tree stage failed on {desc}: error {rc}")
        link = self._parents[t] if where == -1 else self._children[t][where]
        if role == "up":
            what = f"sending chunk {c} up tree {t}" if sending else f"receiving chunk {c} of {desc} from a child in tree {t}"
        else:
            what = f"sending chunk {c} down tree {t}" if sending else \
                f"receiving chunk {c} of {desc} from the parent in tree {t}"
        if rc == _CORE_TIMEOUT:
            return CollectiveTimeout(f"timed out {'sending to' if sending else 'waiting for'} {link.peer_desc} "
                                     f"while {what}")
        if rc == _CORE_LOST:
            return link.lost(what)
        if rc == _CORE_ERROR_FRAME:
            return link.error_frame(nbytes, self._failures.check, what)
        if rc == _CORE_GARBLED:
            return PeerFailure(f"garbled frame from {link.peer_desc} while {what}")
        if rc == _CORE_MISMATCH:
            h0, h1 = self._node.tree_chunk(job, t, c).half
            size = (acc_dtype(desc.dtype, desc.op) if role == "up" else desc.dtype).itemsize
            error = self._frame_error(link, job, c, (h1 - h0) * size, seq, chunk, nbytes, digest)
            if error is not None:
                return error
        return HFReduceError(f"hfreduce's compiled tree stage failed on {desc}: error {rc}")

    def _up(self, job: Job, t: int, chunk: TreeChunk, reducer: SliceReducer) -> None:
        desc, c, check, failures = job.plan.desc, chunk.index, self._failures.check, self._failures
        h0, h1 = chunk.half
        self._node.wait_reduced(job, chunk)
        acc = acc_dtype(desc.dtype, desc.op)
        partial, out = chunk.red, chunk.out
        payload = memoryview(partial.view(torch.uint8).numpy()) if h1 > h0 else memoryview(b"")
        parent = self._parents[t]
        children = self._children[t]
        # The root of a plain sum with nothing left to do after the last child writes that
        # child's sum straight into the result buffer instead of combining and then copying.
        direct = parent is None and acc == desc.dtype and desc.op == Op.SUM and children
        if direct:
            self._node.wait_out_free(job, chunk)
        for i, link in enumerate(children):
            what = f"receiving chunk {c} of {desc} from a child in tree {t}"
            failures.waiting(job.seq, [link.peer_rank], what)
            self._expect(link, job, c, len(payload), what)
            incoming = self._scratch_for(t, i, acc, h1 - h0)
            if h1 > h0:
                link.recv_all(memoryview(incoming.view(torch.uint8).numpy()), check, job.tree_deadline, what)
            failures.done_waiting()
            if h1 > h0:
                if direct and i == len(children) - 1:
                    reducer.reduce(out, [partial, incoming], Op.SUM)
                else:
                    reducer.combine(partial, incoming, desc.op)
        if parent is not None:
            parent.send_frame(job.seq, c, desc.pack(), payload, check, job.tree_deadline, f"sending chunk {c} up tree {t}")
        else:
            if not direct:
                self._node.wait_out_free(job, chunk)
                if h1 > h0:
                    reducer.finish(out, partial, desc.op, self._world_size)
            with self._signal[t]:
                self._root_ready[t] = chunk.number + 1
                self._signal[t].notify_all()

    def _down(self, job: Job, t: int, chunk: TreeChunk) -> None:
        desc, c, g, check = job.plan.desc, chunk.index, chunk.number, self._failures.check
        h0, h1 = chunk.half
        payload = memoryview(chunk.out.view(torch.uint8).numpy()) if h1 > h0 else memoryview(b"")
        parent = self._parents[t]
        if parent is None:
            cond = self._signal[t]
            with cond:
                while not reached(self._root_ready[t], g + 1):
                    if check_unless(check, lambda: reached(self._root_ready[t], g + 1)):
                        break
                    if time.monotonic() > job.tree_deadline + SELF_GRACE:  # its reduce-up gives up first
                        behind = self._failures.behind(job.seq)
                        raise CollectiveTimeout(f"{desc} timed out on {self._describe(self.rank)} in tree {t}"
                                                + (f"; its reduce-up was waiting for {behind}" if behind else ""))
                    cond.wait(_SLICE)
        else:
            self._node.wait_out_free(job, chunk)
            what = f"receiving chunk {c} of {desc} from the parent in tree {t}"
            self._failures.waiting(job.seq, [parent.peer_rank], what)
            self._expect(parent, job, c, len(payload), what)
            if h1 > h0:
                parent.recv_all(payload, check, job.tree_deadline, what)
            self._failures.done_waiting()
        for link in self._children[t]:
            link.send_frame(job.seq, c, desc.pack(), payload, check, job.tree_deadline, f"sending chunk {c} down tree {t}")
        with self._done_lock:
            self._done[t] = g + 1
            if reached(self._done[1 - t], g + 1):
                self._node.publish_out(chunk)

    def _scratch_for(self, t: int, i: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """Where tree ``t``'s reduce-up receives child ``i``'s partial of ``n`` elements."""
        key = (t, i)
        buf = self._scratch.get(key)
        need = n * dtype.itemsize
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, self._scratch_bytes), dtype=torch.uint8)
            self._scratch[key] = buf
        return buf[:need].view(dtype)
