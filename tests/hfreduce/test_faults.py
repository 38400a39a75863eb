"""Faults and bad input: dead peers, timeouts, mismatched calls, intruders, leftover arenas."""

from __future__ import annotations

import re

import pytest

from fireflyer.testing.cases.hfr import (after_failure, allreduce_until_failure, arena_files, capture_refusals, intrude,
                                         keyed, mismatched, skip_collective)
from fireflyer.testing import shm
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

TIMEOUT = 6.0
ENV = {"FIREFLYER_HFREDUCE_TIMEOUT": str(TIMEOUT), "FIREFLYER_HFREDUCE_CHUNK_BYTES": "65536"}


HFR = ("fireflyer-hfr-",)
"""The names of hfreduce's /dev/shm segments begin so."""


@pytest.mark.parametrize(
    "layout,victim",
    [([4], 2), ([2, 2], 3), ([2, 2], 0), ([1, 1, 2], 1)],
    ids=["1x4-rank2", "2x2-rank3", "2x2-rank0", "1+1+2-lone-rank1"],
)
def test_dead_peer_is_named_on_every_survivor_within_the_timeout(layout, victim):
    before = shm.segments(HFR)
    with LocalCluster(layout, env=ENV) as cluster:
        node = next(i for i, hi in enumerate(_cumsum(layout)) if victim < hi)
        for r in range(cluster.world_size):
            cluster.submit(r, allreduce_until_failure, 8 << 20, 50, victim, 0.05)
        survivors = [r for r in range(cluster.world_size) if r != victim]
        got = cluster.gather(timeout=60, expect=survivors)
        for r in survivors:
            status, (kind, msg, elapsed) = got[r]
            assert status == "ok" and kind in ("PeerFailure", "ConnectionLost"), (r, got[r])
            assert re.search(rf"\brank {victim}\b", msg) and f"node {node}" in msg, (r, msg)
            assert elapsed < TIMEOUT + 3, (r, elapsed)
        for r, (outcome, left) in zip(survivors, [_ask(cluster, r, after_failure) for r in survivors]):
            assert outcome in ("PeerFailure", "ConnectionLost"), (r, outcome)
            assert left == [], (r, left)
    assert shm.left_behind(before, HFR) == set()


def test_missing_rank_times_out_and_is_named():
    with LocalCluster([2, 2], env=ENV) as cluster:
        results = cluster.run(skip_collective, 1, timeout=60)
        for r, (kind, msg, elapsed) in enumerate(results):
            if r == 1:
                continue
            assert kind in ("CollectiveTimeout", "PeerFailure"), (r, kind, msg)
            assert "rank 1" in msg, (r, msg)
            assert elapsed < TIMEOUT + 3


@pytest.mark.parametrize("layout", [[3], [2, 2]], ids=["1x3", "2x2"])
def test_mismatched_calls_fail_on_every_rank(layout):
    with LocalCluster(layout, env=ENV) as cluster:
        for what in ("size", "dtype", "op") + (("node_size",) if len(layout) > 1 else ()):
            results = cluster.run(mismatched, what, timeout=60)
            for r, (kind, msg) in enumerate(results):
                assert kind == "CollectiveMismatch", (what, r, kind, msg)
                assert "mismatch" in msg and "allreduce" in msg, (what, r, msg)


def test_intruder_is_refused_logged_and_never_summed():
    with LocalCluster([2, 2], env=ENV) as cluster:
        # rank 2 is rail 0 of node 1; its listener serves the other node's rail 0.
        cluster.submit(2, capture_refusals, 3.0)
        cluster.submit(0, intrude, 2)
        got = cluster.gather(timeout=30, expect=[0, 2])
        assert got[0][0] == "ok" and got[0][1] in ("CollectiveTimeout", "HFReduceError"), got[0]
        refused, records = got[2][1]
        assert refused >= 2
        assert any("refused a connection" in m and "127.0.0.1" in m for m in records), records
        import torch
        from fireflyer.testing.cases.hfr import Case, run_case

        sums = cluster.run(run_case, Case("allreduce", torch.float32, 1000, "sum", seed=1))
        for s in sums[1:]:
            assert torch.equal(s, sums[0])


def test_arena_is_private_and_gone_from_dev_shm_once_mapped():
    before = shm.segments(HFR)
    with LocalCluster([2], env=ENV) as cluster:
        seen = cluster.run(arena_files)
        assert shm.ours(set(seen[0]) - before) == set(), "the arena should be unlinked once every local rank mapped it"
    assert shm.left_behind(before, HFR) == set()


def _ask(cluster: LocalCluster, rank: int, fn):
    cluster.submit(rank, fn)
    status, value = cluster.gather(timeout=30, expect=[rank])[rank]
    assert status == "ok", value
    return value


def _cumsum(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def test_ranks_launched_with_different_job_secrets_fail_at_once_by_name():
    with LocalCluster([2, 2], env=ENV) as cluster:
        assert cluster.run(keyed, False) == [("ok", 4.0)] * 4  # the launcher's one secret: no store secret needed
        results = cluster.run(keyed, True, timeout=60)
        for r, (kind, msg) in enumerate(results):
            assert kind == "HFReduceError" and "different job secrets" in msg and "FIREFLYER_JOB_SECRET" in msg, (r, msg)
