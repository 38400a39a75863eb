"""One rank of ``fireflyer bench allreduce``: ``python -m fireflyer.bench.allreduce_worker SPEC.json``.

Started by :mod:`fireflyer.bench.allreduce` with the environment torchrun gives (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
FIREFLYER_NODE_ID. SPEC's ``set`` says which process set the rank belongs to:

- ``torch``: joins the candidate backend as the default group, a gloo group (measured,
  and used for barriers) and a backend that does nothing (:class:`NoopProcessGroup`), whose
  4-byte all_reduce is the dispatch floor: what torch's plugin boundary costs; it also
  answers ``fireflyer bench alltoall``'s rounds of ``all_to_all_single`` (:class:`_Exchange`);
- ``deepspeed``: ``deepspeed.init_distributed(dist_backend="gloo")`` and DeepSpeed's CPU
  shared-memory allreduce (:mod:`fireflyer.bench.allreduce_peers`).

Every rank connects to the parent's control socket and runs what the parent asks, one
round at a time (:func:`serve`), so systems that live in different processes alternate.
Between rounds a rank blocks in a socket read, so an idle system takes no core from the
one being measured. The OpenMPI ranks (:mod:`fireflyer.bench.mpi_worker`) speak
the same protocol.
"""

from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from fireflyer.bench.allreduce_peers import DEEPSPEED, Channel, dtype_note  # noqa: F401 - Channel re-exported
from fireflyer.bench.skeleton import worker_main
from fireflyer.hfreduce.config import node_key
from fireflyer.launch import this_rank
from fireflyer.errors import JobFailed, UserError

PERIOD = 65521
"""Inputs repeat a seeded random block of this many elements: prime, so a chunk moved to
the wrong offset (chunks are powers of two) shows up as wrong values."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COPY_BYTES = 64 << 20
COPY_REPS = 4
COPY_TRIALS = 3
NOOP_BACKEND = "fireflyer_noop"

Op = Callable[[], Any]
"""One allreduce of a buffer the op was made for, in place."""


# -- inputs and checks (unit-tested) ------------------------------------------------------


def seeded_block(rank: int, size_index: int, dtype_index: int, world_size: int) -> torch.Tensor:
    """This rank's input block: small integers whose partial sums stay within +-256, so every
    partial sum is exact in fp32 and bf16 whatever order the backend adds in."""
    hi = max(1, min(8, 256 // world_size))
    gen = torch.Generator().manual_seed(1_000_003 * rank + 1_009 * size_index + dtype_index + 17)
    return torch.randint(-hi, hi + 1, (PERIOD,), generator=gen, dtype=torch.int32)


def fill(buf: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` repeated over ``buf``, in place."""
    n = buf.numel()
    rows, tail = divmod(n, PERIOD)
    if rows:
        buf[: rows * PERIOD].view(rows, PERIOD).copy_(block.expand(rows, PERIOD))
    if tail:
        buf[rows * PERIOD:].copy_(block[:tail])


def count_wrong(buf: torch.Tensor, expected_block: torch.Tensor) -> int:
    """Elements of ``buf`` that differ from ``expected_block`` repeated."""
    n = buf.numel()
    rows, tail = divmod(n, PERIOD)
    wrong = 0
    if rows:
        wrong += int((buf[: rows * PERIOD].view(rows, PERIOD) != expected_block).sum())
    if tail:
        wrong += int((buf[rows * PERIOD:] != expected_block[:tail]).sum())
    return wrong


def segment_length(world_size: int) -> int:
    """Ops between refills: each op multiplies values by up to ``world_size``; stay far from overflow."""
    return max(1, int(100 / max(1.0, math.log2(max(world_size, 2)))))


