"""The canonical order through ``dist.all_reduce``: on every layout, chunk size, fusion and engine
path, each rank gets the bits one process gets summing every rank's tensor in the canonical tree."""

from __future__ import annotations

import pytest

from fireflyer.hfreduce import HFReduceConfig
from fireflyer.testing.cases import canonical as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

# (seed, numel, dtype, op): one element, a small one-shot tensor, and two that span many chunks
CASES = [(seed, numel, dtype, op) for seed, numel in [(1, 1), (2, 1000), (3, 70_001), (4, 300_000)]
         for dtype in ("float32", "bfloat16", "float16") for op in ("sum", "avg")]
CONFIGS = {
    "default chunks": HFReduceConfig(order="canonical"),
    "8 KiB chunks, no one-shot": HFReduceConfig(order="canonical", chunk_bytes=8192, oneshot_bytes=0),
}
LAYOUTS = [pytest.param([8], marks=pytest.mark.heavy), [2, 2, 2, 2], pytest.param([4, 4], marks=pytest.mark.heavy),
           pytest.param([1] * 8, marks=pytest.mark.heavy), [3], [2, 2, 2]]
"""Eight ranks as one node, two and eight are the heavy tier's: 2+2+2+2 keeps eight ranks in the default one."""


def _check(results: list[list[dict]]) -> None:
    for rank, per_case in enumerate(results):
        for r in per_case:
            assert r["wrong"] == 0, (rank, r)
    digests = {tuple(r["digest"] for r in per_case) for per_case in results}
    assert len(digests) == 1  # and so every rank holds the same bits


@pytest.mark.parametrize("layout", LAYOUTS, ids=["8", "2+2+2+2", "4+4", "1+1+1+1+1+1+1+1", "3", "2+2+2"])
def test_all_reduce_gives_one_process_bits_on_every_layout(layout):
    with LocalCluster(layout, env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        _check(cluster.run(cases.allreduce_cases, CONFIGS["default chunks"], CASES, timeout=300))
        # many chunks of 8 KiB: the large tensors, which span them
        _check(cluster.run(cases.allreduce_cases, CONFIGS["8 KiB chunks, no one-shot"],
                           [c for c in CASES if c[1] >= 70_001 and c[3] == "sum"], timeout=300))
        fused = cluster.run(cases.fused_cases, CONFIGS["8 KiB chunks, no one-shot"], [3, 5000, 100_000], 9)
        for got in fused:
            assert got["alone"] == got["flat"] == got["coalesced"] == got["async"] == got["expected"]


@pytest.mark.parametrize("layout", [[2, 2]], ids=["2x2"])
def test_the_python_engine_sums_in_the_same_tree(layout):
    config = HFReduceConfig(order="canonical", core=False, chunk_bytes=65536)
    with LocalCluster(layout, env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        _check(cluster.run(cases.allreduce_cases, config, CASES[:12], timeout=300))


def test_the_fast_order_does_not_give_these_bits_on_one_node_of_four():
    """The control: the layout's own order (local ranks in turn) differs, so the tests above can fail."""
    with LocalCluster([4], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        results = cluster.run(cases.allreduce_cases, HFReduceConfig(order="fast"), [(4, 300_000, "float32", "sum")])
    assert all(per_case[0]["wrong"] > 1000 for per_case in results)


def test_a_layout_whose_nodes_are_not_subtrees_is_refused_when_the_group_forms():
    with LocalCluster([3, 1], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        messages = cluster.run(cases.refused_layout)
    for message in messages:
        assert message.startswith("UserError: hfreduce cannot sum in the canonical order on this group of 4 ranks")
        assert "3+1" in message and "power-of-two" in message


def test_ranks_that_ask_for_different_orders_are_refused_by_name():
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        messages = cluster.run(cases.mixed_orders)
    assert messages[0].startswith("UserError: hfreduce rank 0 sums in the 'fast' order but ranks [1] do not")
    assert messages[1].startswith("UserError: hfreduce rank 1 sums in the 'canonical' order but ranks [0] do not")
    assert "FIREFLYER_HFREDUCE_ORDER" in messages[0]
