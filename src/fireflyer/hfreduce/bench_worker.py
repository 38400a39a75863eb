"""One rank of ``fireflyer bench allreduce``: ``python -m fireflyer.hfreduce.bench_worker SPEC.json``.

Started by :mod:`fireflyer.hfreduce.bench` with the environment torchrun gives (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
FIREFLYER_NODE_ID. It joins the candidate backend as the default group and a gloo
group as the baseline, measures copy bandwidth, then every (dtype, size) for both
backends in turn, and appends one JSON line per result to its own events file,
which the parent reads as progress.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PERIOD = 65521
"""Inputs repeat a seeded random block of this many elements: prime, so a chunk moved to
the wrong offset (chunks are powers of two) shows up as wrong values."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COPY_BYTES = 64 << 20
COPY_REPS = 4
COPY_TRIALS = 3


class Events:
    """Append-only JSON-lines file: this rank's progress and results."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1, encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"event": event, **fields}) + "\n")
        self._f.flush()


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


def measure_copy(gloo: dist.ProcessGroup, ev: Events, first_trial: int = 0) -> None:
    """Memory bandwidth of this host with every core copying: one copier per core (every
    emulated node shares this host), so the figure is the hardware's, not the scheduler's."""
    copier = int(os.environ["RANK"]) < (os.cpu_count() or 1)
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    for trial in range(first_trial, first_trial + COPY_TRIALS):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for _ in range(COPY_REPS if copier else 0):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
        if copier:
            ev.emit("copy", trial=trial, bytes=2 * COPY_BYTES * COPY_REPS, seconds=seconds)


def measure(buf: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup | None,
            gloo: dist.ProcessGroup, warmup: int, iters: int, seg: int) -> float:
    """Mean seconds per all_reduce on ``group`` (None: the default group)."""
    fill(buf, block)
    for _ in range(warmup):
        dist.all_reduce(buf, group=group)
    total, done = 0.0, 0
    while done < iters:
        k = min(seg, iters - done)
        fill(buf, block)
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(buf, group=group)
        total += time.perf_counter() - t0
        done += k
    return total / iters


def run(spec: dict[str, Any]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ev = Events(os.path.join(spec["events_dir"], f"rank{rank}.jsonl"))
    candidate = spec["candidate"]
    if candidate != "gloo":
        import fireflyer.hfreduce  # noqa: F401  (registers the "hfreduce" backend)
    timeout = timedelta(seconds=spec["timeout_s"])
    dist.init_process_group(candidate, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    ev.emit("ready", node=os.environ.get("FIREFLYER_NODE_ID", ""), pid=os.getpid())
    _inject_fault(rank)
    measure_copy(gloo, ev)
    seg = segment_length(world)
    for di, dname in enumerate(spec["dtypes"]):
        dtype = DTYPES[dname]
        for si, (nbytes, iters, warmup) in enumerate(spec["schedule"]):
            blocks = [seeded_block(r, si, di, world) for r in range(world)]
            expected = torch.stack(blocks).sum(0).to(dtype)
            block = blocks[rank].to(dtype)
            buf = torch.empty(nbytes // buf_itemsize(dtype), dtype=dtype)
            for backend, group in (("candidate", None), ("gloo", gloo)):
                fill(buf, block)
                dist.all_reduce(buf, group=group)
                wrong = count_wrong(buf, expected)
                mean_s = measure(buf, block, group, gloo, warmup, iters, seg)
                ev.emit("row", dtype=dname, bytes=nbytes, backend=backend,
                        mean_s=mean_s, wrong=wrong, iters=iters)
            del buf
    measure_copy(gloo, ev, first_trial=COPY_TRIALS)  # again at the end; the best trial counts
    dist.barrier(group=gloo)
    ev.emit("done")
    dist.destroy_process_group()


def _inject_fault(rank: int) -> None:
    """Test hook: FIREFLYER_BENCH_FAULT="RANK:exit" or "RANK:hang" makes that rank fail or stall."""
    fault = os.environ.get("FIREFLYER_BENCH_FAULT", "")
    if fault.partition(":")[0] != str(rank):
        return
    if fault.endswith(":exit"):
        raise SystemExit(f"rank {rank}: injected failure (FIREFLYER_BENCH_FAULT={fault})")
    if fault.endswith(":hang"):
        time.sleep(3600)


def buf_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fireflyer.hfreduce.bench_worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
