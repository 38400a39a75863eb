"""Saves checkpoints in a loop until killed: every tensor of step s is filled with s."""

import sys

import torch

from fireflyer.checkpoint import CheckpointManager

root, first = sys.argv[1], int(sys.argv[2])
mgr = CheckpointManager(root, keep_last=2, rank=0, world_size=1, chunk_bytes=1 << 20, threads=3)
step = first
while True:
    state = {"step": step, "tensors": {f"t{i}": torch.full((50_000 + 997 * i,), float(step)) for i in range(24)}}
    mgr.save(step, state)
    print(step, flush=True)
    step += 1
