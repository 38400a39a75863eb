"""The fault matrix, through the doors torch users use: a failed collective raises on every survivor.

What goes wrong: a peer killed between collectives, a peer killed during one, a rank
that never arrives, and calls that disagree in size, dtype or op. How it is called:
``dist.all_reduce`` synchronously, ``async_op=True`` then ``wait()``, and
``get_future().wait()``, and functional collectives. Through whom: plain calls, torch DDP, FSDP2 ``fully_shard``,
haiscale DDP and ``dist.barrier``. Layouts: 1 node x 4, 2 x 2, and 3 + 1.

Every cell checks, on every survivor: the call raised (never returned a tensor), with
the engine's error class and the culprit's rank in the message, within the timeout;
afterwards every style raises at once (a failed group stays failed); and
``destroy_process_group()`` cleans up, after which the next cell makes a new group
on the same processes (the killed rank is started again).
"""

from __future__ import annotations

import itertools
import re
import time

import pytest

from fireflyer.testing.cases import torch_faults as F
from fireflyer.testing.cluster import ClusterPool, LocalCluster

pytestmark = pytest.mark.multiproc

TIMEOUT = 3.0  # the group's timeout in plain cells
WRAPPED_TIMEOUT = 6.0  # model steps on 4 ranks sharing 2 cores take longer
SLACK = 10.0  # proves "raised by the timeout, did not hang"; generous, since 4 ranks share 2 loaded cores
ENV = {"FIREFLYER_TEST_COMM": "0", "FIREFLYER_HFREDUCE_CHUNK_BYTES": "262144", "OMP_NUM_THREADS": "1"}
LAYOUTS = {"1x4": [4], "2x2": [2, 2], "3+1": [3, 1]}
EXPECTED = {"between": "PeerFailure", "during": "PeerFailure", "absent": "CollectiveTimeout", "aborts": "PeerFailure",
            "size": "CollectiveMismatch", "dtype": "CollectiveMismatch", "op": "CollectiveMismatch",
            "node_size": "CollectiveMismatch"}

# (layout, door, fault, style or wrapper, victim)
CELLS = [
    # plain dist.all_reduce: every fault in every style, spread over the layouts
    ("1x4", "plain", "between", "sync", 2), ("1x4", "plain", "between", "async", 0), ("1x4", "plain", "between", "future", 3),
    ("1x4", "plain", "during", "sync", 1), ("1x4", "plain", "during", "async", 3), ("1x4", "plain", "during", "future", 2),
    ("2x2", "plain", "between", "sync", 3), ("2x2", "plain", "between", "async", 0), ("2x2", "plain", "between", "future", 2),
    ("2x2", "plain", "during", "sync", 0), ("2x2", "plain", "during", "async", 3), ("2x2", "plain", "during", "future", 1),
    ("3+1", "plain", "between", "sync", 3), ("3+1", "plain", "during", "sync", 3),  # its async and future styles: heavy
    pytest.param(("3+1", "plain", "between", "async", 1), marks=pytest.mark.heavy),
    pytest.param(("3+1", "plain", "between", "future", 0), marks=pytest.mark.heavy),
    pytest.param(("3+1", "plain", "during", "async", 0), marks=pytest.mark.heavy),
    pytest.param(("3+1", "plain", "during", "future", 3), marks=pytest.mark.heavy),
    ("1x4", "plain", "absent", "future", 3), ("2x2", "plain", "absent", "sync", 2), ("3+1", "plain", "absent", "async", 3),
    ("1x4", "plain", "size", "sync", 0), ("1x4", "plain", "dtype", "async", 3), ("1x4", "plain", "op", "future", 3),
    ("2x2", "plain", "size", "sync", 0), ("2x2", "plain", "dtype", "sync", 3), ("2x2", "plain", "op", "async", 3),
    ("3+1", "plain", "size", "sync", 3),
    ("2x2", "plain", "node_size", "sync", 2),  # every rank of the victim's node: only the trees' frames can tell
    ("2x2", "plain", "aborts", "async", 2),  # a rank calls ProcessGroup.abort()
    # functional collectives (what DTensor calls)
    ("2x2", "plain", "between", "funcol", 1), ("1x4", "plain", "during", "funcol", 0),
    ("3+1", "plain", "absent", "funcol", 3), ("2x2", "plain", "size", "funcol", 0),
    # dist.barrier
    ("1x4", "plain", "absent", "barrier", 1), ("2x2", "plain", "between", "barrier", 1),
    ("3+1", "plain", "during", "barrier-async", 3),
    # training wrappers: each of torch DDP, FSDP2 and haiscale DDP meets each kind of death or absence
    ("1x4", "wrapped", "during", "ddp", 2), ("1x4", "wrapped", "absent", "fsdp", 3), ("1x4", "wrapped", "between", "haiscale", 1),
    ("2x2", "wrapped", "between", "ddp", 3), ("2x2", "wrapped", "during", "fsdp", 1), ("2x2", "wrapped", "absent", "haiscale", 2),
    # (3+1 is heavy: its plain cells above cover the uneven layout)
    pytest.param(("3+1", "wrapped", "absent", "ddp", 3), marks=pytest.mark.heavy),
    pytest.param(("3+1", "wrapped", "between", "fsdp", 2), marks=pytest.mark.heavy),
    pytest.param(("3+1", "wrapped", "during", "haiscale", 3), marks=pytest.mark.heavy),
]
_names = itertools.count()


