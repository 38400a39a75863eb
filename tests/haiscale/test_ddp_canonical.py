"""``DistributedDataParallel(order="canonical").accumulate``: the same global batch gives the same bits
on one rank and on many, whatever the node layout; and every misuse gets a clear refusal."""

from __future__ import annotations

import pytest

from fireflyer.testing.cases import canonical_ddp as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

STEPS = 3
GLOBAL = 8  # micro-batches per step


def _one_answer(results: list[dict]) -> dict:
    assert len({(tuple(r["losses"]), tuple(r["grads"]), r["weights"]) for r in results}) == 1, results
    return results[0]


@pytest.fixture(scope="module")
def one_process() -> dict:
    with LocalCluster([1], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        return _one_answer(cluster.run(cases.train, GLOBAL, STEPS))


@pytest.mark.parametrize("layout", [[2], [4], [2, 2], pytest.param([2, 2, 2, 2], marks=pytest.mark.heavy)],
                         ids=["2", "4", "2+2", "2+2+2+2"])
def test_every_layout_gives_the_bits_of_one_process(layout, one_process):
    ranks = sum(layout)
    with LocalCluster(layout, env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        got = _one_answer(cluster.run(cases.train, GLOBAL // ranks, STEPS, timeout=300))
    assert got["losses"] == one_process["losses"]
    assert got["grads"] == one_process["grads"]
    assert got["weights"] == one_process["weights"]
    assert got["buckets"] > 3 and got["stats"]["steps"] == STEPS


def test_bf16_weights_too():
    with LocalCluster([1], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        alone = _one_answer(cluster.run(cases.train, 4, 2, "canonical", "bfloat16"))
    with LocalCluster([1, 1], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        spread = _one_answer(cluster.run(cases.train, 2, 2, "canonical", "bfloat16"))
    assert spread == {**alone, "stats": spread["stats"]}


@pytest.mark.heavy  # what the canonical order is for, shown; the default tier checks the canonical bits
def test_the_fast_order_depends_on_the_layout(one_process):
    """The control: the usual accumulation (each loss divided by m, the ranks' average) agrees with one
    process to rounding, but not in its bits, so the test above can fail."""
    with LocalCluster([4], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        got = _one_answer(cluster.run(cases.train, 2, STEPS, "fast"))
    assert got["grads"] != one_process["grads"]
    for a, b in zip(got["losses"], one_process["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_misuse_is_refused_and_the_ddp_keeps_working():
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        results = cluster.run(cases.refusals, timeout=120)
    for out in results:
        assert out["order"].startswith("UserError: order must be one of ['fast', 'canonical'], got 'tree'")
        assert "needs a process_group that sums in the canonical order, but this hfreduce group" in out["fast group"]
        assert "this gloo group does not" in out["gloo group"]
        assert out["reduce_dtype"].startswith("UserError: order='canonical' keeps partial sums in fp32")
        assert out["plain forward"].startswith("UsageError: this DDP sums in the canonical order")
        assert out["three each"].startswith("UserError: 3 micro-batches per rank")
        assert out["unequal"].startswith("UserError: ranks hold between 1 and 2 micro-batches in this step")
        assert out["none"] == "UserError: accumulate() needs at least one micro-batch"
        assert out["not a list"].startswith("UserTypeError: micro_batches must be a sequence")
        assert out["vector loss"] == ("UserTypeError: loss_fn must return a scalar tensor; "
                                      "micro-batch 0 gave a tensor of shape (5,)")
        assert out["after refusals"] == "no error"
        assert out["grads changed"] == "True"
