"""FSDP gradient accumulation in the canonical order, for :func:`fireflyer.haiscale.fully_shard` with ``order="canonical"``.

A step is ``M`` global micro-batches, numbered ``0 .. M-1``, on ``R`` shard ranks of ``m = M / R``
each, and its gradient is, as for DDP (:mod:`fireflyer.haiscale.accumulate`),

    (1/M) * (the sum of the M micro-batch gradients in the canonical tree over their indices).

DDP gives each rank an aligned block of micro-batches and sums it locally, which needs every
rank to hold every gradient in full. FSDP keeps only a shard, so the assignment is
**interleaved** instead: rank ``r``'s ``j``-th micro-batch is global micro-batch ``j*R + r``
(:meth:`~fireflyer.haiscale.fsdp.ShardingInfo.micro_batch_indices`). With ``R`` a power of two,
micro-batches ``j*R .. j*R+R-1`` are an aligned block, hence a subtree (``hfreduce.plans.canonical``),
so the tree over ``M`` is the tree over ``j`` of the trees over ``r``:

* after micro-batch ``j``'s backward, each unit's reduce-scatter (a SUM, no division) on an
  hfreduce group made with ``HFReduceConfig(order="canonical")`` gives each rank its shard of
  the tree over ranks, kept in fp32 for half types;
* a :class:`~fireflyer.hfreduce.plans.canonical.PairwiseAccumulator` per unit folds these shards over
  ``j`` (``log2(m) + 1`` sharded buffers), and the last micro-batch's reduce-scatter output
  becomes ``total / M``, rounded once, which FSDP2 itself turns into the sharded ``.grad``s.

Any ``m`` works, powers of two or not. The global mean loss follows the same tree: the ranks'
per-micro-batch losses are summed over ranks (one canonical allreduce of ``m`` numbers), then
over ``j``. On one rank FSDP2 runs no reduce-scatter at all; there each micro-batch's ``.grad``
is folded directly.

Each unit's reduce-scatter is a :class:`CanonicalReduceScatter` (FSDP2's custom reduce-scatter
hook): it runs asynchronously on the CPU, and folds when the model's
:class:`~fireflyer.haiscale.fsdp_comm.ReduceScatterBacklog` waits for it, as the fast order's
gradients land (see :mod:`fireflyer.haiscale.fsdp_comm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fireflyer.errors import UsageError, UserError
from fireflyer.haiscale import accumulate as micro
from fireflyer.haiscale.fsdp_comm import CUSTOM_REDUCE_SCATTER, ReduceScatter, ReduceScatterBacklog
from fireflyer.hfreduce import engine_of
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, accumulation_dtype


class _Group(NamedTuple):
    """What :func:`fireflyer.haiscale.accumulate.check_order` reads of a group."""

    pg: dist.ProcessGroup
    engine: Any  # the hfreduce Communicator, or None on another backend
    world: int


def check(group: dist.ProcessGroup, mp_policy: MixedPrecisionPolicy | None, optimizer: Any) -> None:
    """Refuse what cannot sum in the canonical order, before anything is sharded."""
    world = group.size()
    micro.check_order("canonical", [_Group(group, engine_of(group), world)], None)
    if world & (world - 1):
        raise UserError(f"order='canonical' needs a power-of-two number of shard ranks (1, 2, 4, 8, ...), but the group "
                        f"has {world}, so the micro-batches of one local step are not a subtree of the canonical tree")
    if mp_policy is not None and (mp_policy.param_dtype is not None or mp_policy.reduce_dtype is not None):
        raise UserError("order='canonical' sums gradients in the parameters' own dtype (fp32 partials for half types) "
                        f"and rounds once; leave mp_policy's param_dtype and reduce_dtype unset (got "
                        f"param_dtype={mp_policy.param_dtype}, reduce_dtype={mp_policy.reduce_dtype})")
    if optimizer is not None:
        raise UserError("order='canonical' steps the optimizer once per fsdp_accumulate() step, not inside each "
                        "micro-batch's backward; build it on model.parameters() and call its step() yourself")
    if not CUSTOM_REDUCE_SCATTER:
        raise UserError("order='canonical' needs FSDP2's custom reduce-scatter hook (set_custom_reduce_scatter), "
                        "which this torch lacks; upgrade torch")


class _Landing(dist.Work):
    """A unit's reduce-scatter in flight: :meth:`wait` waits for it, then folds its sum (once)."""

    def __init__(self, work: dist.Work, fold: Callable[[], None]) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._fold = fold

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
            self._fold()
        return True


