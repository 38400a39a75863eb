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
  :class:`~fireflyer.hfreduce.canonical.PairwiseAccumulator` per source (the EP rank the tokens
  came from). Source ``k'`` at local step ``j`` is global micro-batch ``(d*ep + k')*m + j``, so
  each source's stream is an aligned block of ``m`` terms; the streams are summed in the tree over
  ``k'`` (the block of ``ep*m`` terms rank ``d`` of the expert group holds), then over ``d`` by an
  hfreduce group made with ``HFReduceConfig(order="canonical")``, and divided by ``M`` once.
  Every expert gets one term per micro-batch (zero when no token of it was routed there).
* **Dense weights** (gate, shared experts, attention, embeddings) follow DDP's canonical round
  (:class:`fireflyer.haiscale.accumulate.Round`) over the dense group.

:class:`CanonicalMoE` runs such a step for a model with MoE layers; :meth:`MoE.set_order` and the
layer's ``begin_step`` / ``end_micro_batch`` / ``finish_expert_grads`` are the pieces, for a loop
of one's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fireflyer.errors import UsageError, UserError, UserTypeError
from fireflyer.haiscale import accumulate as micro
from fireflyer.haiscale.expert import ep_size_of
from fireflyer.hfreduce.canonical import PairwiseAccumulator, canonical_sum
from fireflyer.hfreduce.reduce import Op

if TYPE_CHECKING:
    from fireflyer.haiscale.moe import MoE


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


def run_blocks(moe: MoE, x: torch.Tensor, blocks: Sequence[Sequence[int]]) -> torch.Tensor:
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