def _id(cell) -> str:
    layout, door, fault, how, victim = getattr(cell, "values", (cell,))[0]
    return f"{layout}-{door}-{fault}-{how}-rank{victim}"


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    pool = ClusterPool(LAYOUTS, env=dict(ENV, FIREFLYER_HFREDUCE_TRACE_DIR=str(tmp_path_factory.mktemp("trace"))))
    yield pool.get
    pool.close()


def _run_cell(cluster: LocalCluster, fn, args: tuple, victim: int, fault: str, timeout: float) -> dict[int, dict]:
    name = f"cell{next(_names)}"
    world = cluster.world_size
    assert cluster.run(F.join, name, timeout, timeout=60) == [float(world)] * world
    for r in range(world):
        cluster.submit(r, fn, *args)
    dies = fault in ("between", "during")
    survivors = [r for r in range(world) if not (dies and r == victim)]
    seen = [r for r in survivors if not (fault == "absent" and r == victim)]
    got = cluster.gather(timeout=60, expect=seen)
    if fault == "absent":
        cluster.store.set(f"{name}/release", "1")
        got.update(cluster.gather(timeout=60, expect=[victim]))
    if fault in ("absent", "aborts"):
        assert got[victim] == ("ok", got[victim][1]) and got[victim][1]["victim"], got[victim]
        del got[victim]
    if dies:
        cluster.respawn(victim)
    for r, (status, value) in got.items():
        assert status == "ok", (r, value)
    return {r: value for r, (_, value) in got.items()}


KINDS = {"PeerFailure": ("PeerFailure", "ConnectionLost"),  # a lost link is a PeerFailure too
         "CollectiveTimeout": ("CollectiveTimeout",), "CollectiveMismatch": ("CollectiveMismatch",)}


def _raised(report: dict, expected: str) -> bool:
    """The engine's class, or (through a torch future or DDP's C++ reducer) a RuntimeError carrying it."""
    kinds = KINDS[expected]
    return report["raised"] in kinds or (
        report["raised"] == "RuntimeError" and any(f"{k}:" in report["msg"] for k in kinds))


