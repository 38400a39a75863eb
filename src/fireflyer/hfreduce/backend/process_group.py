"""``torch.distributed`` backend ``"hfreduce"``: a Python ProcessGroup over the HFReduce engine.

After ``import fireflyer.hfreduce``, ``dist.init_process_group("hfreduce")`` under torchrun
(or any launcher that sets the usual environment) gives a default group whose
collectives run on the engine and return :class:`~fireflyer.hfreduce.backend.work.HFReduceWork`,
so ``async_op=True`` overlaps them with compute. DDP, FSDP2 (``fully_shard`` on a
DeviceMesh) and ``dist.new_group(backend="hfreduce")`` work on it.

A failed collective raises on every rank, through every door torch offers
(``wait()``, ``get_future()``, ``exception()``), and the group stays failed: every
later collective raises the same error at once. ``destroy_process_group()`` then
cleans up and a new group can be made. :data:`SUPPORTED` lists what this backend
implements; every other collective raises ``NotImplementedError`` naming it.
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from fireflyer.hfreduce.plans import collectives
from fireflyer.hfreduce.backend import cpp_door, spread
from fireflyer.hfreduce.engine.communicator import Communicator, HFReduceConfig
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.hfreduce.diagnosis.flight import trace_of
from fireflyer.hfreduce.backend.point_to_point import ExchangeCollectives
from fireflyer.hfreduce.plans.plan import Kind, Op, Plan
from fireflyer.hfreduce.backend.work import DoneWork, HFReduceWork, seconds
from fireflyer.errors import UserError, UserTypeError

BACKEND = "hfreduce"

#: The torch.distributed functions this backend implements (by the name users call).
SUPPORTED = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier",
    "_coalescing_manager (all_reduce, all_gather_into_tensor, reduce_scatter_tensor)",
    "all_gather_object", "broadcast_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single", "all_to_all", "gather", "scatter",
)

_OPS = {
    dist.ReduceOp.SUM: Op.SUM,
    dist.ReduceOp.AVG: Op.AVG,
    dist.ReduceOp.MIN: Op.MIN,
    dist.ReduceOp.MAX: Op.MAX,
    dist.ReduceOp.PRODUCT: Op.PRODUCT,
    dist.ReduceOp.BAND: Op.BAND,
    dist.ReduceOp.BOR: Op.BOR,
    dist.ReduceOp.BXOR: Op.BXOR,
}
_OP_NAMES = ", ".join(op.name for op in _OPS.values())


def _op(opts) -> Op:
    red = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for torch_op, op in _OPS.items():
        if red == torch_op:
            return op
    raise NotImplementedError(f"hfreduce does not support reduce op {red}; supported: {_OP_NAMES}")


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise UserError(f"hfreduce {what} takes exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


def _check_alike(tensors: list, like: torch.Tensor, what: str, side: str, other: str) -> None:
    """Every one of ``tensors`` (the call's ``side`` list) has ``like``'s (the ``other``'s) size and dtype."""
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() != like.numel() or t.dtype != like.dtype:
            raise UserError(f"hfreduce {what} needs every {side} tensor to match the {other}'s size and dtype "
                             f"({like.numel()} x {like.dtype})")


def _unsupported(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"hfreduce does not implement {name} yet; it supports: {', '.join(SUPPORTED)}. "
        "Use a gloo group for it (dist.new_group(backend='gloo'))."
    )


class HFReduceProcessGroup(ExchangeCollectives, dist.ProcessGroup):
    """A process group whose collectives run on :class:`~fireflyer.hfreduce.engine.communicator.Communicator`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, config: HFReduceConfig | None = None,
                 *, group_name: str = "", global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, world_size)
        self._name = ""
        self._group_store = store
        self._monitored = 0
        self.comm = Communicator(store, rank, world_size, config=config, group_name=group_name,
                                 global_ranks=global_ranks)
        # The C++ door (cpp_door.py): small one-node allreduces without Python between the call and the core.
        self._door = None
        wanted = self.comm.fast_door is not None and self.comm.config.door == "cpp"
        compiled = cpp_door.load() if wanted else None
        if compiled is not None:
            self._door = compiled.Door(self.comm.fast_door, weakref.ref(self), DOOR_OPS,
                                       self.comm.core.node_run_capsule)
            self.comm.flight.attach(self._door)  # the collectives it records itself

    @property
    def door(self) -> str:
        """Which door this group's small allreduces take: ``"cpp"``, ``"python"``, or ``"none"`` (several nodes,
        or no compiled core: every allreduce takes the engine's general path)."""
        if self._door is not None:
            return "cpp"
        return "python" if self.comm.fast_door is not None else "none"

    @property
    def door_calls(self) -> int:
        """How many allreduces the C++ door has taken to the core (0 without it)."""
        return self._door.ran if self._door is not None else 0

    # -- identity ---------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        if not self._name:
            raise UserError("ProcessGroup name not set")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name
        self.comm.flight.group_name = name

    def set_timeout(self, timeout: timedelta) -> None:
        value = seconds(timeout)
        if value is None:
            raise UserError(f"a process group's timeout must be positive, got {timeout}")
        self.comm.set_timeout(value)

    # -- plumbing -----------------------------------------------------------------------
    def _work(self, plans: list[Plan], result: list[torch.Tensor], opts, what: str,
              inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> HFReduceWork:
        timeout = seconds(getattr(opts, "timeout", None))
        trace = (*trace_of(inputs), *trace_of(outputs)) if len(plans) == 1 else None
        for p in plans:
            p.timeout = timeout
            if trace is not None:
                p.trace = trace
        inline = not asynchronous(opts)
        if inline and len(plans) == 1:
            try:
                if self.comm.run_now(plans[0]):
                    return DoneWork(result, plans[0].seq, what)
            except HFReduceError as exc:
                failed: torch.futures.Future = torch.futures.Future()
                failed.set_exception(exc)
                return HFReduceWork(self.comm, [failed], result, seqs=[plans[0].seq], what=what)
        futures = [self.comm.submit(p, inline=inline) for p in plans]
        return HFReduceWork(self.comm, futures, result, seqs=[p.seq for p in plans], what=what)

    def _spread_or_work(self, plans: list[Plan], result: list[torch.Tensor], opts, what: str,
                        inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        """Across several nodes, ``spread``'s work for ``plans`` where it has one; else :meth:`_work`'s.

        A canonical group's reduce-scatters stay on the engine, whose sums follow the canonical tree."""
        summing = any(p.desc.kind == Kind.REDUCE_SCATTER for p in plans)
        keep = summing and self.comm.config.order == "canonical"
        if not keep and len(plans) == 1:  # the flight recorder's sizes, as the engine's path records them
            plans[0].trace = (*trace_of(inputs), *trace_of(outputs))
        across = None if keep else spread.work(self.comm, plans, result, opts, what)
        if across is not None:
            return across
        return self._work(plans, result, opts, what, inputs, outputs)

    # -- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if self._door is not None and opts is not None and type(tensors) is list:
            work = self._door.run(tensors, opts)
            if work is not None:
                return work
        op = _op(opts)
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        t = _one(tensors, "allreduce")
        if not asynchronous(opts) and isinstance(t, torch.Tensor):
            # dist.all_reduce of a small CPU tensor on one node: one call of the compiled core
            try:
                if self.comm.allreduce_now(t, op, seconds(opts.timeout)):
                    return DoneWork(tensors, self.comm.last_number, "all_reduce")
            except HFReduceError as exc:
                return self._failed(exc, tensors, "all_reduce")
        return self._work([collectives.allreduce(t, op, self.size())], tensors, opts, "all_reduce", [t], [t])

    def _failed(self, exc: HFReduceError, tensors: list[torch.Tensor], what: str) -> HFReduceWork:
        """The Work of a collective that failed in the caller's thread: ``wait()`` raises ``exc``, as torch expects."""
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(exc)
        return HFReduceWork(self.comm, [failed], tensors, seqs=[self.comm.last_number], what=what)

    def _door_settle(self, tensors: list[torch.Tensor], slot, ticket, rc: int, stage: int, k: int, chunk: int,
                     interrupt: BaseException | None) -> dist.Work:
        """What the core handed back to the C++ door (a mismatch to finish, a failure, Ctrl-C), settled as the
        Python door settles it."""
        try:
            self.comm.fast_door.settle(slot, tensors[0], ticket, rc, stage, k, chunk, interrupt)
        except HFReduceError as exc:
            return self._failed(exc, tensors, "all_reduce")
        return DoneWork(tensors, ticket[0], "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op(opts)
        plans = [collectives.allreduce(t, op, self.size()) for t in tensors]
        return self._work(plans, tensors, opts, "all_reduce_coalesced", tensors, tensors)

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", 0)
        t = _one(tensors, "broadcast")
        plan = collectives.broadcast(t, root, self.rank(), self.size())
        # several nodes: the root's bytes once each
        return self._spread_or_work([plan], [t], opts, "broadcast", [t], [t])

    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        root = getattr(opts, "rootRank", 0)
        plan = collectives.reduce(t, _op(opts), root, self.rank(), self.size())
        return self._work([plan], [t], opts, "reduce", [t], [t])

    def _gather_into_list(self, outs: list[torch.Tensor], inp: torch.Tensor, what: str) -> Plan:
        """An allgather into a flat buffer, copied out into ``outs`` (one tensor per rank) when done."""
        if len(outs) != self.size():
            raise UserError(f"hfreduce {what} needs an output list of {self.size()} tensors, got {len(outs)}")
        _check_alike(outs, inp, what, "output", "input")
        flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device=inp.device)
        plan = collectives.allgather(flat, inp, self.rank(), self.size())

        def scatter_back() -> None:
            for i, o in enumerate(outs):
                o.copy_(flat[i * inp.numel() : (i + 1) * inp.numel()].view(o.shape))

        plan.on_done.append(scatter_back)
        return plan

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "allgather")
        if len(output_tensors) != 1:
            raise UserError(f"hfreduce allgather needs one output list, got {len(output_tensors)}")
        outs = output_tensors[0]
        plan = self._gather_into_list(outs, inp, "allgather")
        # several nodes: along the rails
        return self._spread_or_work([plan], output_tensors, opts, "all_gather", [inp], list(outs))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """torch's layout: ``output_lists[r][i]`` receives input ``i`` of rank ``r``."""
        if len(output_lists) != self.size() or any(len(outs) != len(input_tensors) for outs in output_lists):
            raise UserError(f"hfreduce all_gather_coalesced needs {self.size()} output lists (one per rank) of "
                             f"{len(input_tensors)} tensors (one per input)")
        plans = [self._gather_into_list([outs[i] for outs in output_lists], inp, "all_gather_coalesced")
                 for i, inp in enumerate(input_tensors)]
        flat_outs = [o for outs in output_lists for o in outs]
        return self._spread_or_work(plans, flat_outs, opts, "all_gather_coalesced", list(input_tensors), flat_outs)

    def all_gather_single(self, output, input, opts=None):
        plan = collectives.allgather(output, input, self.rank(), self.size())
        return self._spread_or_work([plan], [output], opts, "all_gather_into_tensor", [input], [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise UserError(f"hfreduce coalesced all_gather needs as many outputs as inputs, got {len(outputs)} and {len(inputs)}")
        plans = [collectives.allgather(o, i, self.rank(), self.size()) for o, i in zip(outputs, inputs)]
        return self._spread_or_work(plans, outputs, opts, "all_gather_into_tensor_coalesced", inputs, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
            raise UserError(f"hfreduce reduce_scatter needs one input list of {self.size()} tensors")
        ins = input_tensors[0]
        _check_alike(ins, out, "reduce_scatter", "input", "output")
        flat = torch.cat([t.reshape(-1) for t in ins])
        plan = collectives.reduce_scatter(out, flat, _op(opts), self.rank(), self.size())
        # several nodes: partials
        return self._spread_or_work([plan], output_tensors, opts, "reduce_scatter", list(ins), [out])

    def reduce_scatter_single(self, output, input, opts=None):
        plan = collectives.reduce_scatter(output, input, _op(opts), self.rank(), self.size())
        return self._spread_or_work([plan], [output], opts, "reduce_scatter_tensor", [input], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise UserError(f"hfreduce coalesced reduce_scatter needs as many outputs as inputs, got {len(outputs)} and {len(inputs)}")
        op = _op(opts)
        plans = [collectives.reduce_scatter(o, i, op, self.rank(), self.size()) for o, i in zip(outputs, inputs)]
        return self._spread_or_work(plans, outputs, opts, "reduce_scatter_tensor_coalesced", inputs, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._work([collectives.barrier(self.size())], [], opts, "barrier", [], [])

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it within ``timeout`` (gloo's semantics).

        Rank 0 waits for every rank's arrival on the job's store; the others wait for
        rank 0's release. It does not go through the engine, so it works even on a
        group whose collectives failed, and it leaves the group usable.
        """
        limit = seconds(timeout) or self.comm.config.timeout
        n, self._monitored = self._monitored, self._monitored + 1
        store = dist.PrefixStore(f"hfreduce-monitored/{self.comm.incarnation}/{n}", self._group_store)
        store.set(f"arrived/{self.rank()}", "1")
        if self.rank() == 0:
            missing = []
            for r in range(1, self.size()):
                key = f"arrived/{r}"
                if missing:  # the wait is spent: the rest are asked once, not given a round trip's worth of time
                    if not store.check([key]):
                        missing.append(r)
                    continue
                try:
                    store.wait([key], timedelta(seconds=limit))
                except Exception:  # noqa: BLE001 - torch raises its own store timeout flavours
                    missing.append(r)
                    if not wait_all_ranks:
                        break
            if missing:
                which = "Rank" if len(missing) == 1 else "Ranks"
                message = (f"{which} {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                           f"{int(limit * 1000)} ms")
                store.set("released", message)
                raise CollectiveTimeout(message)
            store.set("released", "")
            return
        try:
            store.wait(["released"], timedelta(seconds=limit + 5.0))
        except Exception as exc:  # noqa: BLE001
            raise CollectiveTimeout(f"rank {self.rank()}: rank 0 did not release monitoredBarrier within "
                                    f"{limit + 5.0:g}s") from exc
        message = store.get("released").decode()
        if message:
            raise CollectiveTimeout(f"monitoredBarrier failed on rank 0: {message}")

    # -- lifetime -----------------------------------------------------------------------
    def shutdown(self) -> None:
        self.comm.close()

    def abort(self) -> None:
        self.comm.abort()


#: ProcessGroup methods torch calls for what hfreduce does not implement, and the name users know them by.
_REFUSED = {
    "_start_coalescing": "_coalescing_manager with a device",
    "_end_coalescing": "_coalescing_manager with a device",
}


def _refuse(name: str):
    def refused(self, *args, **kwargs):
        raise _unsupported(name)

    return refused


for _method, _name in _REFUSED.items():
    setattr(HFReduceProcessGroup, _method, _refuse(_name))


def _create(dist_opts, backend_options=None) -> HFReduceProcessGroup:
    """torch's creator hook. ``pg_options`` (``init_process_group``, ``new_group``), where given, is the
    group's :class:`HFReduceConfig` (for example ``HFReduceConfig(order="canonical")``). The group's timeout
    follows the one rule of :attr:`HFReduceConfig.timeout`: the config's own where set, else torch's
    ``timeout=`` where the caller gave one, else ``FIREFLYER_HFREDUCE_TIMEOUT``, else torch's default.
    torch hands its default over when the caller gives none, so a timeout equal to it counts as none."""
    given = torch_timeout(getattr(dist_opts, "timeout", None))
    if backend_options is None:
        config = HFReduceConfig.from_env(timeout=given)
    elif isinstance(backend_options, HFReduceConfig):
        config = backend_options
    else:
        raise UserTypeError(f"hfreduce's pg_options must be an HFReduceConfig, got {type(backend_options).__name__}")
    config = config.settled(given, default=TORCH_DEFAULT_TIMEOUT.total_seconds())
    ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or range(dist_opts.group_size))
    return HFReduceProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, config,
                                group_name=str(getattr(dist_opts, "group_id", "") or ""), global_ranks=ranks)


DOOR_OPS = [-1] * len(dist.ReduceOp.RedOpType.__members__)
"""torch's reduce ops, by their number (``ReduceOp.RedOpType``), as hfreduce's :class:`Op`; -1 where the door
hands the call to the Python door (``PREMUL_SUM``, which it refuses by name)."""
for _torch_op, _hfreduce_op in _OPS.items():
    DOOR_OPS[int(_torch_op)] = int(_hfreduce_op)


def engine_of(group: object) -> Communicator | None:
    """The hfreduce engine behind a torch process group (haiscale's one way in); None where the group is
    not hfreduce's (gloo, NCCL, a torchft wrapper) or is None."""
    return group.comm if isinstance(group, HFReduceProcessGroup) else None


def asynchronous(opts: object) -> bool:
    """Whether torch asked for the collective to go on in the background (``async_op=True``). torch's
    options default to it, and so does a direct call without options."""
    return bool(getattr(opts, "asyncOp", True))


TORCH_DEFAULT_TIMEOUT = default_pg_timeout
"""What torch passes a backend when ``init_process_group``/``new_group`` got no ``timeout``."""


def torch_timeout(timeout: object) -> timedelta | None:
    """The timeout a caller gave torch, or None where it gave none (torch's default stands in for none)."""
    if not isinstance(timeout, timedelta) or timeout == TORCH_DEFAULT_TIMEOUT or timeout <= timedelta(0):
        return None
    return timeout


def register() -> None:
    """Register backend ``"hfreduce"`` with torch.distributed (idempotent)."""
    if BACKEND.upper() in dist.Backend.__dict__ or BACKEND in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
