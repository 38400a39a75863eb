"""The MoE layer in the canonical order: one process holding every expert, EP=2 and EP=2 x DP=2 give the
same bits (losses, outputs, input, dense and expert gradients, weights after AdamW and the bias update);
the fast order does not; what cannot be canonical is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fireflyer.errors import UsageError, UserError
from fireflyer.haiscale.moe import MoE, MoEConfig
from fireflyer.haiscale.moe_steps import CanonicalMoE, check_layout
from fireflyer.testing.cases import canonical_moe as cases
from fireflyer.testing.cluster import LocalCluster

STEPS = 2
ENV = {"FIREFLYER_TEST_COMM": "0"}


@pytest.fixture(scope="module")
def one_process():
    """The reference runs, by (kind, global micro-batch count)."""
    runs: dict = {}
    with LocalCluster([1], env=ENV) as cluster:
        for kind in ("layer", "gpt"):
            for count in (2, 4, 8):
                runs[kind, count] = cluster.run(cases.train, kind, count, STEPS)[0]
    return runs


def _full(results: list[dict], step: int | None, name: str, what: str = "grads") -> torch.Tensor:
    """A tensor as one process holds it: expert weights put together by global expert index (and the data-parallel
    copies of each expert checked equal), dense ones checked equal on every rank."""
    pick = (lambda r: r[what][step][name]) if step is not None else (lambda r: r[what][name])
    if name not in results[0]["first"]:
        for r in results[1:]:
            assert torch.equal(pick(r), pick(results[0])), name
        return pick(results[0])
    by_first: dict[int, torch.Tensor] = {}
    for r in results:
        first = r["first"][name]
        if first in by_first:
            assert torch.equal(pick(r), by_first[first]), (name, first)
        by_first[first] = pick(r)
    return torch.cat([by_first[f] for f in sorted(by_first)])


def _assert_same(results: list[dict], ref: dict, kind: str) -> None:
    for step in range(STEPS):
        for r in results:
            assert torch.equal(r["losses"][step], ref["losses"][step]), step
        for name, want in ref["grads"][step].items():
            assert torch.equal(_full(results, step, name), want), (step, name)
        if kind == "layer":
            outputs = {g: y for r in results for g, y in r["outputs"][step].items()}
            input_grads = {g: y for r in results for g, y in r["input_grads"][step].items()}
            assert sorted(outputs) == sorted(ref["outputs"][step])
            for g, want in ref["outputs"][step].items():
                assert torch.equal(outputs[g], want), (step, g)
                assert torch.equal(input_grads[g], ref["input_grads"][step][g]), (step, g)
        for r in results:
            assert r["biases"][step].keys() == ref["biases"][step].keys()
            for name, want in ref["biases"][step].items():
                assert torch.equal(r["biases"][step][name], want), (step, name)
    for name, want in ref["weights"].items():
        assert torch.equal(_full(results, None, name, "weights"), want), name
    assert any(b.abs().sum() > 0 for b in ref["biases"][0].values())  # the loads moved the bias


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [[2], [2, 2]], ids=["ep2", "ep2xdp2"])
def test_expert_parallel_gives_the_bits_of_one_process(layout, one_process):
    with LocalCluster(layout, env=ENV) as cluster:
        for kind in ("layer", "gpt"):
            for m in (1, 2):
                results = cluster.run(cases.train, kind, m, STEPS, timeout=300)
                _assert_same(results, one_process[kind, sum(layout) * m], kind)


@pytest.mark.multiproc
def test_the_fast_order_does_not_and_misuse_is_refused(one_process):
    with LocalCluster([2], env=ENV) as cluster:
        results = cluster.run(cases.train, "gpt", 2, STEPS, "fast", timeout=300)
        refused = cluster.run(cases.refusals, timeout=120)
    ref = one_process["gpt", 4]
    names = list(ref["grads"][0])
    differ = [n for n in names if not torch.equal(_full(results, 0, n), ref["grads"][0][n])]
    assert differ  # the control: the same numbers to rounding, other bits
    for n in names:
        torch.testing.assert_close(_full(results, 0, n), ref["grads"][0][n], rtol=1e-4, atol=1e-6)
    assert abs(results[0]["losses"][0].item() - ref["losses"][0].item()) < 1e-5
    for out in refused:
        assert out["order"] == "UserError: MoE order must be one of ['fast', 'canonical'], got 'tree'"
        assert out["fast dense"].startswith("UserError: dense_group must sum in the canonical order, but this "
                                            "hfreduce group does not")
        assert "but this gloo group does not" in out["gloo dense"]
        assert out["gloo expert"].startswith("UserError: expert_group must sum in the canonical order")
        assert out["no dense"].startswith("UserError: the dense group has 1 ranks but ep (2) x expert_group (1) is 2")
        assert out["three each"].startswith("UserError: 3 micro-batches per rank")
        assert out["unequal"].startswith("UserError: ranks hold between 1 and 2 micro-batches in this step")
        assert out["after refusals"] == "no error"


# -- one process --------------------------------------------------------------------------------
def _batches(n: int) -> list:
    return [(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)),
             torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(100 + i))) for i in range(n)]


def _loss(model, micro):
    x, y = micro
    return F.mse_loss(model(x), y) + model.aux_loss


@pytest.mark.parametrize("top_k,capacity", [(1, None), (3, None), (2, 1.0)])
def test_canonical_gradients_are_the_fast_ones_to_rounding(top_k, capacity):
    config = MoEConfig(d_model=16, n_routed=8, expert_hidden=8, top_k=top_k, init_std=0.2, aux_loss_alpha=0.01,
                       capacity_factor=capacity)
    fast, canonical = MoE(config, seed=3), MoE(config, seed=3)
    batches = _batches(4)
    for micro in batches:
        (_loss(fast, micro) / 4).backward()
    mean = CanonicalMoE(canonical).accumulate(batches, _loss)
    for (name, p), q in zip(fast.named_parameters(), canonical.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        want = sum(_loss(fast, micro) for micro in batches) / 4
        torch.testing.assert_close(canonical(batches[0][0]), fast(batches[0][0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-6)
    assert canonical.stats.tokens == fast.stats.tokens


def test_a_canonical_backward_outside_a_step_is_refused():
    moe = MoE(MoEConfig(d_model=16, n_routed=4, expert_hidden=8, aux_loss_alpha=0.01), seed=1)
    moe.set_order("canonical")
    x, y = _batches(1)[0]
    with pytest.raises(UsageError, match="must run inside a step"):
        _loss(moe, (x, y)).backward()
    with pytest.raises(UsageError, match="no micro-batch ran in this step"):
        moe.begin_step()
        moe.finish_expert_grads(1)
    moe.set_order("fast")
    with pytest.raises(UsageError, match="is in the fast order"):
        moe.begin_step()
    _loss(moe, (x, y)).backward()  # the fast order is back
    assert all(p.grad is not None for p in moe.parameters())


def test_layouts_whose_blocks_are_not_subtrees_are_refused():
    check_layout(3, 1, 2, 0, 2, 3)  # any EP size when there is one copy
    check_layout(4, 2, 1, 1, 5, 8)
    with pytest.raises(UserError, match=r"^EP 3 with 2 data-parallel copies: in the canonical order the EP size must "
                                        r"be a power of two"):
        check_layout(3, 2, 0, 1, 3, 6)
    with pytest.raises(UserError, match=r"^this rank is dense rank 1 but EP rank 0 of copy 1"):
        check_layout(2, 2, 0, 1, 1, 4)
    with pytest.raises(UserError, match="the model has no MoE layer"):
        CanonicalMoE(torch.nn.Linear(2, 2))


def test_steps_driven_by_hand_are_accumulate_and_misuse_is_refused():
    """CanonicalSteps' pieces (a pipeline's hooks call them) give accumulate()'s bits; a dense model is taken."""
    from fireflyer.haiscale.moe_steps import CanonicalSteps

    config = MoEConfig(d_model=16, n_routed=4, expert_hidden=8, top_k=2, init_std=0.2, aux_loss_alpha=0.01)
    by_hand, whole = MoE(config, seed=5), MoE(config, seed=5)
    batches = _batches(4)
    steps = CanonicalSteps(by_hand)
    with pytest.raises(UsageError, match="no canonical step is open: call begin"):
        steps.begin_micro_batch()
    assert steps.begin(4) == 4
    for micro in batches[:3]:
        steps.begin_micro_batch()
        _loss(by_hand, micro).backward()
        steps.end_micro_batch(_loss(by_hand, micro).detach())
    with pytest.raises(UsageError, match="begun with 4 micro-batches but 3 ran"):
        steps.finish()
    steps.begin(4)
    for micro in batches:
        steps.begin_micro_batch()
        loss = _loss(by_hand, micro)
        loss.backward()
        steps.end_micro_batch(loss)
    mean = steps.finish()
    want = CanonicalSteps(whole).accumulate(batches, _loss)
    assert torch.equal(mean, want)
    for p, q in zip(by_hand.parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad)
    dense = torch.nn.Linear(16, 16)
    assert CanonicalSteps(dense).accumulate(batches, lambda m, b: F.mse_loss(m(b[0]), b[1])).dim() == 0


def test_a_backward_inside_uncounted_reaches_no_canonical_gradient():
    """A pipeline stage's shape inference runs a forward and a backward on uninitialised tensors inside
    ``uncounted``: neither the load nor the expert gradients may see it."""
    from fireflyer.haiscale.moe import uncounted

    config = MoEConfig(d_model=16, n_routed=4, expert_hidden=8, top_k=2, init_std=0.2)
    clean, probed = MoE(config, seed=7), MoE(config, seed=7)
    batches = _batches(2)
    want = CanonicalMoE(clean).accumulate(batches, _loss_plain)
    steps = CanonicalMoE(probed)
    steps.begin(2)
    with uncounted(probed):
        _loss_plain(probed, (torch.full((2, 5, 16), 1e3), torch.zeros(2, 5, 16))).backward()
    for micro in batches:
        steps.begin_micro_batch()
        loss = _loss_plain(probed, micro)
        loss.backward()
        steps.end_micro_batch(loss)
    assert torch.equal(steps.finish(), want)
    for p, q in zip(probed.experts.parameters(), clean.experts.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(probed.take_step_load(), clean.take_step_load())


def _loss_plain(model, micro):
    x, y = micro
    return F.mse_loss(model(x), y)
