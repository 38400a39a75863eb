"""Moving tokens to their experts and back: ``all_to_all_single`` with uneven splits on the EP group.

An expert-parallel MoE layer sends each token to the rank that holds its expert (dispatch),
runs the experts there, and sends the results back (combine). Both moves are one
``torch.distributed.all_to_all_single`` whose split sizes differ per rank and per step, so
the sizes travel first: :func:`exchange_counts` gives every rank of the group every rank's
per-expert counts (one small even all-to-all), from which each rank knows how many rows it
sends to and receives from each peer.

:func:`exchange_rows` is the data move as an autograd function: the gradient of "rows
``send_rows[r]`` go to rank ``r``, ``recv_rows[r]`` come from rank ``r``" is the same
exchange with the two lists swapped, so backward is the reverse all-to-all, on the same
group, in the same order on every rank (autograd runs the layers' backwards in reverse
order everywhere). It works on any backend that implements uneven ``all_to_all_single``:
``"hfreduce"`` (through the node's arena inside a node, the exchange across nodes) and gloo.

:class:`ExchangeTally` counts what crossed the wire: bytes to and from *other* ranks (a
rank's own rows are a local copy) and the seconds spent inside the calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ExchangeTally:
    """Bytes and seconds of a layer's all-to-alls: forward's dispatch, combine and counts, and,
    once backward has run, its two reverse exchanges too."""

    bytes_sent: int = 0
    """Bytes this rank sent to the other ranks of the group."""
    bytes_received: int = 0
    """Bytes this rank received from the other ranks of the group."""
    seconds: float = 0.0
    """Wall time inside ``all_to_all_single`` (the calls are synchronous)."""
    calls: int = 0
    """How many ``all_to_all_single`` calls."""

    def add(self, sent: int, received: int, seconds: float) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.seconds += seconds
        self.calls += 1

    def absorb(self, other: ExchangeTally) -> None:
        """Add another tally's bytes, seconds and calls to this one."""
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.seconds += other.seconds
        self.calls += other.calls


def _row_bytes(t: torch.Tensor) -> int:
    n = t.element_size()
    for d in t.shape[1:]:
        n *= d
    return n


def _all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup,
                tally: ExchangeTally | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows), group=group)
    if tally is not None:
        me, row = dist.get_rank(group), _row_bytes(x)
        tally.add((sum(send_rows) - send_rows[me]) * row, (sum(recv_rows) - recv_rows[me]) * row,
                  time.perf_counter() - start)
    return out


class _ExchangeRows(torch.autograd.Function):
    """Forward: rows to their ranks. Backward: the gradient rows back to where the rows came from."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group, tally):  # noqa: D102 - torch's interface
        ctx.send_rows, ctx.recv_rows, ctx.group, ctx.tally = send_rows, recv_rows, group, tally
        return _all_to_all(x, send_rows, recv_rows, group, tally)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        back = _all_to_all(grad, ctx.recv_rows, ctx.send_rows, ctx.group, ctx.tally)
        return back, None, None, None, None


def exchange_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup,
                  tally: ExchangeTally | None = None) -> torch.Tensor:
    """Send rows (dim 0) of ``x``: the first ``send_rows[0]`` to group rank 0, the next
    ``send_rows[1]`` to rank 1, ...; receive ``recv_rows[r]`` rows from rank ``r``, in rank order.

    Collective on ``group``: every rank calls it with lists that agree (what ``r`` sends ``s`` is
    what ``s`` receives from ``r``; :func:`exchange_counts` gives the sizes). Differentiable: the
    gradient is the reverse exchange. ``tally`` (optional) adds the bytes and seconds of this call
    and of its backward.
    """
    return _ExchangeRows.apply(x, list(send_rows), list(recv_rows), group, tally)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup,
                    tally: ExchangeTally | None = None) -> torch.Tensor:
    """Every rank's ``counts`` (a 1-D int64 tensor, the same length everywhere): row ``r`` of the
    ``(group size, len)`` result is rank ``r``'s.

    An all-gather written as an even ``all_to_all_single`` (each rank sends its vector to every
    peer), so a backend needs one collective for the whole layer: the split sizes of the data
    exchange and the per-expert totals of the group both come from it.
    """
    size = dist.get_world_size(group)
    flat = counts.reshape(1, -1).expand(size, -1).contiguous()
    rows = [1] * size
    return _all_to_all(flat, rows, rows, group, tally)
