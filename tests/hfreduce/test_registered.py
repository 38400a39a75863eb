"""Registered (shared-memory) buffers: allreduce reads peers' inputs in place and, on one node, writes results home.

The results must be the same bits as the ordinary path, whichever ranks use registered buffers.
"""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases.hfr import Case, reference, registered_allreduce, tolerance
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module", params=[[4], [2, 2]], ids=["1x4", "2x2"])
def cluster(request):
    with LocalCluster(request.param, env={"FIREFLYER_HFREDUCE_CHUNK_BYTES": "65536"}) as c:
        yield c


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "avg")], ids=str)
def test_registered_allreduce_matches_reference_and_the_ordinary_path(cluster, dtype, op):
    numel, rounds = 40_001, 2  # several chunks, an uneven tail
    runs = {who: cluster.run(registered_allreduce, numel, dtype, op, who, rounds) for who in ("all", "odd", "none")}
    for r in range(rounds):
        case = Case("allreduce", dtype, numel, op, seed=r)
        expected = reference(case, cluster.world_size)
        tol = tolerance(case, cluster.world_size)
        for rank in range(cluster.world_size):
            got = runs["all"][rank][r]
            assert (got.to(expected[rank].dtype) - expected[rank]).abs().max().item() <= tol
            # bitwise the same as the ordinary path, and as a mix of both
            assert torch.equal(got, runs["none"][rank][r])
            assert torch.equal(got, runs["odd"][rank][r])