def timed_round(make_op: Callable[[torch.Tensor], Op], barrier: Callable[[], Any], buf: torch.Tensor,
                block: torch.Tensor, expected: torch.Tensor, ops: int, warmup: int,
                seg: int) -> tuple[list[float], int]:
    """One round of one system: a checked op on fresh inputs, ``warmup - 1`` more untimed ops,
    then ``ops`` timed back to back (refilled every ``seg``). Returns each op's seconds on this
    rank and the wrong elements of the checked op."""
    op = make_op(buf)
    fill(buf, block)
    op()
    wrong = count_wrong(buf, expected)
    for _ in range(max(0, warmup - 1)):
        op()
    times: list[float] = []
    while len(times) < ops:
        k = min(seg, ops - len(times))
        fill(buf, block)
        barrier()
        prev = time.perf_counter()
        for _ in range(k):
            op()
            now = time.perf_counter()
            times.append(now - prev)
            prev = now
    return times, wrong


# -- all_to_all_single (fireflyer bench alltoall; unit-tested) ----------------------------


def exchange_input(rank: int, world_size: int, numel: int, size_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fp32 input to ``all_to_all_single`` and the block its output must repeat.

    Chunk j of every rank's input holds rank j's block at the offset where that chunk lands
    in rank j's output, so each rank's whole output is its own block repeated (checked with
    :func:`count_wrong`), and a chunk from the wrong rank or put at the wrong place shows
    (chunks are not multiples of the prime ``PERIOD``)."""
    if numel % world_size:
        raise UserError(f"{numel} elements do not split evenly over {world_size} ranks")
    c = numel // world_size
    x = torch.empty(numel, dtype=torch.float32)
    for j in range(world_size):
        block = seeded_block(j, size_index, 1, world_size).float()
        fill(x[j * c:(j + 1) * c], torch.roll(block, -((rank * c) % PERIOD)))
    return x, seeded_block(rank, size_index, 1, world_size).float()


class _Exchange:
    """The ``exchange`` command: one round of ``all_to_all_single`` on one system's group, its
    first op checked, the rest timed back to back (:func:`timed_round`)."""

    def __init__(self, rank: int, world: int, groups: dict[str, Any], barrier: Callable[[], Any]) -> None:
        self.rank, self.world, self.groups, self.barrier = rank, world, groups, barrier
        self.key: tuple[int, int] | None = None
        self.x = self.y = self.expected = self.stale = torch.empty(0)

    def round(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = (cmd["bytes"], cmd["size_index"])
        if key != self.key:
            self.key, self.x, self.y = None, torch.empty(0), torch.empty(0)  # free the old buffers first
            self.x, self.expected = exchange_input(self.rank, self.world, cmd["bytes"] // 4, cmd["size_index"])
            self.stale = self.expected + 100  # what the output holds before each op: never the answer
            self.y = torch.empty_like(self.x)
            self.key = key
        group, x = self.groups[cmd["system"]], self.x
        times, wrong = timed_round(lambda y: lambda: dist.all_to_all_single(y, x, group=group), self.barrier,
                                   self.y, self.stale, self.expected, cmd["ops"], cmd["warmup"],
                                   segment_length(self.world))
        return {"times": times, "wrong": wrong}


class _Buffers:
    """The buffer of the (dtype, size) being measured, with this rank's input and the expected sum."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.key: tuple[Any, ...] | None = None
        self.buf = self.block = self.expected = torch.empty(0)

    def get(self, cmd: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (cmd["dtype"], cmd["bytes"], cmd["size_index"], cmd["dtype_index"])
        if key != self.key:
            dtype = DTYPES[cmd["dtype"]]
            self.key, self.buf = None, torch.empty(0)  # free the old buffer before the new one
            blocks = [seeded_block(r, cmd["size_index"], cmd["dtype_index"], self.world) for r in range(self.world)]
            self.expected = torch.stack(blocks).sum(0).to(dtype)
            self.block = blocks[self.rank].to(dtype)
            self.buf = torch.empty(cmd["bytes"] // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
            self.key = key
        return self.buf, self.block, self.expected


def serve(ch: Channel, rank: int, world: int, systems: dict[str, Callable[[torch.Tensor], Op]],
          barrier: Callable[[], Any], handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
          idle_timeout_s: float) -> None:
    """Answer the parent's commands until it says ``exit`` or goes away."""
    buffers = _Buffers(rank, world)
    seg = segment_length(world)
    while True:
        cmd = ch.recv(idle_timeout_s)
        if cmd is None:
            raise SystemExit(f"rank {rank}: the bench parent went away")
        kind = cmd["cmd"]
        if kind == "exit":
            ch.send({"ok": True})
            return
        if kind == "round":
            buf, block, expected = buffers.get(cmd)
            times, wrong = timed_round(systems[cmd["system"]], barrier, buf, block, expected,
                                       cmd["ops"], cmd["warmup"], seg)
            ch.send({"times": times, "wrong": wrong})
        elif kind in handlers:
            ch.send(handlers[kind](cmd))
        else:
            raise UserError(f"unknown command {kind!r}")


Setup = tuple[dict[str, Callable[[torch.Tensor], Op]], Callable[[], Any],
              dict[str, Callable[[dict[str, Any]], dict[str, Any]]], dict[str, Any]]
"""What a process set offers: its systems, its barrier, its extra commands, and its hello."""


def run_rank(spec: dict[str, Any], rank: int, world: int, setup: Callable[[], Setup]) -> None:
    """Connect, set up (reporting a failure to the parent as one line), then serve."""
    ch = Channel.connect(spec["control"])
    try:
        ch.send({"conn": spec["set"], "rank": rank, "pid": os.getpid()})  # who this is, before a setup that may fail
        try:
            systems, barrier, handlers, info = setup()
        except Exception as exc:
            ch.send({"hello": spec["set"], "rank": rank, "error": f"{type(exc).__name__}: {exc}"})
            raise
        ch.send({"hello": spec["set"], "rank": rank, **info})
        try:
            serve(ch, rank, world, systems, barrier, handlers, spec["idle_timeout_s"])
        except Exception as exc:
            try:
                ch.send({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
            except OSError:
                pass
            raise
    finally:
        ch.close()


# -- the torch set: candidate, gloo, copy bandwidth and the dispatch floor -----------------


class NoopWork(dist.Work):
    """A Work that is done before anyone asks."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class NoopProcessGroup(dist.ProcessGroup):
    """A Python backend whose all_reduce does nothing: ``dist.all_reduce`` on it costs only
    torch's dispatch through ``dist.Backend.register_backend``'s plugin boundary."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NOOP_BACKEND

    def name(self) -> str:
        return NOOP_BACKEND

    def allreduce(self, tensors, opts=None):
        return NoopWork(tensors if isinstance(tensors, list) else [tensors])


def register_noop_backend() -> None:
    if NOOP_BACKEND in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(NOOP_BACKEND, lambda o, _b=None: NoopProcessGroup(o.group_rank, o.group_size),
                                  extended_api=True, devices=["cpu"])


def measure_copy(gloo: dist.ProcessGroup, first_trial: int = 0) -> list[dict[str, Any]]:
    """Memory bandwidth of this host with every core copying: one copier per core (every
    emulated node shares this host), so the figure is the hardware's, not the scheduler's."""
    copier = dist.get_rank() < (os.cpu_count() or 1)
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for trial in range(first_trial, first_trial + COPY_TRIALS):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for _ in range(COPY_REPS if copier else 0):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
        if copier:
            out.append({"trial": trial, "bytes": 2 * COPY_BYTES * COPY_REPS, "seconds": seconds})
    return out


def dispatch_times(group: dist.ProcessGroup, ops: int) -> list[float]:
    """Seconds of each 4-byte ``dist.all_reduce`` on ``group``, back to back."""
    x = torch.zeros(1, dtype=torch.float32)
    for _ in range(min(100, ops)):
        dist.all_reduce(x, group=group)
    times = []
    prev = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(x, group=group)
        now = time.perf_counter()
        times.append(now - prev)
        prev = now
    return times


def door_groups(rank: int, world: int, timeout: timedelta) -> dict[str, dist.ProcessGroup]:
    """This rank's one-rank hfreduce group per door (``cpp``, ``python``): what a call costs through each, where
    nobody waits. Every rank makes every rank's, as ``new_group`` asks."""
    from fireflyer.hfreduce.config import DOORS, HFReduceConfig

    out = {}
    for door in DOORS:
        for r in range(world):
            group = dist.new_group([r], backend="hfreduce", timeout=timeout,
                                   pg_options=HFReduceConfig.from_env(door=door))
            if r == rank:
                out[door] = group
    return out


def _torch_set(spec: dict[str, Any], rank: int) -> Setup:
    candidate = spec["candidate"]
    if candidate != "gloo":
        import fireflyer.hfreduce  # noqa: F401  (registers the "hfreduce" backend)
    register_noop_backend()
    timeout = timedelta(seconds=spec["timeout_s"])
    dist.init_process_group(candidate, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    noop = dist.new_group(backend=NOOP_BACKEND, timeout=timeout)
    doors = door_groups(rank, dist.get_world_size(), timeout) if candidate == "hfreduce" else {}
    _inject_fault(rank)
    systems = {"candidate": lambda buf: lambda: dist.all_reduce(buf),
               "gloo": lambda buf: lambda: dist.all_reduce(buf, group=gloo)}
    exchange = _Exchange(rank, dist.get_world_size(), {"candidate": None, "gloo": gloo},
                         lambda: dist.barrier(group=gloo))
    handlers = {"copy": lambda cmd: {"copies": measure_copy(gloo, cmd.get("first_trial", 0))},
                "floor": lambda cmd: {"times": dispatch_times(noop, cmd["ops"]),
                                      "doors": {d: dispatch_times(g, cmd["ops"]) for d, g in doors.items()}},
                "exchange": exchange.round}
    info = {"node": node_key(), "dtypes": {s: {d: None for d in DTYPES} for s in systems}}
    return systems, lambda: dist.barrier(group=gloo), handlers, info


def _deepspeed_set(spec: dict[str, Any], rank: int) -> Setup:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed import comm as ds_comm


    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        raise JobFailed("DeepSpeed did not load its shm op (torch.ops.deepspeed.inference_all_reduce_)")
    level = getattr(getattr(ds_comm.comm, "cdb", None), "shm_vector_kernel_level", 0)
    _inject_fault(rank, DEEPSPEED)
    allreduce = torch.ops.deepspeed.inference_all_reduce_
    systems = {DEEPSPEED: lambda buf: lambda: allreduce(buf)}
    info = {"dtypes": {DEEPSPEED: {d: dtype_note(DEEPSPEED, d, level) for d in DTYPES}}, "kernel_level": level,
            "version": deepspeed.__version__}
    return systems, dist.barrier, {}, info


def run(spec: dict[str, Any]) -> None:
    place = this_rank()
    rank, world = place.rank, place.world_size
    setups = {"torch": _torch_set, "deepspeed": _deepspeed_set}
    run_rank(spec, rank, world, lambda: setups[spec["set"]](spec, rank))
    if dist.is_initialized():
        dist.destroy_process_group()


def _inject_fault(rank: int, set_name: str = "torch") -> None:
    """Test hook: FIREFLYER_BENCH_FAULT="[SET/]RANK:exit" or "[SET/]RANK:hang" makes that rank of
    that process set (torch unless named: deepspeed, openmpi) fail or stall."""
    fault = os.environ.get("FIREFLYER_BENCH_FAULT", "")
    target, _, what = fault.partition(":")
    where, _, who = target.rpartition("/")
    if who != str(rank) or (where or "torch") != set_name:
        return
    if what == "exit":
        raise SystemExit(f"{set_name} rank {rank}: injected failure (FIREFLYER_BENCH_FAULT={fault})")
    if what == "hang":
        time.sleep(3600)


def buf_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.allreduce_worker", run))
