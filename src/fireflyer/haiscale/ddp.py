"""HaiScale DistributedDataParallel: each gradient bucket's allreduce starts the moment backward fills it.

Paper §V-A: HaiScale DDP runs an asynchronous HFReduce allreduce on gradients as they
are computed, so communication overlaps the rest of backward, and the reduction runs on
the CPU, so it takes no GPU compute at all.

How it works:

* Gradients live in flat bucket buffers: each parameter's ``.grad`` is a view into its
  bucket, so a bucket is reduced in place with one collective and no gathering copy.
* A post-accumulate-grad hook on every parameter counts the bucket down; a full bucket
  is handed to the hfreduce engine at once (``Communicator.allreduce(..., Op.AVG)``),
  which moves it through shared memory and the inter-node trees on its own threads.
  Buckets are launched strictly in order, so every rank issues the same collectives in
  the same order even when gradients arrive in a different order.
* The average is taken once, in the engine's final reduction step (fp16/bf16 are
  accumulated in fp32 there and rounded once). ``reduce_dtype=torch.float32`` also
  makes the whole collective, inter-node hops included, run in fp32 for bf16 models.
* At the end of backward (an autograd engine callback) any bucket with unused
  parameters is launched, then every bucket is awaited. When ``backward()`` returns,
  ``.grad`` holds the average over ranks, exactly as with torch DDP.
* After the first step the buckets are rebuilt in the order gradients actually arrived
  (rank 0's order, so all ranks agree), which gives the best overlap.

On another backend (gloo, nccl) the same wrapper uses plain ``dist.all_reduce`` with
``async_op=True``; on hfreduce it talks to the engine directly.

Expert parallel (MoE): expert weights are sharded over the EP group and replicated over
data parallel, so their gradients are averaged only over the ranks holding the same
experts (``expert_process_group``), the rest over ``process_group``. Each group's
parameters get buckets of their own, and every rank launches all buckets in one list
order planned from the same parameter order (rank 0's of ``process_group``, which
contains every expert group), so each group's ranks issue its collectives in the same
sequence: no rank waits in one group for a peer that is waiting in another.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.haiscale import accumulate as micro
from fireflyer.haiscale.buckets import plan_buckets
from fireflyer.haiscale.expert import ep_size_of, is_expert_param
from fireflyer.hfreduce import engine_of
from fireflyer.hfreduce.plans.plan import Op
from fireflyer.errors import UsageError, UserError, UserTypeError


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """How :class:`DistributedDataParallel` buckets and reduces gradients."""

    bucket_cap_mb: float = 25.0
    """Bucket size in MiB. Larger buckets mean fewer collectives; smaller ones start earlier."""
    first_bucket_mb: float = 1.0
    """The first bucket (the last layers) is smaller so communication starts early in backward."""
    reduce_dtype: torch.dtype | None = None
    """Reduce in this dtype (e.g. ``torch.float32`` for a bf16 model); default: the gradients' dtype."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank at each forward."""
    check_model: bool = True
    """Check at wrap time that every rank built the same model (names, shapes, dtypes)."""
    rebuild_buckets: bool = True
    """Re-plan the buckets after the first step in the order gradients actually arrived."""
    timeout: float = 300.0
    """Seconds to wait for a bucket at the end of backward on backends without their own timeout."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise UserError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if not self.first_bucket_mb > 0:
            raise UserError(f"first_bucket_mb must be positive, got {self.first_bucket_mb}")
        if self.reduce_dtype is not None and (not isinstance(self.reduce_dtype, torch.dtype) or not self.reduce_dtype.is_floating_point):
            raise UserError(f"reduce_dtype must be a floating torch.dtype such as torch.float32, got {self.reduce_dtype!r}")
        if not self.timeout > 0:
            raise UserError(f"timeout must be positive seconds, got {self.timeout}")


@dataclass(frozen=True)
class _Group:
    """A process group some gradients are averaged over, and how to reach it."""

    pg: dist.ProcessGroup
    engine: Any  # the hfreduce Communicator, or None on another backend
    world: int
    root: int  # the global rank of the group's rank 0


def _group(pg: dist.ProcessGroup) -> _Group:
    return _Group(pg, engine_of(pg), dist.get_world_size(pg), dist.get_global_rank(pg, 0))


class _Bucket:
    __slots__ = ("params", "grads", "comm", "flags", "group", "handle", "launched_at", "done_at")

    def __init__(self, params: tuple[int, ...], grads: torch.Tensor, comm: torch.Tensor,
                 flags: torch.Tensor | None, group: int = 0) -> None:
        self.params, self.grads, self.comm, self.flags = params, grads, comm, flags
        self.group = group  # index into DistributedDataParallel._groups
        self.handle: Any = None
        self.launched_at = 0.0
        self.done_at = 0.0


class _Step:
    """What one synchronising backward has seen so far."""

    __slots__ = ("ready", "used", "pending", "next_launch", "order")

    def __init__(self, buckets: list[_Bucket]) -> None:
        self.ready: set[int] = set()
        self.used: set[int] = set()
        self.pending = [len(b.params) for b in buckets]
        self.next_launch = 0
        self.order: list[int] = []


class DistributedDataParallel(nn.Module):
    """Data parallel training over hfreduce, a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    ``ddp = DistributedDataParallel(model)``; then ``loss = loss_fn(ddp(x), y)``,
    ``loss.backward()`` and ``optimizer.step()`` as usual. Gradients are averaged
    across the ranks of ``process_group`` (default: the whole job) when backward
    returns. ``with ddp.no_sync():`` accumulates gradients locally. Call
    :meth:`close` to remove the hooks.

    For an MoE model pass ``expert_process_group`` (a layout's ``expert_group``): the
    parameters marked with :func:`fireflyer.haiscale.expert.mark_expert` are averaged
    over it, and at wrap time they get the values of its rank 0, so expert weights may
    differ between the ranks of ``process_group`` (only names, shapes and dtypes must
    agree). ``group_of(name, param)`` is the general form: it returns the group of each
    parameter (None: ``process_group``). Every such group must contain this rank and
    lie inside ``process_group``.

    ``order="canonical"`` (on a group made with ``HFReduceConfig(order="canonical")``) makes a
    step's gradients independent of the layout, bit for bit: steps then go through
    :meth:`accumulate`, which sums every rank's micro-batches in one pairwise tree over their
    global index (:mod:`fireflyer.haiscale.accumulate`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        expert_process_group: dist.ProcessGroup | None = None,
        group_of: Callable[[str, nn.Parameter], dist.ProcessGroup | None] | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        reduce_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        check_model: bool = True,
        rebuild_buckets: bool = True,
        timeout: float = 300.0,
        order: str = "fast",
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise UserTypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise UserError("torch.distributed is not initialised: call dist.init_process_group('hfreduce') first "
                             "(for example under torchrun)")
        self.config = DDPConfig(
            bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, reduce_dtype=reduce_dtype,
            broadcast_buffers=broadcast_buffers, check_model=check_model, rebuild_buckets=rebuild_buckets,
            timeout=timeout,
        )
        self.module = module
        if process_group is not None:
            _check_group(process_group, "process_group")
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.expert_process_group = expert_process_group
        self._comm = engine_of(self.process_group)  # the hfreduce engine, when that is the backend
        self._world = dist.get_world_size(self.process_group)
        self._root = dist.get_global_rank(self.process_group, 0)
        self._groups: list[_Group] = [_group(self.process_group)]
        self._group_tags = [""]  # how the model check names each group (the default group: nothing)
        self._label = self._labeller(expert_process_group, group_of)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UserError("the module has no parameters that require grad, so there is nothing to synchronise")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise UserError(f"all parameters must be on one device, got {sorted(map(str, devices))}; "
                             "wrap one model replica per rank (use pipeline stages to split a model)")
        self.device = devices.pop()
        for n, p in named:
            if p.layout != torch.strided:
                raise UserError(f"parameter {n!r} has layout {p.layout}; only dense parameters are supported")
        self._labels = [self._label(n, p) for n, p in named]  # the group each gradient is averaged over
        self.order = micro.check_order(order, self._groups, reduce_dtype)
        self._members = [[i for i, g in enumerate(self._labels) if g == label] for label in range(len(self._groups))]
        self._buffers_list = [b for b in module.buffers()]
        self._buffer_labels = [self._buffer_label(b) for b in self._buffers_list]
        if self.config.check_model:
            self._check_same_model()
        all_params = list(module.named_parameters())
        self._sync_tensors([p.detach() for _, p in all_params] + self._buffers_list,
                           [self._label(n, p) for n, p in all_params] + self._buffer_labels)

        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        self._buckets: list[_Bucket] = []
        self._build(list(reversed(range(len(self._params)))))
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self._params)]
        self._require_sync = True
        self._sync_backward = True
        self._step: _Step | None = None
        self._rebuilt = not self.config.rebuild_buckets
        self._closed = False
        self._stats = {"steps": 0, "allreduce_bytes": 0, "allreduce_seconds": 0.0, "wait_seconds": 0.0}
        self._round: micro.Round | None = None

    # ------------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise UsageError("this DistributedDataParallel was closed; wrap the module again to keep training")
        self._sync_backward = self._require_sync
        if self._sync_backward and self.order == "canonical":
            raise UsageError("this DDP sums in the canonical order: run a step with ddp.accumulate(micro_batches, "
                             "loss_fn), or forward inside no_sync() to accumulate gradients locally")
        if self.config.broadcast_buffers and self._buffers_list and any(g.world > 1 for g in self._groups):
            self._sync_tensors(self._buffers_list, self._buffer_labels)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block accumulate gradients without communicating."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether backward passes reduce gradients from now on, for schedules that run backward themselves.

        A pipeline schedule calls backward once per micro-batch; it turns sync off for all
        but the last, so gradients are reduced once per step. ``no_sync()`` is the same,
        scoped to a block of forwards.
        """
        self._require_sync = bool(requires)
        self._sync_backward = bool(requires)

    def accumulate(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """One step's gradients from this rank's micro-batches; the global mean loss (detached, fp32).

        ``loss_fn(ddp, micro_batch)`` returns a micro-batch's scalar loss (a mean over its samples).
        When this returns, ``.grad`` holds (replacing what it held) the mean over every rank's micro-batches of their
        gradients, as if each loss were divided by the global count: ready for ``optimizer.step()``.
        Every rank must pass the same number of micro-batches.

        With ``order="canonical"`` the micro-batches of all ranks are summed in the canonical tree
        over their global index (rank ``r`` holds ``r*m .. r*m+m-1``, ``m`` a power of two when
        there are several ranks), so the gradients' bits are those of one process running every
        micro-batch; see :mod:`fireflyer.haiscale.accumulate`. With ``order="fast"`` it is the
        usual ``no_sync`` accumulation, the last backward's buckets reduced as it runs.
        """
        if self._closed:
            raise UsageError("this DistributedDataParallel was closed; wrap the module again to keep training")
        if not callable(loss_fn):
            raise UserTypeError(f"loss_fn must be a function (model, micro_batch) -> loss, got {type(loss_fn).__name__}")
        if isinstance(micro_batches, (str, bytes)) or not hasattr(micro_batches, "__len__"):
            raise UserTypeError(f"micro_batches must be a sequence (a list of this rank's micro-batches), got "
                                f"{type(micro_batches).__name__}")
        batches = list(micro_batches)
        if self.order == "fast":
            return self._accumulate_fast(batches, loss_fn)
        micro.check_count(len(batches), self._world)
        count = micro.agree_count(self._comm, len(batches), self._world)
        previous = self._require_sync
        self._require_sync = False
        self._round = rnd = micro.Round(self._buckets, self._bucket_of, len(batches), count, self._comm, self._world)
        try:
            for i, p in enumerate(self._params):
                p.grad = self._views[i]  # backward accumulates into the buckets, which each micro-batch zeroes
            for j, batch in enumerate(batches):
                started = time.perf_counter()
                rnd.begin()
                loss = micro.micro_loss(loss_fn, self, batch, j)
                loss.backward()
                rnd.end_backward(loss)
            waited = time.perf_counter()
            mean = rnd.finish()
        finally:
            self._round = None
            self._require_sync = previous
        st = self._stats
        st["steps"] += 1
        st["allreduce_bytes"] += sum(b.grads.numel() * b.grads.element_size() for b in self._buckets)
        st["wait_seconds"] += time.perf_counter() - waited
        st["allreduce_seconds"] += time.perf_counter() - started
        if not self._rebuilt:
            self._rebuilt = True
            self._rebuild(rnd.order)
        return mean

    def _accumulate_fast(self, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        if not batches:
            raise UserError("accumulate() needs at least one micro-batch")
        for p in self._params:
            if p.grad is not None:
                p.grad.detach().zero_()
        total = torch.zeros((), dtype=torch.float32)
        for j, batch in enumerate(batches):
            with (self.no_sync() if j < len(batches) - 1 else contextlib.nullcontext()):
                loss = micro.micro_loss(loss_fn, self, batch, j)
                (loss / len(batches)).backward()
            total += loss.detach().float()
        total = (total / len(batches)).reshape(1)
        if self._world > 1:
            if self._comm is not None:
                self._comm.allreduce(total, Op.AVG).wait()
            else:
                dist.all_reduce(total, group=self.process_group)
                total.div_(self._world)
        return total.reshape(())

    def stats(self) -> dict[str, float]:
        """Cumulative counters since wrapping.

        ``steps``: synchronised backward passes; ``allreduce_bytes``: bytes reduced;
        ``allreduce_seconds``: time the buckets spent in the engine, each counted from when
        it could start (this includes waiting for the slowest rank's gradients);
        ``wait_seconds``: time backward's end waited for communication (the exposed part).
        """
        out = dict(self._stats)
        out["buckets"] = len(self._buckets)
        return out

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [b.comm.numel() * b.comm.element_size() for b in self._buckets]

    def close(self) -> None:
        """Remove the hooks; the module keeps its parameters and last gradients. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._release_buffers()

    # ------------------------------------------------------------------ groups
    def _labeller(self, expert_group: dist.ProcessGroup | None,
                  group_of: Callable[[str, nn.Parameter], dist.ProcessGroup | None] | None
                  ) -> Callable[[str, nn.Parameter], int]:
        """A function from a parameter to the index in ``self._groups`` of the group its gradient is averaged over."""
        if expert_group is not None and group_of is not None:
            raise UserError("give expert_process_group or group_of, not both (group_of is the general form)")
        if group_of is not None and not callable(group_of):
            raise UserTypeError(f"group_of must be a function (name, parameter) -> ProcessGroup or None, "
                                f"got {type(group_of).__name__}")
        if expert_group is not None:
            expert = self._add_group(expert_group, "expert_process_group", " expert")
            return lambda name, p: expert if is_expert_param(p) else 0
        if group_of is not None:
            labels: dict[str, int] = {}

            def label(name: str, p: nn.Parameter) -> int:
                if name not in labels:
                    pg = group_of(name, p)
                    labels[name] = 0 if pg is None else self._add_group(pg, f"group_of({name!r})", None)
                return labels[name]

            return label

        def dense(name: str, p: nn.Parameter) -> int:
            if ep_size_of(p) > 1:
                raise UserError(
                    f"parameter {name!r} is an expert weight sharded over {ep_size_of(p)} EP ranks, but no "
                    "expert_process_group was given, so it would be averaged with other ranks' experts; pass "
                    "expert_process_group= (the layout's expert_group: the ranks holding the same experts)")
            return 0

        return dense

    def _add_group(self, pg: Any, what: str, tag: str | None) -> int:
        """The index of ``pg`` in ``self._groups``, checked and added on first sight."""
        if pg is self.process_group:
            return 0
        for i, g in enumerate(self._groups):
            if g.pg is pg:
                return i
        _check_group(pg, what)
        outside = sorted(set(dist.get_process_group_ranks(pg)) - set(dist.get_process_group_ranks(self.process_group)))
        if outside:
            raise UserError(f"{what} has ranks {outside} that are not in process_group; each gradient group must be "
                             "a subgroup of process_group (for MoE: the expert group, the ranks with the same experts, "
                             "inside the dense group), so that every rank plans the same buckets")
        self._groups.append(_group(pg))
        self._group_tags.append(tag if tag is not None else f" group {len(self._groups) - 1}")
        return len(self._groups) - 1

    def _buffer_label(self, b: torch.Tensor) -> int:
        """Buffers marked as expert tensors are broadcast within the expert group, the rest within process_group."""
        if self.expert_process_group is not None and is_expert_param(b):
            return self._add_group(self.expert_process_group, "expert_process_group", " expert")
        return 0

    # ------------------------------------------------------------------ wrap-time checks
    def _check_same_model(self) -> None:
        """Every rank must build the same model; otherwise gradients would be summed across unrelated tensors.

        Values are not compared (wrapping broadcasts them), so expert weights may differ between
        EP ranks; which group each parameter is averaged over must agree.
        """
        tags = self._group_tags
        mine = [f"param {n} {tuple(p.shape)} {p.dtype}{tags[g]}" for n, p, g in zip(self._names, self._params, self._labels)]
        mine += [f"buffer {n} {tuple(b.shape)} {b.dtype}{tags[self._buffer_label(b)]}"
                 for n, b in self.module.named_buffers()]
        digest = hashlib.sha256("\n".join(mine).encode()).hexdigest()
        everyone: list[Any] = [None] * self._world
        dist.all_gather_object(everyone, (digest, mine), group=self.process_group)
        reference = everyone[0][1]
        differing = [r for r, (d, _) in enumerate(everyone) if d != everyone[0][0]]
        if not differing:
            return
        first = differing[0]
        theirs = everyone[first][1]
        detail = next(
            (f"rank {first} has '{b}' where rank 0 has '{a}'" for a, b in zip(reference, theirs) if a != b),
            f"rank {first} has {len(theirs)} parameters and buffers where rank 0 has {len(reference)}",
        )
        raise UserError(f"the model differs across ranks (ranks {differing} differ from rank 0): {detail}; "
                         "every rank must construct the same model before wrapping it")

    def _sync_tensors(self, tensors: list[torch.Tensor], labels: list[int]) -> None:
        """Copy each group's rank 0's values of ``tensors`` to its ranks, one broadcast per (group, device, dtype).

        Groups go in index order, so every rank issues the same broadcasts in the same order.
        """
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t, label in zip(tensors, labels):
            if self._groups[label].world > 1:
                groups.setdefault((label, t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for (label, _, _), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
                g = self._groups[label]
                flat = torch.cat([t.reshape(-1) for t in group])
                if g.engine is not None:
                    g.engine.broadcast(flat, root=0).wait()
                else:
                    dist.broadcast(flat, src=g.root, group=g.pg)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    # ------------------------------------------------------------------ buckets
    def _build(self, order: list[int]) -> None:
        reduce_dtype = self.config.reduce_dtype
        plan = plan_buckets(
            order,
            [p.numel() for p in self._params],
            [(reduce_dtype or p.dtype).itemsize for p in self._params],
            [p.dtype for p in self._params],
            cap_bytes=int(self.config.bucket_cap_mb * (1 << 20)),
            first_cap_bytes=int(self.config.first_bucket_mb * (1 << 20)),
            groups=self._labels if len(self._groups) > 1 else None,
        )
        self._release_buffers()
        buckets = []
        last = {self._labels[params[0]]: b for b, params in enumerate(plan.buckets)}  # each group's last bucket
        with torch.no_grad():
            for b, (params, offsets, numel) in enumerate(zip(plan.buckets, plan.offsets, plan.numels)):
                dtype = self._params[params[0]].dtype
                label = self._labels[params[0]]
                # A group's last bucket also carries one "used" flag per parameter of the group: a parameter
                # no rank of its group used keeps grad None, as with torch DDP, at no cost of an extra collective.
                extra = len(self._members[label]) if b == last[label] else 0
                same = reduce_dtype is None or reduce_dtype == dtype
                comm = self._alloc(numel + extra, dtype if same else reduce_dtype, label)
                grads = comm[:numel] if same else torch.zeros(numel, dtype=dtype, device=self.device)
                flags = comm[numel:] if extra else None
                for i, off in zip(params, offsets):
                    p = self._params[i]
                    view = grads[off : off + p.numel()].view_as(p)
                    if p.grad is not None:  # keep what is there; a None grad stays None until backward fills it
                        view.copy_(p.grad)
                        p.grad = view
                    self._views[i] = view
                buckets.append(_Bucket(params, grads, comm, flags, label))
        self._buckets = buckets
        self._bucket_of = plan.bucket_of()

    def _alloc(self, numel: int, dtype: torch.dtype, label: int = 0) -> torch.Tensor:
        """A zeroed bucket buffer; on hfreduce and CPU, registered shared memory so the engine skips its copies."""
        g = self._groups[label]
        if g.engine is not None and self.device.type == "cpu" and g.world > 1:
            return g.engine.shared_empty(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _release_buffers(self) -> None:
        for bucket in getattr(self, "_buckets", []):
            engine = self._groups[bucket.group].engine
            if engine is not None:
                engine.shared_release(bucket.comm)

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)

        return hook

    def _adopt(self, i: int, p: torch.Tensor) -> None:
        """Make ``p.grad`` the bucket view again (after ``zero_grad(set_to_none=True)`` autograd made a new tensor)."""
        view = self._views[i]
        g = p.grad
        if g is not None and g.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(g)
            p.grad = view

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        self._adopt(i, p)
        if self._round is not None:
            self._round.on_grad(i)
            return
        if not self._sync_backward:
            return
        step = self._step
        if step is None:
            step = self._step = _Step(self._buckets)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if i in step.ready:
            raise UsageError(
                f"parameter {self._names[i]!r} received a gradient twice in one backward pass; with DDP each "
                "parameter may be reduced once per step (use no_sync() for several backward passes per step)")
        step.ready.add(i)
        step.used.add(i)
        step.order.append(i)
        b, _ = self._bucket_of[i]
        step.pending[b] -= 1
        self._launch_ready(step)

    def _launch_ready(self, step: _Step) -> None:
        while step.next_launch < len(self._buckets) and step.pending[step.next_launch] == 0:
            self._launch(self._buckets[step.next_launch], step)
            step.next_launch += 1

    def _launch(self, bucket: _Bucket, step: _Step) -> None:
        if bucket.comm.data_ptr() != bucket.grads.data_ptr():
            bucket.comm[: bucket.grads.numel()].copy_(bucket.grads)
        if bucket.flags is not None:  # the group's last bucket: every parameter's fate is known by now
            members = self._members[bucket.group]
            if len(step.used) == len(self._params):
                bucket.flags.fill_(1)
            else:
                used = torch.tensor([i in step.used for i in members], dtype=torch.bool)
                bucket.flags.copy_(used)
        bucket.launched_at = time.perf_counter()
        bucket.done_at = 0.0
        g = self._groups[bucket.group]
        if g.world == 1:  # the average over one rank is the gradient itself
            bucket.handle = None
            bucket.done_at = bucket.launched_at
        elif g.engine is not None:
            fut = g.engine.allreduce(bucket.comm, Op.AVG)

            def done(_: torch.futures.Future, bucket: _Bucket = bucket) -> None:
                bucket.done_at = time.perf_counter()

            fut.add_done_callback(done)
            bucket.handle = fut
        else:
            bucket.handle = dist.all_reduce(bucket.comm, group=g.pg, async_op=True)

    def _finish(self) -> None:
        """End of a synchronising backward: launch what is left, wait for every bucket, publish averaged grads."""
        step, self._step = self._step, None
        assert step is not None
        backward_done = time.perf_counter()
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if i in step.ready:
                    continue
                # Not used in this step's graph on this rank: contribute what its grad holds (zeros if None).
                if p.grad is None:
                    self._views[i].zero_()
                else:
                    step.used.add(i)
                    if p.grad.data_ptr() != self._views[i].data_ptr():
                        self._views[i].copy_(p.grad)
                step.order.append(i)
                step.pending[self._bucket_of[i][0]] -= 1
            self._launch_ready(step)
            for bucket in self._buckets:
                g = self._groups[bucket.group]
                if bucket.handle is None:
                    pass
                elif g.engine is not None:
                    bucket.handle.wait()  # the engine raises CollectiveTimeout/PeerFailure on its own deadline
                else:
                    bucket.handle.wait(timeout=timedelta(seconds=self.config.timeout))
                    bucket.done_at = time.perf_counter()
                    bucket.comm.div_(g.world)
                bucket.handle = None
                if bucket.comm.data_ptr() != bucket.grads.data_ptr():
                    bucket.grads.copy_(bucket.comm[: bucket.grads.numel()])
            unused = []
            if len(step.used) != len(self._params):
                for bucket in self._buckets:
                    if bucket.flags is not None:
                        members = self._members[bucket.group]
                        unused += [members[k] for k in (bucket.flags <= 0).nonzero().flatten().tolist()]
            for i in unused:  # no rank used it: leave it as it was (None), so optimizers skip it
                self._params[i].grad = None
            for i, p in enumerate(self._params):
                if p.grad is None and i not in unused:
                    p.grad = self._views[i]
        end = time.perf_counter()
        st = self._stats
        st["steps"] += 1
        st["allreduce_bytes"] += sum(b.comm.numel() * b.comm.element_size() for b in self._buckets)
        busy, free_at = 0.0, 0.0  # buckets run one after another: count each from when it could start
        for b in self._buckets:
            start = max(b.launched_at, free_at)
            free_at = max(start, b.done_at or end)
            busy += free_at - start
        st["allreduce_seconds"] += busy
        st["wait_seconds"] += end - backward_done
        if not self._rebuilt:
            self._rebuilt = True
            self._rebuild(step.order)

    def _rebuild(self, order: list[int]) -> None:
        """Adopt rank 0's observed gradient order for the buckets (a collective: every rank takes part)."""
        agreed = torch.tensor(order, dtype=torch.int64)
        if self._world > 1:
            if self._comm is not None:
                self._comm.broadcast(agreed, root=0).wait()
            else:
                dist.broadcast(agreed, src=self._root, group=self.process_group)
        agreed_order = agreed.tolist()
        current = [i for bucket in self._buckets for i in bucket.params]
        if agreed_order != current:
            self._build(agreed_order)


def _check_group(pg: Any, what: str) -> None:
    """``pg`` must be a process group this rank belongs to (new_group hands other ranks a placeholder)."""
    if not isinstance(pg, dist.ProcessGroup):
        raise UserTypeError(f"{what} must be a torch.distributed ProcessGroup that this rank belongs to, got "
                            f"{type(pg).__name__} {pg!r} (dist.new_group returns a placeholder on ranks outside "
                            "the group: pass each rank the group it is in)")
    if dist.get_rank(pg) < 0:
        raise UserError(f"{what} does not contain this rank ({dist.get_rank()}); pass each rank the group it is in")
