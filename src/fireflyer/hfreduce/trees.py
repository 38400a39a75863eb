"""The inter-node stage: each rail allreduces its slice of every chunk over two binary trees of nodes.

Rail r is local rank r of every node. For each of the two trees (NCCL's double
binary tree over nodes) a rail runs a reduce-up thread and a broadcast-down thread,
so chunk c can travel down while chunk c+1 is still being summed on its way up.
Tree t carries half t of the rail's slice. Partial sums travel in the accumulation
dtype; the root rounds once and sends the final dtype down.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from fireflyer.hfreduce.arena import reached
from fireflyer.hfreduce.config import route_address
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout
from fireflyer.hfreduce.reduce import Descriptor, Op, Reducer, acc_dtype
from fireflyer.hfreduce.topology import split, tree_links
from fireflyer.hfreduce.transport import Link, Listener, connect

if TYPE_CHECKING:
    from fireflyer.hfreduce.engine import Job

_SLICE = 0.05  # seconds between checks while the root waits for its own reduce-up
SELF_GRACE = 0.5  # seconds a wait on this rank's own threads outlasts their waits on other ranks


class Trees:
    """Mixed into :class:`~fireflyer.hfreduce.engine.Communicator`: links, tree threads and the tree stages."""

    def _setup_links(self, deadline: float) -> None:
        self._out_queue: queue.Queue = queue.Queue()
        self._out_thread = threading.Thread(target=self._out_loop, name=f"hfreduce-{self.rank}-out", daemon=True)
        self._out_thread.start()
        if self.local_rank >= self.rails:
            return
        store = self._store
        host = route_address(self.config)
        self._listener = Listener(host, self._secret, self.rank)
        store.set(f"addr/{self.rank}", json.dumps(self._listener.address))
        self._parents: list[Link | None] = [None, None]
        self._children: list[list[Link]] = [[], []]
        rail_ranks = [self.layout.rail_peer(n, self.local_rank) for n in range(self.num_nodes)]
        for t in (0, 1):
            links = tree_links(self.num_nodes, self.node, t)
            if links.parent >= 0:
                peer = rail_ranks[links.parent]
                key = f"addr/{peer}"
                store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                phost, pport = json.loads(store.get(key))
                sock = connect(phost, pport, my_rank=self.rank, peer_rank=peer, tag=t, secret=self._secret, deadline=deadline)
                self._parents[t] = Link(sock, peer, self.describe(peer))
                self._links.append(self._parents[t])
        for t in (0, 1):
            for child in tree_links(self.num_nodes, self.node, t).children:
                peer = rail_ranks[child]
                sock = self._listener.take(peer, t, deadline, self._check)
                link = Link(sock, peer, self.describe(peer))
                self._children[t].append(link)
                self._links.append(link)
        self._tree_signal = [threading.Condition(), threading.Condition()]
        self._root_ready = [0, 0]
        for t in (0, 1):
            for role in ("up", "down"):
                q: queue.Queue = queue.Queue()
                th = threading.Thread(target=self._tree_loop, args=(t, role, q), name=f"hfreduce-{self.rank}-t{t}{role}", daemon=True)
                self._tree_queues.append(q)
                self._tree_threads.append(th)
                th.start()

    def _tree_loop(self, t: int, role: str, q: queue.Queue) -> None:
        torch.set_num_threads(1)
        reducer = Reducer()
        while True:
            job = q.get()
            if job is None:
                return
            if self._error is not None:
                continue
            try:
                for c in range(job.nchunks):
                    if role == "up":
                        self._tree_up(job, t, c, reducer)
                    else:
                        self._tree_down(job, t, c)
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)

    def _tree_half(self, job: Job, t: int, c: int) -> tuple[int, int]:
        c0, c1 = self._chunk_range(job, c)
        r0, r1 = split(c1 - c0, self.rails, self.local_rank)
        h0, h1 = split(r1 - r0, 2, t)
        return r0 + h0, r0 + h1

    def _expect(self, link: Link, job: Job, c: int, nbytes: int, what: str) -> None:
        _, seq, chunk, got, digest = link.recv_header(self._check, job.tree_deadline, what)
        desc = job.plan.desc.pack()
        if digest != desc:
            raise self._mismatch(job, link.peer_desc, Descriptor.unpack(digest), seq)
        if seq != job.seq & 0xFFFFFFFF or chunk != c or got != nbytes:
            raise CollectiveMismatch(
                f"collective mismatch: {link.peer_desc} sent collective #{seq} chunk {chunk} ({got} bytes) while "
                f"{self.describe(self.rank)} expected #{job.seq} chunk {c} ({nbytes} bytes) of {job.plan.desc}"
            )

    def _tree_up(self, job: Job, t: int, c: int, reducer: Reducer) -> None:
        desc, g, b = job.plan.desc, job.first_chunk + c, self._buf(job, c)
        h0, h1 = self._tree_half(job, t, c)
        # Wait for the local reducers whose slices overlap this half.
        c0, c1 = self._chunk_range(job, c)
        owners = [k for k in range(self.local_size) if _overlaps(split(c1 - c0, self.local_size, k), (h0, h1))]
        self._wait("red", owners, g + 1, job, f"tree {t} reduce-up", late=True)
        acc = acc_dtype(desc.dtype, desc.op)
        partial = self._view(self._shape.red_offset(b), acc, h0, h1)
        payload = memoryview(partial.view(torch.uint8).numpy()) if h1 > h0 else memoryview(b"")
        parent = self._parents[t]
        children = self._children[t]
        out = self._view(self._shape.out_offset(b), desc.dtype, h0, h1)
        # The root of a plain sum with nothing left to do after the last child writes that
        # child's sum straight into the result buffer instead of combining and then copying.
        direct = parent is None and acc == desc.dtype and desc.op == Op.SUM and children
        if direct:
            self._wait("done", range(self.local_size), g - self.config.depth + 1, job, f"tree {t} root", late=True)
        for i, link in enumerate(children):
            what = f"receiving chunk {c} of {desc} from a child in tree {t}"
            self._waiting(job, [link.peer_rank], what)
            self._expect(link, job, c, len(payload), what)
            incoming = self._scratch(t, i, acc, h1 - h0)
            if h1 > h0:
                link.recv_all(memoryview(incoming.view(torch.uint8).numpy()), self._check, job.tree_deadline, what)
            self._done_waiting()
            if h1 > h0:
                if direct and i == len(children) - 1:
                    torch.add(partial, incoming, out=out)
                else:
                    reducer.combine(partial, incoming, desc.op)
        if parent is not None:
            parent.send_frame(job.seq, c, desc.pack(), payload, self._check, job.tree_deadline, f"sending chunk {c} up tree {t}")
        else:
            if not direct:
                self._wait("done", range(self.local_size), g - self.config.depth + 1, job, f"tree {t} root", late=True)
                if h1 > h0:
                    reducer.finish(out, partial, desc.op, self.world_size)
            with self._tree_signal[t]:
                self._root_ready[t] = g + 1
                self._tree_signal[t].notify_all()

    def _tree_down(self, job: Job, t: int, c: int) -> None:
        desc, g, b = job.plan.desc, job.first_chunk + c, self._buf(job, c)
        h0, h1 = self._tree_half(job, t, c)
        out = self._view(self._shape.out_offset(b), desc.dtype, h0, h1)
        payload = memoryview(out.view(torch.uint8).numpy()) if h1 > h0 else memoryview(b"")
        parent = self._parents[t]
        if parent is None:
            cond = self._tree_signal[t]
            with cond:
                while not reached(self._root_ready[t], g + 1):
                    self._check()
                    if time.monotonic() > job.tree_deadline + SELF_GRACE:  # its reduce-up gives up first
                        behind = "; ".join(f"{', '.join(self.describe(r) for r in rs)} ({what})"
                                           for rs, what in self.waited_on(job.seq))
                        raise CollectiveTimeout(f"{desc} timed out on {self.describe(self.rank)} in tree {t}"
                                                + (f"; its reduce-up was waiting for {behind}" if behind else ""))
                    cond.wait(_SLICE)
        else:
            self._wait("done", range(self.local_size), g - self.config.depth + 1, job, f"tree {t} broadcast", late=True)
            what = f"receiving chunk {c} of {desc} from the parent in tree {t}"
            self._waiting(job, [parent.peer_rank], what)
            self._expect(parent, job, c, len(payload), what)
            if h1 > h0:
                parent.recv_all(payload, self._check, job.tree_deadline, what)
            self._done_waiting()
        for link in self._children[t]:
            link.send_frame(job.seq, c, desc.pack(), payload, self._check, job.tree_deadline, f"sending chunk {c} down tree {t}")
        with self._tree_lock:
            self._tree_done[t] = g + 1
            if reached(self._tree_done[1 - t], g + 1):
                self._arena.publish("out", self.local_rank, g + 1)

    def _scratch(self, t: int, i: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        key = (t, i)
        store = self.__dict__.setdefault("_scratch_bufs", {})
        buf = store.get(key)
        need = n * dtype.itemsize
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, self.config.chunk_bytes), dtype=torch.uint8)
            store[key] = buf
        return buf[:need].view(dtype)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] or (a == b)


