"""The HFReduce engine: one communicator per rank and process group.

A collective runs as a pipeline over chunks of a flat buffer:

1. stage-in   every local rank copies its chunk into its slot of the node's arena
              (D2H on a copy stream for CUDA tensors);
2. reduce     local rank k sums slice k of the chunk across all slots, in one pass;
3. trees      with several nodes, rail r (local rank r of every node) allreduces
              slice r of the node's partial over a double binary tree of nodes:
              each tree carries half the slice, reduce-up and broadcast-down run in
              their own threads at the same time, chunk after chunk;
4. stage-out  every local rank copies the finished chunk back (H2D for CUDA).

Local ranks hand chunks to each other through counters in the arena (futex waits);
nodes talk over authenticated TCP links. Every wait has a deadline, a dead local
peer is noticed by its pid, a dead remote one by its closed socket, and the first
failure is broadcast to every rank, which then raises it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from fireflyer.hfreduce import collectives, fdshare, futex
from fireflyer.hfreduce.arena import NAME_PREFIX, STAGES, Arena, ArenaShape
from fireflyer.hfreduce.config import HFReduceConfig, default_chunk_bytes, node_key
from fireflyer.hfreduce.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    HFReduceError,
    PeerFailure,
    error_from_text,
    error_to_text,
    fresh,
)
from fireflyer.hfreduce.flight import FlightRecorder
from fireflyer.hfreduce.procs import pid_alive
from fireflyer.hfreduce.shared import SharedBuffers
from fireflyer.hfreduce.reduce import (
    DESCRIPTOR_BYTES,
    DTYPES,
    Descriptor,
    Kind,
    check_op,
    Op,
    Plan,
    Reducer,
    USER_OPS,
    acc_dtype,
    chunk_elems,
)
from fireflyer.hfreduce.topology import Layout, split
from fireflyer.hfreduce.transport import Link, Listener
from fireflyer.hfreduce.exchange import Exchange, for_communicator
from fireflyer.hfreduce.diagnosis import Diagnosis
from fireflyer.hfreduce.trees import SELF_GRACE, Trees

_log = logging.getLogger("fireflyer.hfreduce")
_SLICE = 0.05  # seconds between liveness checks while waiting
_OUT_GRACE = SELF_GRACE  # a wait on the tree stage's result outlasts the tree stage's own deadline
INLINE_BYTES = 64 << 10  # CPU collectives up to this size run in the caller's thread when the engine is idle
_SHARED = struct.Struct("<qq")
_COMM = struct.Struct("<14q")  # _core/node.h: hfr_comm
_JOB = struct.Struct("<20q")  # _core/node.h: hfr_job
_PIPELINE, _NODE_STAGE, _ONESHOT = 1, 2, 3
_CORE_DONE, _CORE_NEED_PYTHON, _CORE_TIMEOUT, _CORE_ABORTED, _CORE_PEER_DEAD = 0, 1, 2, 3, 4
try:
    from fireflyer.hfreduce import _core  # the compiled core, when pip could build it
except ImportError:  # pragma: no cover - a machine without a C compiler: the Python reference runs
    _core = None
if not hasattr(_core, "node_run"):  # not built: the import found the _core/ source folder
    _core = None
_CORE_DTYPES = frozenset(DTYPES)


def _addresses(tensors: list | None) -> "ctypes.Array | None":
    """Each local rank's registered buffer as an address (0: none), for the core; None when no rank has one."""
    if tensors is None or not any(t is not None for t in tensors):
        return None
    return (ctypes.c_int64 * len(tensors))(*[0 if t is None else t.data_ptr() for t in tensors])


def _core_error(rc: int) -> str:
    return {-1: "unknown dtype", -2: "an op the dtype cannot take", -3: "bad output dtype", -4: "bad argument",
            -5: "a misaligned pointer"}.get(rc, "unknown")  # after a rank's descriptor: registered buffer (index + 1, bit 62: in place), byte offset
_IN_PLACE = 1 << 62


@dataclass
class Job:
    """One collective in flight on this rank: its plan, its place in the chunk sequence, its deadlines."""

    plan: Plan
    future: torch.futures.Future | None  # None: run by run_now, whose caller takes the outcome
    first_chunk: int = 0
    nchunks: int = 1
    elems: int = 1
    seq: int = 0
    deadline: float = 0.0
    tree_deadline: float = 0.0  # a little later, so the rank that saw the root cause reports it first
    stream_event: object = None
    own: torch.Tensor | None = None  # the CPU tensor this rank reduces its own slice from directly
    shared: tuple[int, int, bool] | None = None  # this rank's input is registered: (buffer, byte offset, in place)
    peer_in: list | None = None  # per local rank: its registered input, read directly instead of its arena slot
    peer_out: list | None = None  # per local rank: its registered in-place buffer, written directly (one node)


