"""A small platform task for the tests: counts steps, checkpoints on suspend, resumes.

``python platform_job.py STATE_FILE STEPS [--step-s S] [--fail-attempts K] [--ignore-suspend] [--silent] [--hold FILE]``

Each step appends to ``STATE_FILE.log`` and sleeps; the progress (next step) lives in
``STATE_FILE`` (written atomically). On a suspend command it saves and calls
``go_suspend``. ``--fail-attempts K`` makes the first K attempts of the chain exit 3
(counted in the whole-life state); ``--ignore-suspend`` never polls; ``--silent``
prints nothing; ``--hold FILE`` waits before its last step until FILE exists (a test
decides when the task may end, whatever the host's load). When done it writes ``STATE_FILE.done`` with the step count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from fireflyer.platform import client


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("state")
    p.add_argument("steps", type=int)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--fail-attempts", type=int, default=0)
    p.add_argument("--ignore-suspend", action="store_true")
    p.add_argument("--silent", action="store_true")
    p.add_argument("--hold", help="wait before the last step until this file exists")
    args = p.parse_args()
    if client.rank() != 0:  # the other ranks just live as long as rank 0 needs them
        while not os.path.exists(args.state + ".done"):
            time.sleep(0.05)
        return 0
    life = client.get_whole_life_state()
    if life < args.fail_attempts:
        client.set_whole_life_state(life + 1)
        print(f"attempt {client.attempt()}: failing on purpose ({life + 1} of {args.fail_attempts})", flush=True)
        return 3
    step = int(open(args.state).read()) if os.path.exists(args.state) else 0
    if not args.silent:
        print(f"attempt {client.attempt()} of task {client.chain_id()} starts at step {step} on "
              f"{os.environ['FIREFLYER_NODE_ID']} (world {client.world_size()})", flush=True)
    while step < args.steps:
        while args.hold and step == args.steps - 1 and not os.path.exists(args.hold):
            time.sleep(0.05)
        if not args.ignore_suspend and client.receive_suspend_command():
            tmp = args.state + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, args.state)
            if not args.silent:
                print(f"suspending at step {step}", flush=True)
            client.go_suspend()
        with open(args.state + ".log", "a") as f:
            f.write(f"{client.attempt()} {step}\n")
        step += 1
        time.sleep(args.step_s)
        if not args.silent:
            print(f"step {step}", flush=True)
    with open(args.state + ".done", "w") as f:
        f.write(str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
