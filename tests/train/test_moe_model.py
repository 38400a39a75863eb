"""The small DeepSeekMoE (MoEGPT) in one process: shape, loss, seeding, balancing."""

from __future__ import annotations

import pytest
import torch

from fireflyer.errors import UserError
from fireflyer.haiscale.moe import MoE, is_expert_param
from fireflyer.train.model import Block
from fireflyer.train.moe_model import MoEBlock, MoEGPT, MoEShape


def shape(**kw) -> MoEShape:
    base = dict(vocab_size=64, context=16, layers=2, d_model=32, heads=2, n_routed=4, n_shared=1,
                expert_hidden=16, top_k=2)
    base.update(kw)
    return MoEShape(**base)


def test_logits_loss_and_gradients():
    model = MoEGPT(shape(aux_loss_alpha=0.01), seed=1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert model(idx).shape == (2, 16, 64)
    loss = model(idx, idx)
    aux = model.aux_loss()
    assert aux is not None and aux.item() > 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len(model.expert_stats()) == 2 and all(sum(s.tokens) == 2 * 16 * 2 for s in model.expert_stats())


def test_first_dense_blocks_and_expert_parameters():
    model = MoEGPT(shape(layers=3, first_dense=1), seed=2)
    assert isinstance(model.blocks[0], Block) and all(isinstance(b, MoEBlock) for b in model.blocks[1:])
    assert len(model.moe_layers()) == 2
    experts = model.expert_parameters()
    assert len(experts) == 6 and all(is_expert_param(p) for p in experts)
    assert sum(is_expert_param(p) for p in model.parameters()) == 6


def test_seeded_independently_of_the_global_rng():
    torch.manual_seed(123)
    a = MoEGPT(shape(), seed=3)
    torch.manual_seed(456)
    b = MoEGPT(shape(), seed=3)
    c = MoEGPT(shape(), seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if p.dim() >= 2:
            assert not torch.equal(p, r), name
    assert all(isinstance(m, MoE) for m in a.moe_layers())
    # different layers get different experts
    assert not torch.equal(a.moe_layers()[0].experts.w1, a.moe_layers()[1].experts.w1)


def test_update_bias_after_a_step():
    model = MoEGPT(shape(bias_update_speed=0.01), seed=5)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    model.update_bias()
    assert all(m.expert_bias.abs().sum() > 0 for m in model.moe_layers())
    assert all(f"blocks.{i}.moe.expert_bias" in model.state_dict() for i in range(2))


def test_bad_shapes():
    with pytest.raises(UserError, match="first_dense"):
        shape(first_dense=3)
    with pytest.raises(UserError, match="multiple of heads"):
        shape(heads=5)
    with pytest.raises(UserError, match="top_k"):
        shape(top_k=5)
    with pytest.raises(UserError, match="longer than the model's context"):
        MoEGPT(shape())(torch.zeros(1, 17, dtype=torch.long))

