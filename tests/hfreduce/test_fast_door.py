"""The fast door of a small ``dist.all_reduce`` leaves no long-lived object behind.

Each call used to leave a new flight-record entry and new shape lists alive for as long as
the ring kept them; the cycle collector's full passes that this churn brought on cost tens
of ms each in a process holding torch. The Python door's ring reuses its entries, and the door
keeps one trace per shape; the C++ door keeps its records in a ring of its own, which the flight
recorder reports as its own.
"""

from __future__ import annotations

import pytest

from fireflyer.testing.cases.fast_door import records_after, ring_after
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


def test_a_full_ring_reuses_its_entries_and_one_trace_per_shape():
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0", "OMP_NUM_THREADS": "1",
                                "FIREFLYER_HFREDUCE_TRACE_BUFFER": "64", "FIREFLYER_HFREDUCE_DOOR": "python"}) as cluster:
        results = cluster.run(ring_after, "door", 100)
    for r in results:
        first, second = r["passes"]
        assert r["right"] and r["capacity"] == 64
        assert first["entries"] == second["entries"], "the ring made new entries once it was full"
        assert len(first["sizes"]) == 1 and first["sizes"] == second["sizes"], "a trace list per call"
        assert second["seqs"] == list(range(200 - 64, 200)), "the ring keeps the newest collectives"


def test_the_cpp_door_records_every_call_and_leaves_nothing_behind():
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0", "OMP_NUM_THREADS": "1",
                                "FIREFLYER_HFREDUCE_TRACE_BUFFER": "64"}) as cluster:
        results = cluster.run(records_after, "ledger", 300)
    for r in results:
        if r["door"] != "cpp":
            pytest.skip(f"the C++ door is not built here (the group took the {r['door']} door)")
        first, second = r["passes"]
        assert r["right"]
        assert second["seqs"] == list(range(600 - 64, 600)), "the recorder reports the newest 64 collectives"
        assert second["ids"] == sorted(second["ids"]) and len(set(second["ids"])) == 64
        assert second["states"] == ["completed"] and second["sizes"] == ["[[7, 3]]"]
        assert (second["settled"], second["in_flight"]) == (600, 0)
        assert second["tracked"] - first["tracked"] < 50, "300 calls left objects for the cycle collector"
