"""Rank-side functions for the canonical-order MoE tests: :class:`~fireflyer.haiscale.moe_steps.CanonicalMoE`
on one process, on EP=2 (one node of 2) and on EP=2 x DP=2 (2 nodes of 2: EP inside a node, copies across).

Global micro-batch ``g`` of step ``s`` is a function of ``(g, s)`` alone, and data replica ``r`` (the
dense rank, ``d*ep + k``) with ``m`` micro-batches takes ``g = r*m .. r*m+m-1``: every layout trains on
the same global batch. Two models: one MoE layer (whose outputs and input gradients are kept per
global micro-batch) and a tiny :class:`~fireflyer.train.moe_model.MoEGPT`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fireflyer.haiscale.moe import MoE, MoEConfig
from fireflyer.haiscale.moe_steps import CanonicalMoE, moe_layers
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.testing.cases.canonical import Refusals
from fireflyer.train.moe_model import MoEGPT, MoEShape

CONFIG = MoEConfig(d_model=16, n_routed=8, n_shared=1, expert_hidden=8, top_k=3, init_std=0.3,
                   bias_update_speed=0.05, aux_loss_alpha=0.01)
SHAPE = MoEShape(vocab_size=32, context=8, layers=2, d_model=16, heads=2, n_routed=4, n_shared=1, expert_hidden=8,
                 top_k=2, bias_update_speed=0.05, aux_loss_alpha=0.01)
SEED = 5
EP = 2
_GROUPS: dict = {}


def groups(ctx) -> dict:
    """This rank's groups (made once per process): ``ep`` (gloo, a node's ranks), ``dense`` (canonical hfreduce,
    every rank), ``expert`` (canonical hfreduce, the ranks with the same experts) and their gloo twins for the
    fast control; all None on one process."""
    world = ctx.world_size
    if world == 1:
        return {"ep": None, "dense": None, "expert": None, "world": None, "expert_gloo": None, "dp": 1}
    if not _GROUPS:
        torch.set_num_threads(1)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.PrefixStore("moe", ctx.store), rank=ctx.rank,
                                    world_size=world, timeout=timedelta(seconds=60))
        canonical = HFReduceConfig(order="canonical")
        dp = world // EP
        mine: dict = {"dp": dp, "world": dist.new_group(backend="gloo"), "expert": None, "expert_gloo": None}
        mine["dense"] = dist.new_group(backend="hfreduce", pg_options=canonical)
        for d in range(dp):
            ranks = list(range(d * EP, (d + 1) * EP))
            g = dist.new_group(ranks, backend="gloo")
            if ctx.rank in ranks:
                mine["ep"] = g
        if dp > 1:
            for k in range(EP):
                ranks = list(range(k, world, EP))
                g = dist.new_group(ranks, backend="hfreduce", pg_options=canonical)
                g2 = dist.new_group(ranks, backend="gloo")
                if ctx.rank in ranks:
                    mine["expert"], mine["expert_gloo"] = g, g2
        _GROUPS.update(mine)
    return _GROUPS


def build(kind: str, ep_group) -> nn.Module:
    return MoE(CONFIG, ep_group=ep_group, seed=SEED) if kind == "layer" else MoEGPT(SHAPE, ep_group=ep_group, seed=SEED)


def micro_batch(kind: str, g: int, step: int) -> tuple:
    gen = torch.Generator().manual_seed(7919 * step + g)
    if kind == "layer":
        x = torch.randn(2, 4, CONFIG.d_model, generator=gen)
        return g, x, torch.randn(2, 4, CONFIG.d_model, generator=gen)
    idx = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.context + 1), generator=gen)
    return g, idx[:, :-1], idx[:, 1:]


class _Recorder:
    """A loss function that keeps each micro-batch's output and input (for its gradient, after backward)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, model: nn.Module, micro: tuple) -> torch.Tensor:
        g, x, y = micro
        if isinstance(model, MoE):
            x = x.clone().requires_grad_(True)
            out = model(x)
            self.seen[g] = (out.detach().clone(), x)
            return F.mse_loss(out, y) + model.aux_loss
        return model(x, y)


