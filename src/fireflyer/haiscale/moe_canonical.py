"""The MoE layer in the canonical order: a step whose bits do not depend on the expert-parallel layout.

A step is ``M`` global micro-batches on ``R = dp * ep`` data replicas of ``m`` each: rank
``(d, k)`` (expert-parallel rank ``k`` of ``ep``, data-parallel copy ``d`` of ``dp``) is replica
``r = d*ep + k`` and owns the aligned block ``r*m .. r*m+m-1``, as in
:mod:`fireflyer.haiscale.accumulate`. One process holding every expert and running the ``M``
micro-batches in turn gives the same outputs, losses and gradients, bit for bit, as any such
layout, because every number is computed by the same kernels on the same shapes and every sum
meets its terms in a fixed order:

* **Routing** reads the micro-batch's tokens, the gate and the balancing bias only (the bias is
  updated from exact integer loads, the same on every rank).
* **Expert forward and backward**: an expert runs once per *source micro-batch* on that
  micro-batch's tokens in ascending position (a stable sort by expert), never on the
  concatenation of several sources' tokens, and each block is copied to a fresh tensor first, so
  its matmuls see the same shapes and alignment wherever it runs (:class:`_ExpertFFN`).
* **Combine and dispatch backward**: a token's ``k`` expert outputs, and in backward the
  gradients of its ``k`` copies, are added left to right by ascending expert index, whatever
  order the rows came back in.
* **Expert weight gradients** do not go through autograd's ``+=``: each block's backward
  deposits its ``dW`` in an :class:`ExpertGrads`, which keeps one
  :class:`~fireflyer.hfreduce.plans.canonical.PairwiseAccumulator` per source (the EP rank the tokens
  came from). Source ``k'`` at local step ``j`` is global micro-batch ``(d*ep + k')*m + j``, so
  each source's stream is an aligned block of ``m`` terms; the streams are summed in the tree over
  ``k'`` (the block of ``ep*m`` terms rank ``d`` of the expert group holds), then over ``d`` by an
  hfreduce group made with ``HFReduceConfig(order="canonical")``, and divided by ``M`` once.
  Every expert gets one term per micro-batch (zero when no token of it was routed there).
* **Dense weights** (gate, shared experts, attention, embeddings) follow DDP's canonical round
  (:class:`fireflyer.haiscale.accumulate.Round`) over the dense group.

:class:`~fireflyer.haiscale.moe_steps.CanonicalMoE` runs such a step for a model with MoE layers;
:meth:`MoE.set_order` and the layer's ``begin_step`` / ``end_micro_batch`` / ``finish_expert_grads``
are the pieces, for a loop of one's own. This module holds what a layer runs (it imports no layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fireflyer.errors import UsageError, UserError, UserTypeError
from fireflyer.hfreduce import engine_of
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, canonical_sum
from fireflyer.hfreduce.plans.plan import Op

def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in a new allocation: a kernel sees the same alignment wherever the rows came from."""
    return t.clone(memory_format=torch.contiguous_format)


class ExpertGrads:
    """One layer's expert-weight gradients of a step, kept per source stream in the canonical tree.

    ``params`` are the layer's stacked expert weights (``w1``, ``w3``, ``w2``, local experts first);
    ``sources`` is the EP size (one stream per EP rank the tokens come from).
    """

    def __init__(self, params: Sequence[nn.Parameter], sources: int) -> None:
        self.params = list(params)
        self.sources = sources
        self.streams: list[PairwiseAccumulator] = []
        self._terms: list[torch.Tensor] | None = None  # this micro-batch's dW per source, flat
        self.open = False
        self.muted = False
        """True while a backward must not reach the gradients (a pipeline stage's shape inference, on
        uninitialised tensors: :func:`fireflyer.haiscale.moe.uncounted`)."""

    def begin_step(self) -> None:
        """Empty streams: the step's first micro-batch comes next."""
        self.streams = [PairwiseAccumulator() for _ in range(self.sources)]
        self._terms = None
        self.open = True

    def _flat(self) -> torch.Tensor:
        p = self.params[0]
        return torch.zeros(sum(q.numel() for q in self.params), dtype=p.dtype, device=p.device)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    @torch.no_grad()
    def deposit(self, source: int, expert: int, grads: Sequence[torch.Tensor]) -> None:
        """Add local expert ``expert``'s weight gradients from the tokens of ``source`` to this micro-batch's term."""
        if self.muted:
            return
        if not self.open:
            raise UsageError("this MoE layer sums its expert gradients in the canonical order, so its backward must "
                             "run inside a step: use CanonicalMoE(model, ...).accumulate(micro_batches, loss_fn), or "
                             "call layer.begin_step() first (layer.set_order('fast') turns the mode off)")
        if self._terms is None:
            self._terms = [self._flat() for _ in range(self.sources)]
        for view, g in zip(self._views(self._terms[source]), grads):
            view[expert] += g

    def end_micro_batch(self) -> None:
        """Fold this micro-batch's term into every stream (a zero term where no token came)."""
        if not self.open:
            raise UsageError("end_micro_batch() outside a step: call begin_step() first")
        terms = self._terms if self._terms is not None else [self._flat()] * self.sources
        for stream, term in zip(self.streams, terms):
            stream.add(term)
        self._terms = None

    def total(self) -> torch.Tensor:
        """The tree over the streams of their trees: this rank's block of the step's sum, flat, unrounded."""
        if self._terms is not None:
            raise UsageError("a micro-batch's expert gradients were not folded: call end_micro_batch() after each "
                             "backward")
        if not self.open or not self.streams or self.streams[0].count == 0:
            raise UsageError("no micro-batch ran in this step: call begin_step(), then a forward, backward and "
                             "end_micro_batch() for each micro-batch")
        return canonical_sum([s.result(keep_accumulator=True) for s in self.streams], keep_accumulator=True)

    @torch.no_grad()
    def publish(self, total: torch.Tensor, count: int) -> None:
        """``total / count`` into the weights' ``.grad`` (replacing it); the step is over."""
        total.div_(count)
        for p, g in zip(self.params, self._views(total)):
            g = g.to(p.dtype)
            if p.grad is None or p.grad.shape != p.shape:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        self.open = False


