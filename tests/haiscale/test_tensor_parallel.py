"""Tensor parallel GPT on real ranks (2 emulated nodes x 2, tp=2 inside each node, dp=2 across):
the same logits, loss, gradients and weights as the unsharded model in one process."""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases import tensor_parallel as tp_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_gpt_equals_the_unsharded_model(cluster, sequence_parallel):
    results = cluster.run(tp_cases.tp_step, sequence_parallel)
    assert [r["replica"] for r in results] == [0, 0, 1, 1]  # a TP pair per node, one DP replica each
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    references = {replica: tp_cases.reference(replica) for replica in (0, 1)}
    d = tp_cases.SHAPE.d_model
    for rank, got in enumerate(results):
        want = references[got["replica"]]
        assert abs(got["loss"] - want["loss"]) < 1e-5, (rank, got["loss"], want["loss"])
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} grad {name}: {m}")
            torch.testing.assert_close(got["params"][name], want["params"][name], rtol=0, atol=0)
        # this rank's qkv shard is its two heads' q, k and v (not all of q and half of k)
        full = want["params"]["blocks.0.attn.qkv.weight"]
        half = d // 2
        t = got["tp_rank"]
        mine = torch.cat([full[c * d + t * half:c * d + (t + 1) * half] for c in range(3)])
        assert torch.equal(got["local_qkv"], mine)
        assert got["local_heads"] == tp_cases.SHAPE.heads // 2
        assert got["ln_is_dtensor"] is sequence_parallel  # SequenceParallel made the LayerNorms DTensors
        assert got["tp_backend"] == "hfreduce"
    # different replicas saw different batches, so the test would see a replica mix-up
    assert results[0]["loss"] != results[2]["loss"]


def test_heads_not_divisible_by_tp_are_refused(cluster):
    errors = cluster.run(tp_cases.bad_shape, 3, 48)
    assert all(e.startswith("UserError: tensor parallel degree tp=2 does not divide the attention heads (3)")
               for e in errors)


def test_sequence_parallel_needs_a_length_tp_divides(cluster):
    errors = cluster.run(tp_cases.bad_shape, 4, 32, 7)
    assert all("sequence parallel over tp=2 ranks needs a sequence length that tp divides, got 7" in e for e in errors)
