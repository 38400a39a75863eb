"""Gradient accumulation over micro-batches in the canonical order: a step whose bits do not depend on the layout.

A global batch is ``M`` micro-batches, numbered ``0 .. M-1``; with ``R`` data-parallel ranks of
``m = M / R`` micro-batches each, rank ``r`` owns the aligned block ``r*m .. r*m+m-1``. Each
micro-batch's gradient is computed alone (its own backward, from zeroed gradients), and the
step's gradient is

    (1/M) * (the sum of the M micro-batch gradients in the canonical tree over their indices)

(``hfreduce.plans.canonical``). With ``m`` a power of two, a rank's block is a subtree of that tree: the
rank sums it locally with a :class:`~fireflyer.hfreduce.plans.canonical.PairwiseAccumulator`
(``log2(m) + 1`` partial buffers), and an hfreduce group made with
``HFReduceConfig(order="canonical")`` sums the ranks' partials in the tree over ranks. The result
is the tree over all ``M``, so 1 rank with 8 micro-batches, 2 ranks with 4 and 8 ranks with 1 give
the same bits, provided each micro-batch's own gradient does (same kernels and thread count).

A :class:`Round` is one such step on one rank's DDP buckets. It folds a bucket into its
accumulator the moment backward has filled it; on the last micro-batch it also launches the
bucket's allreduce then, in bucket order (so every rank issues the same collectives), which
overlaps the communication with the rest of that backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fireflyer.errors import UserError, UserTypeError
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator
from fireflyer.hfreduce.plans.plan import Op

ORDERS = ("fast", "canonical")


def check_order(order: Any, groups: Sequence[Any], reduce_dtype: torch.dtype | None) -> str:
    """``order`` checked against the groups gradients are reduced over (each with ``pg``, ``engine``, ``world``)."""
    if order not in ORDERS:
        raise UserError(f"order must be one of {list(ORDERS)}, got {order!r}")
    if order == "fast":
        return order
    if len(groups) > 1:
        raise UserError("order='canonical' covers dense data parallel only: expert or per-parameter groups "
                        "(expert_process_group, group_of) are not in the canonical order yet")
    if reduce_dtype is not None:
        raise UserError("order='canonical' keeps partial sums in fp32 for half types and in the gradients' own "
                        f"dtype otherwise; leave reduce_dtype unset (got {reduce_dtype})")
    g = groups[0]
    if g.world > 1:
        config = getattr(g.engine, "config", None)
        if getattr(config, "order", None) != "canonical":
            backend = "hfreduce" if g.engine is not None else dist.get_backend(g.pg)
            raise UserError(
                f"order='canonical' needs a process_group that sums in the canonical order, but this {backend} "
                "group does not; make it with dist.new_group(backend='hfreduce', "
                "pg_options=HFReduceConfig(order='canonical')), or start the job with FIREFLYER_HFREDUCE_ORDER=canonical")
    return order


def check_count(m: int, world: int) -> None:
    """A rank's micro-batch count: at least one, and a power of two when ranks share the batch."""
    if m < 1:
        raise UserError("accumulate() needs at least one micro-batch")
    if world > 1 and m & (m - 1):
        raise UserError(f"{m} micro-batches per rank: in the canonical order each of the {world} ranks must hold a "
                        "power-of-two number of micro-batches (1, 2, 4, ...), so that its block is a subtree of "
                        "the tree over the global batch")


def agree_count(engine: Any, m: int, world: int) -> int:
    """The global micro-batch count ``m * world``, refused unless every rank holds ``m`` (one tiny collective)."""
    if world == 1:
        return m
    counts = torch.tensor([m, -m], dtype=torch.int64)
    engine.allreduce(counts, Op.MAX).wait()
    most, fewest = int(counts[0]), -int(counts[1])
    if most != fewest:
        raise UserError(f"ranks hold between {fewest} and {most} micro-batches in this step; in the canonical order "
                        f"every rank holds the same number (this rank holds {m})")
    return m * world


def micro_loss(loss_fn: Callable[[Any, Any], torch.Tensor], model: Any, micro: Any, index: int) -> torch.Tensor:
    """``loss_fn(model, micro)``, checked to be a scalar tensor that backward can run from."""
    loss = loss_fn(model, micro)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserTypeError(f"loss_fn must return a scalar tensor; micro-batch {index} gave {what}")
    if not loss.requires_grad:
        raise UserError(f"the loss of micro-batch {index} does not require grad: nothing in it depends on the "
                        "model's parameters")
    return loss.reshape(())


class Round:
    """One canonical step over a DDP's buckets (``grads``: flat gradient buffers, ``params``: their parameters).

    Call :meth:`begin` before each micro-batch's backward, :meth:`on_grad` from the parameters'
    post-accumulate hooks, and :meth:`end_backward` after it; after the last, :meth:`finish`
    writes ``total / count`` into the buckets and returns the global mean loss.
    """

    def __init__(self, buckets: Sequence[Any], bucket_of: dict[int, tuple[int, int]], m: int, count: int,
                 engine: Any, world: int) -> None:
        self.buckets, self.bucket_of, self.m, self.count = list(buckets), bucket_of, m, count
        self.engine, self.world = engine, world
        self.grads = [PairwiseAccumulator() for _ in self.buckets]
        self.losses = PairwiseAccumulator()
        self.index = -1
        self.pending: list[int] = []
        self.next_launch = 0
        self.reduced: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.futures: list[Any] = [None] * len(self.buckets)
        self.order: list[int] = []  # every parameter, in the order gradients arrived in the last micro-batch (unused last)

    @property
    def last(self) -> bool:
        return self.index == self.m - 1

    def begin(self) -> None:
        """Start the next micro-batch: gradients from zero."""
        self.index += 1
        self.pending = [len(b.params) for b in self.buckets]
        self.order = []
        for b in self.buckets:
            b.grads.zero_()

    def on_grad(self, i: int) -> None:
        b, _ = self.bucket_of[i]
        self.order.append(i)
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._fold(b)

    def end_backward(self, loss: torch.Tensor) -> None:
        """After the micro-batch's backward: fold the buckets that unused parameters left open."""
        seen = set(self.order)
        self.order += [i for b in self.buckets for i in b.params if i not in seen]
        for b, left in enumerate(self.pending):
            if left > 0:
                self.pending[b] = 0
                self._fold(b)
        self.losses.add(loss.detach().float())

    def _fold(self, b: int) -> None:
        self.grads[b].add(self.buckets[b].grads)
        if self.last:
            self.reduced[b] = self.grads[b].result(keep_accumulator=True)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.reduced[self.next_launch] is not None:
            b = self.next_launch
            if self.world > 1:
                self.futures[b] = self.engine.allreduce(self.reduced[b], Op.SUM)
            self.next_launch += 1

    def finish(self) -> torch.Tensor:
        """Wait for every bucket's sum, publish ``sum / count`` as the gradients; the global mean loss."""
        loss = self.losses.result(keep_accumulator=True).reshape(1)
        if self.world > 1:
            total = self.engine.allreduce(loss, Op.SUM)
        with torch.no_grad():
            for b, bucket in enumerate(self.buckets):
                if self.futures[b] is not None:
                    self.futures[b].wait()  # the engine raises CollectiveTimeout/PeerFailure on its own deadline
                summed = self.reduced[b]
                assert summed is not None
                bucket.grads.copy_(summed.div_(self.count))
            if self.world > 1:
                total.wait()
        return loss.div_(self.count).reshape(())
