"""``fully_shard(order="canonical")`` and ``fsdp_accumulate``: the same global batch gives the bits of one
plain process (a PairwiseAccumulator over the micro-batch gradients, divided by their count) on any number
of shard ranks and nodes, through two AdamW steps; and every misuse gets a clear refusal."""

from __future__ import annotations

import pytest

from fireflyer.testing.cases import canonical_fsdp as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0"}
STEPS = 2
GLOBAL = 8  # micro-batches per step
UNITS = 3  # the GPT's two blocks and its root


def _one_answer(results: list[dict]) -> dict:
    assert len({(tuple(r["losses"]), tuple(r["grads"]), r["weights"]) for r in results}) == 1, results
    return results[0]


def _reference(total: int, dtype: str = "float32") -> dict:
    with LocalCluster([1], env=ENV) as cluster:
        return cluster.run(cases.one_process, total, STEPS, dtype)[0]


def _same_bits(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["grads"] == want["grads"]
    assert got["weights"] == want["weights"]


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _reference(GLOBAL)


@pytest.mark.parametrize("layout", [pytest.param([1], marks=pytest.mark.heavy), pytest.param([2], marks=pytest.mark.heavy),
                                    [4], [2, 2]], ids=["1x1", "1x2", "1x4", "2x2"])
def test_every_layout_gives_the_bits_of_one_process(layout, one_process):
    ranks = sum(layout)
    with LocalCluster(layout, env=ENV) as cluster:
        got = _one_answer(cluster.run(cases.train, GLOBAL // ranks, STEPS, timeout=300))
    _same_bits(got, one_process)
    if ranks > 1:  # each unit's reduce-scatter of each micro-batch ran while backward went on
        backwards = GLOBAL // ranks * STEPS
        assert got["stats"] == {"overlapped": UNITS * backwards, "synchronous": 0, "backwards": backwards}


def test_a_rank_may_hold_any_number_of_micro_batches():
    """12 micro-batches on 4 ranks: 3 each, interleaved, still the tree over all 12."""
    want = _reference(12)
    with LocalCluster([4], env=ENV) as cluster:
        _same_bits(_one_answer(cluster.run(cases.train, 3, STEPS, timeout=300)), want)


def test_bf16_weights_sum_in_fp32_and_round_once():
    """The wrapper class, with synchronous reduce-scatters, on bf16 weights."""
    want = _reference(4, "bfloat16")
    with LocalCluster([2], env=ENV) as cluster:
        got = _one_answer(cluster.run(cases.train, 2, STEPS, "canonical", "bfloat16", True, timeout=300))
    _same_bits(got, want)
    assert got["stats"]["synchronous"] > 0 and got["stats"]["overlapped"] == 0


@pytest.mark.heavy  # what the canonical order is for, shown; the default tier checks the canonical bits
def test_the_fast_order_depends_on_the_layout(one_process):
    """The control: FSDP2's own accumulation (each loss divided by m, the ranks' average) agrees with one
    process to rounding, but not in its bits, so the tests above can fail."""
    with LocalCluster([4], env=ENV) as cluster:
        got = _one_answer(cluster.run(cases.train, GLOBAL // 4, STEPS, "fast", timeout=300))
    assert got["grads"][0] != one_process["grads"][0]
    for a, b in zip(got["losses"], one_process["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_misuse_is_refused_and_the_model_keeps_working():
    with LocalCluster([4], env=ENV) as cluster:
        results = cluster.run(cases.refusals, timeout=200)
    for rank, out in enumerate(results):
        assert out["order"] == "UserError: order must be one of ['fast', 'canonical'], got 'tree'"
        assert "needs a process_group that sums in the canonical order, but this hfreduce group" in out["fast group"]
        assert "this gloo group does not" in out["gloo group"]
        if rank < 3:
            assert out["three ranks"].startswith("UserError: order='canonical' needs a power-of-two number of shard "
                                                 "ranks (1, 2, 4, 8, ...), but the group has 3")
        for name, dtypes in (("reduce_dtype", "param_dtype=None, reduce_dtype=torch.float32"),
                             ("param_dtype", "param_dtype=torch.bfloat16, reduce_dtype=None")):
            assert out[name].startswith("UserError: order='canonical' sums gradients in the parameters' own dtype")
            assert dtypes in out[name]
        for name in ("optimizer", "optimizer later"):
            assert out[name].startswith("UserError: order='canonical' steps the optimizer once per fsdp_accumulate()")
        assert out["plain forward"].startswith("UsageError: this model sums gradients in the canonical order")
        assert out["evaluation"] == "no error"
        assert out["unequal"].startswith("UserError: ranks hold between 1 and 2 micro-batches in this step")
        assert out["none"] == "UserError: fsdp_accumulate() needs at least one micro-batch"
        assert out["not a list"].startswith("UserTypeError: micro_batches must be a sequence")
        assert out["vector loss"] == ("UserTypeError: loss_fn must return a scalar tensor; "
                                      "micro-batch 0 gave a tensor of shape (2,)")
        assert out["after refusals"] == "no error"
        assert out["grads"] == "True"
