"""The HFReduce communicator: one per rank and process group, assembled from the engine's parts.

Construction is the rendezvous: through the job's store every rank learns the group's
layout (which ranks share a node), the group's key (derived from the launcher's secret,
:func:`~fireflyer.hfreduce.config.launcher_secret`, and only without one carried by the
store), and every peer's pid. Its settings are an :class:`HFReduceConfig` (by default
from the environment); the compiled core comes from ``compiled.py``. Then come the parts,
one module each:

* ``transport/arena.py``      the node's shared memory and the flags that hand chunks between local ranks;
* ``engine/failures.py``      failure propagation and diagnosis (whom each thread waits on);
* ``engine/jobs.py``          the job queue and the engine thread (collectives in submission order);
* ``engine/node_stage.py``    stage-in, reduce and stage-out through the arena, in Python or the compiled core;
* ``engine/trees.py``         the inter-node stage (rail ranks with several nodes);
* ``engine/fast_door.py``     small one-node allreduces as one call of the compiled core;
* ``transport/exchange.py``   send/recv, all_to_all, gather and scatter;
* ``engine/watch.py``         across nodes, news of a failure for every rank, and each rank's position for a timeout's diagnosis.

Local ranks talk through the arena, nodes over authenticated TCP links. Every wait has a
deadline, a dead local peer is noticed by its pid, a dead remote one by its closed
socket, and the first failure is broadcast to every rank, which then raises it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from datetime import timedelta

import torch

from fireflyer.errors import UserError
from fireflyer.hfreduce.plans import collectives
from fireflyer.hfreduce.transport import fdshare
from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.transport.arena import NAME_PREFIX, Arena, ArenaShape
from fireflyer.hfreduce.config import (
    SECRET_ENV,
    HFReduceConfig,
    default_chunk_bytes,
    launcher_secret,
    node_key,
    route_address,
)
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.transport.exchange import Exchange
from fireflyer.hfreduce.engine.failures import Failures
from fireflyer.hfreduce.engine.fast_door import FastDoor
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder
from fireflyer.hfreduce.engine.jobs import INLINE_BYTES, Job, Jobs
from fireflyer.hfreduce.engine.node_stage import NodeStage
from fireflyer.hfreduce.plans.plan import USER_OPS, Op, Plan
from fireflyer.hfreduce.transport.registered import SharedBuffers
from fireflyer.hfreduce.plans.canonical import layout_problem
from fireflyer.hfreduce.plans.topology import Layout, binomial_links, tree_links
from fireflyer.hfreduce.engine.trees import TreeStage
from fireflyer.hfreduce.engine.watch import Watch

from fireflyer.hfreduce.compiled import CORE as _core  # None without a built core: the Python reference runs

__all__ = ["INLINE_BYTES", "SECRET_ENV", "Communicator", "HFReduceConfig", "launcher_secret"]
_log = logging.getLogger("fireflyer.hfreduce")


class Communicator:
    """HFReduce for one rank of one process group.

    ``store`` is the job's torch.distributed store (the process group's prefix store).
    All ranks must construct their communicator together and then issue the same
    collectives in the same order, as with any torch.distributed backend.
    """

    def __init__(
        self,
        store: "torch.distributed.Store",
        rank: int,
        world_size: int,
        *,
        config: HFReduceConfig | None = None,
        node: str | None = None,
        group_name: str = "",
        global_ranks: list[int] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside 0..{world_size - 1}")
        self.config = (config or HFReduceConfig.from_env()).settled()  # its timeout a number, by the one rule
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._arena: Arena | None = None
        self._fd_server: fdshare.FdServer | None = None
        self._shared: SharedBuffers | None = None
        self._failures: Failures | None = None
        self._node_stage: NodeStage | None = None
        self._trees: TreeStage | None = None
        self._door: FastDoor | None = None
        self._watch: Watch | None = None
        self.exchange: Exchange | None = None  # send/recv, all_to_all, gather, scatter (exchange.py)
        self.flight = FlightRecorder(rank=rank, world_size=world_size, group_name=group_name or "0",
                                     global_ranks=list(global_ranks) if global_ranks else list(range(world_size)))
        try:
            self._setup(node or node_key())
        except BaseException:
            self._teardown()
            raise
        if not group_name:  # several direct communicators in one process must not share a name in the dump
            self.flight.group_name = f"direct-{self.incarnation}"
        self._jobs.start()

    # ------------------------------------------------------------------ setup
    def _setup(self, node: str) -> None:
        deadline = self._rendezvous(node)
        self._setup_arena(deadline)
        self._failures = Failures(rank=self.rank, members=self.members, pids=self._pids, describe=self.describe,
                                  store=self._store, arena=self._arena, flight=self.flight,
                                  running=lambda: self._jobs.running)
        self._jobs = Jobs(rank=self.rank, world_size=self.world_size, flight=self.flight, failures=self._failures,
                          execute=self._execute, stopped=self._stop_stages, timeout=lambda: self.config.timeout)
        core = _core if self.config.core else None
        self._node_stage = NodeStage(arena=self._arena, config=self.config, rank=self.rank,
                                     world_size=self.world_size, members=self.members, num_nodes=self.num_nodes,
                                     rails=self.rails, describe=self.describe, failures=self._failures,
                                     shared=self._shared, core=core)
        if core is not None and self.num_nodes == 1:
            self._door = FastDoor(node=self._node_stage, jobs=self._jobs, failures=self._failures,
                                  flight=self.flight, timeout=lambda: self.config.timeout)
        if self.num_nodes > 1 and self.local_rank < self.rails:
            self._trees = TreeStage(node=self._node_stage, failures=self._failures, rank=self.rank,
                                    node_index=self.node,
                                    rail_ranks=[self.layout.rail_peer(n, self.local_rank)
                                                for n in range(self.num_nodes)],
                                    world_size=self.world_size, describe=self.describe,
                                    scratch_bytes=self.config.chunk_bytes, compiled=core is not None,
                                    core=core if self.config.core_trees else None,
                                    links=binomial_links if self.config.order == "canonical" else tree_links)
            self._failures.on_failure(self._trees.tell)
            self._trees.connect(store=self._store, host=route_address(self.config), secret=self._secret,
                                deadline=deadline)
        self.exchange = self._make_exchange()
        self._failures.on_failure(lambda error, _text: self.exchange.fail(error))
        if self.num_nodes > 1:
            flight, failures = self.flight, self._failures
            self._watch = Watch(rank=self.rank, world_size=self.world_size, store=self._store, members=self.members,
                                pids=self._pids, progress=lambda: (flight.in_flight(), flight.settled),
                                position=lambda: self._jobs.seq, died=lambda r: failures.peer_died(r, None),
                                adopt=failures.fail)
            failures.attach(self._watch)
            self._watch.start()

    def _rendezvous(self, node: str) -> float:
        """Learn the group from the store: its layout, its key and every rank's pid; returns the setup deadline."""
        # Every incarnation of a group on the same store (init, destroy, init again) gets
        # fresh keys: each rank counts itself in once, so the k-th incarnation's ranks all
        # draw numbers in k*W+1 .. (k+1)*W.
        drawn = self._store.add("hfreduce/incarnations", 1)
        self.incarnation = (drawn - 1) // self.world_size
        self._store = torch.distributed.PrefixStore(f"hfreduce/{self.incarnation}", self._store)
        store, rank, cfg = self._store, self.rank, self.config
        deadline = time.monotonic() + cfg.timeout
        wait = timedelta(seconds=cfg.timeout)
        job_secret = launcher_secret()
        if rank == 0:
            # A public salt makes every communicator's key its own; the key itself comes from
            # the launcher's environment, and only without one from the store.
            store.set("salt", secrets.token_hex(16))
            if job_secret is None:
                store.set("secret", secrets.token_hex(32))
        keys = ["salt"] + ([] if job_secret is not None else ["secret"])
        self._wait_keys(keys, wait)
        salt = store.get("salt")
        if job_secret is not None:
            self._secret = hmac.new(job_secret, b"hfreduce-group|" + salt, hashlib.sha256).digest()
        else:
            _warn_store_secret()
            self._secret = bytes.fromhex(store.get("secret").decode())
        # A fingerprint (a MAC of the salt, which tells nothing of the key) lets ranks whose
        # launchers handed them different secrets fail at once, by name, not by a timeout.
        fingerprint = hmac.new(self._secret, b"fingerprint|" + salt, hashlib.sha256).hexdigest()[:16]
        store.set(f"info/{rank}", json.dumps({"node": node, "pid": os.getpid(), "key": fingerprint,
                                              "order": cfg.order}))
        self._wait_keys([f"info/{r}" for r in range(self.world_size)], wait)
        infos = [json.loads(store.get(f"info/{r}")) for r in range(self.world_size)]
        strangers = [r for r, i in enumerate(infos) if i.get("key") != fingerprint]
        if strangers:
            raise HFReduceError(
                f"hfreduce rank {rank} and ranks {strangers[:8]} hold different job secrets "
                f"({SECRET_ENV} differs between their launchers, or is set for some ranks only)")
        others = [r for r, i in enumerate(infos) if i.get("order") != cfg.order]
        if others:
            raise UserError(f"hfreduce rank {rank} sums in the {cfg.order!r} order but ranks {others[:8]} do not; "
                            f"set {names.ORDER} the same for every rank of the group")
        self.layout = Layout.from_node_keys([i["node"] for i in infos])
        problem = layout_problem(self.layout.nodes) if cfg.order == "canonical" else None
        if problem:
            raise UserError(f"hfreduce cannot sum in the canonical order on this group of {self.world_size} ranks: "
                            f"{problem}")
        self._pids = [i["pid"] for i in infos]
        self.node = self.layout.node_of(rank)
        self.members = self.layout.nodes[self.node]
        self.local_rank = self.members.index(rank)
        self.local_size = len(self.members)
        self.num_nodes = self.layout.num_nodes
        self.rails = self.layout.rails
        if self.config.chunk_bytes is None:
            self.config = dataclasses.replace(self.config, chunk_bytes=default_chunk_bytes(self.num_nodes))
        return deadline

    def _wait_keys(self, keys: list[str], wait: timedelta) -> None:
        try:
            self._store.wait(keys, wait)
        except Exception as exc:  # torch raises its own DistStoreError / RuntimeError flavours
            missing = [k for k in keys if not self._store.check([k])]
            raise CollectiveTimeout(
                f"hfreduce rendezvous timed out after {self.config.timeout:.0f}s; missing: {missing[:8]}") from exc

    def describe(self, rank: int) -> str:
        node = self.layout.node_of(rank)
        return f"rank {rank} (node {node}, local rank {self.layout.local_rank(rank)})"

    def _setup_arena(self, deadline: float) -> None:
        store = self._store
        shape = ArenaShape(local_size=self.local_size, chunk_bytes=self.config.chunk_bytes, depth=self.config.depth)
        job = hashlib.sha256(self._secret).hexdigest()[:12]
        key = f"arena/{self.node}"
        left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
        private = fdshare.SUPPORTED and self.config.private_arena
        if self.local_rank == 0:
            name = f"{NAME_PREFIX}{job}-{self.node}-{os.getpid()}"
            if private:
                self._arena, share = Arena.create_private(name, shape)
                try:
                    if self.local_size > 1:
                        self._fd_server = fdshare.FdServer(name, share, self._secret, self.local_size - 1)
                finally:
                    os.close(share)
            else:
                self._arena = Arena.create(name, shape)
            store.set(key, json.dumps({"name": name, "private": private}))
        else:
            try:
                store.wait([key], timedelta(seconds=left()))
            except Exception as exc:
                raise CollectiveTimeout(f"local rank 0 of node {self.node} never created its arena") from exc
            info = json.loads(store.get(key))
            name = info["name"]
            if info["private"]:
                fd = fdshare.fetch_fd(name, self._secret, time.monotonic() + left())
                self._arena = Arena.from_fd(name, shape, fd)
            else:
                self._arena = Arena.attach(name, shape, timeout=left())
        self._arena.set_pid(self.local_rank, os.getpid())
        # A file arena: the last local rank to map it unlinks it; from then on only mappings keep it alive.
        if store.add(f"{key}/attached", 1) == self.local_size:
            self._arena.unlink()
        self._shared = SharedBuffers(store=store, node=self.node, local_rank=self.local_rank,
                                     local_size=self.local_size, secret=self._secret,
                                     timeout=self.config.timeout, enabled=private)

    # ------------------------------------------------------------------ public API
    def submit(self, plan: Plan, *, inline: bool = True) -> torch.futures.Future:
        """Queue a collective; the future completes with None when every sink holds its result.

        ``inline=False`` keeps even a small collective off the caller's thread (an
        ``async_op=True`` caller must get its Work back at once, whatever the peers do).
        """
        return self._jobs.submit(plan, inline=inline)

    def run_now(self, plan: Plan) -> bool:
        """Run a synchronous CPU collective in the caller's thread, at once, when nothing is ahead of it.

        True: it ran and its results are in place (its error raised otherwise). False: it did
        not run (CUDA, or the engine is busy); ``submit`` it instead (see :meth:`Jobs.run_now`).
        """
        return self._jobs.run_now(plan)

    def number(self, plan: Plan) -> int:
        """Give a collective that runs off the engine (``backend/spread.py``) the group's next number, and enter it
        in the flight recorder as the engine would enter ``plan``; returns the number."""
        return self._jobs.number_plan(plan)

    @property
    def fast_door(self) -> FastDoor | None:
        """The door of small one-node allreduces (None where there are several nodes or no compiled core)."""
        return self._door

    @property
    def core(self):
        """The compiled core this communicator runs (``fireflyer.hfreduce._core``), or None (the Python reference)."""
        return self._node_stage.core if self._node_stage is not None else None

    def allreduce_now(self, tensor: torch.Tensor, op: Op, timeout: float | None) -> bool:
        """``dist.all_reduce`` of a small contiguous CPU tensor on one node, as one call of the core.

        The same protocol, descriptors, flight record and errors as :meth:`run_now`, with none of
        its bookkeeping: True when it ran (its error raised otherwise); False when it is not a
        collective this door takes, or the engine is busy (the caller then takes the general path).
        """
        return self._door is not None and self._door.allreduce_now(tensor, op, timeout)

    # Direct API: each returns a torch.futures.Future that completes when the result is in place.
    def allreduce(self, tensor: torch.Tensor, op: Op | str = Op.SUM) -> torch.futures.Future:
        return self.submit(collectives.allreduce(tensor, _op(op), self.world_size))

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: Op | str = Op.SUM) -> torch.futures.Future:
        return self.submit(collectives.reduce(tensor, _op(op), root, self.rank, self.world_size))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op | str = Op.SUM) -> torch.futures.Future:
        return self.submit(collectives.reduce_scatter(output, input, _op(op), self.rank, self.world_size))

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        return self.submit(collectives.allgather(output, input, self.rank, self.world_size))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.futures.Future:
        return self.submit(collectives.broadcast(tensor, root, self.rank, self.world_size))

    def barrier(self) -> torch.futures.Future:
        return self.submit(collectives.barrier(self.world_size))

    def shared_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed flat CPU tensor in memory the node's ranks share; allreduce on it skips the arena copies.

        Collective among the ranks of a node: each must allocate the same sizes in the same
        order. Where memory cannot be shared, an ordinary tensor comes back (same results).
        """
        if self._jobs.closed:
            raise HFReduceError("hfreduce communicator is closed")
        return self._shared.alloc(numel, dtype)

    def shared_release(self, tensor: torch.Tensor) -> None:
        """Forget a tensor from :meth:`shared_empty` (after its last collective)."""
        if self._shared is not None:
            self._shared.release(tensor)

    def close(self) -> None:
        """Stop the worker threads and release the arena and sockets. Idempotent."""
        if self._jobs.closed:
            return
        self._jobs.close(timeout=self.config.timeout)
        self._teardown()

    def abort(self) -> None:
        """Fail every collective in flight here and on every peer at once, then close (as NCCL's abort)."""
        if not self._jobs.closed and self.error is None:
            self.fail(PeerFailure(f"{self.describe(self.rank)} aborted the process group"))
        self.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state and diagnosis
    @property
    def error(self) -> HFReduceError | None:
        """The error that failed this communicator, or None while it is healthy."""
        return self._failures.error

    def alive(self) -> bool:
        """Whether the engine thread still runs (it stops only at close)."""
        return self._jobs.alive()

    def set_timeout(self, seconds: float) -> None:
        """Change the default timeout of collectives submitted from now on."""
        self.config = dataclasses.replace(self.config, timeout=float(seconds))

    def waited_on(self, seq: int) -> list[tuple[list[int], str]]:
        """Whom the engine's threads are blocked on for collective ``seq`` right now, and for what."""
        return self._failures.waited_on(seq)

    def time_out(self, seq: int, desc: str, seconds: float) -> HFReduceError:
        """Collective ``seq`` overran a caller's deadline: fail the group with a CollectiveTimeout naming whom it waited for.

        Returns the error to raise (an earlier failure, if the group had already failed).
        """
        return self._failures.time_out(seq, desc, seconds)

    def fail(self, exc: BaseException) -> HFReduceError:
        """Fail the group with ``exc`` (the first failure wins); returns the error every rank's calls raise."""
        return self._failures.fail(exc)

    def check(self) -> None:
        """Raise the group's failure, if it has failed."""
        self._failures.check()

    @property
    def node_stage(self) -> NodeStage | None:
        """The node's shared-memory stage (None before the group forms, or after it closed)."""
        return self._node_stage

    def _make_exchange(self) -> Exchange:
        """The exchange (send/recv, all-to-all, gather, scatter), from what the rendezvous learned. Its
        checks and failures are this group's: a failed group fails the exchange and the other way round."""
        job = hashlib.sha256(self._secret).hexdigest()[:12]
        private = fdshare.SUPPORTED and self.config.private_arena
        return Exchange(rank=self.rank, layout=self.layout, pids=self._pids, store=self._store, secret=self._secret,
                        host=route_address(self.config) if self.num_nodes > 1 else "127.0.0.1",
                        timeout=lambda: self.config.timeout, describe=self.describe, check=self.check,
                        fail=self.fail, name=f"{NAME_PREFIX}{job}-x{self.node}-{os.getpid()}",
                        private=private, setup_timeout=self.config.timeout, flight=self.flight,
                        number=self._jobs.number, compiled=self.config.core and self.config.core_exchange)

    @property
    def last_number(self) -> int:
        """The number of this rank's latest collective (the flight recorder's and the work's ``#``)."""
        return self._jobs.seq - 1

    @property
    def runs_core(self) -> bool:
        """Whether the node stage runs in the compiled core (False where the Python reference runs)."""
        return self._node_stage is not None and self._node_stage.core_comm is not None

    @property
    def runs_core_trees(self) -> bool:
        """Whether the tree stage across nodes runs in the compiled core (False: its Python loop, or one node)."""
        return self._trees is not None and self._trees.in_core

    @property
    def refused_connections(self) -> int:
        """Connections to this rank's tree listener refused so far (a wrong key, or not a peer at all)."""
        listener = self._trees.listener if self._trees is not None else None
        return listener.refused if listener is not None else 0

    # ------------------------------------------------------------------ the stages
    def _execute(self, job: Job) -> None:
        """Run one collective through the stages (on the engine thread, or a caller's)."""
        if job.plan.run is not None:  # a collective that is not a reduction over chunks
            job.plan.run(job)
            return
        self._node_stage.prepare(job, job.plan.timeout or self.config.timeout)
        self.flight.started(job.seq)
        if self._trees is not None:
            self._trees.start(job)
        self._node_stage.run(job)

    def _stop_stages(self) -> None:
        if self._trees is not None:
            self._trees.stop()
        self._node_stage.stop()

    def _teardown(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.exchange is not None:
            self.exchange.close()
        if self._trees is not None:
            self._trees.close()
        if self._node_stage is not None:
            self._node_stage.close()
        if self._fd_server is not None:
            self._fd_server.close()
            self._fd_server = None
        if self._shared is not None:
            self._shared.close()
        if self._arena is not None:
            if self._failures is not None:
                self._failures.detach()
            self._arena.unlink()  # harmless if already gone; covers a peer that never attached
            self._arena.close()
            self._arena = None


_warned_store_secret = False


def _warn_store_secret() -> None:
    global _warned_store_secret
    if not _warned_store_secret:
        _warned_store_secret = True
        _log.warning("hfreduce: %s is not set, so the job's secret goes through the rendezvous store, where any "
                     "client of the store can read it; set it in every rank's environment (the platform and "
                     "'fireflyer train' do)", SECRET_ENV)


def _op(op: Op | str) -> Op:
    if isinstance(op, Op):
        return op
    try:
        return Op[str(op).upper()]
    except KeyError:
        names = ", ".join(o.name.lower() for o in USER_OPS)
        raise UserError(f"unsupported op {op!r}; hfreduce supports: {names}") from None
