"""HFReduce on CUDA tensors: D2H into the pinned arena on a copy stream, H2D back. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases.hfr import DTYPES, Case, reference, run_case_cuda, tolerance
from fireflyer.testing.cluster import LocalCluster

pytestmark = [
    pytest.mark.multiproc,
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


def _core_built(ctx) -> bool:
    from fireflyer.hfreduce.engine import kernels

    return kernels.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_cuda_allreduce_gives_the_bits_of_the_cpu_core(cluster, dtype, op):
    """A CUDA tensor is staged through the pinned arena and reduced by the same compiled kernels
    as a CPU tensor: the two results are the same bits (gpu_check.sh builds the core first)."""
    from fireflyer.testing.cases.hfr import run_case

    assert all(cluster.run(_core_built)), "the compiled core is not built: run `python setup.py build_ext --inplace`"
    case = Case("allreduce", dtype, 65_537, op, seed=23)
    on_gpu = cluster.run(run_case_cuda, case)
    on_cpu = cluster.run(run_case, case)
    for g, c in zip(on_gpu, on_cpu):
        assert g.dtype == c.dtype and g.shape == c.shape
        assert torch.equal(g.contiguous().view(torch.uint8), c.contiguous().view(torch.uint8))
