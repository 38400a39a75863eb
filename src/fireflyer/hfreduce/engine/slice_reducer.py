"""The engine's arithmetic on chunk slices: the compiled kernels where they take the case, else torch ops.

The node stage's reduce and the tree stage's combine and finish each go through one
:class:`SliceReducer` per thread. On contiguous CPU tensors of one dtype it calls
:func:`fireflyer.hfreduce.engine.kernels.reduce` (one pass in C, the same bits as the reference;
see ``engine/kernels.py`` for the NaN and signed-zero rules). Everything else (a strided
tensor, mixed dtypes, the rounding of a partial into a lower precision) and every case
where the communicator runs without the core (``FIREFLYER_HFREDUCE_CORE=0``, or no core
built) goes through :class:`~fireflyer.hfreduce.plans.plan.Reducer`, the torch reference.
"""

from __future__ import annotations

import torch

from fireflyer.hfreduce.engine import kernels
from fireflyer.hfreduce.plans.plan import Op, Reducer, acc_dtype


class SliceReducer:
    """Reduces, combines and finishes chunk slices for one thread; ``compiled=False``: the reference only."""

    def __init__(self, *, compiled: bool) -> None:
        self._compiled = compiled
        self._reducer = Reducer()

    def reduce(self, out: torch.Tensor, inputs: list[torch.Tensor], op: Op, *, divisor: int = 0,
               tree: bool = False) -> None:
        """``out = finish(inputs[0] op inputs[1] op ...)``, in list order (``tree``: in the canonical
        pairwise tree over the inputs' indices; see :func:`fireflyer.hfreduce.engine.kernels.reduce`).

        ``out`` in the accumulation dtype holds a partial (not rounded); in the inputs' dtype,
        the result, divided by ``divisor`` first when it is AVG's (``divisor > 0``).
        ``out`` must not be any of the inputs.
        """
        if self._fits(out, inputs, op):
            kernels.reduce(out, inputs, op, divisor=divisor, tree=tree)
            return
        r = self._reducer
        if out.dtype != acc_dtype(inputs[0].dtype, op):  # rounded into a low precision: accumulate apart
            work = r.acc_scratch(out.numel())
            r.reduce_into(work, inputs, op, tree=tree)
            r.finish(out, work, Op.SUM if op == Op.AVG and not divisor else op, divisor)
        else:
            r.reduce_into(out, inputs, op, tree=tree)
            if divisor:
                r.finish(out, out, op, divisor)

    def combine(self, acc: torch.Tensor, other: torch.Tensor, op: Op) -> None:
        """``acc = acc op other``, in place; ``acc`` is in the accumulation dtype."""
        if self._fits(acc, [acc, other], op):
            kernels.reduce(acc, [acc, other], op)
        else:
            self._reducer.combine(acc, other, op)

    def finish(self, out: torch.Tensor, acc: torch.Tensor, op: Op, world_size: int) -> None:
        """Turn a complete accumulation into the result: divide for AVG, round once into ``out``.

        ``acc`` may be changed on the way."""
        if op == Op.AVG and out.dtype == acc.dtype and self._fits(out, [acc], op):
            kernels.reduce(out, [acc], op, divisor=world_size)
        else:
            self._reducer.finish(out, acc, op, world_size)

    def _fits(self, out: torch.Tensor, inputs: list[torch.Tensor], op: Op) -> bool:
        """Whether the compiled kernels run and take these tensors as they are."""
        if not self._compiled or not kernels.available():
            return False
        dtype, n = inputs[0].dtype, inputs[0].numel()
        for t in inputs:
            if t.dtype != dtype or t.numel() != n or t.device.type != "cpu" or not t.is_contiguous():
                return False
        return out.numel() == n and out.device.type == "cpu" and out.is_contiguous() and \
            out.dtype in (dtype, acc_dtype(dtype, op))
