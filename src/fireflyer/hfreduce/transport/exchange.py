"""Point-to-point for hfreduce: send/recv, all-to-all, gather and scatter, between the ranks that exchange.

Every call is a set of transfers (:mod:`~fireflyer.hfreduce.transport.transfers`), each a byte
range to or from one peer: ``isend`` is one, ``all_to_all`` one to and one from every
peer, ``gather`` one from every peer to the root. They travel over channels
(:mod:`~fireflyer.hfreduce.transport.channels`, with this rank's ends of them in
:mod:`~fireflyer.hfreduce.transport.endpoints`), one per direction between two ranks: within a
node a ring in the node's shared mailboxes (:mod:`~fireflyer.hfreduce.transport.mailbox`), with
big payloads read straight from the sender's memory; across nodes a TCP connection
straight to the peer; to itself a hand-over in memory.

Async calls (``isend``, ``irecv``, ``async_op=True``) return at once: what fits goes
out on the caller's thread, the rest on the channel's own thread, and receives are
read by the channel's thread, so two ranks that both send first never deadlock. A
synchronous collective drives its channels itself (:mod:`~fireflyer.hfreduce.transport.progress`).

On a channel, frames keep the order this rank posted them in, and each carries a key:
``(P2P, tag)`` for user transfers, whose n-th send to a peer matches that peer's n-th
receive with the same tag, or ``(COLLECTIVE, n)`` for the group's n-th exchange
collective. A frame that arrives before its receive is posted is kept aside until it is.

Failures follow the engine's rules: every wait has a deadline (the group's timeout or
the call's), a dead local peer is noticed by its pid and a remote one by its closed
connection, the first failure fails the whole group (the communicator's ``fail``,
which calls :meth:`Exchange.fail`), and a failed group fails every later call at once.

The flight recorder sees every call: an all-to-all, gather or scatter takes the group's
next collective number (the engine's numbering, so every rank gives it the same one), a
send or a receive a point-to-point record; when the group fails, each call still in
flight notes there whom it was waiting on.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch

from fireflyer.hfreduce.transport.channels import RingIn, RingOut, TcpIn, TcpOut
from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.config import read_int
from fireflyer.hfreduce.transport.endpoints import Inbox, Outbox
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout, HFReduceError, error_to_text, fresh
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder, dtype_name, trace_of
from fireflyer.hfreduce.transport.mailbox import Mailboxes
from fireflyer.hfreduce.transport.progress import drive, steps_in_python
from fireflyer.hfreduce.plans.topology import Layout
from fireflyer.hfreduce.transport.transfers import (
    COLLECTIVE,
    P2P,
    Kind,
    Op,
    Transfer,
    dest_bytes,
    describe_digest,
    digest,
    source_bytes,
)
from fireflyer.hfreduce.transport.links import Listener
from fireflyer.errors import UserError

DIRECT_ENV = names.DIRECT_BYTES


def direct_bytes() -> int:
    """Payloads from this size up go between local ranks as direct reads (``FIREFLYER_HFREDUCE_DIRECT_BYTES``;
    0 turns them off); smaller ones through the ring, where they cost no round trip."""
    value = read_int(DIRECT_ENV, 256 << 10, "a whole number of bytes")
    if value < 0:
        raise UserError(f"{DIRECT_ENV} must be 0 (off) or a positive number of bytes, got {value}")
    return value


def split_rows(shape: Sequence[int], splits: list[int] | None, world: int, what: str) -> list[int]:
    """Rows per rank of an all_to_all_single tensor of ``shape``, checked as gloo checks them."""
    if not len(shape):
        raise UserError(f"hfreduce all_to_all_single needs an {what} tensor with at least one dimension (rows)")
    n = shape[0]
    if not splits:
        if n % world:
            raise UserError(f"hfreduce all_to_all_single: the {what}'s dim 0 ({n}) does not divide into {world} "
                             f"equal parts; pass {what}_split_sizes")
        return [n // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world or any(s < 0 for s in splits) or sum(splits) != n:
        raise UserError(f"hfreduce all_to_all_single: {what}_split_sizes={splits} must give {world} non-negative "
                         f"row counts (one per rank) that sum to the {what}'s dim 0 ({n})")
    return splits


@functools.lru_cache(maxsize=512)
def _spans(shape: tuple[int, ...], dtype: torch.dtype, splits: tuple[int, ...], world: int,
           what: str) -> tuple[tuple[int, int, bytes], ...]:
    """Per rank, the byte range of an all_to_all_single tensor of ``shape`` that goes to (or comes from) it, and
    its digest. Cached: a training loop makes the same few calls again and again."""
    rows = split_rows(shape, list(splits), world, what)
    row = 1
    for d in shape[1:]:
        row *= d
    size = dtype.itemsize
    out, off = [], 0
    for r in rows:
        n = r * row
        out.append((off, off + n * size, digest(Kind.ALL_TO_ALL, dtype, n)))
        off += n * size
    return tuple(out)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    if a.is_contiguous() and b.is_contiguous():  # the common case, without making storage objects
        pa, pb = a.data_ptr(), b.data_ptr()
        return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Exchange:
    """Point-to-point transfers of one rank of one process group (see the module docstring).

    Collective to create (the node's ranks share mailboxes, every rank of a multi-node
    group publishes a listening address). The host communicator hands in what it knows:
    the layout, the peers' pids, the store, the group's secret, and three hooks: its
    group timeout, a ``check`` that raises if the group has failed or a local peer died,
    and ``fail``, which records a failure group-wide and returns the error to raise. With a
    ``flight`` recorder and ``number`` (the engine's :meth:`~fireflyer.hfreduce.engine.jobs.Jobs.number`)
    every call is recorded.
    """

    def __init__(self, *, rank: int, layout: Layout, pids: list[int], store, secret: bytes, host: str,
                 timeout: Callable[[], float], describe: Callable[[int], str], check: Callable[[], None],
                 fail: Callable[[BaseException], HFReduceError], name: str, private: bool = True,
                 setup_timeout: float = 60.0, flight: FlightRecorder | None = None,
                 number: Callable[[Callable[[int], None]], int] | None = None, compiled: bool = True) -> None:
        self.rank = rank
        self._compiled = compiled  # synchronous calls drive their channels in the compiled core, where it is built
        self.world_size = layout.world_size
        self.describe = describe
        self._me = describe(rank)
        self._layout = layout
        self._pids = list(pids)
        self._direct = direct_bytes()
        self.secret = secret
        self._timeout = timeout
        self._host_check = check
        self._host_fail = fail
        self._flight = flight if number is not None else None
        self._number = number
        node = layout.node_of(rank)
        self._members = layout.nodes[node]
        # Reentrant: a call that completes at once (to itself) settles under it, and its callbacks may post more.
        self._lock = threading.RLock()
        self._ops: dict[int, Op] = {}
        self._next_op = 0
        self._collectives = 0
        self._error: HFReduceError | None = None
        self._closed = False
        self._outboxes: dict[int, Outbox] = {}
        self._inboxes: dict[int, Inbox] = {}
        self._box: Mailboxes | None = None
        self.listener: Listener | None = None
        self.addresses: dict[int, tuple[str, int]] = {}
        try:
            if len(self._members) > 1:
                self._box = Mailboxes.open(store=store, node=node, local_rank=self._members.index(rank),
                                           local_size=len(self._members), secret=secret, name=name,
                                           timeout=setup_timeout, private=private)
            if layout.num_nodes > 1:
                self.listener = Listener(host, secret, rank)
                store.set(f"exchange/addr/{rank}", json.dumps(self.listener.address))
                remote = [r for r in range(self.world_size) if r not in self._members]
                try:
                    store.wait([f"exchange/addr/{r}" for r in remote], timedelta(seconds=setup_timeout))
                except Exception as exc:  # torch raises its own store error flavours
                    raise CollectiveTimeout(f"{describe(rank)}: not every rank published its exchange address "
                                            f"within {setup_timeout:g}s") from exc
                for r in remote:
                    h, p = json.loads(store.get(f"exchange/addr/{r}"))
                    self.addresses[r] = (h, p)
        except BaseException:
            self.close()
            raise

    # -- the calls -------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, timeout: float | None = None) -> Op:
        self._peer(dst, "send to")
        data = source_bytes(tensor)
        dig = digest(Kind.P2P, tensor.dtype, tensor.numel())
        return self._start(f"send to rank {dst}", (P2P, tag), timeout, [tensor], [],
                           sends=[(dst, data, dig)], recvs=[], trace=("send", [tensor], [], dst))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, timeout: float | None = None) -> Op:
        self._peer(src, "receive from")
        finish: list = []
        data = dest_bytes(tensor, finish)
        dig = digest(Kind.P2P, tensor.dtype, tensor.numel())
        return self._start(f"recv from rank {src}", (P2P, tag), timeout, [tensor], finish,
                           sends=[], recvs=[(src, data, dig)], trace=("recv", [tensor], [], src))

    def all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *,
                   timeout: float | None = None, sync: bool = False) -> Op:
        """``inputs[r]`` goes to rank ``r``; ``outputs[r]`` receives what rank ``r`` sent to this rank.

        ``sync``: the caller will wait for it anyway, so it moves the bytes itself (and returns when done)."""
        w = self.world_size
        if len(outputs) != w or len(inputs) != w:
            raise UserError(f"hfreduce all_to_all needs {w} input and {w} output tensors (one per rank), "
                             f"got {len(inputs)} and {len(outputs)}")
        finish: list = []
        recv = [(dest_bytes(o, finish), digest(Kind.ALL_TO_ALL, o.dtype, o.numel())) for o in outputs]
        send = [(source_bytes(t), digest(Kind.ALL_TO_ALL, t.dtype, t.numel())) for t in inputs]
        return self._all_to_all("all_to_all", recv, send, list(outputs), finish, timeout, sync,
                                (list(inputs), list(outputs)))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                          input_splits: list[int] | None, *, timeout: float | None = None, sync: bool = False) -> Op:
        """Rows (dim 0) ``input_splits[r]`` of ``input`` go to rank ``r``, in rank order; ``output`` takes
        ``output_splits[r]`` rows from rank ``r``. Empty or None splits: equal parts."""
        w = self.world_size
        send_spans = _spans(tuple(input.shape), input.dtype, tuple(input_splits or ()), w, "input")
        recv_spans = _spans(tuple(output.shape), output.dtype, tuple(output_splits or ()), w, "output")
        if _overlap(input, output):
            input = input.clone()  # in place: the rows sent must not be overwritten by the rows received
        finish: list = []
        src, dst = source_bytes(input), dest_bytes(output, finish)
        send = [(src[a:b], dig) for a, b, dig in send_spans]
        recv = [(dst[a:b], dig) for a, b, dig in recv_spans]
        return self._all_to_all("all_to_all_single", recv, send, [output], finish, timeout, sync,
                                ([input], [output]))

    def _all_to_all(self, name: str, recv: list, send: list, result: list[torch.Tensor],
                    finish: list[Callable[[], None]], timeout: float | None, sync: bool,
                    tensors: tuple[list, list]) -> Op:
        me = self.rank
        (mine_in, want), (mine_out, have) = recv[me], send[me]
        if want != have or mine_in.numel() != mine_out.numel():
            raise UserError(f"hfreduce {name}: rank {me} sends itself {describe_digest(have)} but expects "
                             f"{describe_digest(want)}; the sizes of a rank's own piece must agree")
        mine_in.copy_(mine_out)
        return self._start(name, None, timeout, result, finish,
                           sends=[(r, *send[r]) for r in range(self.world_size) if r != me],
                           recvs=[(r, *recv[r]) for r in range(self.world_size) if r != me], drive_here=sync,
                           trace=("all_to_all", *tensors, None))

    def gather(self, outputs: list[torch.Tensor] | None, tensor: torch.Tensor, root: int, *,
               timeout: float | None = None, sync: bool = False) -> Op:
        self._root(root, "gather")
        me, w = self.rank, self.world_size
        dig = digest(Kind.GATHER, tensor.dtype, tensor.numel(), root)
        if me != root:
            return self._start("gather", None, timeout, [tensor], [],
                               sends=[(root, source_bytes(tensor), dig)], recvs=[], drive_here=sync,
                               trace=("gather", [tensor], [], None))
        finish: list = []
        recv_bytes = [dest_bytes(o, finish) for o in outputs]
        recv_bytes[me].copy_(source_bytes(tensor))
        recvs = [(r, recv_bytes[r], digest(Kind.GATHER, outputs[r].dtype, outputs[r].numel(), root))
                 for r in range(w) if r != me]
        return self._start("gather", None, timeout, list(outputs), finish, sends=[], recvs=recvs, drive_here=sync,
                           trace=("gather", [tensor], list(outputs), None))

    def scatter(self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, root: int, *,
                timeout: float | None = None, sync: bool = False) -> Op:
        self._root(root, "scatter")
        me, w = self.rank, self.world_size
        finish: list = []
        out = dest_bytes(tensor, finish)
        if me != root:
            dig = digest(Kind.SCATTER, tensor.dtype, tensor.numel(), root)
            return self._start("scatter", None, timeout, [tensor], finish, sends=[], recvs=[(root, out, dig)],
                               drive_here=sync, trace=("scatter", [], [tensor], None))
        out.copy_(source_bytes(inputs[me]))
        sends = [(r, source_bytes(inputs[r]), digest(Kind.SCATTER, inputs[r].dtype, inputs[r].numel(), root))
                 for r in range(w) if r != me]
        return self._start("scatter", None, timeout, [tensor], finish, sends=sends, recvs=[], drive_here=sync,
                           trace=("scatter", list(inputs), [tensor], None))

    # -- keyed calls, for collectives built of several steps (spread.py) --------------------
    def reserve(self, count: int) -> int:
        """The first of ``count`` consecutive collective numbers, for a collective made of several calls.

        Its transfers carry keys ``(COLLECTIVE, first + i)`` of its own choosing (:meth:`post`).
        Every rank must reserve the same counts in the same order, on the caller's thread, as
        it makes its collectives; a call posted later (from a callback) then still matches."""
        with self._lock:
            first = self._collectives
            self._collectives += count
            return first

    def post(self, name: str, *, sends: list, recvs: list, timeout: float | None = None,
             record: int | None = None) -> Op:
        """One call of transfers that each carry their own key: ``(peer, key, data, digest)`` tuples.

        Sends go from ``data`` as it is when the channel reaches them (keep it unchanged until the
        call is done); receives land in ``data``. Returns at once; the call's future completes when
        every transfer has, as :meth:`isend`'s does. ``record``: the collective (its number) this
        call is a step of, whose flight record notes whom the call waits on if the group fails."""
        return self._start(name, None, timeout, [], [], sends=sends, recvs=recvs, keyed=True, record=record)

    # -- plumbing --------------------------------------------------------------------------
    def _peer(self, peer: int, what: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise UserError(f"hfreduce cannot {what} rank {peer!r}: the group's ranks are 0..{self.world_size - 1}")

    def _root(self, root: int, what: str) -> None:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise UserError(f"hfreduce {what} root must be a rank of the group (0..{self.world_size - 1}), got {root!r}")

    def _start(self, name: str, key: tuple[int, int] | None, timeout: float | None, result: list[torch.Tensor],
               finish: list[Callable[[], None]], *, sends: list, recvs: list, drive_here: bool = False,
               keyed: bool = False, trace: tuple | None = None, record: int | None = None) -> Op:
        """Post a call's transfers to their channels, in this rank's order, and return the call.

        ``drive_here`` (a synchronous call): the caller moves the transfers on the channels it
        can claim itself, before returning; the rest go to the channels' threads. ``keyed``:
        each of ``sends`` and ``recvs`` is ``(peer, key, data, digest)`` (:meth:`post`).
        ``trace``: ``(op, inputs, outputs, peer)`` to enter the call in the flight recorder as
        (its own record); ``record``: the record of the collective it is a step of.
        """
        if timeout is not None and not timeout > 0:
            raise UserError(f"a timeout must be positive seconds, got {timeout}")
        limit = timeout or self._timeout()
        owned = trace is not None and self._flight is not None
        if owned:
            record = self._enter(trace, limit)
        claimed_out: list = []
        claimed_in: list = []
        with self._lock:
            op_id = self._next_op
            self._next_op += 1
            if key is None and not keyed:
                key = (COLLECTIVE, self._collectives)
                self._collectives += 1
            op = Op(op_id, name, time.monotonic() + limit, limit, result, finish, self._forget)
            op.record = record
            if owned:
                self._flight.started(record)
                op.on_settled = self._settled
            error = self._refusal()
            if error is None:
                me = self._me
                if keyed:
                    sending = [Transfer(op, peer, True, k, data, dig, me) for peer, k, data, dig in sends]
                    receiving = [Transfer(op, peer, False, k, data, dig, me) for peer, k, data, dig in recvs]
                else:
                    sending = [Transfer(op, peer, True, key, data, dig, me) for peer, data, dig in sends]
                    receiving = [Transfer(op, peer, False, key, data, dig, me) for peer, data, dig in recvs]
                op.add_all(sending)
                op.add_all(receiving)
                stepping = steps_in_python(self._compiled)
                self._ops[op_id] = op
                for tr in sending:
                    if tr.peer == self.rank:  # to itself: hand it over now
                        self._inbox(tr.peer).deliver(tr.key, tr.digest, tr.data)
                        op.done(tr)
                        continue
                    out = self._outbox(tr.peer)
                    if drive_here and out.claim(stepping):
                        claimed_out.append((out, tr))
                    else:
                        out.post(tr)
                for tr in receiving:
                    box = self._inbox(tr.peer)
                    if drive_here and tr.peer != self.rank and box.claim(tr.key, stepping):
                        claimed_in.append((box, tr))
                    else:
                        box.post(tr)
        if error is not None:
            op.fail(error if self._closed or error is self._error else self.failed(error))
            return op
        if claimed_out or claimed_in:
            drive(self, op, claimed_out, claimed_in, compiled=self._compiled)
        op.done(None)  # completes a call with nothing to move (world size 1, or all of it local)
        return op

    def _enter(self, trace: tuple, timeout: float) -> int:
        """Enter a call in the flight recorder: a send or a receive as such, a collective under the group's
        next number; returns its record key."""
        op, ins, outs, peer = trace
        if op in ("send", "recv"):
            t = ins[0]
            return self._flight.record_p2p(op, peer, sizes=[list(t.shape)], dtypes=[dtype_name(t.dtype)],
                                           timeout_s=timeout)
        (in_sizes, in_dtypes), (out_sizes, out_dtypes) = trace_of(ins), trace_of(outs)
        return self._number(lambda seq: self._flight.record(seq, op, input_sizes=in_sizes, input_dtypes=in_dtypes,
                                                            output_sizes=out_sizes, output_dtypes=out_dtypes,
                                                            timeout_s=timeout))

    def _settled(self, op: Op, error: str | None) -> None:
        if error is None:
            self._flight.completed(op.record)
        else:
            self._flight.failed(op.record, error)

    def _refusal(self) -> BaseException | None:
        """Why no new call may start now (the group failed, or is closed), or None."""
        if self._error is not None:
            return self._error
        if self._closed:
            return HFReduceError("hfreduce communicator is closed; create a new process group")
        try:
            self._host_check()
        except BaseException as exc:  # noqa: BLE001 - the host's failure, or a local peer found dead
            return exc
        return None

    def _forget(self, op: Op) -> None:
        with self._lock:
            self._ops.pop(op.id, None)

    def _outbox(self, peer: int) -> Outbox:
        box = self._outboxes.get(peer)
        if box is None:
            if peer in self._members:
                ring = self._box.ring(self._members.index(self.rank), self._members.index(peer), self.describe(peer))
                transport = RingOut(ring, self._direct)
            else:
                transport = TcpOut(self, peer)
            box = self._outboxes[peer] = Outbox(self, peer, transport)
        return box

    def _inbox(self, peer: int) -> Inbox:
        box = self._inboxes.get(peer)
        if box is None:
            if peer == self.rank:
                transport = None
            elif peer in self._members:
                transport = RingIn(self._box.ring(self._members.index(peer), self._members.index(self.rank),
                                                   self.describe(peer)), self._pids[peer])
            else:
                transport = TcpIn(self, peer)
            box = self._inboxes[peer] = Inbox(self, peer, transport)
        return box

    def expect(self, tr: Transfer, dig: bytes, nbytes: int) -> None:
        if dig != tr.digest or nbytes != tr.data.numel():
            raise CollectiveMismatch(
                f"collective mismatch: {self.describe(self.rank)} expected {describe_digest(tr.digest)} "
                f"({tr.data.numel()} bytes, {tr.op.name} #{tr.op.id}) from {self.describe(tr.peer)}, which sent "
                f"{describe_digest(dig)} ({nbytes} bytes); every rank must make matching calls with matching sizes "
                "and dtypes")

    def check(self) -> None:
        """Raise if the group has failed or this exchange is closed (called between waits)."""
        if self._error is not None:
            raise fresh(self._error)
        if self._closed:
            raise HFReduceError("hfreduce communicator is closed")
        self._host_check()

    def stopped(self) -> bool:
        return self._error is not None or self._closed

    def failed(self, exc: BaseException) -> HFReduceError:
        """A transfer failed: fail the group (unless this is just the exchange closing); return the error."""
        if self._closed:
            return self._error or HFReduceError("hfreduce communicator is closed")
        error = self._host_fail(exc)
        self.fail(error)  # the host calls it too; a second call changes nothing
        return error

    # -- failure and the Work's hooks ------------------------------------------------------
    def fail(self, error: HFReduceError) -> None:
        """The group failed: fail every call in flight, tell the peers this rank is connected to, stop."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            ops = list(self._ops.values())
        self._note_waits(ops)
        for op in ops:
            op.fail(error)
        text = error_to_text(error)
        for box in list(self._outboxes.values()):
            box.stop(text)
        for box in list(self._inboxes.values()):
            box.stop(failed=True)
        if self._box is not None:
            self._box.wake_all()

    def _note_waits(self, ops: list[Op]) -> None:
        """In the flight recorder, whom each call still in flight was waiting on (the group is failing)."""
        if self._flight is None:
            return
        waits: dict[int, tuple[set[int], list[str]]] = {}
        for op in ops:
            if op.record is not None:
                peers, what = waits.setdefault(op.record, (set(), []))
                peers.update(op.peers())
                what += op.waiting_on()
        for record, (peers, what) in waits.items():
            if peers:
                self._flight.waiting(record, sorted(peers), "; ".join(sorted(set(what))))

    def time_out(self, seq: int, what: str, seconds: float) -> HFReduceError:
        """A caller's ``wait(timeout)`` expired on call ``seq``: fail the group with a timeout naming whom it waited for."""
        op = self._ops.get(seq)
        waits = op.waiting_on() if op is not None else []
        detail = f"it was {', '.join(waits)}" if waits else "it had nothing left to move"
        return self.failed(CollectiveTimeout(
            f"{what} (#{seq}) did not finish within the caller's timeout of {seconds:g}s on "
            f"{self.describe(self.rank)}: {detail}"))

    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Fail what is still in flight, stop the threads, release the mailboxes and connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ops = list(self._ops.values())
        closed = HFReduceError("hfreduce communicator is closed; create a new process group")
        for op in ops:
            op.fail(closed)
        for box in self._outboxes.values():
            box.stop(None)
        for box in self._inboxes.values():
            box.stop(failed=False)
        if self._box is not None:
            self._box.wake_all()
        for box in list(self._outboxes.values()) + list(self._inboxes.values()):
            if box.thread is not None:
                box.thread.join(timeout=2)
        for box in self._outboxes.values():
            if isinstance(box.transport, TcpOut) and box.transport.link is not None:
                box.transport.link.close()
        for box in self._inboxes.values():
            if isinstance(box.transport, TcpIn) and box.transport.link is not None:
                box.transport.link.close()
        self._outboxes.clear()
        self._inboxes.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self._box is not None:
            self._box.close()
            self._box = None
