"""The compiled core against the pure-Python reference, through the whole engine, bit for bit.

Two clusters of each layout run the same collectives on the same inputs, one with the
compiled core (the default where it is built) and one with ``FIREFLYER_HFREDUCE_CORE=0``.
Every result must be the same bytes: one-shot sizes, pipelined sizes that reuse every
arena buffer, every dtype and op, in place through ``dist.all_reduce`` and through the
direct API. The kernels alone are compared in tests/hfreduce/test_hfreduce_kernels.py.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest
import torch

from fireflyer.testing.cases.hfr import ALL_DTYPES, Case, ops_for, registered_allreduce, run_case
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

LAYOUTS = {
    "1x4": ([4], {"FIREFLYER_HFREDUCE_CHUNK_BYTES": "16384"}),
    "2x2": ([2, 2], {"FIREFLYER_HFREDUCE_CHUNK_BYTES": "8192", "FIREFLYER_HFREDUCE_DEPTH": "3"}),
}
SIZES = [0, 1, 7, 1000, 4095, 4096, 20011]  # 4096 fp32 fills a 16 KiB chunk: the largest one-shot here


def _cases() -> list[Case]:
    cases, seed = [], 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for numel in SIZES:
                seed += 1
                cases.append(Case("allreduce", dtype, numel, op, seed=seed))
    cases += [Case("reduce_scatter", torch.float32, 1000, "sum", seed=7), Case("reduce", torch.bfloat16, 5000, "avg",
                                                                              root=1, seed=8)]
    return cases


def run_all(ctx, cases: list[Case]) -> tuple[bool, list[torch.Tensor]]:
    return ctx.comm.runs_core, [run_case(ctx, c) for c in cases]


def through_torch(ctx, sizes: list[int]) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = []
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(1000 + i * 31 + ctx.rank)
        x = torch.randn(n, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
        dist.all_reduce(x, op=dist.ReduceOp.AVG if i % 3 == 0 else dist.ReduceOp.SUM)
        out.append(x)
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def clusters(request):
    layout, env = LAYOUTS[request.param]
    with LocalCluster(layout, env={**env, "FIREFLYER_HFREDUCE_CORE": "1"}) as core, \
            LocalCluster(layout, env={**env, "FIREFLYER_HFREDUCE_CORE": "0"}) as reference:
        yield core, reference


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def test_the_core_and_the_reference_give_the_same_bits(clusters):
    core, reference = clusters
    cases = _cases()
    got = core.run(run_all, cases, timeout=300)
    want = reference.run(run_all, cases, timeout=300)
    assert all(used for used, _ in got), "the compiled core was not used where it was asked for"
    assert not any(used for used, _ in want)
    for rank, ((_, mine), (_, theirs)) in enumerate(zip(got, want)):
        for case, a, b in zip(cases, mine, theirs):
            assert _same_bytes(a, b), (rank, case)


@pytest.mark.parametrize("who", ["all", "odd"])
def test_registered_buffers_too(clusters, who):
    """shared_empty buffers: the core reads peers' inputs in place (and writes results home on one node)."""
    core, reference = clusters
    for numel, dtype, op in ((3000, torch.float32, "sum"), (20011, torch.bfloat16, "avg"), (50, torch.int64, "max")):
        got = core.run(registered_allreduce, numel, dtype, op, who, 3, timeout=300)
        want = reference.run(registered_allreduce, numel, dtype, op, who, 3, timeout=300)
        for rank, (mine, theirs) in enumerate(zip(got, want)):
            for a, b in zip(mine, theirs):
                assert _same_bytes(a, b), (rank, numel, dtype, op, who)


def test_through_torch_distributed_too(clusters):
    core, reference = clusters
    for c in (core, reference):
        c.run(_init_torch, timeout=120)
    try:
        sizes = [1, 3, 1000, 4096, 9000, 70000]
        got = core.run(through_torch, sizes, timeout=300)
        want = reference.run(through_torch, sizes, timeout=300)
        for rank, (mine, theirs) in enumerate(zip(got, want)):
            for n, a, b in zip(sizes, mine, theirs):
                assert _same_bytes(a, b), (rank, n)
    finally:
        for c in (core, reference):
            c.run(_destroy_torch, timeout=120)


MIXED = [1, 2, 1, 2]  # four nodes (trees with two children), one rail: ranks 0, 1, 3 and 4


def mixed_trees(ctx, cases: list[Case]) -> tuple[bool, list[torch.Tensor]]:
    """Ranks of even nodes run the tree stage in the compiled core, the others in Python, on the same links."""
    import dataclasses

    import torch.distributed as dist

    from fireflyer.hfreduce import Communicator, HFReduceConfig

    config = HFReduceConfig.from_env(core_trees=ctx.node % 2 == 0)
    comm = Communicator(dist.PrefixStore("mixed", ctx.store), ctx.rank, ctx.world_size, config=config)
    try:
        return comm.runs_core_trees, [run_case(dataclasses.replace(ctx, comm=comm), c) for c in cases]
    finally:
        comm.close()


def test_ranks_with_the_compiled_trees_and_ranks_with_the_python_ones_interoperate_bit_for_bit():
    env = {"FIREFLYER_HFREDUCE_CHUNK_BYTES": "8192", "FIREFLYER_HFREDUCE_DEPTH": "3"}
    cases, seed = [], 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for numel in (0, 1, 7, 1000, 20011):
                seed += 1
                cases.append(Case("allreduce", dtype, numel, op, seed=seed))
    with LocalCluster(MIXED, env={**env, "FIREFLYER_TEST_COMM": "0"}) as mixed:
        got = mixed.run(mixed_trees, cases, timeout=300)
    with LocalCluster(MIXED, env={**env, "FIREFLYER_HFREDUCE_CORE": "0"}) as reference:
        want = reference.run(run_all, cases, timeout=300)
    assert [used for used, _ in got] == [True, False, False, True, False, False]  # rails 0 and 3: C; 1 and 4: Python
    for rank, ((_, mine), (_, theirs)) in enumerate(zip(got, want)):
        for case, a, b in zip(cases, mine, theirs):
            assert _same_bytes(a, b), (rank, case)


def _init_torch(ctx) -> None:
    import torch.distributed as dist

    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    dist.init_process_group("hfreduce", store=dist.PrefixStore("torch", ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size)


def _destroy_torch(ctx) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _can_build() -> bool:
    include = sysconfig.get_paths()["include"]
    return shutil.which(os.environ.get("CC", "cc")) is not None and os.path.exists(os.path.join(include, "Python.h"))


@pytest.mark.skipif(not _can_build(), reason="no C compiler or no Python headers: the core cannot be built here")
def test_the_core_is_built_and_is_the_default_path():
    from fireflyer.hfreduce import compiled
    from fireflyer.hfreduce.engine import kernels
    from fireflyer.hfreduce.config import HFReduceConfig

    assert compiled.CORE is not None, "pip built no compiled core although a compiler and Python's headers exist"
    assert kernels.available() and kernels.isa() != "reference"
    assert HFReduceConfig().core
