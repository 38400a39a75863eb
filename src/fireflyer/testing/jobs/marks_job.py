"""A bench job: marks when it runs, answers a suspend by saving and go_suspend().

``python marks_job.py OUT MODE``: writes ``OUT/ready.CHAIN.ATTEMPT`` (the time it started)
at once; ``MODE`` ``once`` then exits 0; ``loop`` counts steps until a suspend command, saves
its step to ``OUT/state.CHAIN``, writes ``OUT/ack.CHAIN.ATTEMPT`` (when it saw the command)
and calls ``go_suspend``; it gives up after ten minutes (exit 1). Every mark is written
atomically, so a reader sees a whole time or none.
"""

import os
import sys
import time

from fireflyer.platform import client


def main() -> int:
    out, mode = sys.argv[1], sys.argv[2]
    tag = f"{client.chain_id()}.{client.attempt()}"

    def mark(name: str, t: float) -> None:
        tmp = os.path.join(out, f".{name}.{tag}")
        with open(tmp, "w") as f:
            f.write(f"{t:.6f}")
        os.replace(tmp, os.path.join(out, f"{name}.{tag}"))

    mark("ready", time.time())
    if mode == "once":
        return 0
    state = os.path.join(out, f"state.{client.chain_id()}")
    step = int(open(state).read()) if os.path.exists(state) else 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if client.receive_suspend_command():
            acked = time.time()
            with open(state + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(state + ".tmp", state)
            mark("ack", acked)
            client.go_suspend()
        step += 1
        time.sleep(0.01)
    return 1


if __name__ == "__main__":
    sys.exit(main())
