"""Whole training steps in the canonical order: :class:`CanonicalSteps` (any model, driven micro-batch by
micro-batch, as a pipeline's schedule does) and :class:`CanonicalMoE` (a model with MoE layers).

Each MoE layer computes in the canonical order (:mod:`fireflyer.haiscale.moe_canonical`); this
module drives a step over them: the micro-batches' forwards and backwards, the dense gradients in
DDP's canonical round (:class:`fireflyer.haiscale.accumulate.Round`) over the dense group, and each
layer's expert gradients summed over its per-source streams and the expert group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.errors import UsageError, UserError, UserTypeError
from fireflyer.haiscale import accumulate as micro
from fireflyer.haiscale.expert import ep_size_of
from fireflyer.haiscale.moe import MoE
from fireflyer.haiscale.moe_canonical import canonical_group


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
    return [m for m in model.modules() if isinstance(m, MoE)]


class _Flat:
    """Dense gradients of one dtype in one buffer: a bucket for :class:`~fireflyer.haiscale.accumulate.Round`."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        p = params[0]
        self.grads = torch.zeros(sum(q.numel() for q in params), dtype=p.dtype, device=p.device)
        self.params = tuple(range(len(params)))
        self.views = [v.view_as(q) for v, q in zip(self.grads.split([q.numel() for q in params]), params)]
        self.tensors = params


class CanonicalSteps:
    """Training steps of a model in the canonical order, micro-batch by micro-batch (see the module docstring).

    ``steps = CanonicalSteps(model, dense_group=..., expert_group=...)`` switches every MoE layer of
    ``model`` (it may have none) to ``order="canonical"``. A step is either :meth:`accumulate`, or,
    for a loop that runs the backwards itself (a pipeline's schedule), :meth:`begin`, then
    :meth:`begin_micro_batch` before and :meth:`end_micro_batch` after each micro-batch's backward,
    then :meth:`finish`. Then ``optimizer.step()`` and the layers' bias update (``update_bias`` over
    the dense group). :meth:`close` switches the layers back.

    Args:
        model: every rank builds it with the same shape and seed (nothing is broadcast), its MoE
            layers on one EP group.
        dense_group: every data replica (dp x ep ranks), an hfreduce group made with
            ``HFReduceConfig(order="canonical")``, numbered copy by copy (rank ``d*ep + k``);
            None on one process.
        expert_group: the ranks holding the same experts (the dp copies, in order), a canonical
            hfreduce group too; None when dp is 1 or the model has no MoE layer.
    """

    def __init__(self, model: nn.Module, *, dense_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise UserTypeError(f"{type(self).__name__} takes an nn.Module, got {type(model).__name__}")
        self.layers = moe_layers(model)
        self.dense, self.expert = canonical_group(dense_group, "dense_group"), canonical_group(expert_group, "expert_group")
        if self.layers:
            sizes = {(m.ep_size, m.ep_rank) for m in self.layers}
            if len(sizes) > 1:
                raise UserError(f"the model's MoE layers sit on different EP groups (size, rank: {sorted(sizes)}); "
                                "build every layer on the same ep_group")
            ep, ep_rank = sizes.pop()
            dp_rank = dist.get_rank(expert_group) if expert_group is not None else 0
            dense_rank = dist.get_rank(dense_group) if dense_group is not None else 0
            check_layout(ep, self.expert.world, ep_rank, dp_rank, dense_rank, self.dense.world)
        self.model = model
        experts = {id(p) for m in self.layers for p in m.expert_parameters()}
        dense = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in experts]
        for name, p in dense:
            if ep_size_of(p) > 1:
                raise UserError(f"parameter {name!r} is an expert weight sharded over {ep_size_of(p)} ranks outside "
                                "any MoE layer; the canonical steps sum only MoE layers' experts over expert_group")
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for _, p in dense:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        self._flats = [_Flat(ps) for ps in by_dtype.values()]
        self._round: micro.Round | None = None
        self._count = 0
        for m in self.layers:
            m.set_order("canonical")

    def begin(self, m: int) -> int:
        """Start a step of ``m`` micro-batches on this rank; the global count (a tiny collective on the dense
        group, which refuses ranks that hold different counts)."""
        micro.check_count(m, self.dense.world)
        self._count = micro.agree_count(self.dense.engine, m, self.dense.world)
        self._round = micro.Round(self._flats, {}, m, self._count, self.dense.engine, self.dense.world)
        for flat in self._flats:
            for p, view in zip(flat.tensors, flat.views):
                p.grad = view  # backward adds into the buffer, which each micro-batch zeroes
        for layer in self.layers:
            layer.begin_step()
        return self._count

    def _open(self) -> micro.Round:
        if self._round is None:
            raise UsageError("no canonical step is open: call begin(micro_batches) first")
        return self._round

    def begin_micro_batch(self) -> None:
        """Before a micro-batch's backward: its gradients start from zero."""
        self._open().begin()

    def end_micro_batch(self, loss: torch.Tensor | None) -> None:
        """After a micro-batch's backward: fold its gradients into the step's trees. ``loss`` is the micro-batch's
        (None on a rank that computes no loss, such as a pipeline's earlier stages)."""
        rnd = self._open()
        for layer in self.layers:
            layer.end_micro_batch()
        rnd.end_backward(loss if loss is not None else torch.zeros((), dtype=torch.float32))

    def finish(self) -> torch.Tensor:
        """End the step: every ``.grad`` holds the mean over the global micro-batches in the canonical order;
        the global mean loss (collectives on the dense and expert groups)."""
        rnd = self._open()
        if rnd.index != rnd.m - 1:
            raise UsageError(f"the step was begun with {rnd.m} micro-batches but {rnd.index + 1} ran")
        self._round = None
        mean = rnd.finish()
        for layer in self.layers:  # in layer order on every rank
            layer.finish_expert_grads(self._count, self.expert.pg)
        return mean

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
        self.begin(len(batches))
        try:
            for j, batch in enumerate(batches):
                self.begin_micro_batch()
                loss = micro.micro_loss(loss_fn, self.model, batch, j)
                loss.backward()
                self.end_micro_batch(loss)
        except BaseException:
            self._round = None
            raise
        return self.finish()

    def close(self) -> None:
        """Switch the layers back to the fast order."""
        for m in self.layers:
            m.set_order("fast")


class CanonicalMoE(CanonicalSteps):
    """:class:`CanonicalSteps` for a model that has MoE layers (refused without one: a dense model's steps are
    ``DistributedDataParallel(order="canonical")``'s)."""

    def __init__(self, model: nn.Module, *, dense_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        if isinstance(model, nn.Module) and not moe_layers(model):
            raise UserError("the model has no MoE layer; use DistributedDataParallel(order='canonical') for a "
                            "dense model")
        super().__init__(model, dense_group=dense_group, expert_group=expert_group)
