"""Rank-side functions for the tensor parallel tests (LocalCluster ranks, 2 nodes x 2, tp=2 in a node).

Each rank builds the seeded GPT, shards it with :func:`~fireflyer.train.model.parallelize_gpt`
over ``layout(tp=2)``'s TP group, runs one forward and backward on its DP replica's batch, and
reports logits, loss and every gradient and weight as full tensors in the model's own layout.
:func:`reference` is the unsharded model in one process on the same batch.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fireflyer.testing.cases.layout import init
from fireflyer.train.model import GPT, ModelShape, synthetic_batch

SHAPE = ModelShape(vocab_size=64, context=8, layers=2, d_model=32, heads=4)
SEED = 5
BATCH = 2


def _full(name: str, tensor: torch.Tensor, tp: int) -> torch.Tensor:
    from fireflyer.haiscale.tensor_parallel import restore_fused
    from fireflyer.train.model import QKV_CHUNKS

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
        if ".attn.qkv." in name:
            tensor = restore_fused(tensor, QKV_CHUNKS, tp)
    return tensor.detach().clone()


def _step(model: GPT, replica: int, tp: int) -> dict:
    idx, targets = synthetic_batch(SHAPE, rank=replica, step=0, size=BATCH)
    logits = model(idx)
    loss = model(idx, targets)
    loss.backward()
    return {
        "logits": logits.detach().clone(),
        "loss": loss.item(),
        "grads": {n: _full(n, p.grad, tp) for n, p in model.named_parameters()},
        "params": {n: _full(n, p.data if not isinstance(p, DTensor) else p, tp) for n, p in model.named_parameters()},
    }


def tp_step(ctx, sequence_parallel: bool) -> dict:
    """One forward and backward of the TP=2 GPT on this rank's DP replica's batch."""
    import fireflyer.haiscale as hs
    from fireflyer.train.model import parallelize_gpt

    init(ctx)
    lay = hs.layout(tp=2, timeout=60)
    model = parallelize_gpt(GPT.seeded(SHAPE, SEED), lay.mesh["tp"], sequence_parallel=sequence_parallel)
    out = _step(model, lay.coords["dp"], 2)
    out["replica"] = lay.coords["dp"]
    out["local_qkv"] = model.blocks[0].attn.qkv.weight.to_local().detach().clone()
    out["local_heads"] = model.blocks[0].attn.heads
    out["tp_rank"] = lay.coords["tp"]
    ln = model.blocks[0].ln1.weight
    out["ln_is_dtensor"] = isinstance(ln, DTensor)
    out["tp_backend"] = str(lay.mesh["tp"].get_group().name())
    return out


def reference(replica: int) -> dict:
    """The unsharded model, in this process, on replica ``replica``'s batch."""
    return _step(GPT.seeded(SHAPE, SEED), replica, 1)


def bad_shape(ctx, heads: int, d_model: int, sequence: int | None = None) -> str:
    """The error parallelize_gpt (or, with ``sequence``, a sequence-parallel forward) raises here."""
    import fireflyer.haiscale as hs
    from fireflyer.train.model import parallelize_gpt

    init(ctx)
    lay = hs.layout(tp=2, timeout=60)
    shape = ModelShape(vocab_size=64, context=8, layers=1, d_model=d_model, heads=heads)
    try:
        model = parallelize_gpt(GPT.seeded(shape, SEED), lay.tp_group, sequence_parallel=sequence is not None)
        if sequence is not None:
            model(torch.zeros(1, sequence, dtype=torch.long))
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return ""
