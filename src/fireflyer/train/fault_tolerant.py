"""Fault-tolerant training (``fireflyer train --fault-tolerant``): each node a torchft replica group.

torchft (Meta) does the fault tolerance: a Lighthouse forms a quorum of live replica groups
before every step, a ``Manager`` per rank reconfigures the cross-replica process group
(:class:`~fireflyer.hfreduce.backend.fault_tolerance.ProcessGroupHFReduce`) on every quorum change,
heals a replica that is behind from a live one over the network, and commits a step only
if every rank of the replica group computed it without error. Each emulated node is one
replica group with its own torchrun agent, which restarts the node's ranks when they die.

What fireflyer adds is **the same step whatever the quorum** (the canonical order):

- a step's global batch is a fixed set of ``M`` micro-batches (the configured layout's);
- before each step the live ranks (``L`` replicas of ``R`` ranks, in quorum order) split the
  ``M`` micro-batches into aligned blocks, subtrees of the canonical tree over ``M``
  (:func:`micro_blocks`), as evenly as such blocks allow; each rank sums its blocks' gradients
  in that tree;
- the block sums are gathered on every rank (within the node over its own group, across
  replicas through the Manager's allreduce, each block in its own slot padded with ``-0.0``,
  the exact identity of IEEE addition) and summed in the canonical tree over the blocks
  (:func:`tree_over_blocks`): the bits of one process summing all ``M``.

A step that a death interrupts is not committed anywhere (torchft's vote); the next quorum
redoes it in full on the survivors. Without the canonical order a step keeps every rank's
own micro-batches and drops a lost replica's, as torchft's own data parallel does; the
run's record counts what was dropped.

Healing moves the model, optimizer, schedule and history from a live replica through
torchft's HTTP transport, loaded as data only (:class:`DataOnlyTransport`: tensors and plain
values, never code). Validation is computed by every replica on its own (its node's ranks
split the batches), so it never waits on a quorum.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fireflyer.errors import FireflyerError, UserError
from fireflyer.hfreduce.plans.canonical import split_point
from fireflyer.lighthouse import LIGHTHOUSE_ENV, LighthouseFailed

_ID_BYTES = 64
"""Room for a replica id in the quorum's exchange of ids."""


class LeftBehind(FireflyerError, RuntimeError):
    """A replica's quorum is behind the checkpoint on disk: the live replicas went on (or finished) without it,
    as when its node was stopped past the timeout. Its agent restarts it from the checkpoint."""


class PartialHeal(FireflyerError, RuntimeError):
    """A heal reached some ranks of a replica and not others (its source died during the transfer): the replica's
    ranks hold the states of different steps. Its agent restarts it from the checkpoint."""


def node_index(node: str) -> int:
    """``node2`` -> 2: an emulated node's place in the configured layout (its replica id)."""
    digits = node.removeprefix("node")
    return int(digits) if digits.isdigit() else 0


def restarts() -> int:
    """How many times this node's agent has restarted its ranks (torchrun's count; 0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# ------------------------------------------------------------------ the pure core: who sums what
def tree_blocks(total: int, parts: int) -> list[tuple[int, int]]:
    """Subtrees ``(start, size)`` of the canonical tree over ``total`` terms that cover it in order:
    the coarsest cut with at least ``parts`` blocks (or every single term, if fewer)."""
    if total < 1 or parts < 1:
        raise UserError(f"a step needs at least one micro-batch and one rank, got {total} and {parts}")

    def cut(start: int, size: int, limit: int) -> list[tuple[int, int]]:
        if size <= limit or size == 1:
            return [(start, size)]
        m = split_point(size)
        return cut(start, m, limit) + cut(start + m, size - m, limit)

    limit = total
    blocks = cut(0, total, limit)
    while len(blocks) < parts and limit > 1:
        limit = max(1, limit // 2)
        blocks = cut(0, total, limit)
    return blocks


def micro_blocks(total: int, parts: int) -> tuple[list[tuple[int, int]], list[range]]:
    """The blocks of :func:`tree_blocks` and, for each of ``parts`` ranks, the range of block indices it
    sums: consecutive, as even as the blocks allow (a rank may hold none when blocks are fewer)."""
    blocks = tree_blocks(total, parts)
    k = len(blocks)
    return blocks, [range(p * k // parts, (p + 1) * k // parts) for p in range(parts)]


def tree_over_blocks(total: int, blocks: Sequence[tuple[int, int]], sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical tree over ``total`` terms, given the sums of blocks that are subtrees of it."""
    where = {(start, size): i for i, (start, size) in enumerate(blocks)}

    def node(start: int, size: int) -> torch.Tensor:
        i = where.get((start, size))
        if i is not None:
            return sums[i]
        if size == 1:
            raise UserError(f"term {start} is in no block")
        m = split_point(size)
        return node(start, m) + node(start + m, size - m)

    return node(0, total)


