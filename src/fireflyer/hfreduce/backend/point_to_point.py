"""The ``"hfreduce"`` process group's point-to-point doors: send/recv, all_to_all, gather and scatter.

Mixed into :class:`~fireflyer.hfreduce.backend.process_group.HFReduceProcessGroup`. torch calls
these methods as ``dist.send/recv/isend/irecv/batch_isend_irecv``,
``dist.all_to_all_single``, ``dist.all_to_all``, ``dist.gather`` and ``dist.scatter``
(and ``torch.distributed.pipelining`` through ``batch_isend_irecv``). Each checks its
arguments here, on the caller's thread, hands the transfers to the communicator's
:class:`~fireflyer.hfreduce.transport.exchange.Exchange`, and returns at once a
:class:`~fireflyer.hfreduce.backend.work.HFReduceWork` with the same guarantees as the
collectives': ``wait()`` raises the call's error, a ``wait(timeout)`` that expires fails
the group, and a failed group fails every later call at once.
"""

from __future__ import annotations

import torch

from fireflyer.hfreduce.engine import node_all_to_all
from fireflyer.hfreduce.errors import HFReduceError
from fireflyer.hfreduce.transport.exchange import split_rows
from fireflyer.hfreduce.backend.work import HFReduceWork, seconds
from fireflyer.errors import UserError, UserTypeError


def _single(tensors, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor):
        raise UserError(f"hfreduce {what} takes exactly one tensor, got {len(tensors)}")
    return tensors[0]


def _check_tensors(tensors: list, like: torch.Tensor, count: int, what: str, name: str) -> None:
    if len(tensors) != count:
        raise UserError(f"hfreduce {what} needs a {name} of {count} tensors (one per rank), got {len(tensors)}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise UserTypeError(f"hfreduce {what}: {name}[{i}] is a {type(t).__name__}, not a tensor")
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise UserError(f"hfreduce {what}: {name}[{i}] has {t.numel()} x {t.dtype} but the tensor has "
                             f"{like.numel()} x {like.dtype}; every tensor of the list must match it")


class ExchangeCollectives:
    """send/recv, all_to_all, gather and scatter of a process group whose ``comm`` has an exchange."""

    def _exchange(self):
        exchange = self.comm.exchange
        if exchange is None:
            raise HFReduceError("hfreduce communicator is closed; create a new process group")
        return exchange

    def _root_list(self, lists, like: torch.Tensor, root: int, what: str, side: str) -> list[torch.Tensor] | None:
        """The ``WHAT_list`` (``lists`` is ``[WHAT_list]``, the call's ``side`` argument) on the root, checked
        against ``like``; None elsewhere, where no list may be given."""
        name = f"{what}_list"
        if self.rank() == root:
            if len(lists) != 1:
                raise UserError(f"hfreduce {what} needs one {side} list ({name}) on the root")
            items = list(lists[0])
            _check_tensors(items, like, self.size(), what, name)
            return items
        if lists and any(len(x) for x in lists):
            raise UserError(f"hfreduce {what} takes a {name} on the root only")
        return None

    def _exchange_work(self, op, result: list[torch.Tensor], what: str) -> HFReduceWork:
        return HFReduceWork(self._exchange(), [op.future], result, seqs=[op.id], what=what)

    # -- point to point -----------------------------------------------------------------
    def send(self, tensors, dstRank: int, tag: int = 0):  # noqa: N803 - torch's names
        t = _single(tensors, "send")
        return self._exchange_work(self._exchange().isend(t, dstRank, tag), [t], "send")

    def recv(self, tensors, srcRank: int, tag: int = 0):  # noqa: N803
        t = _single(tensors, "recv")
        return self._exchange_work(self._exchange().irecv(t, srcRank, tag), [t], "recv")

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError("hfreduce recv needs its source rank (dist.recv(tensor, src=...)); receiving "
                                  "from any source is not supported")

    # -- all to all -----------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        if output.dtype != input.dtype:
            raise UserTypeError(f"hfreduce all_to_all_single needs one dtype, got input {input.dtype} and output "
                            f"{output.dtype}")
        exchange = self._exchange()
        out_splits, in_splits = list(output_split_sizes or []), list(input_split_sizes or [])
        # One node: a one-shot through the arena, in the engine's order (node_all_to_all.py).
        if self.comm.num_nodes == 1:
            w = self.size()
            p = node_all_to_all.plan(self.comm, output, input, split_rows(output.shape, out_splits, w, "output"),
                                     split_rows(input.shape, in_splits, w, "input"), even=not out_splits and not in_splits)
            if p is not None:
                return self._work([p], [output], opts, "all_to_all_single", [input], [output])
        op = exchange.all_to_all_single(output, input, out_splits, in_splits, timeout=_timeout(opts),
                                        sync=_sync(opts))
        return self._exchange_work(op, [output], "all_to_all_single")

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        for name, ts in (("input", input_tensors), ("output", output_tensors)):
            if not all(isinstance(t, torch.Tensor) for t in ts):
                raise UserTypeError(f"hfreduce all_to_all takes lists of tensors; the {name} list holds something else")
        op = self._exchange().all_to_all(list(output_tensors), list(input_tensors), timeout=_timeout(opts),
                                         sync=_sync(opts))
        return self._exchange_work(op, list(output_tensors), "all_to_all")

    # -- gather and scatter -----------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        """torch's layout: ``output_tensors`` is ``[gather_list]`` on the root and ``[]`` (or ``[[]]``) elsewhere."""
        t = _single(input_tensors, "gather")
        root = getattr(opts, "rootRank", 0)
        outs = self._root_list(output_tensors, t, root, "gather", "output")
        op = self._exchange().gather(outs, t, root, timeout=_timeout(opts), sync=_sync(opts))
        return self._exchange_work(op, outs if outs is not None else [t], "gather")

    def scatter(self, output_tensors, input_tensors, opts=None):
        """torch's layout: ``input_tensors`` is ``[scatter_list]`` on the root and ``[]`` elsewhere."""
        t = _single(output_tensors, "scatter")
        root = getattr(opts, "rootRank", 0)
        ins = self._root_list(input_tensors, t, root, "scatter", "input")
        op = self._exchange().scatter(t, ins, root, timeout=_timeout(opts), sync=_sync(opts))
        return self._exchange_work(op, [t], "scatter")


def _timeout(opts) -> float | None:
    return seconds(getattr(opts, "timeout", None))


def _sync(opts) -> bool:
    """torch waits on the Work at once (``async_op=False``): the caller may move the bytes itself."""
    return opts is not None and not getattr(opts, "asyncOp", True)
