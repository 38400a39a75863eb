"""One replica group (one process) of a torchft job on hfreduce, for the fault-tolerance tests.

``python ft_replica.py REPLICA_ID LIGHTHOUSE STEPS OUT_JSONL [--min-replicas N] [--hold F] [--ready F]``: trains a small
linear model with ``torchft.Manager(pg=ProcessGroupHFReduce())``: every step starts a quorum,
averages the gradient across the live replica groups with ``Manager.allreduce`` and commits
only if every member says so. A replica that joins late heals: it takes the model and optimizer
from a live replica over the network (torchft's checkpoint transport). Each committed step
appends one JSON line to OUT_JSONL: the step, the quorum's participants and the weights' sha256.
"""

import argparse
import hashlib
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed

from fireflyer import lifetime
from fireflyer.hfreduce.backend.fault_tolerance import ProcessGroupHFReduce
from fireflyer.ports import free_port

p = argparse.ArgumentParser()
p.add_argument("replica_id")
p.add_argument("lighthouse")
p.add_argument("steps", type=int)
p.add_argument("out")
p.add_argument("--min-replicas", type=int, default=1)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--hold", default=None, help="before each step, wait while this file exists (120 s at most)")
p.add_argument("--ready", default=None, help="create this file once the Manager exists, before the first quorum")
args = p.parse_args()
lifetime.graceful(2.0)
os.environ.setdefault("FIREFLYER_NODE_ID", f"replica-{args.replica_id}")

from torchft import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

torch.manual_seed(0)  # every replica starts from the same model; a healed one takes the live state anyway
model = torch.nn.Linear(16, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)


def state_dict():
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    optim.load_state_dict(sd["optim"])


# the replica group's own store, as its torchrun agent would host it (one rank per replica group here)
store_port = free_port()
group_store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=30))
manager = Manager(pg=ProcessGroupHFReduce(timeout=timedelta(seconds=10)), min_replica_size=args.min_replicas,
                  use_async_quorum=False,  # the step (and so the batch) is settled when zero_grad returns
                  load_state_dict=load_state_dict, state_dict=state_dict, replica_id=args.replica_id,
                  lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store_port, rank=0,
                  world_size=1, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30),
                  connect_timeout=timedelta(seconds=10), hostname="127.0.0.1")
opt = OptimizerWrapper(manager, optim)


def hold() -> None:
    """A test's pause: this replica stays out of the next quorum while the file exists (a bounded while)."""
    deadline = time.monotonic() + 120
    while args.hold and os.path.exists(args.hold):
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {args.replica_id}: held for over 120 s by {args.hold}")
        time.sleep(0.02)


if args.ready:
    open(args.ready, "w").close()
with open(args.out, "a") as out:
    while manager.current_step() < args.steps:
        hold()
        opt.zero_grad()  # starts the quorum (healing from a live replica if this one is behind)
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every replica
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for param in model.parameters():
            manager.allreduce(param.grad).wait()
        participants = manager.num_participants()
        opt.step()  # commits only if the quorum agrees
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        out.write(json.dumps({"step": manager.current_step(), "participants": participants,
                              "sha": h.hexdigest(), "t": time.time(), "pid": os.getpid()}) + "\n")
        out.flush()
        if args.step_sleep:
            time.sleep(args.step_sleep)
manager.shutdown()
