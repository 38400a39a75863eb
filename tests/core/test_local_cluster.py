"""The test harness itself: a rank killed in the middle of an answer silences no other rank."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


def _answer_and_die(ctx, victim: int) -> bytes:
    """The victim dies while its (large) answer is on its way; the others answer normally."""
    if ctx.rank == victim:
        threading.Timer(0.15, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        return b"x" * (256 << 20)
    return bytes([ctx.rank])


def _ping(ctx) -> int:
    return ctx.rank


def test_a_rank_killed_while_answering_leaves_the_others_heard():
    with LocalCluster([3], env={"FIREFLYER_TEST_COMM": "0"}, parent_store=True) as cluster:
        for r in range(3):
            cluster.submit(r, _answer_and_die, 1)
        got = cluster.gather(timeout=60, expect=[0, 2])
        assert got[0] == ("ok", b"\x00") and got[2] == ("ok", b"\x02")
        cluster.respawn(1)
        assert cluster.run(_ping, timeout=60) == [0, 1, 2]


def _env_of(ctx, names: list[str]) -> dict[str, str | None]:
    return {n: os.environ.get(n) for n in names}


def test_ranks_see_the_parents_environment_of_now_and_the_clusters_own(monkeypatch):
    """Ranks fork from a server started once per session; they must still see what the parent set since."""
    monkeypatch.setenv("FIREFLYER_TEST_GONE", "removed-after-the-server-started")
    with LocalCluster([1], env={"FIREFLYER_TEST_COMM": "0"}):
        pass  # the fork server is running from here on
    monkeypatch.setenv("FIREFLYER_TEST_LATE", "set-after-the-server-started")
    monkeypatch.delenv("FIREFLYER_TEST_GONE")
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0", "FIREFLYER_TEST_OWN": "x"}) as cluster:
        got = cluster.run(_env_of, ["FIREFLYER_TEST_LATE", "FIREFLYER_TEST_OWN", "FIREFLYER_TEST_GONE", "RANK"])
    assert got == [{"FIREFLYER_TEST_LATE": "set-after-the-server-started", "FIREFLYER_TEST_OWN": "x",
                    "FIREFLYER_TEST_GONE": None, "RANK": str(r)} for r in range(2)]
