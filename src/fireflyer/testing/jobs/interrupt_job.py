"""One rank of a 2-rank hfreduce job in which rank 0 is interrupted (SIGINT) inside dist.all_reduce.

Rank 0 calls ``dist.all_reduce`` while rank 1 stays away; the test sends rank 0 SIGINT. Rank 1
then calls ``dist.all_reduce`` up to twice. Each rank prints one ``RESULT <what> <seconds>`` line
(rank 1's ``what``: each call's outcome and seconds). Usage: interrupt_job.py RANK PORT NBYTES
"""

import os
import sys
import time

from fireflyer.launch import rank_env

rank, port, nbytes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.environ.update(rank_env(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node="n0", master_port=int(port)),
                  FIREFLYER_JOB_SECRET="interrupt-test-secret-0123456789")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fireflyer.hfreduce  # noqa: E402,F401

from datetime import timedelta  # noqa: E402

dist.init_process_group("hfreduce", rank=rank, world_size=2, timeout=timedelta(seconds=60))
x = torch.ones(nbytes // 4)
dist.all_reduce(x)  # both ranks here once: the group works
dist.barrier()
if rank == 0:
    x.fill_(1)
    print("CALLING", flush=True)
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        what = "returned"
    except KeyboardInterrupt:
        what = "KeyboardInterrupt"
    except Exception as exc:  # noqa: BLE001
        what = type(exc).__name__ + ("+KeyboardInterrupt" if "KeyboardInterrupt" in str(exc) else "")
    # One write, its newline included: torch's threads may write to the same pipe (stderr) meanwhile.
    sys.stdout.write(f"RESULT {what} {time.monotonic() - t0:.2f}\n")
    sys.stdout.flush()
else:
    time.sleep(float(os.environ.get("STAY_AWAY_S", "3")))
    # Rank 0 may have staged its input before the interrupt: then this call can still complete,
    # with the true sum. The call after it must fail, since rank 0 is gone from the group.
    outcomes = []
    for _ in range(2):
        t0 = time.monotonic()
        x.fill_(1)
        try:
            dist.all_reduce(x)
            what = "sum-right" if bool((x == 2).all()) else "sum-WRONG"
        except Exception as exc:  # noqa: BLE001
            what = type(exc).__name__
        outcomes.append(f"{what}:{time.monotonic() - t0:.2f}")
        if not what.startswith("sum"):
            break
    sys.stdout.write("RESULT " + ",".join(outcomes) + " 0\n")
    sys.stdout.flush()
os._exit(0)  # the group is failed; skip the teardown's waits
