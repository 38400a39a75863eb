"""The fast door of a small ``dist.all_reduce`` leaves no long-lived object behind.

Each call used to leave a new flight-record entry and new shape lists alive for as long as
the ring kept them; the cycle collector's full passes that this churn brought on cost tens
of ms each in a process holding torch. The ring now reuses its entries, and the door keeps
one trace per shape.
"""

from __future__ import annotations

import pytest

from fireflyer.testing.cases.fast_door import ring_after
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


def test_a_full_ring_reuses_its_entries_and_one_trace_per_shape():
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0", "OMP_NUM_THREADS": "1",
                                "FIREFLYER_HFREDUCE_TRACE_BUFFER": "64"}) as cluster:
        results = cluster.run(ring_after, "door", 100)
    for r in results:
        first, second = r["passes"]
        assert r["right"] and r["capacity"] == 64
        assert first["entries"] == second["entries"], "the ring made new entries once it was full"
        assert len(first["sizes"]) == 1 and first["sizes"] == second["sizes"], "a trace list per call"
        assert second["seqs"] == list(range(200 - 64, 200)), "the ring keeps the newest collectives"
