"""The validator's GPU checks on a real GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fireflyer.validator.checks import (
    ALL_CHECKS,
    CheckContext,
    CheckSettings,
    RunOptions,
)
from fireflyer.validator.grading import Status

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)"),
]


def run(name: str, **params):
    cls = ALL_CHECKS[name]
    ctx = CheckContext(options=RunOptions(quick=True), settings=CheckSettings(params=params),
                       defaults=dict(cls.params), budget_s=cls.quick_budget_s)
    return cls().run(ctx)


def test_gpu_memory_patterns_find_no_errors():
    result = run("gpu_memory")
    assert result.status == Status.PASS, result.reason
    assert all(d["wrong_words"] == 0 and d["passes"] >= 2 for d in result.details.values())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_gemm_is_verified(dtype):
    result = run("gpu_gemm", dtype=dtype)
    assert result.status == Status.PASS, result.reason
    for dev in result.details.values():
        assert dev["verified_products"] >= 2 and dev["reference_wrong"] == 0 and not dev["bad_products"]
    assert all(m.value > 0 for m in result.metrics)


def test_gpu_bandwidth_measures_both_directions():
    result = run("gpu_bandwidth")
    assert result.status == Status.PASS, result.reason
    names = {m.name.split("@")[0] for m in result.metrics}
    assert names == {"h2d", "d2h"} and all(m.value > 0.5 for m in result.metrics)
