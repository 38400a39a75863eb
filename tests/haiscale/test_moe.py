"""The MoE layer in one process: routing, the sorted dispatch against a per-token loop, drops, balancing, errors.

The expert-parallel runs (2 emulated nodes x 2 ranks) are in test_moe_ep.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale import MoE, MoEConfig, is_expert_param
from fireflyer.haiscale.moe import RoutedExperts

D = 32


def config(**kw) -> MoEConfig:
    base = dict(d_model=D, n_routed=8, n_shared=1, expert_hidden=16, top_k=2, init_std=0.2)
    base.update(kw)
    return MoEConfig(**base)


def tokens(b: int = 3, t: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(seed))


def per_token(moe: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """The layer's definition, one token and one chosen expert at a time."""
    c = moe.config
    flat = x.reshape(-1, D)
    logits = flat @ moe.gate.weight.T
    scores = torch.sigmoid(logits) if c.score == "sigmoid" else torch.softmax(logits, dim=-1)
    chosen = torch.topk(scores + moe.expert_bias, c.top_k, dim=-1).indices
    ex = moe.experts
    out = []
    for n in range(flat.shape[0]):
        w = scores[n, chosen[n]]
        w = w / w.sum() if c.norm_topk else w
        y = moe.shared(flat[n]) if moe.shared is not None else torch.zeros(D)
        for j, e in enumerate(chosen[n].tolist()):
            if keep is not None and not keep[n * c.top_k + j]:
                continue
            h = F.silu(ex.w1[e] @ flat[n]) * (ex.w3[e] @ flat[n])
            y = y + w[j] * (ex.w2[e] @ h)
        out.append(y)
    return torch.stack(out).view_as(x), chosen


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_output_and_routing_equal_a_per_token_loop(score):
    moe = MoE(config(score=score, norm_topk=score == "sigmoid"), seed=1)
    moe.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))  # the bias takes part in the choice
    x = tokens()
    y = moe(x)
    want, chosen = per_token(moe, x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert moe.stats.tokens == torch.bincount(chosen.reshape(-1), minlength=8).tolist()


def test_bias_chooses_but_does_not_weigh():
    moe = MoE(config(n_shared=0), seed=2)
    x = tokens()
    moe.expert_bias.fill_(0.0)
    moe.expert_bias[3] = 10.0  # expert 3 is chosen for every token...
    y = moe(x)
    assert moe.stats.tokens[3] == x.shape[0] * x.shape[1]
    want, _ = per_token(moe, x)  # ...but weighed by its plain affinity
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_dropless_processes_every_token_even_when_the_gate_is_skewed():
    moe = MoE(config(), seed=3)
    moe.expert_bias[0] = moe.expert_bias[1] = 5.0  # every token to experts 0 and 1
    moe(tokens(4, 8))
    assert moe.stats.tokens[:2] == [32, 32] and sum(moe.stats.tokens) == 64
    assert moe.stats.dropped == 0 and moe.stats.imbalance == 4.0
    record = json.loads(json.dumps(moe.stats.as_dict()))
    assert record["tokens"][:2] == [32, 32] and record["imbalance"] == 4.0 and record["all_to_all"]["calls"] == 0


def test_capacity_drops_the_lowest_affinities_and_counts_them():
    moe = MoE(config(capacity_factor=1.0), seed=4)
    moe.expert_bias[0] = 5.0  # every token wants expert 0; capacity is ceil(32 * 2 / 8) = 8
    x = tokens(4, 8)
    y = moe(x)
    stats = moe.stats
    assert stats.tokens[0] == 8 and max(stats.tokens) <= 8
    assert stats.dropped == 64 - sum(stats.tokens) > 0
    # the 8 kept assignments of expert 0 are its 8 highest affinities; check against the per-token loop
    flat = x.reshape(-1, D)
    scores = torch.sigmoid(flat @ moe.gate.weight.T)
    chosen = torch.topk(scores + moe.expert_bias, 2, dim=-1).indices
    keep = torch.zeros(64, dtype=torch.bool)
    for e in range(8):
        idx = (chosen.reshape(-1) == e).nonzero().view(-1)
        aff = scores.gather(1, chosen).reshape(-1)[idx]
        keep[idx[torch.argsort(aff, descending=True, stable=True)[:8]]] = True
    want, _ = per_token(moe, x, keep)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_aux_loss_only_when_enabled_and_it_reaches_the_gate():
    off = MoE(config(), seed=5)
    off(tokens())
    assert off.aux_loss is None
    on = MoE(config(aux_loss_alpha=0.01), seed=5)
    on(tokens())
    assert on.aux_loss.item() > 0
    on.aux_loss.backward()
    assert on.gate.weight.grad.abs().sum() > 0
    assert on.experts.w1.grad is None  # the balance loss is the gate's alone


def test_bias_update_moves_a_skewed_load_toward_balance():
    moe = MoE(config(n_shared=0, bias_update_speed=0.02), seed=6)
    with torch.no_grad():
        moe.gate.weight[0] += 0.5 * tokens(1, 1, seed=99).view(D)  # expert 0 favoured by tokens alike
    x = tokens(8, 8, seed=7) + 0.5 * tokens(1, 1, seed=99)
    imbalance = []
    for _ in range(40):
        moe(x)
        imbalance.append(moe.stats.imbalance)
        load = moe.update_bias()
        assert sum(load.tolist()) == 128
    assert imbalance[0] >= 3.0 and max(imbalance[-10:]) < 1.5, imbalance  # from 4x the mean to within 1.5x
    assert moe.expert_bias[0] < 0  # the favoured expert was pushed down
    assert "expert_bias" in moe.state_dict() and all(p is not moe.expert_bias for p in moe.parameters())


def test_eval_forwards_do_not_count_toward_the_bias():
    moe = MoE(config(), seed=8).eval()
    moe(tokens())
    assert torch.equal(moe.update_bias(), torch.zeros(8, dtype=torch.int64))
    assert torch.equal(moe.expert_bias, torch.zeros(8))


def test_expert_parameters_are_marked_and_seeded_per_global_expert():
    moe = MoE(config(in_std=0.2), seed=9)  # in_std = init_std: no rescaling of w1 and w3
    experts = list(moe.expert_parameters())
    assert experts == [moe.experts.w1, moe.experts.w3, moe.experts.w2]
    assert all(is_expert_param(p) for p in experts)
    assert not any(is_expert_param(p) for p in (moe.gate.weight, moe.shared.w1.weight))
    upper = RoutedExperts(D, 16, count=4, first=4, seed=9, std=0.2)  # what EP rank 1 of 2 holds
    for name in ("w1", "w3", "w2"):
        assert torch.equal(getattr(upper, name), getattr(moe.experts, name)[4:])
    assert list(moe.global_experts) == list(range(8))


def test_gradients_reach_inputs_gate_and_experts():
    moe = MoE(config(), seed=10)
    x = tokens().requires_grad_(True)
    moe(x).square().sum().backward()
    for t in (x, moe.gate.weight, moe.experts.w1, moe.experts.w2, moe.shared.w2.weight):
        assert t.grad is not None and t.grad.abs().sum() > 0


@pytest.mark.parametrize("kw, words", [
    (dict(top_k=9), "top_k (9) must be at most n_routed (8)"),
    (dict(top_k=0), "top_k must be >= 1"),
    (dict(n_routed=0), "n_routed must be >= 1"),
    (dict(n_shared=-1), "n_shared must be >= 0"),
    (dict(score="relu"), "score must be one of sigmoid, softmax"),
    (dict(bias_update_speed=-0.1), "bias_update_speed"),
    (dict(aux_loss_alpha=float("nan")), "aux_loss_alpha"),
    (dict(capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
    (dict(init_std=0), "init_std"),
])
def test_bad_config(kw, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        config(**kw)


def test_bad_types_and_inputs():
    with pytest.raises(UserTypeError, match="d_model must be an int"):
        config(d_model=32.0)
    with pytest.raises(UserTypeError, match="norm_topk must be a bool"):
        config(norm_topk=1)
    with pytest.raises(UserTypeError, match="needs a MoEConfig"):
        MoE({"d_model": 32})
    with pytest.raises(UserError, match="seed"):
        MoE(config(), seed=-1)
    moe = MoE(config())
    with pytest.raises(UserError, match=r"\(batch, time, 32\)"):
        moe(torch.randn(4, 32))
    with pytest.raises(UserError, match=r"\(batch, time, 32\)"):
        moe(torch.randn(2, 4, 16))


def test_the_experts_input_projections_start_at_the_fan_in_scale():
    """w1 and w3 default to std d_model ** -0.5 (a SwiGLU's product of two projections vanishes at 0.02);
    w2 and the gate keep init_std; an explicit in_std rescales the same draws."""
    c = config(d_model=64, n_routed=16, expert_hidden=64, init_std=0.02)
    moe = MoE(c, seed=3)
    for w in (moe.experts.w1, moe.experts.w3, moe.shared.w1.weight, moe.shared.w3.weight):
        assert abs(w.std().item() - 64 ** -0.5) < 0.01
    for w in (moe.experts.w2, moe.gate.weight):
        assert abs(w.std().item() - 0.02) < 0.003
    other = MoE(config(d_model=64, n_routed=16, expert_hidden=64, init_std=0.02, in_std=0.5), seed=3)
    torch.testing.assert_close(other.experts.w1 * (64 ** -0.5 / 0.5), moe.experts.w1)
    with pytest.raises(ValueError, match="in_std must be a finite number > 0"):
        config(in_std=0.0)
