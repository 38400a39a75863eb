"""Initialise, use and destroy backend "hfreduce" three times in one torchrun job (same store)."""

import sys

import torch
import torch.distributed as dist

import fireflyer.hfreduce  # noqa: F401

results = []
for i in range(3):
    dist.init_process_group("hfreduce")
    x = torch.ones(1000) * (dist.get_rank() + i)
    dist.all_reduce(x)
    results.append(x[0].item())
    dist.destroy_process_group()
with open(f"{sys.argv[1]}.{sys.argv[2] if len(sys.argv) > 2 else 'r'}", "a") as f:
    f.write(" ".join(map(str, results)) + "\n")
