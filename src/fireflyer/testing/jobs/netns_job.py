"""One rank of a job whose nodes sit in separate network namespaces (run by test_hfreduce_netns.py)."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import fireflyer.hfreduce  # noqa: F401


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(300_001, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    y = torch.full((1000,), float(rank), dtype=torch.bfloat16)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    comm = dist.group.WORLD.comm
    result = {"rank": rank, "x_ok": bool(torch.equal(x, torch.arange(300_001, dtype=torch.float32) * sum(range(1, world + 1)))),
              "y": y[0].item(), "nodes": comm.num_nodes, "addr": os.environ.get("FIREFLYER_HFREDUCE_IFADDR")}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
