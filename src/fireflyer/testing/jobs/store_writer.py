"""Drives the platform store until killed: submits (with request ids), schedules, finishes, requeues."""

import random
import sys

from fireflyer.platform.state.policy import Node, schedule
from fireflyer.platform.state.store import StopCode, Store

path, first = sys.argv[1], int(sys.argv[2])
store = Store(path)
store.add_nodes([Node(f"n{i}", f"z{i % 2}") for i in range(6)])
rng = random.Random(first)
i = first
while True:
    store.submit(user=f"u{i % 3}", nodes=rng.choice([1, 2, 3]), command=["sleep", "1"],
                 priority=rng.choice(["LOW", "NORMAL", "HIGH"]), request_id=f"r{i}")
    print(i, flush=True)  # only after the submit committed
    now = float(i)
    store.apply(schedule(store.nodes(), store.policy_tasks(now)), now=now)
    for t in store.tasks():
        if t.state in ("running", "suspending") and rng.random() < 0.3:
            store.finish(t.id, rng.choice([StopCode.STOP, StopCode.INTERRUPT, StopCode.FAILED]), now=now)
    i += 1