class Communicator(Trees, Diagnosis):
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
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.config = config or HFReduceConfig.from_env()
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._error: HFReduceError | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self._links: list[Link] = []
        self._listener: Listener | None = None
        self._arena: Arena | None = None
        self._fd_server: fdshare.FdServer | None = None
        self._shared: SharedBuffers | None = None
        self.exchange: Exchange | None = None  # send/recv, all_to_all, gather, scatter (exchange.py)
        self._seq = 0
        self._chunk = 0
        self._reducer = Reducer()
        self._views: dict = {}
        self._submit_lock = threading.Lock()
        self._exec_lock = threading.Lock()
        self._pending = 0  # collectives submitted and not yet finished
        # Threads and queues of the inter-node stage; they stay empty on a single node.
        self._tree_queues: list[queue.Queue] = []
        self._tree_threads: list[threading.Thread] = []
        self._tree_signal: list[threading.Condition] = []
        self._out_queue: queue.Queue | None = None
        self._out_thread: threading.Thread | None = None
        self._copy_stream = None
        self._core_comm: bytes | None = None
        self._elems: dict = {}  # (dtype, op) -> elements per chunk
        self._fast: dict = {}  # (dtype, numel, op) -> what allreduce_now packs for the core
        self._last_liveness = 0.0
        self._tree_done = [0, 0]
        self._tree_lock = threading.Lock()
        # What each engine thread is blocked on right now: thread id -> (seq, group ranks, what).
        self._waits: dict[int, tuple[int, list[int], str]] = {}
        self._running: Job | None = None  # the collective the engine is executing
        self.flight = FlightRecorder(rank=rank, world_size=world_size, group_name=group_name or "0",
                                     global_ranks=list(global_ranks) if global_ranks else list(range(world_size)))
        try:
            self._setup(node or node_key())
            self.exchange = for_communicator(self)
        except BaseException:
            self._teardown()
            raise
        if not group_name:  # several direct communicators in one process must not share a name in the dump
            self.flight.group_name = f"direct-{self.incarnation}"
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"hfreduce-{rank}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ setup
    def _setup(self, node: str) -> None:
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
        store.set(f"info/{rank}", json.dumps({"node": node, "pid": os.getpid(), "key": fingerprint}))
        self._wait_keys([f"info/{r}" for r in range(self.world_size)], wait)
        infos = [json.loads(store.get(f"info/{r}")) for r in range(self.world_size)]
        strangers = [r for r, i in enumerate(infos) if i.get("key") != fingerprint]
        if strangers:
            raise HFReduceError(
                f"hfreduce rank {rank} and ranks {strangers[:8]} hold different job secrets "
                f"({SECRET_ENV} differs between their launchers, or is set for some ranks only)")
        self.layout = Layout.from_node_keys([i["node"] for i in infos])
        self._pids = [i["pid"] for i in infos]
        self.node = self.layout.node_of(rank)
        self.members = self.layout.nodes[self.node]
        self.local_rank = self.members.index(rank)
        self.local_size = len(self.members)
        self.num_nodes = self.layout.num_nodes
        self.rails = self.layout.rails
        if self.config.chunk_bytes is None:
            self.config = dataclasses.replace(self.config, chunk_bytes=default_chunk_bytes(self.num_nodes))
        self._setup_arena(deadline)
        if self.num_nodes > 1:
            self._setup_links(deadline)

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
        private = fdshare.SUPPORTED and os.environ.get("FIREFLYER_HFREDUCE_ARENA", "memfd") != "file"
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
        self._shape = shape
        self._core_comm = self._pack_comm() if self.config.core and _core is not None else None
        self._shared = SharedBuffers(store=store, node=self.node, local_rank=self.local_rank,
                                     local_size=self.local_size, secret=self._secret,
                                     timeout=self.config.timeout, enabled=private)

    # ------------------------------------------------------------------ public API
    def submit(self, plan: Plan, *, inline: bool = True) -> torch.futures.Future:
        """Queue a collective; the future completes with None when every sink holds its result.

        ``inline=False`` keeps even a small collective off the caller's thread (an
        ``async_op=True`` caller must get its Work back at once, whatever the peers do).
        """
        fut: torch.futures.Future = torch.futures.Future()
        if self._closed:
            fut.set_exception(HFReduceError("hfreduce communicator is closed; create a new process group"))
            return fut
        if self._error is not None:
            fut.set_exception(fresh(self._error))  # a failed group stays failed: never compute with fewer ranks
            return fut
        if plan.timeout is not None and not plan.timeout > 0:
            raise ValueError(f"a collective's timeout must be positive seconds, got {plan.timeout}")
        job = Job(plan=plan, future=fut)
        cuda = [t for _, t in plan.sources + plan.sinks if t.is_cuda]
        if cuda:
            job.stream_event = torch.cuda.Event()
            job.stream_event.record(torch.cuda.current_stream(cuda[0].device))
        # A small CPU collective with nothing ahead of it runs right here: handing it to the
        # engine thread and back would cost more than the collective itself.
        small = inline and not cuda and plan.desc.numel * plan.desc.dtype.itemsize <= INLINE_BYTES
        with self._submit_lock:
            job.seq = plan.seq = self._seq
            self._seq += 1
            self._record(job)
            inline = small and self._pending == 0
            self._pending += 1
            if inline:
                self._exec_lock.acquire()  # free: nothing is pending, so the engine thread is idle
            else:
                self._queue.put(job)
        if inline:
            try:
                self._run_job(job)
            finally:
                self._exec_lock.release()
        return fut

    def run_now(self, plan: Plan) -> bool:
        """Run a synchronous CPU collective in the caller's thread, at once, when nothing is ahead of it.

        True: it ran and its results are in place (its error raised otherwise, as a fresh copy).
        False: it did not run (CUDA, or the engine is busy); ``submit`` it instead.
        The door for a caller that would only wait for the result (``dist.all_reduce`` without
        ``async_op``): no future, and no handoff to the engine thread and back, which costs two
        wake-ups where ranks outnumber cores (1x4, 1 MiB: 0.98 ms through the thread, 0.67 ms here).
        Any size: the collective's own deadline bounds the wait as it does on the engine thread.
        """
        if self._closed or self._error is not None:
            return False
        for _, t in plan.sources:
            if t.is_cuda:
                return False
        for _, t in plan.sinks:
            if t.is_cuda:
                return False
        if plan.timeout is not None and not plan.timeout > 0:
            raise ValueError(f"a collective's timeout must be positive seconds, got {plan.timeout}")
        job = Job(plan=plan, future=None)
        with self._submit_lock:
            if self._pending:
                return False
            job.seq = plan.seq = self._seq
            self._seq += 1
            self._record(job)
            self._pending += 1
            self._exec_lock.acquire()  # free: nothing is pending, so the engine thread is idle
        try:
            self._run_job(job)
        finally:
            self._exec_lock.release()
        return True

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
        if self._closed:
            raise HFReduceError("hfreduce communicator is closed")
        return self._shared.alloc(numel, dtype)

    def shared_release(self, tensor: torch.Tensor) -> None:
        """Forget a tensor from :meth:`shared_empty` (after its last collective)."""
        if self._shared is not None:
            self._shared.release(tensor)

    def close(self) -> None:
        """Stop the worker threads and release the arena and sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=self.config.timeout)
        self._teardown()

    def abort(self) -> None:
        """Fail every collective in flight here and on every peer at once, then close (as NCCL's abort)."""
        if not self._closed and self._error is None:
            self._fail(PeerFailure(f"{self.describe(self.rank)} aborted the process group"))
        self.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ failure handling
    def _fail(self, exc: BaseException) -> HFReduceError:
        """Record this rank's first failure and pass it to every neighbour; return the error to raise."""
        if not isinstance(exc, HFReduceError):
            exc = HFReduceError(f"hfreduce {self.describe(self.rank)}: {type(exc).__name__}: {exc}")
        if getattr(exc, "secondary", False):
            exc = self._root_cause(exc)
        if self._error is None:
            self._publish_root_cause(exc)  # first writer wins, so a primary cause seen earlier stays
        with self._error_lock:
            first = self._error is None
            if first:
                self._error = exc
        if first:
            text = error_to_text(exc)
            if self._arena is not None:
                self._arena.abort(text)
            for link in self._links:
                link.send_error(text)
            for link in self._links:
                link.close()
            for cond in self._tree_signal:
                with cond:
                    cond.notify_all()
            self._dump_flight(exc)
            if self.exchange is not None:
                self.exchange.fail(exc)
        return self._error

    def _root_cause(self, symptom: HFReduceError, patience: float = 1.0) -> HFReduceError:
        """A closed connection is a symptom: give the rank that saw the cause a moment to report it.

        The report arrives through another thread of this rank (an error frame), the node's
        arena, or the job's store, where the first rank to fail leaves its error.
        """
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if self._error is not None:
                return self._error
            if self._arena is not None and self._arena.aborted():
                return error_from_text(self._arena.abort_message(), HFReduceError)
            text = self._store_error()
            if text:
                return error_from_text(text, HFReduceError)
            time.sleep(0.02)
        return symptom

    def _store_error(self) -> str | None:
        result: list = []

        def look() -> None:
            try:
                if self._store.check(["error"]):
                    result.append(self._store.get("error").decode())
            except Exception:  # noqa: BLE001 - the store may be gone with a dead rank
                pass

        th = threading.Thread(target=look, daemon=True)
        th.start()
        th.join(0.2)
        return result[0] if result else None

    def _publish_root_cause(self, exc: HFReduceError) -> None:
        def put() -> None:
            try:
                self._store.compare_set("error", "", error_to_text(exc))
            except Exception:  # noqa: BLE001 - best effort
                pass

        threading.Thread(target=put, daemon=True).start()

    def _check(self) -> None:
        """Raise if this rank or its node has failed, or a local peer has died."""
        if self._error is not None:
            raise fresh(self._error)
        arena = self._arena
        if arena is not None and arena.aborted():
            raise error_from_text(arena.abort_message(), HFReduceError)
        now = time.monotonic()
        if now - self._last_liveness > _SLICE:
            self._last_liveness = now
            for k, r in enumerate(self.members):
                if r != self.rank and not pid_alive(self._pids[r]):
                    running = self._running
                    if running is not None:  # the flight recorder names the culprit, not a peer's symptom
                        self.flight.waiting(running.seq, [r], f"rank {r} (pid {self._pids[r]}) died")
                    raise PeerFailure(f"{self.describe(r)}, pid {self._pids[r]}, died")

    def _wait(self, stage: str, local_ranks, target: int, job: Job, what: str, *, late: bool = False) -> None:
        """Block until every local rank in ``local_ranks`` has published ``stage`` up to ``target``.

        ``late`` waits use the tree deadline: what they wait for depends on other nodes,
        whose own errors should arrive before this rank gives up on its own account.
        """
        arena = self._arena
        words, index = arena._words, arena._index
        for k in local_ranks:
            i = index[stage, k]
            if ((words[i] - target) & 0xFFFFFFFF) < 0x80000000:  # the common case: already there
                continue
            self._sleep_until(i, stage, k, target, job, late)

    def _sleep_until(self, i: int, stage: str, k: int, target: int, job: Job, late: bool) -> None:
        arena = self._arena
        words = arena._words
        deadline = job.tree_deadline if late else job.deadline
        if stage == "out":
            # 'out' is published by a rail's tree threads, which wait on other nodes directly:
            # let them time out first, so the error names the rank really missing.
            deadline += _OUT_GRACE
        addr = arena.flag_address(stage, k)
        self._waiting(job, [self.members[k]], f"'{stage}' of chunk {target - 1 - job.first_chunk} of {job.nchunks}")
        while True:
            value = words[i]
            if ((value - target) & 0xFFFFFFFF) < 0x80000000:
                self._done_waiting()
                return
            self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(job, stage, k, target)
            futex.wait(addr, value, min(_SLICE, left))

    def _timed_out(self, job: Job, stage: str, k: int, target: int) -> CollectiveTimeout:
        """The timeout of a wait for local rank ``k``'s ``stage`` to reach ``target``, naming whom it waited for."""
        whom = f"{self.describe(self.members[k])} to finish '{stage}' of chunk {target - 1 - job.first_chunk} " \
               f"of {job.nchunks}"
        behind = [w for w in self.waited_on(job.seq) if self.members[k] not in w[0]]
        if behind:  # what this rank's other threads (its trees) were stuck on: closer to the cause
            whom += "; its tree stage was waiting for " + "; ".join(
                f"{', '.join(self.describe(r) for r in rs)} ({what})" for rs, what in behind)
        return CollectiveTimeout(
            f"{job.plan.desc} (#{job.seq}) timed out after {job.plan.timeout or self.config.timeout:g}s "
            f"on {self.describe(self.rank)} waiting for {whom}"
        )

    # ------------------------------------------------------------------ the pipeline
    def _run(self) -> None:
        # One thread per rank: the local ranks already keep every core busy, and OpenMP
        # teams spinning in four processes at once would starve the handoffs. This only
        # changes this thread's setting, not the caller's.
        torch.set_num_threads(1)
        while True:
            job = self._queue.get()
            if job is None:
                for q in self._tree_queues + ([self._out_queue] if self._out_queue else []):
                    q.put(None)
                return
            with self._exec_lock:
                self._run_job(job)

    def _run_job(self, job: Job) -> None:
        """Run one collective to completion and settle its future. Callers hold ``_exec_lock``."""
        try:
            if self._error is not None:
                raise fresh(self._error)
            self._execute(job)
            for fn in job.plan.on_done:
                fn()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            error = self._fail(exc)
            self._running = None
            self.flight.failed(job.seq, str(error))
            if job.future is None:  # run_now: the caller raises it
                raise fresh(error) from None
            job.future.set_exception(fresh(error))
        else:
            self._running = None
            self.flight.completed(job.seq)
            if job.future is not None:
                job.future.set_result(job.plan.result)
        finally:
            # Only after the future is settled may a later collective run inline, so futures
            # complete in the order their collectives were submitted.
            with self._submit_lock:
                self._pending -= 1

    def _execute(self, job: Job) -> None:
        desc = job.plan.desc
        elems = self._elems.get((desc.dtype, desc.op))
        if elems is None:
            red = self._shape.red_bytes if self.num_nodes > 1 else None
            elems = self._elems[desc.dtype, desc.op] = chunk_elems(self.config.chunk_bytes, desc.dtype, desc.op,
                                                                   red_bytes=red)
        job.elems = elems
        job.nchunks = max(1, -(-desc.numel // job.elems))
        job.first_chunk = self._chunk
        job.own = self._own_source(job.plan)
        job.shared = self._registered(job.plan)
        timeout = job.plan.timeout or self.config.timeout
        job.deadline = time.monotonic() + timeout
        job.tree_deadline = job.deadline + min(2.0, 0.25 * timeout)
        self._chunk += job.nchunks
        self._running = job
        self.flight.started(job.seq)
        if job.stream_event is not None:
            self._cuda_prepare(job)
        if self.num_nodes > 1 and self.local_rank < self.rails:
            for q in self._tree_queues:
                q.put(job)
        # One node: stage each chunk out right after reducing it, while it is still in cache.
        # Several nodes: a separate thread stages out what the trees finish, so reducing the
        # next chunks never waits on the network.
        staged_out = threading.Event() if self.num_nodes > 1 else None
        if staged_out is not None:
            self._out_queue.put((job, staged_out))
        # One node, one small chunk, no registered buffer anywhere (known once every local
        # rank's descriptor is in): one shot. Every rank stages in all of its input and
        # reduces all of it into its own result, with no second handoff.
        oneshot = self.num_nodes == 1 and job.plan.dense and job.nchunks == 1 and \
            desc.numel * desc.dtype.itemsize <= min(self.config.oneshot_bytes, self.config.chunk_bytes)
        staged = self._run_core(job, oneshot) if self._core_comm is not None else None
        self._pipeline(job, oneshot, staged, staged_out)

    def _pipeline(self, job: Job, oneshot: bool, staged: str | None, staged_out: threading.Event | None) -> None:
        """The Python loop over the chunks, from the start or from where the core stopped (``staged``)."""
        depth, L, lr = self.config.depth, self.local_size, self.local_rank
        all_local, rails = range(L), range(self.rails)
        for c in range(job.nchunks if staged != "done" else 0):
            g = job.first_chunk + c
            if not (c == 0 and staged == "chunk 0 staged in"):
                self._wait("red", all_local, g - depth + 1, job, "stage-in")
                if c == 0:
                    self._write_descriptor(job)
                self._stage_in(job, c, whole=oneshot)
                self._arena.publish("in", lr, g + 1)
                self._wait("in", all_local, g + 1, job, "reduce")
            if c == 0:
                self._check_descriptors(job)
                oneshot = oneshot and job.peer_in is None
                if staged == "chunk 0 staged in" and not oneshot and \
                        self._run_core(job, False, resume=True) == "done":
                    break  # registered buffers: the core goes on with them from here
            if oneshot:
                self._reduce_oneshot(job)
                self._arena.publish("red", lr, g + 1)  # done reading this buffer's slots
                self._arena.publish("done", lr, g + 1)  # and never wrote its out buffer
            elif self.num_nodes == 1:
                self._wait("done", all_local, g - depth + 1, job, "reduce")
                self._reduce(job, c, final=True)
                self._arena.publish("red", lr, g + 1)  # on one node "red" also means "out" is ready
                self._stage_out(job, c)
            else:
                self._wait("out", rails, g - depth + 1, job, "reduce", late=True)
                self._reduce(job, c, final=False)
                self._arena.publish("red", lr, g + 1)
        while staged_out is not None and not staged_out.is_set():
            desc = job.plan.desc
            self._check()
            if time.monotonic() > job.tree_deadline + 2 * _OUT_GRACE:  # the stage-out's own waits give up first
                raise CollectiveTimeout(f"{desc} timed out on {self.describe(self.rank)} waiting for its stage-out")
            staged_out.wait(_SLICE)
        self._check()

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
                staged_out.set()
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)

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
            view = self._views[key] = self._arena.bytes[offset + lo * size : offset + hi * size].view(dtype)
        return view

    @staticmethod
    def _own_source(plan: Plan) -> torch.Tensor | None:
        """The CPU tensor this rank reduces its own slice from directly, skipping its slot."""
        if plan.dense and len(plan.sources) == 1 and plan.sources[0][0] == 0 and not plan.sources[0][1].is_cuda:
            return plan.sources[0][1]
        return None

    def _registered(self, plan: Plan) -> tuple[int, int, bool] | None:
        """(buffer, byte offset, in place) when this rank's only input is a registered buffer."""
        if not plan.dense or len(plan.sources) != 1 or plan.sources[0][0] != 0:
            return None
        src = plan.sources[0][1]
        if src.numel() != plan.desc.numel:
            return None
        found = self._shared.locate(src) if self._shared is not None else None
        if found is None:
            return None
        in_place = len(plan.sinks) == 1 and plan.sinks[0][0] == 0 and plan.sinks[0][1].data_ptr() == src.data_ptr() \
            and plan.sinks[0][1].numel() == src.numel() and plan.sinks[0][1].dtype == src.dtype
        return found[0], found[1], in_place

    def _write_descriptor(self, job: Job) -> None:
        """This rank's view of the collective, in the slot of its first buffer (see ArenaShape.desc_slot)."""
        index, offset, in_place = job.shared or (-1, 0, False)
        ext = _SHARED.pack((index + 1) | (_IN_PLACE if in_place else 0), offset)
        self._arena.write_descriptor(self.local_rank, job.seq.to_bytes(8, "little") + job.plan.desc.pack() + ext,
                                     self._buf(job, 0))

    def _stage_in(self, job: Job, c: int, *, whole: bool = False) -> None:
        """Copy this rank's part of chunk ``c`` into its slot: all of it (``whole``: one shot, where every
        rank reads every slot), else all but its own slice, which its reduce reads from the source."""
        if job.shared is not None:
            return  # the other local ranks read this rank's registered buffer directly
        c0, c1 = self._chunk_range(job, c)
        slot = self._shape.in_offset(self._buf(job, c), self.local_rank)
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
            self._wait("red", range(self.local_size), g + 1, job, "stage-out")
        else:
            self._wait("out", range(self.rails), g + 1, job, "stage-out", late=True)
        c0, c1 = self._chunk_range(job, c)
        out = self._shape.out_offset(self._buf(job, c))
        dtype = job.plan.desc.dtype
        if job.peer_out is not None and job.peer_out[self.local_rank] is not None:
            self._arena.publish("done", self.local_rank, g + 1)  # every slice's owner wrote it here already
            return
        for off, dst in job.plan.sinks:
            lo, hi = max(c0, off), min(c1, off + dst.numel())
            if lo < hi:
                self._copy(dst[lo - off : hi - off], self._view(out, dtype, lo - c0, hi - c0))
        self._cuda_sync()
        self._arena.publish("done", self.local_rank, g + 1)

    def _reduce(self, job: Job, c: int, *, final: bool) -> None:
        """Reduce this local rank's slice of chunk ``c`` across the node's slots."""
        desc, b = job.plan.desc, self._buf(job, c)
        c0, c1 = self._chunk_range(job, c)
        s0, s1 = split(c1 - c0, self.local_size, self.local_rank)
        if s0 == s1:
            return
        dtype, acc = desc.dtype, acc_dtype(desc.dtype, desc.op)
        if final:
            target = self._view(self._shape.out_offset(b), dtype, s0, s1)
        else:
            target = self._view(self._shape.red_offset(b), acc, s0, s1)
        if not job.plan.dense:
            self._gather_slice(job, b, c0, s0, s1, target)
            return
        peer_in = job.peer_in
        inputs = [
            peer_in[k][c0 + s0 : c0 + s1] if peer_in is not None and peer_in[k] is not None
            else self._view(self._shape.in_offset(b, k), dtype, s0, s1)
            for k in range(self.local_size)
        ]
        own = job.own
        if own is not None:
            inputs[self.local_rank] = own[c0 + s0 : c0 + s1]
        if final and (acc != dtype or desc.op == Op.AVG):
            work = self._reducer.acc_scratch(s1 - s0) if acc != dtype else target
            self._reducer.reduce_into(work, inputs, desc.op)
            self._reducer.finish(target, work, desc.op, self.world_size)
        else:
            self._reducer.reduce_into(target, inputs, desc.op)
        if final and job.peer_out is not None:
            for dst in job.peer_out:  # one node, registered in place: the result goes straight home
                if dst is not None:
                    dst[c0 + s0 : c0 + s1].copy_(target)

    def _reduce_oneshot(self, job: Job) -> None:
        """One shot: reduce the whole chunk from every slot into this rank's own result, then its sinks."""
        desc, b = job.plan.desc, self._buf(job, 0)
        n = desc.numel
        inputs = [self._view(self._shape.in_offset(b, k), desc.dtype, 0, n) for k in range(self.local_size)]
        if job.own is not None:
            inputs[self.local_rank] = job.own
        acc = acc_dtype(desc.dtype, desc.op)
        result = torch.empty(n, dtype=desc.dtype)  # never an input: the reference reduces input by input
        if acc != desc.dtype or desc.op == Op.AVG:
            work = self._reducer.acc_scratch(n) if acc != desc.dtype else result
            self._reducer.reduce_into(work, inputs, desc.op)
            self._reducer.finish(result, work, desc.op, self.world_size)
        else:
            self._reducer.reduce_into(result, inputs, desc.op)
        for off, dst in job.plan.sinks:
            self._copy(dst, result[off : off + dst.numel()])
        self._cuda_sync()

    # ------------------------------------------------------------------ the compiled core
    def _pack_comm(self) -> bytes:
        shape, base = self._shape, self._arena._base
        return _COMM.pack(base, self.local_size, self.local_rank, shape.depth, shape.chunk_bytes, shape.control_bytes,
                          shape.red_bytes, shape.flags_offset, shape.pid_offset, shape.desc_offset, shape.abort_offset,
                          self.rails, self.config.spin, self.config.yields)

    def _run_core(self, job: Job, oneshot: bool, *, resume: bool = False) -> str | None:
        """Run the node stage of ``job`` in the compiled core, when its plan is one the core takes.

        Returns None (not taken: the Python loop runs it all), ``"done"``, or ``"chunk 0 staged in"``
        (a descriptor the core does not judge, or a registered buffer: the Python loop checks the
        descriptors, then hands the rest back with ``resume``, the registered buffers mapped)."""
        plan, desc = job.plan, job.plan.desc
        own = job.own
        if own is None or job.stream_event is not None or desc.dtype not in _CORE_DTYPES \
                or own.numel() != desc.numel or own.dtype != desc.dtype or not own.is_contiguous():
            return None
        if self.num_nodes == 1:
            sink = plan.sinks[0][1] if len(plan.sinks) == 1 and plan.sinks[0][0] == 0 else None
            if sink is None or sink.numel() != desc.numel or sink.dtype != desc.dtype or sink.is_cuda or \
                    not sink.is_contiguous():
                return None
            mode, dst = (_ONESHOT if oneshot else _PIPELINE), sink.data_ptr()
        else:
            mode, dst = _NODE_STAGE, 0
        acc = acc_dtype(desc.dtype, desc.op)
        divisor = self.world_size if desc.op == Op.AVG and self.num_nodes == 1 else 0
        late = job.tree_deadline + (_OUT_GRACE if self.num_nodes > 1 else 0.0)
        peer_in = _addresses(job.peer_in) if resume else None
        peer_out = _addresses(job.peer_out) if resume and self.num_nodes == 1 else None
        spec = _JOB.pack(mode, job.first_chunk, job.nchunks, job.elems, desc.numel, DTYPES[desc.dtype], int(desc.op),
                         DTYPES[acc], divisor, own.data_ptr(), dst, int(job.deadline * 1e9), int(late * 1e9),
                         job.seq, DESCRIPTOR_BYTES, _SHARED.size, int(resume), int(job.shared is not None),
                         ctypes.addressof(peer_in) if peer_in is not None else 0,
                         ctypes.addressof(peer_out) if peer_out is not None else 0)
        if not resume:
            self._write_descriptor(job)
        if self.num_nodes > 1:  # the trees' threads name what this one waits for in their own timeouts
            self._waiting(job, [r for r in self.members if r != self.rank], "the node stage (compiled core)")
        rc, stage, k, chunk, was_late = _core.node_run(self._core_comm, spec)
        if self.num_nodes > 1:
            self._done_waiting()
        if rc == _CORE_DONE:
            return "done"
        if rc == _CORE_NEED_PYTHON:
            return "chunk 0 staged in"
        raise self._core_failure(job, rc, stage, k, chunk)

    def _core_failure(self, job: Job, rc: int, stage: int, k: int, chunk: int) -> HFReduceError:
        """The error of a core run that stopped with ``rc`` while waiting for local rank ``k``'s ``stage``."""
        desc = job.plan.desc
        stage_name = STAGES[stage] if 0 <= stage < len(STAGES) else "?"
        if rc == _CORE_ABORTED:
            return error_from_text(self._arena.abort_message(), HFReduceError)
        if rc == _CORE_PEER_DEAD:
            r = self.members[k]
            self.flight.waiting(job.seq, [r], f"rank {r} (pid {self._pids[r]}) died")
            return PeerFailure(f"{self.describe(r)}, pid {self._pids[r]}, died")
        if rc == _CORE_TIMEOUT:
            return self._timed_out(job, stage_name, k, job.first_chunk + chunk + 1)
        return HFReduceError(f"hfreduce's compiled core failed on {desc}: error {rc} ({_core_error(rc)})")

    # ------------------------------------------------------------------ the fast door
    def allreduce_now(self, tensor: torch.Tensor, op: Op, timeout: float | None, trace: tuple) -> bool:
        """``dist.all_reduce`` of a small contiguous CPU tensor on one node, as one call of the core.

        The same protocol, descriptors, flight record and errors as :meth:`run_now`, with none of
        its bookkeeping: True when it ran (its error raised otherwise); False when it is not a
        collective this door takes, or the engine is busy (the caller then takes the general path).
        """
        comm = self._core_comm
        if comm is None or self.num_nodes != 1 or self._closed or self._error is not None:
            return False
        numel, dtype = tensor.numel(), tensor.dtype
        key = (dtype, numel, op)
        fast = self._fast.get(key)
        if fast is None:
            if dtype not in _CORE_DTYPES or numel * dtype.itemsize > min(self.config.oneshot_bytes,
                                                                          self.config.chunk_bytes):
                return False
            check_op(op, dtype)
            desc = Descriptor(Kind.ALLREDUCE, dtype, numel, op)
            if len(self._fast) > 1024:
                self._fast.clear()
            fast = self._fast[key] = (desc, desc.pack() + bytes(_SHARED.size), DTYPES[dtype],
                                      DTYPES[acc_dtype(dtype, op)], self.world_size if op == Op.AVG else 0)
        if not tensor.is_contiguous() or tensor.is_cuda or (self._shared is not None and
                                                             self._shared.locate(tensor) is not None):
            return False
        if timeout is not None and not timeout > 0:
            raise ValueError(f"a collective's timeout must be positive seconds, got {timeout}")
        desc, packed, dtype_code, acc_code, divisor = fast
        with self._submit_lock:
            if self._pending:
                return False
            seq = self._seq
            self._seq += 1
            self.flight.record(seq, "allreduce", input_sizes=trace[0], input_dtypes=trace[1],
                               output_sizes=trace[2], output_dtypes=trace[3],
                               timeout_s=timeout or self.config.timeout)
            self._pending += 1
            self._exec_lock.acquire()  # free: nothing is pending, so the engine thread is idle
        job = None
        try:
            g = self._chunk
            self._chunk += 1
            deadline = time.monotonic() + (timeout or self.config.timeout)
            self.flight.started(seq)
            self._arena.write_descriptor(self.local_rank, seq.to_bytes(8, "little") + packed, g % self.config.depth)
            ptr = tensor.data_ptr()
            rc, stage, k, chunk, _ = _core.node_run(comm, _JOB.pack(
                _ONESHOT, g, 1, max(1, numel), numel, dtype_code, int(op), acc_code, divisor, ptr, ptr,
                int(deadline * 1e9), int(deadline * 1e9), seq, DESCRIPTOR_BYTES, _SHARED.size, 0, 0, 0, 0))
            if rc == _CORE_DONE:
                self.flight.completed(seq)
                return True
            flat = tensor.view(-1)
            plan = Plan(desc, sources=[(0, flat)], sinks=[(0, flat)], world_size=self.world_size, timeout=timeout,
                        trace=trace, seq=seq)
            job = Job(plan=plan, future=None, first_chunk=g, nchunks=1, elems=max(1, numel), seq=seq,
                      deadline=deadline, tree_deadline=deadline, own=flat)
            if rc != _CORE_NEED_PYTHON:
                raise self._core_failure(job, rc, stage, k, chunk)
            self._running = job
            self._pipeline(job, True, "chunk 0 staged in", None)  # a mismatch, or a registered peer
            self._check()
            self._running = None
            self.flight.completed(seq)
            return True
        except BaseException as exc:  # noqa: BLE001 - as _run_job: every failure reaches the caller
            error = self._fail(exc)
            self._running = None
            self.flight.failed(seq, str(error))
            raise fresh(error) from None
        finally:
            self._exec_lock.release()
            with self._submit_lock:
                self._pending -= 1

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
                piece.copy_(self._view(self._shape.in_offset(b, k), dtype, a - c0, z - c0))
            else:
                piece.view(torch.uint8).zero_()

    def _check_descriptors(self, job: Job) -> None:
        size, b = 8 + DESCRIPTOR_BYTES, self._buf(job, 0)
        mine = self._arena.descriptor(self.local_rank, size, b)
        registered = []
        for k in range(self.local_size):
            raw = self._arena.descriptor(k, size + _SHARED.size, b)
            theirs = raw[:size]
            their_seq = int.from_bytes(theirs[:8], "little")
            if theirs != mine and their_seq <= job.seq:  # a rank ahead of us already checked against us
                raise self._mismatch(job, self.describe(self.members[k]), Descriptor.unpack(theirs[8:]), their_seq)
            registered.append(_SHARED.unpack(raw[size:]))
        if not any(word for word, _ in registered):
            return
        desc = job.plan.desc
        job.peer_in, job.peer_out = [None] * self.local_size, [None] * self.local_size
        for k, (word, offset) in enumerate(registered):
            if word and self._arena.descriptor(k, 8, b) != job.seq.to_bytes(8, "little"):
                raise HFReduceError(f"{self.describe(self.members[k])} moved past collective #{job.seq} before this "
                                    "rank read where its registered input lives")
            if word:
                view = self._shared.peer_view((word & ~_IN_PLACE) - 1, k, offset, desc.numel, desc.dtype)
                job.peer_in[k] = view
                if word & _IN_PLACE and self.num_nodes == 1:
                    job.peer_out[k] = view

    def _mismatch(self, job: Job, who: str, theirs: Descriptor, their_seq: int) -> CollectiveMismatch:
        return CollectiveMismatch(
            f"collective mismatch: {self.describe(self.rank)} called {job.plan.desc} (#{job.seq}) but "
            f"{who} called {theirs} (#{their_seq})"
        )

    # ------------------------------------------------------------------ CUDA
    def _cuda_prepare(self, job: Job) -> None:
        """Pin the arena once and order this collective's copies after the caller's stream."""
        self._arena.pin()
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

    # ------------------------------------------------------------------ teardown
    def _teardown(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        for link in self._links:
            link.close()
        self._links = []
        for th in self._tree_threads + ([self._out_thread] if self._out_thread else []):
            th.join(timeout=2)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._fd_server is not None:
            self._fd_server.close()
            self._fd_server = None
        if self._shared is not None:
            self._shared.close()
        if self._arena is not None:
            self._arena.unlink()  # harmless if already gone; covers a peer that never attached
            self._arena.close()
            self._arena = None


SECRET_ENV = "FIREFLYER_JOB_SECRET"
_warned_store_secret = False


def launcher_secret() -> bytes | None:
    """The job's secret from the launcher's environment (``FIREFLYER_JOB_SECRET``), or None."""
    raw = os.environ.get(SECRET_ENV)
    if raw is None or raw == "":
        return None
    if len(raw) < 16:
        raise ValueError(f"{SECRET_ENV} must be at least 16 characters (a random token), got {len(raw)}")
    return raw.encode()


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
        raise ValueError(f"unsupported op {op!r}; hfreduce supports: {names}") from None
