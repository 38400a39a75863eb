"""all_to_all_single on one node through the arena in one shot, through ``dist.all_to_all_single``.

Uneven splits (zeros included), an input too big for its slot on one rank only (every rank
then takes the exchange together), synchronous and ``async_op`` calls on different ranks
meeting in the same collective, in place, and disagreements that must fail on every rank.
"""

from __future__ import annotations

import itertools

import pytest

from fireflyer.testing.cases.node_a2a import exchange, in_place, mismatch
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0", "OMP_NUM_THREADS": "1"}
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([4], env=ENV) as c:
        yield c


def _prefix() -> str:
    return f"na2a{next(_names)}"


@pytest.mark.parametrize("cols", [1, 7])
def test_uneven_splits_arrive_exactly_through_the_arena(cluster, cols):
    results = cluster.run(exchange, _prefix(), 3, cols, [])
    assert all(r["right"] for r in results), results
    assert all(r["arena"] == 1 for r in results), results  # recorded as the engine's all_to_all


def test_sync_and_async_callers_meet_in_the_same_collective(cluster):
    results = cluster.run(exchange, _prefix(), 2, 3, [1, 3])
    assert all(r["right"] and r["arena"] == 1 for r in results), results


def test_one_rank_too_big_for_its_slot_sends_everyone_through_the_exchange(cluster):
    results = cluster.run(exchange, _prefix(), 20, 8, [2], 1)
    assert all(r["right"] for r in results), results


def test_in_place(cluster):
    assert all(cluster.run(in_place, _prefix()))


@pytest.mark.parametrize("what", ["split", "dtype"])
def test_a_rank_that_disagrees_fails_the_group(cluster, what):
    results = cluster.run(mismatch, _prefix(), what, 2)
    # The rank that sees the disagreement raises it in the call itself (for a split: rank 0, the
    # receiver of the bad piece; for a dtype: every rank that compares descriptors with rank 2).
    assert results[0][0] == "CollectiveMismatch", results
    if what == "split":
        assert "rank 2" in results[0][1] and "expects 4 bytes" in results[0][1], results
    else:
        assert all(name == "CollectiveMismatch" for name, _, _ in results), results
    # A rank whose own pieces agreed may have finished the call; its next collective fails.
    assert all(after != "returned" for _, _, after in results), results
