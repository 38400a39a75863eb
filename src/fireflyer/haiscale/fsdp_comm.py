"""Reduce-scatters that overlap the rest of backward, for :func:`fireflyer.haiscale.fully_shard`.

torch FSDP2 issues each unit's gradient reduce-scatter from the unit's post-backward
hook and, on the CPU, waits for it right there: the next unit's backward cannot start
until the collective is done. On hfreduce the collective runs on the engine's own
threads, so there is no reason to wait. :class:`OverlappedReduceScatter` is the
``set_custom_reduce_scatter`` comm of every unit: it starts the reduce-scatter with
``async_op=True`` and hands the Work to the model's :class:`ReduceScatterBacklog`.

The backlog keeps one invariant: **a gradient is read only after its reduce-scatter
has landed.** FSDP2 assigns a unit's sharded ``.grad`` (views of the reduce-scatter
output) right after the comm returns, but nothing reads it until

* the next unit's reduce-scatter is issued: the backlog first waits for every older
  one, then runs the optimizer-in-backward step (if any) for the gradients that just
  landed, while the new reduce-scatter is on the wire; or
* the end of backward: an autograd final callback waits for the rest, so when
  ``loss.backward()`` returns every ``.grad`` is complete, as with torch FSDP2.

A reduce-scatter is issued synchronously (FSDP2's own behaviour) whenever FSDP2 would
touch its output right away: a reduce dtype other than the parameters' dtype (it casts
the output), fp16 or another dtype FSDP2 pre/post-divides, an existing ``.grad`` it
accumulates into (gradient accumulation without ``zero_grad``), and any non-CPU device
(there FSDP2 orders the reads on streams instead).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import (
        ReduceScatter,  # the public set_custom_reduce_scatter takes it
    )

    CUSTOM_REDUCE_SCATTER = True
except ImportError:  # a torch without FSDP2's custom reduce-scatter hook: no overlap, same results
    ReduceScatter = object  # type: ignore[assignment,misc]
    CUSTOM_REDUCE_SCATTER = False

_OVERLAP_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes FSDP2 reduces with ReduceOp.AVG and never divides afterwards (see its _get_gradient_divide_factors)."""


class ReduceScatterBacklog:
    """One model's reduce-scatters still in flight, oldest first, and what runs when they land.

    ``on_landed`` (set by :func:`fireflyer.haiscale.fsdp.apply_optimizer_in_backward`)
    runs on the autograd thread each time every gradient assigned so far is complete.
    """

    def __init__(self) -> None:
        self._inflight: deque[tuple[dist.Work, tuple[torch.Tensor, ...]]] = deque()
        self._queued_for: int | None = None
        """The backward (autograd graph task id) whose final callback is queued."""
        self.on_landed: Callable[[], None] | None = None
        self.stats = {"overlapped": 0, "synchronous": 0, "backwards": 0}
        """Counts of reduce-scatters by kind, and of backward passes finished."""

    def issued(self, work: dist.Work | None, keep: tuple[torch.Tensor, ...] = ()) -> None:
        """A unit's reduce-scatter was started (``work``) or already finished (``None``).

        Its gradients are not assigned yet, so every older reduce-scatter is settled
        first and the optimizer runs on those while this one is in flight.
        """
        in_backward = self._queue_final_callback()
        self._settle()
        self.stats["synchronous" if work is None else "overlapped"] += 1
        if work is not None:
            if in_backward:
                self._inflight.append((work, keep))
            else:  # nobody would wait for it later: called by hand outside backward
                work.wait()

    def grad_assigned(self) -> None:
        """A post-accumulate-grad hook saw a sharded gradient arrive (optimizer-in-backward only)."""
        self._queue_final_callback()

    def wait_all(self) -> None:
        """Wait for every reduce-scatter in flight (their gradients may then be read)."""
        while self._inflight:
            work, _ = self._inflight.popleft()
            work.wait()

    def _settle(self) -> None:
        self.wait_all()
        if self.on_landed is not None:
            self.on_landed()

    def _finish_backward(self) -> None:
        self._queued_for = None
        self._settle()
        self.stats["backwards"] += 1

    def _queue_final_callback(self) -> bool:
        """Make sure the end of this backward settles everything; False when not in a backward."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return False
        # Keyed by the backward, not a flag: a backward that raised never ran its callback.
        if self._queued_for == task:
            return True
        Variable._execution_engine.queue_callback(self._finish_backward)
        self._queued_for = task
        return True


class OverlappedReduceScatter(ReduceScatter):
    """The reduce-scatter comm of one FSDP2 unit: asynchronous whenever FSDP2 leaves the output alone."""

    def __init__(self, backlog: ReduceScatterBacklog, params: list[nn.Parameter]) -> None:
        self.backlog = backlog
        self.params = params
        """The unit's own (sharded) parameters: their dtype, and whether a gradient is accumulated."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def can_overlap(self, output: torch.Tensor, op: Any) -> bool:
        """True when FSDP2 neither reads nor writes ``output`` before the next unit's reduce-scatter."""
        return (
            output.device.type == "cpu"
            and output.dtype in _OVERLAP_DTYPES
            and op == dist.ReduceOp.AVG
            and all(p.dtype == output.dtype and p.grad is None for p in self.params)
        )

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self.can_overlap(output_tensor, op):
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            self.backlog.issued(None)
            return None
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        # The backlog holds both buffers until the collective is done: FSDP2 may drop its
        # reference to the input as soon as the next unit reduces.
        self.backlog.issued(work, (output_tensor, input_tensor))
        return None
