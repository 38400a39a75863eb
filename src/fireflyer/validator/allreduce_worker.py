"""One rank of the validator's in-node allreduce check.

``python -m fireflyer.validator.allreduce_worker --backend hfreduce --bytes N --iters K --out DIR``,
started by torchrun (through :func:`fireflyer.launch.run_local`) with the usual RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (read by :func:`fireflyer.launch.this_rank`). Every iteration refills the buffer
with this rank's integer-valued input, runs one timed all_reduce and compares the whole
result with the exact expected sum, so speed and correctness are measured on the same
operations. Each rank writes ``DIR/rank{R}.json``: its mean seconds per op and how many
elements came back wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

from fireflyer.fsutil import atomic_write


def rank_input(n: int, rank: int, device: str):
    """Values in [-125, 125] plus the rank: every sum over up to 1024 ranks is exact in fp32."""
    import torch

    base = (torch.arange(n, dtype=torch.int64) * 7919 % 251 - 125).to(torch.float32)
    return (base + rank).to(device)


def expected_sum(n: int, world: int, device: str):
    import torch

    base = (torch.arange(n, dtype=torch.int64) * 7919 % 251 - 125).to(torch.float32)
    return (base * world + world * (world - 1) / 2).to(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fireflyer.validator.allreduce_worker")
    p.add_argument("--backend", default="hfreduce", choices=["hfreduce", "nccl", "gloo"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may block")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from fireflyer.launch import this_rank

    me = this_rank()
    rank, world, local_rank = me.rank, me.world_size, me.local_rank
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if args.backend == "hfreduce":
        import fireflyer.hfreduce  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    n = max(1, args.bytes // 4)
    src = rank_input(n, rank, device)
    want = expected_sum(n, world, device)
    buf = torch.empty_like(src)
    total, wrong = 0.0, 0
    for it in range(args.warmup + args.iters):
        buf.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        wrong += int((buf != want).sum())
        if it >= args.warmup:
            total += dt
    dist.barrier()
    result = {"rank": rank, "world_size": world, "backend": args.backend, "device": device,
              "bytes": n * 4, "iters": args.iters, "mean_s": total / args.iters, "wrong": wrong,
              "checked_elements": n * (args.warmup + args.iters)}
    data = json.dumps(result).encode()
    atomic_write(os.path.join(args.out, f"rank{rank}.json"), lambda f: f.write(data), tmp_name=f".rank{rank}.json.tmp")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
