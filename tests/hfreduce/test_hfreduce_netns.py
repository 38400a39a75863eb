"""hfreduce between nodes that only meet over a real (shaped) network link. Needs root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fireflyer.launch import rank_env
from fireflyer.testing.netns import ShapedLink, netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

JOB = ["-m", "fireflyer.testing.jobs.netns_job"]


def test_allreduce_across_network_namespaces(tmp_path):
    out = tmp_path / "result"
    ranks_per_node = 2
    with ShapedLink(rate_mbit=2000, nodes=2) as link:
        procs = []
        for node in range(2):
            for local in range(ranks_per_node):
                rank = node * ranks_per_node + local
                env = dict(
                    os.environ,
                    **rank_env(rank=rank, world_size=2 * ranks_per_node, local_rank=local,
                               local_world_size=ranks_per_node, node=node, master_addr=link.addrs[0],
                               master_port=29517),
                    FIREFLYER_HFREDUCE_IFADDR=link.addrs[node],
                    OMP_NUM_THREADS="1",
                )
                procs.append(link.popen(node, [sys.executable, *JOB, str(out)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=120)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-3000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2 * ranks_per_node)]
    for r, res in enumerate(results):
        assert res["x_ok"], res
        assert res["y"] == 3.0  # MAX of ranks 0..3
        assert res["nodes"] == 2
        assert res["addr"] == link.addrs[r // ranks_per_node]
