"""A local emulated cluster for tests: N nodes x M ranks as real processes on this host.

Each rank is a spawned process that joins a real TCPStore, builds an HFReduce
communicator (and, on request, a torch.distributed process group), then serves
calls: ``cluster.run(fn, *args)`` runs the module-level function
``fn(ctx, *args)`` on every rank and returns the per-rank results, or raises
:class:`RankFailed` with each rank's error. Processes persist between calls, so a
test module pays the start-up cost once.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fireflyer import lifetime
from fireflyer.launch import JOB_SECRET, rank_env
from fireflyer.errors import UserError


@dataclass
class RankContext:
    """What a function run on a rank receives."""

    rank: int
    world_size: int
    node: int
    local_rank: int
    comm: Any  # fireflyer.hfreduce.Communicator, or None
    store: Any


class RankFailed(RuntimeError):
    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"rank {r}: {e.splitlines()[-1] if e else e}" for r, e in sorted(errors.items())))


def _context() -> Any:
    """Processes forked from one server that has imported torch already: a rank starts in a fraction of the
    time a fresh interpreter takes to import torch, and nothing else is inherited (the server is a clean
    process of its own, started once per test session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_main(rank: int, world: int, node: int, local_rank: int, local_size: int, port: int, env: dict, inbox, outbox,
               host_store: bool = True, parent_env: dict | None = None, owner: int | None = None) -> None:
    # The fork server is this rank's parent, and it outlives the test process (the ranks hold its lifeline), so the
    # rank follows its owner instead, even one killed outright (its mark, for a sweep, is the fork server's).
    if owner is not None:
        lifetime.die_with(owner, signal.SIGKILL)
    if parent_env is not None:  # the fork server's environment is the one it started with: take the parent's now
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(rank_env(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_size,
                               node=node, master_port=port))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks a hung rank for its stacks
    comm = None
    try:
        if host_store and rank == 0:  # the store's port is the one the kernel gives it, told to the others through
            # the parent: a port chosen beforehand may be taken meanwhile (any connection's ephemeral port)
            store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=60),
                                  wait_for_workers=False)
            os.environ["MASTER_PORT"] = str(store.port)
            outbox.send((rank, "port", store.port))
        else:
            store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
        if env.get("FIREFLYER_TEST_COMM", "1") == "1":
            from fireflyer.hfreduce import Communicator, HFReduceConfig

            comm = Communicator(dist.PrefixStore("test", store), rank, world, config=HFReduceConfig.from_env())
        outbox.send((rank, "ready", None))
    except BaseException:  # noqa: BLE001
        outbox.send((rank, "error", traceback.format_exc()))
        return
    ctx = RankContext(rank, world, node, local_rank, comm, store)
    while True:
        item = inbox.get()
        if item is None:
            break
        fn, args = item
        try:
            outbox.send((rank, "ok", fn(ctx, *args)))
        except BaseException as exc:  # noqa: BLE001
            outbox.send((rank, "error", f"{type(exc).__name__}: {exc}"))
    if comm is not None:
        comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalCluster:
    """``LocalCluster([2, 2])``: two emulated nodes of two ranks each; ``rank_envs`` adds variables for some ranks.

    With ``parent_store=True`` the job's TCPStore lives in this process (as torchrun's
    agent holds it), so any rank may die, and :meth:`respawn` can start it again.
    """

    def __init__(self, layout: Sequence[int], *, env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 parent_store: bool = False, rank_envs: dict[int, dict[str, str]] | None = None) -> None:
        if not layout or any(n < 1 for n in layout):
            raise UserError(f"layout needs one positive rank count per node, got {list(layout)}")
        self.layout = list(layout)
        self.world_size = sum(layout)
        self._mp = _context()
        # One pipe per rank for its answers, written synchronously: a rank killed in the middle of
        # an answer breaks only its own pipe (a queue shared by every rank has one write lock,
        # which a killed writer can take with it, silencing every other rank).
        self._answers: list[Any] = [None] * self.world_size
        self._inboxes = []
        self.procs = []
        self._env = dict(env or {})
        # As a launcher does: one secret in every rank's environment, not in the store.
        self._env.setdefault(JOB_SECRET, secrets.token_hex(32))
        self._rank_envs = dict(rank_envs or {})  # on top of env, for some ranks only
        self._places = []
        self._port = 0  # the store's, once it has one: never chosen beforehand (see _rank_main)
        self.store = None
        if parent_store:
            import datetime

            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, True,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
            self._port = self.store.port
        for node, size in enumerate(layout):
            for local in range(size):
                self._places.append((node, local, size))
        deadline = time.monotonic() + start_timeout
        try:
            for rank in range(self.world_size):
                self._inboxes.append(self._mp.Queue())
                self.procs.append(self._start(rank, self._inboxes[rank]))
                if rank == 0 and self.store is None:  # rank 0 hosts the store: the others need its port first
                    self._port = int(self._answer(0, "port", deadline, "start the job's store in time"))
            self._collect(max(deadline - time.monotonic(), 1.0), "start")
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int, inbox) -> Any:
        node, local, size = self._places[rank]
        answers, outbox = self._mp.Pipe(duplex=False)
        p = self._mp.Process(
            target=_rank_main,
            args=(rank, self.world_size, node, local, size, self._port, {**self._env, **self._rank_envs.get(rank, {})},
                  inbox, outbox, self.store is None,
                  dict(os.environ), os.getpid()),
            daemon=True,
        )
        p.start()
        outbox.close()  # the child holds the write end: its death ends the pipe
        if self._answers[rank] is not None:  # a respawned rank's old pipe
            self._answers[rank].close()
        self._answers[rank] = answers
        return p

    def _next(self, timeout: float, only: int | None = None) -> tuple[int, str, Any] | None:
        """The next answer of any rank (or of rank ``only``), or None when none came within ``timeout``."""
        ends = {end: r for r, end in enumerate(self._answers) if end is not None and only in (None, r)}
        for end in mp.connection.wait(list(ends), timeout):
            try:
                return end.recv()
            except (EOFError, OSError):  # the rank's process is gone: nothing more will come from it
                self._answers[ends[end]] = None
                end.close()
        return None

    def respawn(self, rank: int, timeout: float = 120.0) -> None:
        """Start a new process for ``rank`` (after it died); needs ``parent_store=True``."""
        if self.store is None:
            raise UserError("respawn needs LocalCluster(..., parent_store=True): rank 0 holds the store otherwise")
        old = self.procs[rank]
        if old.is_alive():
            old.kill()
        old.join(5)
        self._inboxes[rank] = self._mp.Queue()
        self.procs[rank] = self._start(rank, self._inboxes[rank])
        self._answer(rank, "ready", time.monotonic() + timeout, f"restart within {timeout:.0f}s")

    def _answer(self, rank: int, want: str, deadline: float, what: str) -> Any:
        """The value of ``rank``'s next answer, which must be ``want``: its error (or its death) raised as
        :class:`RankFailed`, its silence past ``deadline`` as a TimeoutError saying it did not ``what``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._dump_stacks([rank])
                raise TimeoutError(f"rank {rank} did not {what}")
            item = self._next(min(left, 0.5), only=rank)
            if item is None:
                if not self.procs[rank].is_alive():
                    raise RankFailed({rank: f"process exited with code {self.procs[rank].exitcode}"})
                continue
            _, status, value = item
            if status == want:
                return value
            raise RankFailed({rank: value if status == "error" else f"answered {status!r} where {want!r} was due"})

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                self._dump_stacks(missing)
                raise TimeoutError(f"ranks {missing} did not finish {what} within {timeout:.0f}s")
            item = self._next(min(left, 0.5))
            if item is None:
                for r, p in enumerate(self.procs):
                    if not p.is_alive() and r not in results and r not in errors:
                        errors[r] = f"process exited with code {p.exitcode}"
                continue
            rank, status, value = item
            if status == "error":
                errors[rank] = value
                results.pop(rank, None)
            elif rank not in errors:
                results[rank] = value
        if errors:
            raise RankFailed(errors)
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank and return the results by rank."""
        for inbox in self._inboxes:
            inbox.put((fn, args))
        return self._collect(timeout, fn.__name__)

    def submit(self, rank: int, fn: Callable, *args: Any) -> None:
        """Start ``fn`` on one rank without waiting (for fault injection)."""
        self._inboxes[rank].put((fn, args))

    def gather(self, timeout: float = 120.0, expect: Sequence[int] | None = None) -> dict[int, tuple[str, Any]]:
        """Collect one (status, value) per rank in ``expect`` (default: every live rank)."""
        want = set(range(self.world_size) if expect is None else expect)
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                self._dump_stacks(sorted(want - set(got)))
                raise TimeoutError(f"ranks {sorted(want - set(got))} did not answer within {timeout:.0f}s")
            item = self._next(min(left, 0.5))
            if item is None:
                continue
            rank, status, value = item
            got[rank] = (status, value)
        return got

    def _dump_stacks(self, ranks: Sequence[int]) -> None:
        """Have hung ranks print every thread's stack to stderr (for the test's report)."""
        for r in ranks:
            if self.procs[r].is_alive():
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(5)

    def close(self) -> None:
        for inbox, p in zip(self._inboxes, self.procs):
            if p.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ClusterPool:
    """Clusters made on first use, one per named layout, closed together: ``pool.get("2x2")``.

    For a test module whose cases share clusters (a module-scoped fixture yields ``pool.get``
    and calls :meth:`close` after). Every cluster has the job's store in this process, so any
    rank may be killed and respawned.
    """

    def __init__(self, layouts: dict[str, Sequence[int]], *, env: dict[str, str] | None = None) -> None:
        self.layouts, self.env = layouts, env
        self.made: dict[str, LocalCluster] = {}

    def get(self, layout: str) -> LocalCluster:
        if layout not in self.made:
            self.made[layout] = LocalCluster(self.layouts[layout], env=self.env, parent_store=True)
        return self.made[layout]

    def close(self) -> None:
        for c in self.made.values():
            c.close()
        self.made.clear()