def _expert_first(model: nn.Module) -> dict[str, int]:
    """Each expert weight's name and the global index of its first expert here."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MoE):
            prefix = f"{name}." if name else ""
            for w in ("w1", "w3", "w2"):
                out[f"{prefix}experts.{w}"] = mod.experts.first
    return out


def _fast_step(model: nn.Module, batches: list, loss_fn, gs: dict) -> torch.Tensor:
    """The usual accumulation (each loss over m, backward adds), dense gradients averaged over every rank and
    expert gradients (already over ep) over the copies: the control."""
    for p in model.parameters():
        p.grad = None
    total = torch.zeros(())
    for micro in batches:
        loss = loss_fn(model, micro)
        (loss / len(batches)).backward()
        total += loss.detach()
    total /= len(batches)
    experts = {id(p) for m in moe_layers(model) for p in m.expert_parameters()}
    if gs["world"] is not None:
        world = dist.get_world_size(gs["world"])
        dist.all_reduce(total, group=gs["world"])
        total /= world
        for p in model.parameters():
            if id(p) in experts:
                if gs["expert_gloo"] is not None:
                    dist.all_reduce(p.grad, group=gs["expert_gloo"])
                    p.grad /= gs["dp"]
            else:
                dist.all_reduce(p.grad, group=gs["world"])
                p.grad /= world
    return total


def train(ctx, kind: str, m: int, steps: int, order: str = "canonical") -> dict:
    """``steps`` AdamW steps with ``m`` micro-batches on this rank: per step the mean loss, every gradient and
    (the layer) each global micro-batch's output and input gradient; then the weights and the balancing bias."""
    torch.set_num_threads(1)
    gs = groups(ctx)
    model = build(kind, gs["ep"])
    replica = dist.get_rank(gs["dense"]) if gs["dense"] is not None else 0
    runner = CanonicalMoE(model, dense_group=gs["dense"], expert_group=gs["expert"]) if order == "canonical" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out: dict = {"losses": [], "grads": [], "outputs": [], "input_grads": [], "biases": [],
                 "first": _expert_first(model)}
    for step in range(steps):
        batches = [micro_batch(kind, replica * m + j, step) for j in range(m)]
        rec = _Recorder()
        loss = runner.accumulate(batches, rec) if runner is not None else _fast_step(model, batches, rec, gs)
        out["losses"].append(loss.clone())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["outputs"].append({g: y for g, (y, _) in rec.seen.items()})
        out["input_grads"].append({g: x.grad.clone() for g, (_, x) in rec.seen.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer in moe_layers(model):
            layer.update_bias(gs["dense"] if order == "canonical" else gs["world"])
        out["biases"].append({n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    out["weights"] = {n: t.clone() for n, t in model.state_dict().items()}
    if runner is not None:
        runner.close()
    return out


def refusals(ctx) -> dict[str, str]:
    """What each misuse gets on EP=2 (one node of 2), as ``"ErrorType: message"``."""
    torch.set_num_threads(1)
    gs = groups(ctx)
    fast = dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order="fast"))
    out = Refusals()
    attempt = out.attempt

    layer = build("layer", gs["ep"])
    attempt("order", lambda: layer.set_order("tree"))
    attempt("fast dense", lambda: CanonicalMoE(layer, dense_group=fast))
    attempt("gloo dense", lambda: CanonicalMoE(layer, dense_group=gs["world"]))
    attempt("gloo expert", lambda: CanonicalMoE(layer, dense_group=gs["dense"], expert_group=gs["world"]))
    attempt("no dense", lambda: CanonicalMoE(layer))
    runner = CanonicalMoE(layer, dense_group=gs["dense"])
    rec = _Recorder()
    attempt("three each", lambda: runner.accumulate([micro_batch("layer", j, 0) for j in range(3)], rec))
    attempt("unequal", lambda: runner.accumulate([micro_batch("layer", j, 0) for j in range(1 + ctx.rank)], rec))
    attempt("after refusals", lambda: runner.accumulate([micro_batch("layer", ctx.rank * 2 + j, 0) for j in range(2)],
                                                        rec))
    runner.close()
    dist.destroy_process_group(fast)
    return out
