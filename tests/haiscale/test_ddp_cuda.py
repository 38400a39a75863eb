"""haiscale DDP with the model on a GPU: the CPU engine reduces the gradient buckets. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases import ddp as ddp_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)"),
]


def test_cuda_training_matches_cpu_training():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        for on_gpu, on_cpu in cluster.run(ddp_cases.cuda_matches_cpu, 3):
            for a, b in zip(on_gpu, on_cpu):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
