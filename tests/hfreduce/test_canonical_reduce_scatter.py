"""The canonical order through ``dist.reduce_scatter_tensor`` and ``dist.reduce_scatter``: on every layout,
rank ``r`` gets elements ``[r*n, (r+1)*n)`` of what one process gets summing every rank's input in the
canonical tree over ranks (``canonical_sum``: partials of half types in fp32, rounded once)."""

from __future__ import annotations

import pytest

from fireflyer.hfreduce import HFReduceConfig
from fireflyer.testing.cases import canonical as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0"}
# (seed, numel per rank, dtype, op, form): one element, odd sizes, and one that spans many chunks
CASES = [(seed, numel, dtype, "sum", form) for seed, numel in [(1, 1), (2, 7), (3, 3001), (4, 40_001)]
         for dtype in ("float32", "bfloat16") for form in ("tensor", "list", "async")]
CASES += [(5, 999, dtype, "avg", "tensor") for dtype in ("float32", "bfloat16", "float16")]
SMALL_CHUNKS = HFReduceConfig(order="canonical", chunk_bytes=8192, oneshot_bytes=0)


def _check(results: list[list[dict]]) -> None:
    for rank, per_case in enumerate(results):
        for r in per_case:
            assert r["equal"] and r["wrong"] == 0, (rank, r)


@pytest.mark.parametrize("layout", [[2], [4], [2, 2]], ids=["1x2", "1x4", "2x2"])
def test_reduce_scatter_gives_each_rank_its_segment_of_one_process_sum(layout):
    with LocalCluster(layout, env=ENV) as cluster:
        _check(cluster.run(cases.reduce_scatter_cases, HFReduceConfig(order="canonical"), CASES, timeout=300))
        # 8 KiB chunks, no one-shot: the large tensors span many chunks, and segments start mid-chunk
        _check(cluster.run(cases.reduce_scatter_cases, SMALL_CHUNKS, [c for c in CASES if c[1] >= 3001],
                           timeout=300))


def test_the_python_engine_scatters_the_same_sums():
    config = HFReduceConfig(order="canonical", core=False, chunk_bytes=65536)
    with LocalCluster([2, 2], env=ENV) as cluster:
        _check(cluster.run(cases.reduce_scatter_cases, config, [c for c in CASES if c[4] == "tensor"], timeout=300))


def test_the_fast_order_does_not_give_these_bits_on_one_node_of_four():
    """The control: the layout's own order (local ranks in turn) differs, so the tests above can fail."""
    with LocalCluster([4], env=ENV) as cluster:
        results = cluster.run(cases.reduce_scatter_cases, HFReduceConfig(order="fast"),
                              [(4, 40_001, "float32", "sum", "tensor")])
    assert all(not per_case[0]["equal"] and per_case[0]["wrong"] > 1000 for per_case in results)