def _check(reports: dict[int, dict], fault: str, victim: int, limit: float) -> None:
    expected = EXPECTED[fault]
    for r, rep in reports.items():
        assert rep["raised"] is not None, f"rank {r}: the call returned (tensor correct: {rep.get('correct')})"
        assert _raised(rep, expected), (r, rep["raised"], rep["msg"][:400])
        if fault in ("between", "during", "absent", "aborts"):
            assert re.search(rf"\brank {victim}\b", rep["msg"]), (r, rep["msg"][:400])
        else:
            assert "mismatch" in rep["msg"], (r, rep["msg"][:400])
        assert rep["elapsed"] < limit + SLACK, (r, rep["elapsed"])
        assert rep.get("wrong", 0) == 0, (r, rep)  # collectives that returned before the death held the right sum
        after = rep["after"]
        for style in ("sync", "async", "future", "barrier"):
            kind, took = after[style]
            assert kind != "returned", (r, style, after)  # never computes with fewer ranks
            assert took < 1.0, (r, style, after)  # and fails at once
        completed, success, exc = after["work_state"]
        assert completed and not success and exc != "NoneType", (r, after["work_state"])
        assert rep["destroy_s"] < 10, (r, rep["destroy_s"])


@pytest.mark.parametrize("cell", CELLS, ids=[_id(c) for c in CELLS])
def test_a_failed_collective_raises_on_every_survivor(clusters, cell):
    layout, door, fault, how, victim = cell
    cluster = clusters(layout)
    if door == "plain":
        reports = _run_cell(cluster, F.plain, (fault, how, victim), victim, fault, TIMEOUT)
        _check(reports, fault, victim, TIMEOUT)
    else:
        # a death is found by its peers, not by the timeout: only the absent cells give the group the short one
        group_timeout = WRAPPED_TIMEOUT if fault == "absent" else 60.0
        reports = _run_cell(cluster, F.wrapped, (how, fault, victim), victim, fault, group_timeout)
        _check(reports, fault, victim, WRAPPED_TIMEOUT)
    assert len(reports) == cluster.world_size - (fault in ("between", "during", "absent", "aborts"))


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_a_collective_already_done_returns_though_a_peer_fails_the_group_right_after(clusters, layout):
    """Rank 0 aborts as soon as its all_reduce returns. Its node peers' copies of that all_reduce
    (their result already in the arena, its last chunks perhaps still being copied out) return the
    right sum; their next call raises. Several cells, since who finishes first is up to the scheduler."""
    cluster = clusters(layout)
    world = cluster.world_size
    peers = [1] if layout == "2x2" else [1, 2, 3]  # rank 0's node; in 2x2 the other node may see either
    for _ in range(4):
        reports = _run_cell(cluster, F.abort_right_after, (1 << 20,), 0, "aborts", TIMEOUT)
        assert len(reports) == world - 1
        for r, rep in reports.items():
            if r in peers:
                assert rep["raised"] is None and rep["correct"], (r, rep["raised"], rep["msg"][:400])
            else:  # the other node's ranks: the right sum, or the abort by name; never a wrong sum
                assert rep["correct"] if rep["raised"] is None else _raised(rep, "PeerFailure"), (r, rep)
            assert all(rep["after"][s][0] != "returned" for s in ("sync", "async", "future", "barrier")), (r, rep)


@pytest.mark.parametrize("how", ["wait", "opts"])
def test_a_per_call_timeout_is_honoured_and_names_the_rank_waited_for(clusters, how):
    """``work.wait(timeout)`` and the options' timeout cut a collective short long before the group's 60 s."""
    cluster = clusters("2x2")
    victim, limit = 1, 1.5
    reports = _run_cell(cluster, F.timed, (how, victim, limit), victim, "absent", 60.0)
    for r, rep in reports.items():
        assert _raised(rep, "CollectiveTimeout"), (r, rep)
        assert re.search(rf"\brank {victim}\b", rep["msg"]), (r, rep["msg"])
        assert limit - 0.1 < rep["elapsed"] < limit + SLACK, (r, rep["elapsed"])
        assert all(kind != "returned" for kind, _ in (rep["after"][s] for s in ("sync", "async", "future", "barrier")))


