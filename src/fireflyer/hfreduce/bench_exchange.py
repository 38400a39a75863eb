"""all_to_all_single on hfreduce against gloo, in one run: ``python -m fireflyer.hfreduce.bench_exchange``.

Both groups live in the same processes (an emulated cluster on this host: nodes by
``FIREFLYER_NODE_ID``), and the rounds alternate between them, so both see the same
machine. Each op's time is the slowest rank's; the figure is the median (``--back-to-back``:
the mean of ops run in a row, the median of three such runs). Sizes are
the bytes each rank sends in all (its whole input), fp32. ``hfreduce`` is the plain
synchronous call, which drives its channels on the caller's thread; ``async_op`` is the
same call with ``async_op=True`` and ``wait()``, moved by the channels' threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

SIZES = (64 << 10, 4 << 20, 64 << 20)
LAYOUTS = {"1x4": [4], "2x2": [2, 2], "1x2": [2], "2x1": [1, 1]}


def _back_to_back(groups: dict, gloo, x, y, rounds: int) -> dict[str, float]:
    """Seconds per op with ``rounds`` ops back to back (no barrier between them), the slowest rank's."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, g in groups.items():
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for _ in range(rounds):
            if name.endswith("-async"):
                dist.all_to_all_single(y, x, group=g, async_op=True).wait()
            else:
                dist.all_to_all_single(y, x, group=g)
        dt = torch.tensor([(time.perf_counter() - t0) / rounds], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=gloo)
        out[name] = dt.item()
    return out


def _rank(ctx, sizes: list[int], rounds: int, warmup: int, back_to_back: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    dist.init_process_group("hfreduce", store=dist.PrefixStore("bench", ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    groups = {"hfreduce": dist.group.WORLD, "hfreduce-async": dist.group.WORLD, "gloo": gloo}
    w = ctx.world_size
    out: dict = {}
    for nbytes in sizes:
        n = max(w, nbytes // 4 // w * w)
        x = torch.randn(n)
        y = torch.empty(n)
        times: dict[str, list[float]] = {k: [] for k in groups}
        if back_to_back:
            for _ in range(warmup):
                for g in groups.values():
                    dist.all_to_all_single(y, x, group=g)
            per_op = [_back_to_back(groups, gloo, x, y, max(1, rounds)) for _ in range(3)]
            out[nbytes] = {k: statistics.median(p[k] for p in per_op) for k in groups}
            continue
        for i in range(warmup + rounds):
            for name, g in groups.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                if name.endswith("-async"):  # the channels' threads move it, not the caller
                    dist.all_to_all_single(y, x, group=g, async_op=True).wait()
                else:
                    dist.all_to_all_single(y, x, group=g)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=gloo)
                if i >= warmup:
                    times[name].append(dt.item())
        out[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group()
    return out


def run(layouts: list[str], sizes: list[int], rounds: int, warmup: int, back_to_back: bool = False) -> dict:
    from fireflyer.testing.cluster import LocalCluster

    env = {"FIREFLYER_TEST_COMM": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    results: dict = {}
    for name in layouts:
        with LocalCluster(LAYOUTS[name], env=env) as cluster:
            results[name] = cluster.run(_rank, sizes, rounds, warmup, back_to_back, timeout=1800)[0]
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="1x4,2x2")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes per rank, comma separated")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--back-to-back", action="store_true",
                    help="time --rounds ops in a row (throughput) instead of each op after a barrier (latency)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = run(args.layouts.split(","), sizes, args.rounds, args.warmup, args.back_to_back)
    print(f"{'layout':>6} {'bytes/rank':>12} {'gloo ms':>9} {'hfreduce ms':>12} {'speed-up':>9} "
          f"{'async_op ms':>12}")
    for layout, by_size in results.items():
        for nbytes, t in by_size.items():
            print(f"{layout:>6} {nbytes:>12} {t['gloo'] * 1e3:>9.2f} {t['hfreduce'] * 1e3:>12.2f} "
                  f"{t['gloo'] / t['hfreduce']:>8.2f}x {t['hfreduce-async'] * 1e3:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "back_to_back": args.back_to_back, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
