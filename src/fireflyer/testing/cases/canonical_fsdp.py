"""Rank-side functions for the canonical-order FSDP tests: ``fully_shard(order="canonical")`` and
:func:`~fireflyer.haiscale.fsdp.fsdp_accumulate` on a group made with ``HFReduceConfig(order="canonical")``.

Micro-batch ``g`` of step ``s`` is a function of ``(g, s)`` alone, and shard rank ``r`` of ``R`` takes
``g = j*R + r`` for ``j = 0 .. m-1``: every layout trains on the same global batch of ``M = R*m``."""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fireflyer.haiscale.fsdp import (FullyShardedDataParallel, apply_optimizer_in_backward, fsdp_accumulate, fully_shard,
                                     sharding_info)
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator
from fireflyer.testing.cases.canonical import Refusals
from fireflyer.train.model import GPT, Block, ModelShape, lm_loss, synthetic_batch

CFG = ModelShape(vocab_size=67, context=8, layers=2, d_model=64, heads=2)
"""An odd vocabulary, so the tied embedding's shards are padded; blocks of 200 KB, so their
reduce-scatters run on the engine's threads while backward goes on."""
LR = 1e-2


def micro_batch(g: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(CFG, rank=g, step=step, size=2)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _groups(ctx, order: str) -> dist.ProcessGroup:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)
    return dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order=order, chunk_bytes=16384))


def _model(dtype: str) -> GPT:
    return GPT.seeded(CFG).to(getattr(torch, dtype))


def one_process(ctx, total: int, steps: int, dtype: str = "float32") -> dict:
    """The reference: one plain model runs all ``total`` micro-batches of each step, sums their gradients
    with a PairwiseAccumulator over the micro-batch index and divides by ``total`` (rounded once)."""
    torch.set_num_threads(1)
    model = _model(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    losses, grads = [], []
    for step in range(steps):
        accs = [PairwiseAccumulator() for _ in params]
        loss_acc = PairwiseAccumulator()
        for g in range(total):
            for p in params:
                p.grad = None
            loss = lm_loss(model, micro_batch(g, step))
            loss.backward()
            loss_acc.add(loss.detach().float())
            for acc, p in zip(accs, params):
                acc.add(p.grad)
        for acc, p in zip(accs, params):
            p.grad = acc.result(keep_accumulator=True).div_(total).to(p.dtype)
        losses.append(loss_acc.result(keep_accumulator=True).div_(total).item())
        grads.append(_digest(p.grad for p in params))
        opt.step()
    return {"losses": losses, "grads": grads, "weights": _digest(params)}


def train(ctx, m: int, steps: int, order: str = "canonical", dtype: str = "float32", wrapper: bool = False) -> dict:
    """``steps`` AdamW steps of the GPT sharded over every rank, ``m`` micro-batches per rank through
    ``fsdp_accumulate``, or through the wrapper's ``accumulate`` with synchronous reduce-scatters: each
    step's mean loss, the digests of the full gradients and of the final full weights."""
    group = _groups(ctx, order)
    if wrapper:
        model = FullyShardedDataParallel(_model(dtype), group=group, order=order, overlap_reduce_scatter=False)
        step_fn = model.accumulate
    else:
        model = fully_shard(_model(dtype), group=group, shard_types=(Block,), order=order)
        step_fn = functools.partial(fsdp_accumulate, model)
    info = sharding_info(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        loss = step_fn([micro_batch(g, step) for g in info.micro_batch_indices(m)], lm_loss)
        losses.append(loss.item())
        grads.append(_digest(p.grad for p in model.parameters()))
        opt.step()
    out = {"losses": losses, "grads": grads, "weights": _digest(model.parameters()),
           "stats": dict(info.backlog.stats)}
    dist.destroy_process_group(group)
    return out


def refusals(ctx) -> dict[str, str]:
    """What each misuse gets, as ``"ErrorType: message"`` (on 4 ranks: a group of 3 is one of them)."""
    group = _groups(ctx, "canonical")
    fast = dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order="fast"))
    gloo = dist.new_group(backend="gloo")
    three = dist.new_group(ranks=[0, 1, 2], backend="hfreduce", pg_options=HFReduceConfig(order="canonical"))
    out = Refusals()
    attempt = out.attempt

    def shard(**options):
        return fully_shard(_model("float32"), shard_types=(Block,), **options)

    attempt("order", lambda: shard(group=group, order="tree"))
    attempt("fast group", lambda: shard(group=fast, order="canonical"))
    attempt("gloo group", lambda: shard(group=gloo, order="canonical"))
    if ctx.rank < 3:
        attempt("three ranks", lambda: shard(group=three, order="canonical"))
    attempt("reduce_dtype", lambda: shard(group=group, order="canonical",
                                          mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)))
    attempt("param_dtype", lambda: shard(group=group, order="canonical",
                                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
    attempt("optimizer", lambda: shard(group=group, order="canonical",
                                       optimizer=functools.partial(torch.optim.AdamW, lr=LR)))
    model = shard(group=group, order="canonical")
    attempt("optimizer later", lambda: apply_optimizer_in_backward(model, functools.partial(torch.optim.AdamW, lr=LR)))
    batches = [micro_batch(g, 0) for g in sharding_info(model).micro_batch_indices(2)]
    attempt("plain forward", lambda: lm_loss(model, batches[0]))
    with torch.no_grad():
        attempt("evaluation", lambda: lm_loss(model, batches[0]))
    attempt("unequal", lambda: fsdp_accumulate(model, batches[: 1 + ctx.rank % 2], lm_loss))
    attempt("none", lambda: fsdp_accumulate(model, [], lm_loss))
    attempt("not a list", lambda: fsdp_accumulate(model, iter(batches), lm_loss))
    attempt("vector loss", lambda: fsdp_accumulate(model, batches, lambda mdl, b: mdl(b[0]).mean((1, 2))))
    attempt("after refusals", lambda: fsdp_accumulate(model, batches, lm_loss))
    out["grads"] = str(all(p.grad is not None for p in model.parameters()))
    for g in (group, fast, gloo, *([three] if ctx.rank < 3 else [])):
        dist.destroy_process_group(g)
    return out
