"""send/recv, all_to_all, gather and scatter on "hfreduce", against gloo on the same inputs, in several layouts.

Every case runs on an hfreduce default group and on a gloo group of the same ranks, and
the bytes received must be the same: sizes 0, 1, primes and large (beyond a mailbox
ring), every dtype, uneven splits (zeros included), non-contiguous tensors, world sizes
1 to 8 on one or several emulated nodes, with synchronous calls driven in the compiled core, and in
2 x 2 with two ranks driving them in Python against two in the core. Point-to-point runs in the patterns the
pipeline uses: both sides sending first in one batch_isend_irecv, blocking pairs, many
messages in flight, tags received out of order, and a rank sending to itself.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fireflyer.testing.cases.exchange import DTYPES, SIZES, Case, isend_returns_at_once, run_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
LAYOUTS = {
    "1": [1],
    # the /dev/shm file fallback, and rings so small that every transfer wraps around them many times
    "1x2": ([2], {"FIREFLYER_HFREDUCE_ARENA": "file", "FIREFLYER_HFREDUCE_MAILBOX_BYTES": "8192"}),
    "1x4": [4],
    "2x1": [1, 1],
    "2x2": ([2, 2], {"FIREFLYER_HFREDUCE_MAILBOX_BYTES": "65536"}),
    # ranks 1 and 2 drive their synchronous calls in Python (transport/progress.py), 0 and 3 in the compiled
    # core: each side of every ring and socket meets the other drive, and the bytes must still be gloo's
    "2x2-mixed": ([2, 2], {"FIREFLYER_HFREDUCE_MAILBOX_BYTES": "65536"},
                  {1: {"FIREFLYER_HFREDUCE_CORE_EXCHANGE": "0"}, 2: {"FIREFLYER_HFREDUCE_CORE_EXCHANGE": "0"}}),
    "3x1": [1, 1, 1],
    "3+2+1": [3, 2, 1],
    "4x2": [2, 2, 2, 2],
}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.heavy) if n == "4x2" else n for n in LAYOUTS],
                ids=list(LAYOUTS))  # eight ranks: the heavy tier (3+2+1 stays for three uneven nodes)
def cluster(request):
    spec = LAYOUTS[request.param]
    layout, env, rank_envs = (*spec, {})[:3] if isinstance(spec, tuple) else (spec, {}, {})
    with LocalCluster(layout, env={**ENV, **env}, rank_envs=rank_envs) as c:
        yield c


def _check(cluster: LocalCluster, cases: list[Case], timeout: float = 300) -> None:
    results = cluster.run(run_cases, cases, timeout=timeout)
    bad = {r: errs for r, errs in enumerate(results) if errs}
    assert not bad, "\n".join(f"rank {r}: {e}" for r, errs in bad.items() for e in errs[:5])


def test_all_to_all_single_even_and_uneven_every_dtype(cluster):
    cases = [Case(kind, dtype, n, seed=i) for i, (kind, dtype, n) in enumerate(
        itertools.product(["a2a_even", "a2a_uneven"], DTYPES, [0, 1, 13]))]
    cases += [Case(kind, torch.float32, n, seed=i, cols=c) for i, (kind, n, c) in enumerate(
        itertools.product(["a2a_even", "a2a_uneven"], SIZES, [1, 3]))]
    cases += [Case("a2a_uneven", torch.bfloat16, 1009, seed=5, cols=2, noncontig=True),
              Case("a2a_even", torch.int64, 101, seed=6, noncontig=True)]
    _check(cluster, cases)


def test_all_to_all_lists_gather_and_scatter(cluster):
    world = cluster.world_size
    cases = [Case("a2a_list", dtype, n, seed=i) for i, (dtype, n) in enumerate(itertools.product(DTYPES, [0, 7]))]
    cases += [Case("a2a_list_uneven", dtype, n, seed=i, noncontig=i % 3 == 0)
              for i, (dtype, n) in enumerate(itertools.product(DTYPES, [1, 13]))]
    cases += [Case(kind, torch.float32, n, seed=i) for i, (kind, n) in enumerate(
        itertools.product(["a2a_list", "a2a_list_uneven"], SIZES))]
    for kind in ("gather", "scatter"):
        cases += [Case(kind, dtype, n, seed=i, root=i % world) for i, (dtype, n) in enumerate(
            itertools.product(DTYPES, [0, 1, 101]))]
        cases += [Case(kind, torch.float64, n, seed=i, root=world - 1, noncontig=i % 2 == 1)
                  for i, n in enumerate(SIZES)]
    _check(cluster, cases)


def test_point_to_point_patterns(cluster):
    cases = [Case(kind, dtype, n, seed=i) for i, (kind, dtype, n) in enumerate(
        itertools.product(["ring", "pairs", "tags", "self"], [torch.float32, torch.bfloat16, torch.bool,
                                                              torch.complex64, torch.int64], [0, 1, 101]))]
    cases += [Case(kind, torch.float32, n, seed=i) for i, (kind, n) in enumerate(
        itertools.product(["ring", "pairs", "many"], [7, 1009, 65537]))]
    _check(cluster, cases)


def test_large_transfers_overlap_without_deadlock(cluster):
    """Beyond a ring (and a socket buffer) in both directions at once: the receivers drain while senders fill."""
    big = (3 << 20) // max(1, cluster.world_size)  # float32 elements per piece: MiBs per transfer
    cases = [Case("ring", torch.float32, 3 << 20, seed=1), Case("a2a_even", torch.float32, big, seed=2),
             Case("a2a_uneven", torch.float16, big // 8, seed=3, cols=4), Case("gather", torch.int32, big, root=0),
             Case("scatter", torch.float64, big // 2, root=cluster.world_size - 1)]
    _check(cluster, cases)


def test_isend_returns_before_the_receiver_posts(cluster):
    if cluster.world_size == 1:
        pytest.skip("needs two ranks")
    got = cluster.run(isend_returns_at_once, 32 << 20)
    assert got[-1]["ok"]
    assert got[0]["posted_s"] < 0.5, got[0]  # the caller got its Work back at once
    assert got[0]["done_s"] >= 0.9, got[0]  # and it completed only once the receiver took the bytes
