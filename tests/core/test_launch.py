"""The local launcher: real torchrun agents per emulated node; failures and hangs end the job with one clear line."""

from __future__ import annotations

import pytest

from fireflyer.launch import LaunchFailed, LocalJob, run_local

pytestmark = pytest.mark.multiproc

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} on {os.environ['FIREFLYER_NODE_ID']}", flush=True)
mode = sys.argv[1]
if mode == "fail" and rank == 3:
    raise ValueError("bad shard 17 on the last rank")
if mode == "hang":
    time.sleep(600)
"""


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def test_every_rank_gets_its_node_and_rank(script, tmp_path):
    logs = run_local(LocalJob(target=[script, "ok"], nodes=2, ranks_per_node=2, quiet=True, log_dir=str(tmp_path / "l")))
    text = (logs / "node0.log").read_text() + (logs / "node1.log").read_text()
    for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"rank {rank} of 4 on node{node}" in text


def test_a_failing_rank_is_named_with_its_error(script):
    with pytest.raises(LaunchFailed, match="ValueError: bad shard 17 on the last rank"):
        run_local(LocalJob(target=[script, "fail"], nodes=2, ranks_per_node=2, quiet=True, timeout=120))


def test_a_hanging_job_is_stopped(script):
    with pytest.raises(TimeoutError, match="did not finish within 5s"):
        run_local(LocalJob(target=[script, "hang"], nodes=1, ranks_per_node=2, quiet=True, timeout=5))


def test_bad_jobs_are_refused():
    with pytest.raises(ValueError, match="nodes"):
        LocalJob(target=["x.py"], nodes=0)
    with pytest.raises(ValueError, match="target"):
        LocalJob(target=[])
