"""Faults on the point-to-point doors: a failed send/recv/all_to_all raises on every survivor, by name, in time.

What goes wrong: a peer killed while the others wait in ``recv`` from it, or in a
synchronous all_to_all_single that drives its channels on the caller's thread (PeerFailure
naming it, long before the timeout), a peer that never sends or never joins (CollectiveTimeout
naming it, at the group's timeout), a ``work.wait(timeout)`` that expires, and calls
that disagree (a send of another size or dtype than the receive, all_to_all_single
splits that do not match): CollectiveMismatch. Afterwards the group stays failed: every
kind of call raises at once. Layouts: one node (mailboxes), two nodes of one rank
(TCP), and 2 x 2 (both).
"""

from __future__ import annotations

import itertools

import pytest

from fireflyer.testing import shm
from fireflyer.testing.cases import exchange as X
from fireflyer.testing.cluster import ClusterPool

pytestmark = pytest.mark.multiproc

TIMEOUT = 4.0
ENV = {"FIREFLYER_TEST_COMM": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
LAYOUTS = {"1x2": [2], "2x1": [1, 1], "2x2": [2, 2]}
EXPECTED = {"killed": ("PeerFailure", "ConnectionLost"), "absent": ("CollectiveTimeout",),
            "a2a_killed": ("PeerFailure", "ConnectionLost"), "a2a_absent": ("CollectiveTimeout",),
            "size": ("CollectiveMismatch",), "dtype": ("CollectiveMismatch",), "a2a_split": ("CollectiveMismatch",)}
CELLS = [("1x2", "killed", 1), ("2x1", "killed", 0), ("2x2", "killed", 3), ("2x2", "killed", 0),
         ("1x2", "absent", 0), ("2x1", "absent", 1), ("2x2", "absent", 2),
         ("1x2", "size", 1), ("2x1", "dtype", 0), ("2x2", "size", 2), ("2x2", "a2a_split", 1),
         ("2x2", "a2a_killed", 2), ("1x2", "a2a_killed", 0), ("2x2", "a2a_absent", 1)]
_names = itertools.count()


@pytest.fixture(scope="module")
def clusters():
    pool = ClusterPool(LAYOUTS, env=ENV)
    yield pool.get
    pool.close()


@pytest.mark.parametrize("layout, what, victim", CELLS, ids=[f"{l}-{w}-rank{v}" for l, w, v in CELLS])
def test_a_fault_raises_on_every_survivor_by_name_and_the_group_stays_failed(clusters, layout, what, victim):
    cluster = clusters(layout)
    cell = f"xfault{next(_names)}"
    world = cluster.world_size
    for r in range(world):
        cluster.submit(r, X.fault, cell, what, victim, TIMEOUT)
    dies, absent = what in ("killed", "a2a_killed"), what in ("absent", "a2a_absent")
    # who must see the fault in the call itself: the receivers (of the bad piece, for the splits)
    waiting = [(victim + 1) % world] if what == "a2a_split" else [r for r in range(world) if r != victim]
    got = cluster.gather(timeout=60, expect=[r for r in range(world) if not (dies or absent) or r != victim])
    if absent:
        cluster.store.set(f"{cell}/release", "1")
        got.update(cluster.gather(timeout=60, expect=[victim]))
        assert got.pop(victim)[1]["victim"]
    if dies:
        cluster.respawn(victim)
    for r, (status, rep) in got.items():
        assert status == "ok", (r, rep)
        for call, (raised, elapsed) in rep["after"].items():  # whatever its own call did, the group has failed
            assert raised is not None and elapsed < 1.0, (r, call, raised, elapsed)
        if r not in waiting:
            continue  # the sender of a mismatch: its own call may well have gone through
        assert rep["raised"] in EXPECTED[what], (r, rep)
        assert f"rank {victim}" in rep["msg"], (r, rep["msg"])
        limit = TIMEOUT + 3.0 if absent else TIMEOUT
        assert rep["elapsed"] < limit, (r, rep)
        if absent:
            assert rep["elapsed"] > TIMEOUT - 0.5, (r, rep)
        assert rep["destroy_s"] < 5.0, (r, rep)


@pytest.mark.parametrize("layout", ["1x2", "2x1"])
def test_a_wait_timeout_fails_the_group_with_collective_timeout(clusters, layout):
    cluster = clusters(layout)
    cell = f"xwait{next(_names)}"
    victim = cluster.world_size - 1
    for r in range(cluster.world_size):
        cluster.submit(r, X.wait_timeout, cell, victim)
    got = cluster.gather(timeout=60, expect=[r for r in range(cluster.world_size) if r != victim])
    cluster.store.set(f"{cell}/release", "1")
    cluster.gather(timeout=60, expect=[victim])
    for r, (status, rep) in got.items():
        assert status == "ok", rep
        assert rep["raised"] == "CollectiveTimeout" and f"receiving from rank {victim}" in rep["msg"], rep
        assert 1.0 < rep["elapsed"] < 4.0, rep
        assert all(raised for raised, _ in rep["after"].values()), rep


def test_no_thread_or_shared_memory_is_left_after_destroy(clusters):
    cluster = clusters("2x2")
    before = shm.segments()
    got = cluster.run(X.threads_and_shm, timeout=60)
    for r, rep in enumerate(got):
        assert rep["out"] == [float(p) for p in range(cluster.world_size)]
        assert rep["threads"] == [], (r, rep["threads"])
    assert not shm.left_behind(before, ("fireflyer-hfr",))