def own_blocks(total: int, parts: int, present: Sequence[int]) -> tuple[list[tuple[int, int]], list[range]]:
    """Without the canonical order: every configured rank ``p`` keeps its own ``total / parts`` micro-batches,
    one block each; ``present`` are the configured ranks still alive, in order. A lost rank's block is dropped."""
    m = total // parts
    blocks = [(p * m, m) for p in present]
    return blocks, [range(i, i + 1) for i in range(len(present))]


# ------------------------------------------------------------------ what a run went through
@dataclass
class Failure:
    """One quorum change as the surviving replicas saw it."""

    step: int
    """The step the change interrupted (redone by the new quorum)."""
    at: float
    """Wall time the interrupted step's error was seen (time.time())."""
    replicas_before: int
    replicas_after: int
    lost: list[str]
    """The replica ids (nodes) that left."""
    error: str
    """What the survivors saw: the named hfreduce error."""
    recovered_s: float | None = None
    """Seconds from the error to the next committed step."""


@dataclass
class Heal:
    """A replica that joined the quorum behind the others and took their state over the network."""

    step: int
    replica: str
    at: float
    bytes: int
    seconds: float


@dataclass
class Record:
    """The run's fault-tolerance record, kept with the history (and healed with it)."""

    failures: list[dict[str, Any]] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    quorums: list[dict[str, Any]] = field(default_factory=list)
    """Every quorum change: step, replica ids, time."""
    dropped_micro_batches: int = 0
    redone_steps: int = 0


# ------------------------------------------------------------------ the healing transport
def data_only_transport(timeout: timedelta, host: str, healing: Callable[[int], None] | None = None) -> Any:
    """torchft's HTTP checkpoint transport, loading what it receives as data only (``weights_only=True``:
    tensors and plain values; a peer cannot make this process run code) and serving at ``host``;
    ``healing(step)`` is called as a heal's transfer begins."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport
    import urllib.request

    class DataOnlyTransport(HTTPTransport):
        received_bytes = 0

        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                body = f.read()
            DataOnlyTransport.received_bytes += len(body)
            return _streaming_load(io.BytesIO(body), weights_only=True)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            if healing is not None:
                healing(step)
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    return DataOnlyTransport(timeout=timeout, num_chunks=0)


# ------------------------------------------------------------------ one rank's side
@dataclass(frozen=True)
class StepPlan:
    """What this rank computes in one quorum's step and how the sums are put together."""

    step: int
    replicas: list[str]
    """The live replica ids, in quorum order."""
    blocks: list[tuple[int, int]]
    mine: list[tuple[int, int]]
    """This rank's blocks."""
    owner: list[int]
    """For each block, the node-local rank that sums it, in this rank's replica, or -1 (another replica)."""
    total: int
    """Micro-batches the step's mean is over (all of them in the canonical order; the present ones otherwise)."""
    dropped: int


