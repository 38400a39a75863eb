"""all_gather, broadcast and reduce_scatter on "hfreduce" across emulated nodes (the spread path), against gloo.

On more than one node these collectives move only the bytes they need
(:mod:`fireflyer.hfreduce.backend.spread`). Every case runs through ``torch.distributed`` on an
hfreduce default group and on a gloo group of the same ranks: sizes 0, 1, a prime and
about a MiB, dtypes fp32, fp64, bf16, fp16, int32 and int64, every reduce op, several
roots, non-contiguous tensors, in-place and coalesced calls, on even nodes (2x2, 3x2, 4x2) and uneven
ones (2+1, 1+2+3). Small chunk and mailbox sizes in some layouts make the bigger cases
span many chunks and wrap the rings. Then: the bytes that cross between nodes are the
minimum, reruns give the same bits, bad input is refused, and a rank killed mid-call
makes every other rank's call raise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fireflyer.testing.cases import spread as S
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
SMALL = {"FIREFLYER_HFREDUCE_SPREAD_CHUNK_BYTES": "65536", "FIREFLYER_HFREDUCE_MAILBOX_BYTES": "65536"}
LAYOUTS = {
    "2x2": ([2, 2], SMALL),
    "3x2": ([2, 2, 2], {}),
    "4x2": ([2, 2, 2, 2], {"FIREFLYER_HFREDUCE_SPREAD_CHUNK_BYTES": "131072"}),
    "2+1": ([2, 1], {}),
    "1+2+3": ([1, 2, 3], SMALL),
}
LARGE = 1 << 20  # bytes of the large cases' tensors


HEAVY = {"4x2", "1+2+3"}  # eight and six ranks: the heavy tier (2+1 stays for uneven nodes, 3x2 for three)


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in LAYOUTS],
                ids=list(LAYOUTS))
def cluster(request):
    layout, env = LAYOUTS[request.param]
    with LocalCluster(layout, env={**ENV, **env}) as c:
        yield c


def _cases(world: int) -> list[S.Case]:
    def sizes(kind: str, dtype: torch.dtype) -> list[int]:
        big = LARGE // dtype.itemsize // (world if kind.startswith("rs") else 1)
        return [0, 1, 13, big] if dtype in (torch.float32, torch.bfloat16, torch.int64) else [0, 1, 13, 1009]

    cases = []
    seed = itertools.count()
    for kind in ("ag_tensor", "ag_list", "rs_tensor", "rs_list"):
        for dtype in S.DTYPES:
            cases += [S.Case(kind, dtype, n, seed=next(seed)) for n in sizes(kind, dtype)]
    for root, dtype in itertools.product({0, world - 1, (world // 2 + 1) % world}, S.DTYPES):
        cases += [S.Case("bcast", dtype, n, root=root, seed=next(seed)) for n in sizes("bcast", dtype)]
    for op in ("avg", "min", "max", "product"):
        for dtype in S.DTYPES:
            if op != "avg" or dtype.is_floating_point:
                cases.append(S.Case("rs_tensor", dtype, 13, op, seed=next(seed)))
        cases.append(S.Case("rs_list", torch.bfloat16, 1009, op, seed=next(seed)))
    cases += [S.Case("rs_tensor", torch.bfloat16, LARGE // 2 // world, "avg", seed=next(seed)),
              S.Case("rs_tensor", torch.bfloat16, 4099, fractions=True, seed=next(seed)),
              S.Case("rs_list", torch.float16, 4099, fractions=True, seed=next(seed)),
              S.Case("rs_tensor", torch.float16, 1009, "avg", fractions=True, seed=next(seed))]
    for kind, dtype in itertools.product(("ag_tensor", "ag_list", "bcast", "rs_tensor"), (torch.float64, torch.int32)):
        cases.append(S.Case(kind, dtype, 101, root=world - 1, noncontig=True, seed=next(seed)))
    for kind, dtype in itertools.product(("ag_inplace", "rs_inplace"), (torch.float32, torch.bfloat16)):
        cases += [S.Case(kind, dtype, n, seed=next(seed)) for n in (1, 4099)]
    for kind, dtype in itertools.product(("ag_coalesced", "rs_coalesced"), (torch.float32, torch.bfloat16)):
        cases += [S.Case(kind, dtype, n, seed=next(seed)) for n in (0, 7, 4099)]
    return cases


def test_every_collective_matches_gloo_and_the_reference(cluster):
    results = cluster.run(S.run_cases, _cases(cluster.world_size), timeout=300)
    bad = {r: errs for r, errs in enumerate(results) if errs}
    assert not bad, "\n".join(f"rank {r}: {e}" for r, errs in bad.items() for e in errs[:5])


def test_reruns_give_the_same_bits(cluster):
    """Non-integer floats, so the order of the sums shows: it is fixed (node partials, then nodes in order)."""
    for case in (S.Case("rs_tensor", torch.bfloat16, 3001, fractions=True, seed=3),
                 S.Case("rs_tensor", torch.float32, 3001, "avg", seed=4)):  # avg of integers: a true division
        runs = cluster.run(S.deterministic, case, 3)
        for rank, bits in enumerate(runs):
            assert bits[0] == bits[1] == bits[2], f"rank {rank}: reruns of {case} differ"


@pytest.mark.parametrize("cluster", ["2x2", "3x2", "2+1"], indirect=True)
def test_cross_node_bytes_are_the_minimum(cluster):
    """What leaves each node: allgather (N-1)*L*s, reduce_scatter (N-1)*L*s (fp32 partials), broadcast s per node."""
    layout, world = cluster.layout, cluster.world_size
    n_nodes = len(layout)
    numel = 5003
    s = numel * 4
    for kind in ("all_gather", "reduce_scatter", "broadcast"):
        got = cluster.run(S.cross_bytes, kind, numel)
        assert all(g["ok"] for g in got), (kind, got)
        sent = [g["bytes"] for g in got]
        rank = 0
        for node, size in enumerate(layout):
            out_of_node = sum(sent[rank : rank + size])
            rank += size
            if kind == "all_gather":  # every rank's block once to each other node
                assert out_of_node == size * (n_nodes - 1) * s, (kind, node, sent)
            elif kind == "reduce_scatter":  # the node's partial of every other node's rank's block, once
                assert out_of_node == (world - size) * s, (kind, node, sent)
        if kind == "broadcast":  # once into every node but the root's
            assert sum(sent) == (n_nodes - 1) * s, (kind, sent)
        if kind == "all_gather":
            assert sum(sent) == world * (n_nodes - 1) * s


_FIREFLYERS = {"ValueError": "UserError", "TypeError": "UserTypeError"}
"""fireflyer's subclass of each standard error a rank may name."""