def routed(moe: MoE, flat: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
           weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted outputs ``(N, d)`` in the canonical order (the layer's ``_routed``)."""
    from fireflyer.haiscale.moe import MoEStats  # moe imports this module
    from fireflyer.haiscale.moe_dispatch import ExchangeTally

    c, E, k = moe.config, moe.config.n_routed, moe.config.top_k
    n, d = flat.shape
    chosen, slot = chosen.sort(dim=1)  # a token's slots by ascending expert: the order its k outputs meet
    weights = weights.gather(1, slot)
    expert = chosen.reshape(-1)  # assignment a is (token a // k, its expert)
    if moe.training and moe._counting:
        moe._step_load = moe._step_load.to(expert.device) + torch.bincount(expert, minlength=E)
    assignments = torch.arange(expert.numel(), device=flat.device)
    dropped = 0
    if c.capacity_factor is not None:
        keep = moe._keep(expert, scores.detach().gather(1, chosen).reshape(-1), n)
        dropped = int((~keep).sum())
        assignments = assignments[keep]
    assignments = assignments[torch.argsort(expert[assignments], stable=True)]  # by expert, then by token
    counts = torch.bincount(expert[assignments], minlength=E)
    rows = _TokenCopies.apply(flat, k)[assignments]
    tally = ExchangeTally()
    if moe.training and moe._counting:
        moe._tallies.append(tally)
    if moe.ep_size == 1:
        moe.stats = MoEStats(tokens=counts.tolist(), dropped=dropped, all_to_all=tally)
        done = run_blocks(moe, rows, [counts.tolist()])
    else:
        done = moe._expert_parallel(rows, counts, dropped, tally, run=lambda got, blocks: run_blocks(moe, got, blocks))
    scaled = done * weights.reshape(-1)[assignments].to(flat.dtype).unsqueeze(1)
    slots = flat.new_zeros(n * k, d).index_copy(0, assignments, scaled)
    return _in_slot_order(slots.view(n, k, d))


# -- a step ------------------------------------------------------------------------------------
class _Group(NamedTuple):
    """What :func:`fireflyer.haiscale.accumulate.check_order` reads of a group."""

    pg: Any
    engine: Any  # the hfreduce Communicator, or None on another backend
    world: int


def _group(pg: dist.ProcessGroup | None, what: str) -> _Group:
    if pg is None:
        return _Group(None, None, 1)
    if not isinstance(pg, dist.ProcessGroup):
        raise UserTypeError(f"{what} must be a torch.distributed ProcessGroup this rank belongs to, got "
                            f"{type(pg).__name__}")
    if dist.get_rank(pg) < 0:
        raise UserError(f"{what} does not contain this rank; pass each rank the group it is in")
    g = _Group(pg, getattr(pg, "comm", None), dist.get_world_size(pg))
    if g.world > 1 and getattr(getattr(g.engine, "config", None), "order", None) != "canonical":
        backend = "hfreduce" if g.engine is not None else dist.get_backend(pg)
        raise UserError(f"{what} must sum in the canonical order, but this {backend} group does not; make it with "
                        "dist.new_group(ranks, backend='hfreduce', pg_options=HFReduceConfig(order='canonical'))")
    return g


def check_layout(ep: int, dp: int, ep_rank: int, dp_rank: int, dense_rank: int, dense_world: int) -> None:
    """Refuse an expert-parallel layout whose blocks of micro-batches are not subtrees of the canonical tree."""
    if dense_world != ep * dp:
        raise UserError(f"the dense group has {dense_world} ranks but ep ({ep}) x expert_group ({dp}) is {ep * dp}; "
                        "the dense group is every data replica (ep x dp ranks)")
    if dense_rank != dp_rank * ep + ep_rank:
        raise UserError(f"this rank is dense rank {dense_rank} but EP rank {ep_rank} of copy {dp_rank} (expert_group "
                        f"rank), which is data replica {dp_rank * ep + ep_rank}; number the dense group copy by copy "
                        "(dense rank = expert_group rank x ep + EP rank)")
    if dp > 1 and ep & (ep - 1):
        raise UserError(f"EP {ep} with {dp} data-parallel copies: in the canonical order the EP size must be a power "
                        "of two (1, 2, 4, ...) when copies share the batch, so that each copy's micro-batches are a "
                        "subtree of the tree over the global batch")


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``, in module order."""
    from fireflyer.haiscale.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


class _Flat:
    """Dense gradients of one dtype in one buffer: a bucket for :class:`~fireflyer.haiscale.accumulate.Round`."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        p = params[0]
        self.grads = torch.zeros(sum(q.numel() for q in params), dtype=p.dtype, device=p.device)
        self.params = tuple(range(len(params)))
        self.views = [v.view_as(q) for v, q in zip(self.grads.split([q.numel() for q in params]), params)]
        self.tensors = params


class CanonicalMoE:
    """Training steps of a model with MoE layers in the canonical order (see the module docstring).

    ``steps = CanonicalMoE(model, dense_group=..., expert_group=...)`` switches every MoE layer of
    ``model`` to ``order="canonical"``; then each step is ``loss = steps.accumulate(micro_batches,
    loss_fn)``, ``optimizer.step()`` and the layers' bias update (``update_bias`` over the dense
    group). :meth:`close` switches the layers back.

    Args:
        model: every rank builds it with the same shape and seed (nothing is broadcast), its MoE
            layers on one EP group.
        dense_group: every data replica (dp x ep ranks), an hfreduce group made with
            ``HFReduceConfig(order="canonical")``, numbered copy by copy (rank ``d*ep + k``);
            None on one process.
        expert_group: the ranks holding the same experts (the dp copies, in order), a canonical
            hfreduce group too; None when dp is 1.
    """

    def __init__(self, model: nn.Module, *, dense_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise UserTypeError(f"CanonicalMoE takes an nn.Module, got {type(model).__name__}")
        self.layers = moe_layers(model)
        if not self.layers:
            raise UserError("the model has no MoE layer; use DistributedDataParallel(order='canonical') for a "
                            "dense model")
        sizes = {(m.ep_size, m.ep_rank) for m in self.layers}
        if len(sizes) > 1:
            raise UserError(f"the model's MoE layers sit on different EP groups (size, rank: {sorted(sizes)}); build "
                            "every layer on the same ep_group")
        ep, ep_rank = sizes.pop()
        self.dense, self.expert = _group(dense_group, "dense_group"), _group(expert_group, "expert_group")
        dp_rank = dist.get_rank(expert_group) if expert_group is not None else 0
        dense_rank = dist.get_rank(dense_group) if dense_group is not None else 0
        check_layout(ep, self.expert.world, ep_rank, dp_rank, dense_rank, self.dense.world)
        self.model = model
        experts = {id(p) for m in self.layers for p in m.expert_parameters()}
        dense = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in experts]
        for name, p in dense:
            if ep_size_of(p) > 1:
                raise UserError(f"parameter {name!r} is an expert weight sharded over {ep_size_of(p)} ranks outside "
                                "any MoE layer; CanonicalMoE sums only MoE layers' experts over expert_group")
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for _, p in dense:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        self._flats = [_Flat(ps) for ps in by_dtype.values()]
        for m in self.layers:
            m.set_order("canonical")

    def accumulate(self, micro_batches: Sequence[Any],
                   loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """One step's gradients from this rank's micro-batches; the global mean loss (detached, fp32).

        ``loss_fn(model, micro_batch)`` returns a micro-batch's scalar loss. When this returns, every
        ``.grad`` (dense and expert) holds the mean over all ranks' micro-batches of their gradients,
        in the canonical order: ready for ``optimizer.step()``. Rank ``r`` of the dense group holds
        global micro-batches ``r*m .. r*m+m-1``; every rank passes the same ``m`` (a power of two when
        there are several ranks).
        """
        if not callable(loss_fn):
            raise UserTypeError(f"loss_fn must be a function (model, micro_batch) -> loss, got "
                                f"{type(loss_fn).__name__}")
        if isinstance(micro_batches, (str, bytes)) or not hasattr(micro_batches, "__len__"):
            raise UserTypeError(f"micro_batches must be a sequence (a list of this rank's micro-batches), got "
                                f"{type(micro_batches).__name__}")
        batches = list(micro_batches)
        micro.check_count(len(batches), self.dense.world)
        count = micro.agree_count(self.dense.engine, len(batches), self.dense.world)
        rnd = micro.Round(self._flats, {}, len(batches), count, self.dense.engine, self.dense.world)
        for flat in self._flats:
            for p, view in zip(flat.tensors, flat.views):
                p.grad = view  # backward adds into the buffer, which each micro-batch zeroes
        for m in self.layers:
            m.begin_step()
        for j, batch in enumerate(batches):
            rnd.begin()
            loss = micro.micro_loss(loss_fn, self.model, batch, j)
            loss.backward()
            rnd.end_backward(loss)
            for m in self.layers:
                m.end_micro_batch()
        mean = rnd.finish()
        for m in self.layers:  # in layer order on every rank
            m.finish_expert_grads(count, self.expert.pg)
        return mean

    def close(self) -> None:
        """Switch the layers back to the fast order."""
        for m in self.layers:
            m.set_order("fast")


def reduce_expert_sum(total: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum a rank's block of expert gradients over ``group`` (the expert group), in place, in its canonical order."""
    if group is None or dist.get_world_size(group) == 1:
        return
    engine = _group(group, "expert_group").engine
    engine.allreduce(total, Op.SUM).wait()