class _ExpertFFN(torch.autograd.Function):
    """One expert's SwiGLU on one source's rows; backward deposits ``dW`` in an :class:`ExpertGrads`
    (so the weights' ``.grad`` stays untouched) and returns the rows' gradient."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, grads, source, expert):  # noqa: D102 - torch's interface
        x, w1, w3, w2 = (_fresh(t) for t in (x, w1, w3, w2))
        a, b = F.linear(x, w1), F.linear(x, w3)
        ctx.save_for_backward(x, w1, w3, w2, a, b)
        ctx.grads, ctx.source, ctx.expert = grads, source, expert
        return F.linear(F.silu(a) * b, w2)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # noqa: D102
        x, w1, w3, w2, a, b = ctx.saved_tensors
        dy = _fresh(dy)
        g = F.silu(a)
        dh = dy @ w2
        da = torch.ops.aten.silu_backward(dh * b, a)
        db = dh * g
        ctx.grads.deposit(ctx.source, ctx.expert, (da.T @ x, db.T @ x, dy.T @ (g * b)))
        return da @ w1 + db @ w3, None, None, None, None, None, None


class _TokenCopies(torch.autograd.Function):
    """Each token's row ``k`` times (its slots, by ascending expert); backward adds a token's ``k`` slot
    gradients left to right."""

    @staticmethod
    def forward(ctx, flat, k):  # noqa: D102
        ctx.k = k
        return flat.unsqueeze(1).expand(-1, k, -1).reshape(-1, flat.shape[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        return _in_slot_order(grad.reshape(-1, ctx.k, grad.shape[1])), None


def _in_slot_order(slots: torch.Tensor) -> torch.Tensor:
    """``(n, k, d) -> (n, d)``: slot 0 + slot 1 + ... + slot k-1, in that order."""
    total = slots[:, 0].contiguous()
    for j in range(1, slots.shape[1]):
        total = total + slots[:, j]
    return total


def run_blocks(moe: nn.Module, x: torch.Tensor, blocks: Sequence[Sequence[int]]) -> torch.Tensor:
    """``x`` holds ``blocks[s][e]`` rows for local expert ``e`` from source ``s``, source-major (as the
    dispatch delivers them); each block runs alone, and the outputs come back in the same order."""
    ex, grads = moe.experts, moe.expert_grads
    assert grads is not None
    outs, start = [], 0
    for s, row in enumerate(blocks):
        for e, n in enumerate(row):
            if n:
                outs.append(_ExpertFFN.apply(x[start:start + n], ex.w1[e], ex.w3[e], ex.w2[e], grads, s, e))
                start += n
    return torch.cat(outs) if outs else x[:0]


def routed(moe: nn.Module, flat: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
           weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted outputs ``(N, d)`` in the canonical order (the layer's ``_routed``)."""
    k = moe.config.top_k
    n, d = flat.shape
    chosen, slot = chosen.sort(dim=1)  # a token's slots by ascending expert: the order its k outputs meet
    weights = weights.gather(1, slot)
    _, assignments, counts, dropped = moe.assign(scores, chosen)  # by expert, then by token
    rows = _TokenCopies.apply(flat, k)[assignments]
    done = moe.dispatch(rows, counts, dropped, run=lambda got, blocks: run_blocks(moe, got, blocks))
    scaled = done * weights.reshape(-1)[assignments].to(flat.dtype).unsqueeze(1)
    slots = flat.new_zeros(n * k, d).index_copy(0, assignments, scaled)
    return _in_slot_order(slots.view(n, k, d))


# -- groups ------------------------------------------------------------------------------------
class CanonicalGroup(NamedTuple):
    """What :func:`fireflyer.haiscale.accumulate.check_order` reads of a group."""

    pg: Any
    engine: Any  # the hfreduce Communicator, or None on another backend
    world: int


def canonical_group(pg: dist.ProcessGroup | None, what: str) -> CanonicalGroup:
    """``pg`` (None: this rank alone) checked to sum in the canonical order; ``what`` names it in the error."""
    if pg is None:
        return CanonicalGroup(None, None, 1)
    if not isinstance(pg, dist.ProcessGroup):
        raise UserTypeError(f"{what} must be a torch.distributed ProcessGroup this rank belongs to, got "
                            f"{type(pg).__name__}")
    if dist.get_rank(pg) < 0:
        raise UserError(f"{what} does not contain this rank; pass each rank the group it is in")
    g = CanonicalGroup(pg, engine_of(pg), dist.get_world_size(pg))
    if g.world > 1 and getattr(getattr(g.engine, "config", None), "order", None) != "canonical":
        backend = "hfreduce" if g.engine is not None else dist.get_backend(pg)
        raise UserError(f"{what} must sum in the canonical order, but this {backend} group does not; make it with "
                        "dist.new_group(ranks, backend='hfreduce', pg_options=HFReduceConfig(order='canonical'))")
    return g


def reduce_expert_sum(total: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum a rank's block of expert gradients over ``group`` (the expert group), in place, in its canonical order."""
    if group is None or dist.get_world_size(group) == 1:
        return
    engine = canonical_group(group, "expert_group").engine
    engine.allreduce(total, Op.SUM).wait()