def test_the_reported_case_a_dead_peer_never_hands_back_an_unreduced_tensor(clusters):
    """The report that started it: rank 3 exits, survivors call all_reduce on 4 Mi ones 1,000 times."""
    cluster = clusters("2x2")
    reports = _run_cell(cluster, F.hammer, (3, 1000), 3, "between", TIMEOUT)
    for r, (returned, first_error, depths) in reports.items():
        assert returned == 0, (r, returned)  # not one call handed back a tensor
        assert first_error.startswith("PeerFailure") and re.search(r"\brank 3\b", first_error), (r, first_error)
        assert len(depths) == 2 and depths[1] <= depths[0], (r, depths)  # each error is its own, not one regrown


@pytest.mark.parametrize("absent,wait_all", [([2], False), ([1, 3], True)], ids=["first", "all"])
def test_monitored_barrier_names_the_ranks_that_stayed_away_and_leaves_the_group_usable(clusters, absent, wait_all):
    cluster = clusters("2x2")
    name = f"cell{next(_names)}"
    assert cluster.run(F.join, name, 30.0, timeout=60) == [4.0] * 4
    seconds = 3.0  # the present ranks meet on the store first; this is the barrier's own wait for the absent
    for r in range(4):
        cluster.submit(r, F.monitored, absent, wait_all, seconds)
    got = cluster.gather(timeout=60, expect=range(4))
    which = "Rank 2" if not wait_all else "Ranks 1, 3"
    for r, (status, rep) in got.items():
        assert status == "ok", (r, rep)
        assert rep["after"] == 4.0, (r, rep)  # the engine's group still works for everyone
        if r in absent:
            continue
        assert rep["raised"] == "CollectiveTimeout", (r, rep)
        assert f"{which} failed to pass monitoredBarrier in {seconds * 1000:.0f} ms" in rep["msg"], (r, rep["msg"])


def test_the_flight_recorder_dump_names_the_dead_rank_to_torchs_analyzer_and_to_ours(clusters, tmp_path, caplog):
    """Rank 3 dies in the middle of back-to-back allreduces; the survivors' dumps say who everyone waited for."""
    import json
    import logging
    import subprocess
    import sys

    from torch.distributed.flight_recorder import fr_trace

    cluster = clusters("2x2")
    name = f"cell{next(_names)}"
    folder = tmp_path / "trace"
    assert cluster.run(F.join, name, TIMEOUT, str(folder), timeout=60) == [4.0] * 4
    for r in range(4):
        cluster.submit(r, F.plain, "during", "async", 3)
    got = cluster.gather(timeout=60, expect=[0, 1, 2])
    cluster.respawn(3)
    assert all(rep["raised"] for _, rep in got.values()), got
    want = ["hfreduce_trace_rank_0", "hfreduce_trace_rank_1", "hfreduce_trace_rank_2"]
    deadline = time.monotonic() + 30  # the dumps are written in the background
    while sorted(p.name for p in folder.glob("hfreduce_trace_rank_*")) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(p.name for p in folder.glob("hfreduce_trace_rank_*")) == want

    with pytest.raises(AssertionError, match=r"Missing dump files from ranks \{3\}"):
        fr_trace.main([str(folder)])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="Flight Recorder"):
        fr_trace.main([str(folder), "--allow-incomplete-ranks"])
    assert "missed FR dumps from ranks ({3})" in caplog.text

    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "hfreduce", "trace", str(folder), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    groups = json.loads(done.stdout)["groups"]
    world = next(g for g in groups if g["dumped"] == [0, 1, 2])
    assert world["missing"] == [3]
    assert [s["rank"] for s in world["waited_for"]] == [3], world["waited_for"]


def test_a_group_made_by_init_process_group_keeps_the_launchers_secret_out_of_the_store(clusters):
    """The launcher (here LocalCluster, as fireflyer train and the platform do) sets FIREFLYER_JOB_SECRET:
    any client of the store could read a secret kept there, and now there is none."""
    cluster = clusters("2x2")
    assert cluster.run(F.join, f"cell{next(_names)}", TIMEOUT, timeout=60) == [4.0] * 4
    assert cluster.run(F.store_keys) == [{"salt": True, "secret": False}] * 4