@pytest.mark.parametrize("cluster", ["2x2"], indirect=True)
def test_bad_input_is_refused_before_anything_moves(cluster):
    want = {"ag_size": "ValueError", "ag_dtype": "TypeError", "ag_list_size": "ValueError", "rs_size": "ValueError",
            "rs_dtype": "TypeError", "rs_avg_int": "ValueError", "bcast_root": "ValueError"}
    for rank, seen in enumerate(cluster.run(S.bad_inputs)):
        for name, kind in want.items():
            assert seen[name] is not None and seen[name][0] in (kind, _FIREFLYERS[kind]), (rank, name, seen[name])
        assert seen["after"] == [float(r) for r in range(cluster.world_size)], (rank, seen)


# -- a rank dies mid-call --------------------------------------------------------------------------

TIMEOUT = 6.0
FAULTS = [("all_gather", 3, "silent"), ("reduce_scatter", 1, "silent"), ("reduce_scatter", 2, "mid")]
EXPECTED = ("PeerFailure", "ConnectionLost")  # learnt from the death itself, not from a deadline


@pytest.fixture(scope="module")
def fault_cluster():
    with LocalCluster([2, 2], env=ENV, parent_store=True) as c:
        yield c


@pytest.mark.parametrize("kind, victim, mode", FAULTS, ids=[f"{k}-rank{v}-{m}" for k, v, m in FAULTS])
def test_a_rank_killed_mid_call_makes_every_other_rank_raise(fault_cluster, kind, victim, mode):
    cluster = fault_cluster
    cell = f"spread-fault-{kind}-{mode}"
    world = cluster.world_size
    for r in range(world):
        cluster.submit(r, S.killed_during, cell, kind, victim, TIMEOUT, mode)
    survivors = [r for r in range(world) if r != victim]
    got = cluster.gather(timeout=60, expect=survivors)
    cluster.respawn(victim)
    raised = 0
    for r, (status, rep) in got.items():
        assert status == "ok", (r, rep)
        if rep["raised"] is None:  # only where the victim's bytes had all left it: never a wrong result
            assert mode == "mid" and rep["correct"], (r, rep)
            assert rep["after"] is not None and rep["after_s"] < TIMEOUT - 1.0, (r, rep)  # its next call learns it
            continue
        raised += 1
        assert rep["hfreduce_error"], (r, rep)
        if mode == "silent":  # mid-call, a direct read from the dead rank's memory may be what fails first
            assert rep["raised"] in EXPECTED, (r, rep)
        assert f"rank {victim}" in rep["msg"], (r, rep["msg"])
        assert rep["elapsed"] < TIMEOUT - 1.0, (r, rep)
        assert rep["after"] is not None and rep["after_s"] < 1.0, (r, rep)  # the group stays failed
    assert raised >= (len(survivors) if mode == "silent" else 1), got
