"""Gather, broadcast and reduce-scatter across rails: each byte crosses between two nodes at most once.

On one node the ``"hfreduce"`` group runs these collectives as reductions of one flat
buffer through the node's shared memory (:mod:`~fireflyer.hfreduce.plans.collectives`), which
is fast there. Across nodes that path would push a world-sized buffer through the trees,
up to ``world_size`` times the bytes needed. Here they are point-to-point steps on the
group's :class:`~fireflyer.hfreduce.transport.exchange.Exchange` (shared-memory rings within a
node, TCP across), with ``N`` nodes of ``L_a`` ranks, ``W`` ranks in all, and ``s``
bytes per rank's block:

* **allgather** (rail-aligned). Rank ``k`` of node ``a`` sends its block to one *receiver*
  on every other node ``b``, the rank on its rail (local rank ``k mod L_b``), and to its
  own node's ranks through the rings. A receiver hands each block it got to the other
  ranks of its node. Node ``b`` takes in ``(W - L_b) * s`` bytes, every block from
  elsewhere exactly once (``(N-1)*L*s`` when nodes are even: the minimum). Uneven nodes
  take the same plan: the rails wrap (``k mod L_b``), so a small node's receivers take
  more than one block each, and still each block crosses to each node once.
* **broadcast**. The root's block goes to one *leader* per node (the rank on the root's
  rail) along a binomial tree over nodes rooted at the root's node, then from each
  leader to its node's ranks through the rings: ``s`` bytes into every other node,
  ``(N-1)*s`` in all, ``ceil(log2 N)`` hops deep, in chunks so the hops overlap.
* **reduce_scatter**. Rank ``d``'s block is reduced first within each node ``a`` by the
  *reducer* on ``d``'s rail (local rank ``local(d) mod L_a``), which takes the block from
  every rank of its node through the rings; the node's partial then goes to ``d``, which
  combines the ``N`` partials in node order. ``(W - L_a)`` partials leave node ``a``:
  ``(N-1)*L*s`` bytes on even nodes, the minimum, except that fp16, bf16 and fp8
  partials travel in fp32 (twice or four times the bytes), so that the sum is
  accumulated in fp32 and rounded once, at ``d``, as the engine does.

Every result is deterministic: a partial combines its node's ranks in local order and
the final step combines the nodes in node order, so reruns give the same bits. Big
blocks move in chunks (``FIREFLYER_HFREDUCE_SPREAD_CHUNK_BYTES``) so that a chunk is
handed on, or reduced, while the next one is still on the wire.

Each collective is one :class:`Flow` of exchange calls whose keys it reserves on the
caller's thread, so calls posted later, from callbacks, still match on every rank. It
has one deadline (the call's timeout, or the group's); a failed call fails the group,
and the flow's future carries the error, so a dead peer raises from ``wait()``. It takes
the group's next collective number, as the engine's collectives do, and the flight
recorder follows it from its start to its end (and whom its calls wait on, if it fails).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.engine import kernels
from fireflyer.hfreduce.config import read, read_int
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, fresh
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder
from fireflyer.hfreduce.plans.plan import Kind
from fireflyer.hfreduce.plans.plan import Op, Plan, acc_dtype
from fireflyer.hfreduce.plans.topology import Layout
from fireflyer.hfreduce.transport.transfers import COLLECTIVE, byte_view, digest, settle
from fireflyer.hfreduce.transport.transfers import Kind as Digest  # its frames' kinds: ALL_GATHER, BROADCAST, REDUCE_SCATTER + op
from fireflyer.hfreduce.backend.work import HFReduceWork, seconds
from fireflyer.errors import UserError

CHUNK_ENV = names.SPREAD_CHUNK_BYTES
ENABLE_ENV = names.SPREAD
_DEFAULT_CHUNK = 4 << 20


def chunk_bytes() -> int:
    value = read_int(CHUNK_ENV, _DEFAULT_CHUNK, "a whole number of bytes")
    if value < 1:
        raise UserError(f"{CHUNK_ENV} must be a positive number of bytes, got {value}")
    return value


_total_lock = threading.Lock()
_total_cross = [0]


def _count(nbytes: int) -> None:
    with _total_lock:
        _total_cross[0] += nbytes


def cross_node_bytes() -> int:
    """Payload bytes this process's completed spread collectives sent to ranks on other nodes (all groups)."""
    with _total_lock:
        return _total_cross[0]


