"""HFReduce on CUDA tensors: D2H into the pinned arena on a copy stream, H2D back. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from hfr_cases import DTYPES, Case, reference, run_case_cuda, tolerance

from fireflyer.testing.cluster import LocalCluster

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)"),
]


@pytest.fixture(scope="module", params=[[2], [2, 2]], ids=["1x2", "2x2"])
def cluster(request):
    with LocalCluster(request.param, env={"FIREFLYER_HFREDUCE_CHUNK_BYTES": "65536"}) as c:
        yield c


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_collectives_match_reference(cluster, kind, dtype):
    case = Case(kind, dtype, 100_003, "sum", root=cluster.world_size - 1, seed=17)
    results = cluster.run(run_case_cuda, case)
    expected = reference(case, cluster.world_size)
    tol = tolerance(case, cluster.world_size)
    for got, want in zip(results, expected):
        wide = got.to(want.dtype)
        assert (wide - want).abs().max().item() <= tol if want.numel() else True