class Replica:
    """This rank's torchft Manager, for a replica group of the node's ranks (the default process group).

    ``state`` and ``load`` give and take the trainer's whole state (for healing). Construct
    after ``dist.init_process_group`` (the node's group); collective over the node's ranks.
    """

    def __init__(self, *, replica_id: str, configured: int, micro_batches: int, canonical: bool,
                 state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None],
                 timeout: float, quorum_timeout: float, lighthouse: str | None = None) -> None:
        from torchft import Manager

        from fireflyer.hfreduce.backend.fault_tolerance import ProcessGroupHFReduce

        lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise LighthouseFailed(f"no Lighthouse: {LIGHTHOUSE_ENV} is not set (fireflyer train --fault-tolerant "
                                   "starts one)")
        self.replica_id, self.configured, self.micro_batches = replica_id, configured, micro_batches
        self.canonical = canonical
        self.local_rank, self.local_world = dist.get_rank(), dist.get_world_size()
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # the replica group's own store for torchft, fresh for each start of the node's ranks
        self._store = None
        box: list[Any] = [None]
        if self.local_rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=quorum_timeout))
            box = [self._store.port]
        dist.broadcast_object_list(box, src=0)
        # a line in the node's log as a heal's transfer begins (rank 0 for the node)
        healing = (lambda step: print(f"{replica_id}: healing from a live replica at step {step}", flush=True)) \
            if self.local_rank == 0 else None
        self.transport = data_only_transport(timedelta(seconds=timeout), host, healing)
        # A collective that fails by its timeout (a peer stopped, not dead) may end on the replica's ranks seconds
        # apart: each waits its own timeout, then names the culprit over the quorum's store, which a stopped host
        # holds up. The vote waits for the late rank rather than fail (a TimeoutError would crash a live node).
        self._commit_timeout = timedelta(seconds=max(quorum_timeout, 2 * timeout))
        self.record = Record()
        self._last_quorum: tuple[str, ...] = ()
        self.pg = ProcessGroupHFReduce(timeout=timedelta(seconds=timeout))
        self._ids_of: tuple[int | None, list[str]] = (None, [])
        self.manager = Manager(
            pg=self.pg, min_replica_size=1,
            use_async_quorum=False,  # the step's plan is settled before its first forward
            load_state_dict=load, state_dict=state, replica_id=replica_id, lighthouse_addr=lighthouse,
            store_addr=host, store_port=int(box[0]), rank=self.local_rank, world_size=self.local_world,
            timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=timeout), hostname=host, checkpoint_transport=self.transport)

    # -------------------------------------------------------------- a step
    def set_step(self, step: int) -> None:
        """This replica's last committed step (on a start from a checkpoint)."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    def current_step(self) -> int:
        return self.manager.current_step()

    def begin(self) -> StepPlan | None:
        """Join the next quorum (healing first if this replica is behind) and plan its step; None when the
        quorum failed at once (a peer lost while its members were named): the step is then not committed."""
        before = self.transport.received_bytes
        t0 = time.monotonic()
        self.manager.start_quorum()
        healed = self.transport.received_bytes - before
        self._check_one_step()
        step = self.manager.current_step() + 1
        replicas = self._participants(step, healed, time.monotonic() - t0 if healed else 0.0)
        if replicas is None:
            return None
        if tuple(replicas) != self._last_quorum:
            self.record.quorums.append({"step": step, "replicas": replicas, "at": time.time()})
            self._last_quorum = tuple(replicas)
        return self.plan(step, replicas)

    def _check_one_step(self) -> None:
        """Every rank of this replica at one step, or PartialHeal. Each rank heals from its own peer in the source
        replica; when the source dies during the transfer, some ranks may have taken its state (and its step)
        and others not. The step then fails (torchft's vote), but the next quorum would not heal them again: they
        would go on at different steps. A small all-reduce over the node's ranks, every step, finds it."""
        if self.local_world == 1:
            return
        s = self.manager.current_step()
        steps = torch.tensor([s, -s], dtype=torch.int64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        high, low = int(steps[0]), -int(steps[1])
        if high != low:
            raise PartialHeal(f"{self.replica_id}'s ranks are at steps {low} to {high} after a heal whose source was "
                              "lost during the transfer; restarting the node from the checkpoint")

    def plan(self, step: int, replicas: list[str]) -> StepPlan:
        """Pure but for this rank's place: the blocks of ``step`` over the live ``replicas``."""
        R, M = self.local_world, self.configured * self.local_world * self.micro_batches
        q = replicas.index(self.replica_id)
        if self.canonical:
            blocks, shares = micro_blocks(M, len(replicas) * R)
            dropped = 0
        else:
            present = [node_index(r) * R + lr for r in replicas for lr in range(R)]
            blocks, shares = own_blocks(M, self.configured * R, present)
            dropped = M - sum(size for _, size in blocks)
        owner = [-1] * len(blocks)
        for lr in range(R):
            for b in shares[q * R + lr]:
                owner[b] = lr
        mine = [blocks[b] for b in shares[q * R + self.local_rank]]
        return StepPlan(step=step, replicas=replicas, blocks=blocks, mine=mine, owner=owner,
                        total=M - dropped, dropped=dropped)

    def gather(self, plan: StepPlan, mine: Sequence[torch.Tensor], width: int,
               dtype: torch.dtype = torch.float32) -> list[torch.Tensor] | None:
        """Every block's sum on every rank, from this rank's block sums (flat, ``width`` long); None when the
        step failed (a peer lost: the Manager knows, and the step is not committed)."""
        slots = torch.full((len(plan.blocks), width), -0.0, dtype=dtype)
        index = {b: i for i, b in enumerate(plan.blocks)}
        for blk, s in zip(plan.mine, mine, strict=True):
            slots[index[blk]] = s
        if self.local_world > 1:
            dist.all_reduce(slots)  # the node's ranks' slots (a failure here is this node's own: it raises)
        self.manager.allreduce(slots, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        return list(slots.unbind())

    def sum_over_replicas(self, t: torch.Tensor) -> bool:
        """``t`` summed in place with the same rank's ``t`` on every live replica; False when the step failed (a
        peer lost: the Manager knows, and the step is not committed)."""
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        return self.manager.errored() is None

    def commit(self) -> bool:
        """torchft's vote: True when every rank of this replica computed the step without error."""
        return self.manager.should_commit(timeout=self._commit_timeout)

    def error(self) -> str:
        e = self.manager.errored()
        inner = getattr(e, "original_exception", e)
        return f"{type(inner).__name__}: {inner}" if inner is not None else "a peer left the quorum"

    def _participants(self, step: int, healed: int, heal_s: float) -> list[str] | None:
        """The live replica ids in quorum order, learnt over the new quorum's group when it changes, with the
        heals of those that joined (each replica says what it received), recorded on every replica."""
        if self.manager.errored() is not None:
            return None
        if self.pg.quorum_id == self._ids_of[0] and not healed:
            return self._ids_of[1]
        n, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None:
            raise FireflyerError(f"{self.replica_id} is not in the quorum it just joined")
        t = torch.zeros(n, _ID_BYTES + 16, dtype=torch.uint8)
        raw = self.replica_id.encode()[:_ID_BYTES]
        t[rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        t[rank, _ID_BYTES:] = torch.tensor([float(healed), heal_s], dtype=torch.float64).view(torch.uint8)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            self.pg.allreduce([t], opts).wait()
        except Exception as exc:  # noqa: BLE001 - a peer lost: the step fails, the next quorum goes on
            self.manager.report_error(exc)
            return None
        ids = []
        for i in range(n):
            name = t[i, :_ID_BYTES]
            ids.append(bytes(name[name > 0].tolist()).decode())
            got, seconds = t[i, _ID_BYTES:].clone().view(torch.float64).tolist()
            if got > 0:
                self.record.heals.append(asdict(Heal(step=step - 1, replica=ids[-1], at=time.time(),
                                                     bytes=int(got), seconds=seconds)))
        self._ids_of = (self.pg.quorum_id, ids)
        return ids

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        finally:
            if self._store is not None:
                del self._store
                self._store = None


# ------------------------------------------------------------------ fault injection
def node_ranks(node: str, mark: str) -> list[int]:
    """The rank processes (not the torchrun agent) of emulated node ``node`` in the run marked ``mark``
    (:mod:`fireflyer.lifetime`): what a test or ``fireflyer bench recovery`` kills to lose a node."""
    from fireflyer import lifetime

    found = []
    for pid in lifetime.marked(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"FIREFLYER_NODE_ID={node}".encode() in env and b"fireflyer.train.job" in cmd \
                and b"torch.distributed.run" not in cmd:
            found.append(pid)
    return found