def route(comm):
    """The exchange to run a gather, broadcast or reduce-scatter of ``comm``'s group on, or None.

    None (the engine's reduction path) on one node, where shared memory makes that path fast,
    when the exchange is gone, or with ``FIREFLYER_HFREDUCE_SPREAD=0``."""
    if comm.num_nodes <= 1 or comm.exchange is None or read(ENABLE_ENV, "1") == "0":
        return None
    return comm.exchange


def _cuts(total: int, step: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of ``total`` items, ``step`` each (the last shorter); one empty piece for 0."""
    if total == 0:
        return [(0, 0)]
    return [(lo, min(lo + step, total)) for lo in range(0, total, step)]


def _msb(i: int) -> int:
    return 1 << (i.bit_length() - 1)


class Flow:
    """One collective made of several exchange calls, some posted when an earlier one completes.

    Done (its :attr:`future` set to ``result``) when every call and every step after one is;
    failed at the first error, which fails the group. It stands in for the communicator in
    :class:`~fireflyer.hfreduce.backend.work.HFReduceWork` (``time_out``, ``alive``).
    """

    def __init__(self, ex, layout: Layout, name: str, timeout: float, result: list[torch.Tensor],
                 flight: FlightRecorder | None = None, record: int | None = None) -> None:
        self.ex = ex
        self.layout = layout
        self.me = ex.rank
        self.node = layout.node_of(self.me)
        self.members = layout.nodes[self.node]
        self.name = name
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.future: torch.futures.Future = torch.futures.Future()
        self.finish: list[Callable[[], None]] = []
        self.cross_bytes = 0  # bytes this rank posted to ranks on other nodes
        self.first_key = -1
        self._result = result
        self._lock = threading.Lock()
        self._open = 1  # calls and steps not done yet; 1: the set-up on the caller's thread
        self._ops: list = []
        self._error: BaseException | None = None
        self._flight = flight if record is not None else None
        self.record = record  # its number in the group's collectives (and flight record), if it has one

    # -- building ---------------------------------------------------------------------------
    def keys(self, count: int) -> int:
        first = self.ex.reserve(count)
        if self.first_key < 0:
            self.first_key = first
        return first

    def post(self, sends: list, recvs: list, then: Callable[[], None] | None = None) -> None:
        """Post ``(peer, key, data, digest)`` transfers as one call; run ``then`` once they are all done."""
        if self._error is not None:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"hfreduce {self.name} did not finish within its timeout of {self.timeout:g}s "
                                    f"on {self.ex.describe(self.me)}")
        members = self.members
        cross = sum(data.numel() for peer, _, data, _ in sends if peer not in members)
        with self._lock:
            self._open += 1
            self.cross_bytes += cross
        op = self.ex.post(self.name, sends=sends, recvs=recvs, timeout=left, record=self.record)
        self._ops.append(op)
        op.future.add_done_callback(lambda fut: self._settle(fut, then))

    def start(self, build: Callable[["Flow"], None]) -> "Flow":
        """Run ``build`` (which posts the first calls) on the caller's thread; the flow is then under way."""
        if self._flight is not None:
            self._flight.started(self.record)
        try:
            build(self)
        except BaseException as exc:  # noqa: BLE001 - a half-posted collective leaves the ranks out of step
            self._fail(exc, own=True)
        self._close_one()
        return self

    # -- completion -------------------------------------------------------------------------
    def _settle(self, fut: torch.futures.Future, then: Callable[[], None] | None) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - the call's error: the group has failed already
            self._fail(exc, own=False)
        else:
            if then is not None and self._error is None:
                try:
                    then()
                except BaseException as exc:  # noqa: BLE001
                    self._fail(exc, own=True)
        self._close_one()

    def _fail(self, exc: BaseException, own: bool) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        if own:  # this rank's own step failed: the peers must learn it too
            exc = self.ex.failed(exc)
        if self._flight is not None:
            self._flight.failed(self.record, str(exc))
        self.future.set_exception(fresh(exc) if isinstance(exc, HFReduceError) else exc)

    def _close_one(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0 and self._error is None
        if not last:
            return
        _count(self.cross_bytes)
        if self._flight is not None:
            self._flight.completed(self.record)
        settle(self.future, self.name, self.finish, self._result)

    # -- the Work's hooks ---------------------------------------------------------------------
    def time_out(self, seq: int, what: str, seconds: float) -> HFReduceError:
        pending = next((op for op in self._ops if not op.settled), None)
        return self.ex.time_out(pending.id if pending is not None else -1, what, seconds)

    def alive(self) -> bool:
        return self.ex.alive()


# -- staging: the exchange and the kernels work on contiguous CPU memory ---------------------------


def host_in(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (contiguous) on the CPU: itself, or a copy of a CUDA tensor made now."""
    return flat.cpu() if flat.is_cuda else flat


def host_out(flat: torch.Tensor, flow: Flow) -> torch.Tensor:
    """Where a result for ``flat`` (contiguous) is built: itself, or a CPU buffer copied into it at the end."""
    if not flat.is_cuda:
        return flat
    host = torch.empty(flat.shape, dtype=flat.dtype)

    def copy_back() -> None:
        flat.copy_(host)
        torch.cuda.current_stream(flat.device).synchronize()

    flow.finish.append(copy_back)
    return host


# -- allgather -------------------------------------------------------------------------------------


def _receiver(layout: Layout, node: int, origin: int) -> int:
    """The rank of ``node`` that takes ``origin``'s block from across the nodes: the one on its rail."""
    members = layout.nodes[node]
    return members[layout.local_rank(origin) % len(members)]


def allgather(flow: Flow, mine: torch.Tensor, blocks: list[torch.Tensor]) -> Flow:
    """``blocks[r]`` (flat uint8, CPU) receives rank ``r``'s ``mine``; see the module docstring for the bytes."""
    layout, me, node, members = flow.layout, flow.me, flow.node, flow.members
    world = layout.world_size
    pieces = _cuts(mine.numel(), chunk_bytes())
    per = len(pieces)

    def build(f: Flow) -> None:
        first = f.keys(world * per)

        def key(origin: int, c: int) -> tuple[int, int]:
            return (COLLECTIVE, first + origin * per + c)

        def dig(origin: int, c: int) -> bytes:
            lo, hi = pieces[c]
            return digest(Digest.ALL_GATHER, torch.uint8, hi - lo, origin)

        if blocks[me].data_ptr() != mine.data_ptr() and mine.numel():
            blocks[me].copy_(mine)
        others = [p for p in members if p != me]
        sends, recvs, cross = [], [], []
        for c, (lo, hi) in enumerate(pieces):  # across first: the slower way
            for b in range(layout.num_nodes):
                if b != node:
                    sends.append((_receiver(layout, b, me), key(me, c), mine[lo:hi], dig(me, c)))
            for p in others:
                sends.append((p, key(me, c), mine[lo:hi], dig(me, c)))
        for o in range(world):
            if o == me:
                continue
            if o in members:  # a local peer's own block
                recvs += [(o, key(o, c), blocks[o][lo:hi], dig(o, c)) for c, (lo, hi) in enumerate(pieces)]
                continue
            via = _receiver(layout, node, o)
            if via != me:  # a block from elsewhere, handed on by the local peer on its rail
                recvs += [(via, key(o, c), blocks[o][lo:hi], dig(o, c)) for c, (lo, hi) in enumerate(pieces)]
            else:
                cross.append(o)
        for o in cross:  # this rank takes them across and hands each chunk on as it lands
            for c, (lo, hi) in enumerate(pieces):
                piece = blocks[o][lo:hi]
                onward = [(p, key(o, c), piece, dig(o, c)) for p in others]
                f.post([], [(o, key(o, c), piece, dig(o, c))], then=(lambda s=onward: f.post(s, [])) if others else None)
        f.post(sends, recvs)  # after the receives across are posted, so what arrives lands in place

    return flow.start(build)


# -- broadcast -------------------------------------------------------------------------------------


def broadcast(flow: Flow, data: torch.Tensor, root: int) -> Flow:
    """``data`` (flat uint8, CPU): the root's bytes, received in place by every other rank."""
    layout, me, node, members = flow.layout, flow.me, flow.node, flow.members
    n_nodes = layout.num_nodes
    pieces = _cuts(data.numel(), chunk_bytes())
    home = layout.node_of(root)

    def leader(b: int) -> int:
        return root if b == home else _receiver(layout, b, root)

    def node_at(i: int) -> int:  # the node at place i of the binomial tree, counted from the root's node
        return (home + i) % n_nodes

    place = (node - home) % n_nodes
    children = []
    step = 1
    while step < n_nodes:
        if step > place and place + step < n_nodes:
            children.append(leader(node_at(place + step)))
        step <<= 1
    children.reverse()  # the biggest subtree first

    def build(f: Flow) -> None:
        first = f.keys(len(pieces))

        def key(c: int) -> tuple[int, int]:
            return (COLLECTIVE, first + c)

        def dig(c: int) -> bytes:
            lo, hi = pieces[c]
            return digest(Digest.BROADCAST, torch.uint8, hi - lo, root)

        mine = leader(node)
        onward_to = children + [p for p in members if p != me] if me == mine else []
        if me == root:
            f.post([(p, key(c), data[lo:hi], dig(c)) for c, (lo, hi) in enumerate(pieces) for p in onward_to], [])
        elif me == mine:
            parent = leader(node_at(place - _msb(place)))
            for c, (lo, hi) in enumerate(pieces):
                onward = [(p, key(c), data[lo:hi], dig(c)) for p in onward_to]
                f.post([], [(parent, key(c), data[lo:hi], dig(c))],
                       then=(lambda s=onward: f.post(s, [])) if onward else None)
        else:
            f.post([], [(mine, key(c), data[lo:hi], dig(c)) for c, (lo, hi) in enumerate(pieces)])

    return flow.start(build)


# -- reduce-scatter --------------------------------------------------------------------------------


def _b(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a flat contiguous CPU tensor, as the exchange moves them."""
    return byte_view(t)


def _reduce(out: torch.Tensor, inputs: list[torch.Tensor], op: Op, divisor: int = 0) -> None:
    """``out = inputs[0] op inputs[1] op ...`` in list order (the compiled kernels), nothing for no elements."""
    if out.numel():
        kernels.reduce(out, inputs, op, divisor=divisor)


def reduce_scatter(flow: Flow, src: torch.Tensor, dst: torch.Tensor, op: Op) -> Flow:
    """``dst`` (flat, CPU, ``n`` elements) = ``op`` over every rank of that rank's ``src[me*n:(me+1)*n]``.

    ``src`` is flat and contiguous on the CPU, ``world * n`` elements of ``dst``'s dtype."""
    layout, me, node, members = flow.layout, flow.me, flow.node, flow.members
    world, n_nodes = layout.world_size, layout.num_nodes
    dtype = dst.dtype
    acc = acc_dtype(dtype, op)
    n = dst.numel()
    pieces = _cuts(n, max(1, chunk_bytes() // dtype.itemsize))
    per = len(pieces)
    here = members.index(me)
    divisor = world if op == Op.AVG else 0

    def block(d: int, lo: int, hi: int) -> torch.Tensor:
        return src[d * n + lo : d * n + hi]

    def build(f: Flow) -> None:
        first = f.keys(world * per)

        def key(d: int, c: int) -> tuple[int, int]:
            return (COLLECTIVE, first + d * per + c)

        def dig(d: int, c: int, partial: bool) -> bytes:
            lo, hi = pieces[c]
            return digest(Digest.REDUCE_SCATTER + int(op), dtype, hi - lo, -2 - d if partial else d)

        others = [p for p in members if p != me]
        for d in range(world):
            if _receiver(layout, node, d) != me or d == me:
                continue
            for c, (lo, hi) in enumerate(pieces):  # reduce the node's partial of d's block, send it to d
                got = [torch.empty(hi - lo, dtype=dtype) for _ in others]
                recvs = [(p, key(d, c), _b(g), dig(d, c, False)) for p, g in zip(others, got)]

                def partial(d: int = d, c: int = c, lo: int = lo, hi: int = hi, got: list = got) -> None:
                    inputs = got[:here] + [block(d, lo, hi)] + got[here:]
                    if len(inputs) == 1 and acc == dtype:
                        out = inputs[0]
                    else:
                        out = torch.empty(hi - lo, dtype=acc)
                        _reduce(out, inputs, op)
                    f.post([(d, key(d, c), _b(out), dig(d, c, True))], [])

                if recvs:
                    f.post([], recvs, then=partial)
                else:
                    partial()
        remote = [b for b in range(n_nodes) if b != node]
        for c, (lo, hi) in enumerate(pieces):  # this rank's own block: its node's pieces and the others' partials
            got = [torch.empty(hi - lo, dtype=dtype) for _ in others]
            parts = {b: torch.empty(hi - lo, dtype=acc) for b in remote}
            recvs = [(p, key(me, c), _b(g), dig(me, c, False)) for p, g in zip(others, got)]
            recvs += [(_receiver(layout, b, me), key(me, c), _b(parts[b]), dig(me, c, True)) for b in remote]

            def final(c: int = c, lo: int = lo, hi: int = hi, got: list = got, parts: dict = parts) -> None:
                inputs = got[:here] + [block(me, lo, hi)] + got[here:]
                out = dst[lo:hi]
                if acc == dtype:  # one pass: the nodes in order, this node's ranks in local order in its place
                    _reduce(out, [x for b in range(n_nodes) for x in (inputs if b == node else [parts[b]])], op,
                            divisor)
                    return
                own = torch.empty(hi - lo, dtype=acc)  # fp32: this node's partial, then the nodes in order
                _reduce(own, inputs, op)
                total = torch.empty(hi - lo, dtype=acc)
                _reduce(total, [own if b == node else parts[b] for b in range(n_nodes)], op, divisor)
                out.copy_(total)  # rounded once, to nearest even

            f.post([], recvs, then=final)
        sends = []  # last, so that the receives are all posted when the peers' pieces arrive
        for d in range(world):  # this rank's piece of every block goes to its node's reducer of that block
            via = _receiver(layout, node, d)
            if via != me:
                sends += [(via, key(d, c), _b(block(d, lo, hi)), dig(d, c, False)) for c, (lo, hi) in enumerate(pieces)]
        f.post(sends, [])

    return flow.start(build)


# -- the process group's door ----------------------------------------------------------------------


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel():
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


class _Watch:
    """The flows of one Work (several for a coalesced call), as the Work sees its communicator."""

    def __init__(self, flows: list[Flow]) -> None:
        self.flows = flows

    def time_out(self, seq: int, what: str, seconds: float) -> HFReduceError:
        flow = next((f for f in self.flows if not f.future.done()), self.flows[0])
        return flow.time_out(seq, what, seconds)

    def alive(self) -> bool:
        return self.flows[0].alive()


def start(comm, ex, plan: Plan, name: str, timeout: float | None) -> Flow:
    """The spread flow of one collective the engine would run as ``plan`` (already checked by
    :mod:`~fireflyer.hfreduce.plans.collectives`, whose flat views and write-backs it reuses)."""
    flow = Flow(ex, comm.layout, name, timeout or comm.config.timeout, [], comm.flight, comm.number(plan))
    kind = plan.desc.kind
    if kind == Kind.ALLGATHER:
        (_, mine), (_, out) = plan.sources[0], plan.sinks[0]
        out = host_out(out, flow)
        k = mine.numel()
        flow.finish += plan.on_done
        return allgather(flow, host_in(mine), [out[r * k : (r + 1) * k] for r in range(comm.layout.world_size)])
    if kind == Kind.BROADCAST:
        flat = plan.sources[0][1] if plan.sources else plan.sinks[0][1]
        data = host_in(flat) if plan.sources else host_out(flat, flow)
        flow.finish += plan.on_done
        return broadcast(flow, data, plan.desc.root)
    if kind == Kind.REDUCE_SCATTER:
        src, dst = host_in(plan.sources[0][1]), host_out(plan.sinks[0][1], flow)
        if _overlap(src, dst):  # in place: the result must not land where the input is still read
            src = src.clone()
        flow.finish += plan.on_done
        return reduce_scatter(flow, src, dst, plan.desc.op)
    raise AssertionError(f"spread has no flow for {plan.desc}")


def work(comm, plans: list[Plan], result: list[torch.Tensor], opts, what: str) -> HFReduceWork | None:
    """The Work of ``plans`` run as spread flows (their errors raise from ``wait()``), or None where
    :func:`route` keeps them on the engine. ``opts.timeout``, where set, bounds each flow."""
    ex = route(comm)
    if ex is None:
        return None
    timeout = seconds(getattr(opts, "timeout", None))
    for p in plans:
        p.timeout = timeout
    flows = [start(comm, ex, p, what, timeout) for p in plans]
    return HFReduceWork(_Watch(flows), [f.future for f in flows], result, seqs=[f.first_key for f in flows],
                        what=what)
