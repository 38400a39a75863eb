"""Expert-parallel MoE on real ranks (2 emulated nodes x 2, EP=2 inside each node x DP=2 across):
equal to the same MoE in one process on the concatenated batch, on hfreduce and on gloo groups."""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases import moe as moe_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc

STEPS = 4


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster):
    return moe_cases.reference(STEPS, cluster.world_size)


@pytest.mark.parametrize("backend", ["hfreduce", "gloo"])
def test_ep_training_equals_one_process_on_the_whole_batch(cluster, reference, backend):
    results = cluster.run(moe_cases.train_ep, STEPS, backend)
    want = reference
    for rank, got in enumerate(results):
        for step in range(STEPS):
            torch.testing.assert_close(got["outputs"][step], want["outputs"][step][rank], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["input_grads"][step], want["input_grads"][step][rank], rtol=1e-5,
                                       atol=1e-5)
            # the same routing: the EP group's per-expert tokens are the two ranks' share of the reference's
            assert torch.equal(got["loads"][step], want["loads"][step]), (rank, step)
        experts = got["global"]
        assert experts == list(range(4 * (rank % 2), 4 * (rank % 2) + 4))
        for name, value in got["params"].items():
            ref = want["params"][name]
            if name.startswith("experts."):
                ref = ref[experts[0]:experts[-1] + 1]  # this rank's slice of the unsharded layer
            torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
        assert got["a2a"]["calls"] == 5 and got["a2a"]["bytes_sent"] > 0 and got["a2a"]["seconds"] > 0
    # what the ranks sent is what they received
    assert sum(r["a2a"]["bytes_sent"] for r in results) == sum(r["a2a"]["bytes_received"] for r in results)
    # each step's loss on the whole batch is the mean of the ranks' losses (equal batches)
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - want["losses"][step]) < 1e-5, (step, mean, want["losses"][step])
    # the bias moved, identically on every rank, and as in one process
    assert not torch.equal(want["params"]["expert_bias"], torch.zeros(8))
    # the tokens per expert each EP group reports add up to the reference's
    for step in range(STEPS):
        total = [a + b for a, b in zip(results[0]["tokens"][step], results[2]["tokens"][step])]
        assert total == want["tokens"][step]
        assert results[0]["tokens"][step] == results[1]["tokens"][step]


@pytest.mark.parametrize("backend", ["hfreduce", "gloo"])
@pytest.mark.parametrize("scope", ["ep", "world"])
def test_dispatch_backward_is_the_reverse_exchange(cluster, backend, scope):
    assert cluster.run(moe_cases.dispatch_backward, backend, scope) == [[]] * cluster.world_size


def test_ep_that_does_not_divide_the_experts_is_refused(cluster):
    for msg in cluster.run(moe_cases.bad_ep):
        assert msg == "EP (2) does not divide the expert count (7); use an EP size that divides n_routed", msg