class CanonicalReduceScatter(ReduceScatter):
    """The reduce-scatter comm of one unit in the canonical order (one per unit with gradients).

    Sums the ranks' gradients in the tree over ranks (in fp32 for half types), folds the sum
    into the unit's accumulator, and on the step's last micro-batch writes ``total / M`` into
    FSDP2's output, whose views become the sharded gradients.
    """

    def __init__(self, step: CanonicalAccumulation, name: str) -> None:
        self.step = step
        self.name = name
        self.acc: PairwiseAccumulator | None = None
        self.folded = 0
        """Micro-batches of the current step folded so far."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> dist.Work | None:
        if not self.step.active:
            raise UsageError("this model sums gradients in the canonical order: its backward passes run inside "
                             "fsdp_accumulate(model, micro_batches, loss_fn)")
        assert op == dist.ReduceOp.SUM, f"FSDP2 was told to sum without dividing, but reduces with {op}"
        wide = accumulation_dtype(output_tensor.dtype)
        if wide == output_tensor.dtype:
            source, summed = input_tensor, output_tensor
        else:  # half types: the sums in fp32, as one process keeps them
            source = input_tensor.to(wide)
            summed = torch.empty(output_tensor.shape, dtype=wide, device=output_tensor.device)
        work = dist.reduce_scatter_single(summed, source, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        landing = _Landing(work, lambda: self._fold(summed, output_tensor))
        if self.step.overlap:
            self.step.backlog.issued(landing, (source, summed))
        else:
            landing.wait()
            self.step.backlog.issued(None)
        return None

    def start(self) -> None:
        self.acc, self.folded = PairwiseAccumulator(), 0

    def _fold(self, summed: torch.Tensor, output: torch.Tensor) -> None:
        assert self.acc is not None
        self.acc.add(summed)
        self.folded += 1
        if self.folded == self.step.m:
            output.copy_(self.acc.result(keep_accumulator=True).div_(self.step.count))
            self.acc = None  # the partial buffers go back now


class CanonicalAccumulation:
    """One model's canonical accumulation: its units' comms and the step in progress."""

    def __init__(self, group: dist.ProcessGroup, backlog: ReduceScatterBacklog, overlap: bool) -> None:
        self.group = group
        self.world = group.size()
        self.backlog = backlog
        self.overlap = overlap
        """Whether reduce-scatters run while backward goes on (the CPU, unless the config turned it off)."""
        self.comms: list[CanonicalReduceScatter] = []
        self.active = False
        self.m = 0
        """Micro-batches per rank in the current step."""
        self.count = 0
        """Micro-batches in the current step, over every rank (``M``)."""

    def adopt(self, unit: FSDPModule, own: Sequence[nn.Parameter]) -> None:
        """Make ``unit`` (just sharded, owning ``own``) reduce in the canonical order."""
        if not any(p.requires_grad for p in own):
            return
        comm = CanonicalReduceScatter(self, type(unit).__name__)
        unit.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
        # A plain SUM, with no division before or after: the mean is taken once, at the end.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        # Every parameter is reduced in every micro-batch (zeros where unused), so the unit's
        # reduce-scatter has one size throughout the step.
        unit.set_reduce_scatter_unused_params(True, recurse=False)
        self.comms.append(comm)

    def guard(self, root: nn.Module) -> None:
        """Refuse a training forward outside :meth:`run` (evaluation under ``torch.no_grad()`` stays allowed)."""

        def refuse(module: nn.Module, args: Any) -> None:
            if not self.active and torch.is_grad_enabled():
                raise UsageError("this model sums gradients in the canonical order: run a step with "
                                 "fsdp_accumulate(model, micro_batches, loss_fn), or forward under torch.no_grad() "
                                 "to evaluate")

        root.register_forward_pre_hook(refuse, prepend=True)

    def run(self, model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """One step over this rank's micro-batches (``batches[j]`` is global micro-batch ``j*R + rank``);
        the global mean loss. ``model`` is what ``loss_fn`` is called with."""
        if not batches:
            raise UserError("fsdp_accumulate() needs at least one micro-batch")
        m = len(batches)
        self.count = micro.agree_count(engine_of(self.group), m, self.world)
        self.m = m
        params = [p for p in model.parameters() if p.requires_grad]
        alone = [PairwiseAccumulator() for _ in params] if self.world == 1 else []
        losses = []
        for comm in self.comms:
            comm.start()
        self.active = True
        try:
            for j, batch in enumerate(batches):
                for p in params:
                    p.grad = None  # else FSDP2 adds the next micro-batch's sum to this one
                loss = micro.micro_loss(loss_fn, model, batch, j)
                loss.backward()
                losses.append(loss.detach().float())
                if self.world == 1:  # FSDP2 ran no reduce-scatter: each .grad is this micro-batch's own
                    for acc, p in zip(alone, params):
                        acc.add(_local(p))
                else:
                    self._check_folded(j + 1)
        finally:
            self.active = False
        with torch.no_grad():
            for acc, p in zip(alone, params):
                _local(p).copy_(acc.result(keep_accumulator=True).div_(self.count))
        per_micro = torch.stack(losses)
        if self.world > 1:
            dist.all_reduce(per_micro, group=self.group)  # the tree over ranks, for each j
        total = PairwiseAccumulator()
        for loss in per_micro:
            total.add(loss)
        return total.result(keep_accumulator=True).div_(self.count)

    def _check_folded(self, expected: int) -> None:
        for comm in self.comms:
            if comm.folded != expected:
                raise UserError(f"the gradients of unit {comm.name} were reduced {comm.folded} times in "
                                f"{expected} micro-batches; in the canonical order every unit runs forward and "
                                "backward once in each micro-batch")


def _local(p: nn.Parameter) -> torch.Tensor:
    """This rank's shard of ``p``'s gradient."""
    if p.grad is None:
        raise UserError("a parameter that requires grad got no gradient in a micro-batch; in the canonical order "
                        "every unit runs forward and backward in each micro-batch")
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
