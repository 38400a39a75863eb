"""Rank-side functions for the canonical linear tests: a 2-layer MLP (column-parallel ``fc``, GELU,
row-parallel ``proj``) and an attention piece (column-parallel fused ``qkv`` with ``chunks=3``, causal
``scaled_dot_product_attention`` over this rank's heads, row-parallel ``proj``) over a TP group of
every rank, made with ``HFReduceConfig(order="canonical")``.

The MLP's weights, each step's input and output gradient are functions of the seed and the step
alone, so every layout trains on the same data; each rank also runs the one-process
:class:`CanonicalLinear` MLP (the reference), at the same thread count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fireflyer.haiscale.canonical_linear import (CanonicalLinear, ColumnParallelCanonicalLinear,
                                                 RowParallelCanonicalLinear)
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.testing.cases.canonical import Refusals

D_MODEL, HIDDEN = 32, 64
HEADS = 4  # of D_MODEL / HEADS = 8 features each
SEED = 11
LR = 0.05


def _tp_group(ctx, order: str = "canonical") -> dist.ProcessGroup:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)
    return dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order=order))


def _linears(dtype: torch.dtype) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(SEED)
    return nn.Linear(D_MODEL, HIDDEN).to(dtype), nn.Linear(HIDDEN, D_MODEL).to(dtype)


def _data(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(2, 8, D_MODEL, generator=gen) * 10.0 ** torch.randint(-2, 2, (2, 8, 1), generator=gen)
    return x.to(dtype), torch.randn(2, 8, D_MODEL, generator=gen).to(dtype)


def _attend(qkv: torch.Tensor) -> torch.Tensor:
    """Causal attention over the heads in ``qkv`` (``[q; k; v]`` of this rank's heads, along the last dim)."""
    batch, seq, width = qkv.shape
    q, k, v = (t.unflatten(-1, (width // 3 // (D_MODEL // HEADS), -1)).transpose(1, 2) for t in qkv.chunk(3, -1))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, width // 3)


def _run(fc: nn.Module, proj: nn.Module, steps: int, dtype: torch.dtype, grads, mid=F.gelu) -> list[dict]:
    """``steps`` forward/backward passes of ``proj(mid(fc(x)))`` with an SGD update after each; per step the
    output, the input's gradient and the full gradients ``grads(fc, proj)`` gives."""
    out = []
    for step in range(steps):
        x, dy = _data(step, dtype)
        x.requires_grad_(True)
        y = proj(mid(fc(x)))
        y.backward(dy)
        out.append({"y": y.detach(), "dx": x.grad, **grads(fc, proj)})
        with torch.no_grad():
            for p in (*fc.parameters(), *proj.parameters()):
                p.sub_(LR * p.grad)
                p.grad = None
    return out


def _named_grads(fc: nn.Module, proj: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{layer}.{n}": p.grad.clone() for layer, m in (("fc", fc), ("proj", proj))
            for n, p in m.named_parameters()}


def mlp(ctx, blocks: int, steps: int, dtype: str = "float32") -> dict:
    """The TP MLP's steps and final full weights, and the one-process CanonicalLinear MLP's."""
    group = _tp_group(ctx)
    dt = getattr(torch, dtype)
    fc, proj = _linears(dt)
    ref_fc, ref_proj = CanonicalLinear.from_linear(fc, blocks), CanonicalLinear.from_linear(proj, blocks)
    reference = _run(ref_fc, ref_proj, steps, dt, _named_grads)
    tp_fc = ColumnParallelCanonicalLinear.from_full(fc, group, blocks)
    tp_proj = RowParallelCanonicalLinear.from_full(proj, group, blocks)

    def gathered(a: ColumnParallelCanonicalLinear, b: RowParallelCanonicalLinear) -> dict[str, torch.Tensor]:
        return {f"{layer}.{n}": g for layer, m in (("fc", a), ("proj", b)) for n, g in m.full_grads().items()}

    tp = _run(tp_fc, tp_proj, steps, dt, gathered)
    out = {"reference": reference, "tp": tp,
           "reference_weights": {**{f"fc.{n}": p.detach() for n, p in ref_fc.named_parameters()},
                                 **{f"proj.{n}": p.detach() for n, p in ref_proj.named_parameters()}},
           "tp_weights": {**{f"fc.{n}": t for n, t in tp_fc.full_state_dict().items()},
                          **{f"proj.{n}": t for n, t in tp_proj.full_state_dict().items()}},
           "local_fc": tuple(tp_fc.weight.shape), "local_proj": tuple(tp_proj.weight.shape)}
    dist.destroy_process_group(group)
    return out


def attention(ctx, blocks: int, steps: int, dtype: str = "float32") -> dict:
    """:func:`mlp` for the attention piece (``fc`` is the fused ``qkv``, ``chunks=3``), and whether this rank's
    first ``qkv`` output is its heads' ``[q_r; k_r; v_r]`` columns of the one-process output, bit for bit."""
    group = _tp_group(ctx)
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    dt = getattr(torch, dtype)
    torch.manual_seed(SEED)
    qkv, proj = nn.Linear(D_MODEL, 3 * D_MODEL).to(dt), nn.Linear(D_MODEL, D_MODEL).to(dt)
    ref_qkv = CanonicalLinear.from_linear(qkv, blocks, chunks=3)
    ref_proj = CanonicalLinear.from_linear(proj, blocks)
    tp_qkv = ColumnParallelCanonicalLinear.from_full(qkv, group, blocks, chunks=3)
    tp_proj = RowParallelCanonicalLinear.from_full(proj, group, blocks)
    x, _ = _data(0, dt)
    with torch.no_grad():
        mine = slice(r * D_MODEL // tp, (r + 1) * D_MODEL // tp)
        local_order = torch.equal(tp_qkv(x), torch.cat([t[..., mine] for t in ref_qkv(x).chunk(3, -1)], -1))
    reference = _run(ref_qkv, ref_proj, steps, dt, _named_grads, _attend)

    def gathered(a: ColumnParallelCanonicalLinear, b: RowParallelCanonicalLinear) -> dict[str, torch.Tensor]:
        return {f"{layer}.{n}": g for layer, m in (("fc", a), ("proj", b)) for n, g in m.full_grads().items()}

    tp_steps = _run(tp_qkv, tp_proj, steps, dt, gathered, _attend)
    out = {"reference": reference, "tp": tp_steps, "local_order": local_order,
           "reference_weights": {**{f"fc.{n}": p.detach() for n, p in ref_qkv.named_parameters()},
                                 **{f"proj.{n}": p.detach() for n, p in ref_proj.named_parameters()}},
           "tp_weights": {**{f"fc.{n}": t for n, t in tp_qkv.full_state_dict().items()},
                          **{f"proj.{n}": t for n, t in tp_proj.full_state_dict().items()}},
           "local_fc": tuple(tp_qkv.weight.shape), "local_proj": tuple(tp_proj.weight.shape)}
    dist.destroy_process_group(group)
    return out


def plain_split(ctx) -> dict:
    """The control: the same MLP with plain ``nn.Linear`` arithmetic split Megatron's way (fc's rows, proj's
    columns, the partials summed by an allreduce), and the plain one-process MLP; forward outputs. And the TP
    layers' ``order="fast"`` (plain Megatron on a fast group): its output, input gradient and gathered weight
    gradients."""
    fast_group = _tp_group(ctx, "fast")
    fc, proj = _linears(torch.float32)
    col = ColumnParallelCanonicalLinear.from_full(fc, fast_group, dist.get_world_size(fast_group), order="fast")
    row = RowParallelCanonicalLinear.from_full(proj, fast_group, dist.get_world_size(fast_group), order="fast")
    x, _ = _data(0, torch.float32)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    proj(F.gelu(fc(xs))).sum().backward()
    megatron = row(F.gelu(col(xf)))
    megatron.sum().backward()
    fast = {"out": megatron.detach(), "dx": xf.grad, "whole_dx": xs.grad,
            "fc": col.full_grads()["weight"], "whole_fc": fc.weight.grad,
            "proj": row.full_grads()["weight"], "whole_proj": proj.weight.grad}
    dist.destroy_process_group(fast_group)
    group = _tp_group(ctx)
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    fc, proj = _linears(torch.float32)
    x, _ = _data(0, torch.float32)
    with torch.no_grad():
        whole = proj(F.gelu(fc(x)))
        rows = slice(r * HIDDEN // tp, (r + 1) * HIDDEN // tp)
        h = F.gelu(F.linear(x, fc.weight[rows], fc.bias[rows]))
        partial = F.linear(h, proj.weight[:, rows])
        dist.all_reduce(partial, group=group)
        split = partial + proj.bias
    dist.destroy_process_group(group)
    return {"whole": whole, "split": split, "fast": fast}


def refusals(ctx) -> dict[str, str]:
    """What each misuse of the TP layers gets, as ``"ErrorType: message"``."""
    group = _tp_group(ctx)
    fast = _tp_group(ctx, "fast")
    gloo = dist.new_group(backend="gloo")
    out = Refusals()
    attempt = out.attempt

    attempt("blocks 3", lambda: ColumnParallelCanonicalLinear(8, 8, blocks=3, group=group))
    attempt("tp over blocks", lambda: RowParallelCanonicalLinear(8, 8, blocks=1, group=group))
    attempt("in features", lambda: RowParallelCanonicalLinear(10, 8, blocks=4, group=group))
    attempt("out features", lambda: ColumnParallelCanonicalLinear(8, 6, blocks=4, group=group))
    attempt("gloo group", lambda: ColumnParallelCanonicalLinear(8, 8, blocks=2, group=gloo))
    attempt("fast group", lambda: RowParallelCanonicalLinear(8, 8, blocks=2, group=fast))
    attempt("no group", lambda: ColumnParallelCanonicalLinear(8, 8, blocks=2, group=None))  # type: ignore[arg-type]
    conv = nn.Conv1d(8, 8, 1)
    attempt("from a conv", lambda: RowParallelCanonicalLinear.from_full(conv, group, 2))  # type: ignore[arg-type]
    layer = ColumnParallelCanonicalLinear(8, 8, blocks=2, group=group)
    narrow = {"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}
    attempt("wrong full shape", lambda: layer.load_full_state_dict(narrow))
    attempt("missing bias", lambda: layer.load_full_state_dict({"weight": torch.zeros(8, 8)}))
    attempt("grads before backward", layer.full_grads)
    attempt("wrong width", lambda: RowParallelCanonicalLinear(8, 8, blocks=2, group=group)(torch.zeros(3, 8)))
    attempt("chunks over blocks", lambda: ColumnParallelCanonicalLinear(8, 8, blocks=2, group=group, chunks=3))
    attempt("row chunks", lambda: RowParallelCanonicalLinear(8, 12, blocks=2, group=group, chunks=3))
    for g in (group, fast, gloo):
        dist.destroy_process_group(g)
    return out
