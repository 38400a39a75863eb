"""haiscale DDP with an expert group on real ranks (2 emulated nodes x 2): each gradient averaged over its own group.

EP groups {0, 1}, {2, 3}; the ranks holding the same experts are {0, 2} and {1, 3}. Expert
weights differ between EP ranks; dense weights are the same everywhere.
"""

from __future__ import annotations

import pytest

from fireflyer.testing.cases import ddp_expert as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


def _check(results):
    for rank, r in enumerate(results):
        assert r["start_ok"], f"rank {rank} did not start from its groups' rank-0 values"
        assert r["groups_never_mixed"] and r["labels"] == [0, 1], r
        assert r["rebuilt"], r
        for step in r["steps"]:
            for name, diff in step["diffs"].items():
                if name.startswith("spare.") and rank in (0, 2):
                    assert diff == "both None", (rank, name, diff)  # no rank of {0, 2} used it
                else:
                    assert isinstance(diff, float) and diff < 1e-6, (rank, name, diff)
            # the check can tell: the average over all four ranks is far from the expert grads
            assert all(d > 1e-4 for d in step["vs_all_ranks"].values()), step


def test_expert_grads_average_only_over_their_replicas_on_hfreduce(cluster):
    _check(cluster.run(cases.grads_per_group))


def test_expert_grads_average_only_over_their_replicas_on_gloo(cluster):
    _check(cluster.run(cases.grads_per_group, "gloo"))


def test_without_an_expert_group_replicated_experts_are_plain_ddp_bit_for_bit(cluster):
    assert cluster.run(cases.no_expert_group_is_plain_ddp) == [True] * 4


def test_bad_groups_fail_on_every_rank_with_what_to_pass(cluster):
    for rank, out in enumerate(cluster.run(cases.bad_groups)):
        assert out["not_member"].startswith("UserTypeError") and "expert_process_group" in out["not_member"], out
        assert "placeholder" in out["not_member"]
        assert "no expert_process_group was given" in out["no_group"] and "expert." in out["no_group"], out
        assert "not both" in out["both"], out
        assert "not in process_group" in out["not_inside"] and "subgroup" in out["not_inside"], out
        assert out["group_of_type"].startswith("UserTypeError") and "group_of('" in out["group_of_type"], out
        assert out["group_of_not_callable"].startswith("UserTypeError"), out
        assert "differs across ranks" in out["marks_differ"] and "spare.weight" in out["marks_differ"], out
