"""HaiScale FSDP: ZeRO-3 over hfreduce's reduce-scatter and allgather (paper §V-B).

ZeRO stage 3 keeps 1/N of every parameter, gradient and optimizer-state tensor on
each of N ranks. A **unit** (typically one transformer block) is gathered in full only
while it runs: an allgather before its forward, another before its backward, and a
reduce-scatter of its gradients afterwards, so each rank ends a step holding the
averaged gradients of its own shard and steps only that shard.

:func:`fully_shard` builds this from torch FSDP2 on a DeviceMesh of the hfreduce
process group (default: the world group) and adds the overlap the paper relies on:

* **Allgather prefetch.** Each unit is told which units come next
  (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``,
  ``prefetch`` units deep), and on the CPU the allgathers are issued with
  ``async_op=True``, so the next unit's allgather runs on the hfreduce engine's
  threads while the current unit computes.
* **Reduce-scatter overlap.** A unit's gradient reduce-scatter runs while backward
  moves on to the units before it (see :mod:`fireflyer.haiscale.fsdp_comm`); when
  ``loss.backward()`` returns every gradient is complete.
* **Optimizer in backward** (opt-in, ``optimizer=``): each unit's parameters are
  stepped as soon as its gradients land, during backward
  (:mod:`fireflyer.haiscale.fsdp_optim`).
* **The canonical order** (opt-in, ``order="canonical"``): :func:`fsdp_accumulate` gives
  a step's gradients the bits of one process running every micro-batch, whatever the
  number of ranks (:mod:`fireflyer.haiscale.fsdp_canonical`).

Usage::

    import fireflyer.hfreduce                     # registers backend "hfreduce"
    from fireflyer.haiscale import fully_shard

    dist.init_process_group("hfreduce")
    model = fully_shard(GPT(cfg), shard_types=(Block,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # built after sharding
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Parameters are DTensors afterwards; ``p.full_tensor()`` gathers one, and
:meth:`FullyShardedDataParallel.full_state_dict` all of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.tensor import DTensor

from fireflyer.haiscale import accumulate as micro
from fireflyer.haiscale import fsdp_canonical, fsdp_optim
from fireflyer.haiscale.fsdp_canonical import CanonicalAccumulation
from fireflyer.haiscale.fsdp_comm import CUSTOM_REDUCE_SCATTER, OverlappedReduceScatter, ReduceScatterBacklog
from fireflyer.haiscale.fsdp_memory import TensorBytes, tensor_bytes
from fireflyer.haiscale.fsdp_optim import InBackwardStepper, OptimizerSpec
from fireflyer.errors import UserError, UserTypeError

__all__ = ["FSDPConfig", "FullyShardedDataParallel", "ShardingInfo", "apply_optimizer_in_backward",
           "fsdp_accumulate", "fully_shard", "sharding_info"]

_INFO_ATTR = "_haiscale_fsdp"


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """How :func:`fully_shard` shards and schedules one model."""

    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward and gather them again in backward
    (ZeRO-3). False keeps them from forward to backward: one allgather less per unit, more memory.
    The root always keeps its own parameters, since backward needs them first."""
    prefetch: int = 1
    """Units gathered ahead of the one running, in forward and in backward. 0 leaves FSDP2's
    implicit schedule (which on the CPU waits for each allgather before computing)."""
    overlap_reduce_scatter: bool = True
    """Let gradient reduce-scatters run while backward goes on (CPU tensors; see fsdp_comm)."""
    mp_policy: MixedPrecisionPolicy | None = None
    """FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)``. A reduce dtype other than the parameters' dtype makes the
    reduce-scatters synchronous (FSDP2 casts their output at once)."""
    order: str = "fast"
    """How a step's gradients are summed. ``fast``: FSDP2's own way, each reduce-scatter an average
    in the order the layout gives. ``canonical``: steps go through :func:`fsdp_accumulate`, whose
    gradients have the same bits on any number of ranks (:mod:`fireflyer.haiscale.fsdp_canonical`)."""

    def __post_init__(self) -> None:
        if self.order not in micro.ORDERS:
            raise UserError(f"order must be one of {list(micro.ORDERS)}, got {self.order!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise UserTypeError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise UserError(f"prefetch must be a whole number of units >= 0, got {self.prefetch!r}")
        if not isinstance(self.overlap_reduce_scatter, bool):
            raise UserTypeError(f"overlap_reduce_scatter must be True or False, got {self.overlap_reduce_scatter!r}")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise UserTypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, "
                            f"got {type(self.mp_policy).__name__}")


@dataclass
class ShardingInfo:
    """What :func:`fully_shard` did to a model, kept on the model (see :func:`sharding_info`)."""

    group: dist.ProcessGroup
    mesh: DeviceMesh
    config: FSDPConfig
    units: list[nn.Module]
    """The sharded submodules in forward (registration) order; the root is a unit of its own."""
    backlog: ReduceScatterBacklog = field(default_factory=ReduceScatterBacklog)
    stepper: InBackwardStepper | None = None
    canonical: CanonicalAccumulation | None = None
    """The units' canonical reduce-scatters, with ``order="canonical"``."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that steps inside backward, if one was attached."""
        return None if self.stepper is None else self.stepper.optimizer

    def micro_batch_indices(self, m: int) -> list[int]:
        """The global indices of this rank's ``m`` micro-batches of a step, in the order to pass them to
        :func:`fsdp_accumulate`: ``j*R + rank`` for ``j = 0 .. m-1``, over the group's ``R`` ranks."""
        world, rank = self.group.size(), self.group.rank()
        return [j * world + rank for j in range(m)]


def sharding_info(module: nn.Module) -> ShardingInfo:
    """The :class:`ShardingInfo` of a model sharded by :func:`fully_shard` (ValueError otherwise)."""
    target = module.module if isinstance(module, FullyShardedDataParallel) else module
    info = getattr(target, _INFO_ATTR, None)
    if not isinstance(info, ShardingInfo):
        raise UserError(f"{type(module).__name__} was not sharded by fireflyer.haiscale.fully_shard; call that first")
    return info


# -- choosing the units ---------------------------------------------------------------


def _default_units(root: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ``nn.ModuleList``s: a transformer's blocks, in most models."""
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                walk(child)

    walk(root)
    return units


def _select_units(root: nn.Module, shard_types: tuple[type, ...] | None,
                  auto_wrap: Callable[[nn.Module], bool] | None) -> list[nn.Module]:
    if shard_types is not None:
        chosen = [m for m in root.modules() if m is not root and isinstance(m, shard_types)]
    elif auto_wrap is not None:
        chosen = [m for m in root.modules() if m is not root and auto_wrap(m)]
    else:
        chosen = _default_units(root)
    # A parameter used by modules in two units (tied embeddings) must live in the unit around
    # both, or one of them would compute with a shard; such a unit is not made a unit.
    owners: dict[int, list[nn.Module]] = {}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    selected = []
    for unit in chosen:
        inside = {id(m) for m in unit.modules()}
        if any(id(o) not in inside for p in unit.parameters() for o in owners[id(p)]):
            warnings.warn(f"{type(unit).__name__} shares a parameter with a module outside it (tied weights); it is "
                          "not made a unit of its own, so the parameter stays with the unit around both", stacklevel=3)
            continue
        selected.append(unit)
    # Shard bottom-up (a nested unit before the unit around it); drop units whose
    # parameters all belong to units inside them.
    claimed: set[int] = set()
    kept: set[int] = set()
    for unit in reversed(selected):
        own = [p for p in unit.parameters() if id(p) not in claimed]
        if own:
            kept.add(id(unit))
            claimed.update(id(p) for p in own)
    return [m for m in selected if id(m) in kept]


def _check_shard_types(shard_types: Any) -> tuple[type, ...] | None:
    if shard_types is None:
        return None
    if isinstance(shard_types, type):
        shard_types = (shard_types,)
    if not isinstance(shard_types, (tuple, list)) or not shard_types \
            or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in shard_types):
        raise UserTypeError(f"shard_types must be a module class or a tuple of them (e.g. (Block,)), got {shard_types!r}")
    return tuple(shard_types)


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise UserError("torch.distributed is not initialised: `import fireflyer.hfreduce` and call "
                             "dist.init_process_group('hfreduce') (torchrun sets the rest) before fully_shard, "
                             "or pass group=")
        return dist.group.WORLD  # type: ignore[return-value]
    if not isinstance(group, dist.ProcessGroup):
        raise UserTypeError(f"group must be a torch.distributed ProcessGroup that this rank belongs to, got "
                        f"{type(group).__name__} (dist.new_group returns a placeholder on ranks outside the group)")
    return group


def _device_type(module: nn.Module) -> str:
    devices = {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}
    if "meta" in devices:
        raise UserError("the module has parameters on the meta device; materialise them (to_empty + init) "
                         "before fully_shard")
    if len(devices) != 1:
        raise UserError(f"the module's tensors are on several device types {sorted(devices)}; move it to one device first")
    return devices.pop()


# -- the entry points ---------------------------------------------------------------


def fully_shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    shard_types: type | tuple[type, ...] | None = None,
    auto_wrap: Callable[[nn.Module], bool] | None = None,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    overlap_reduce_scatter: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    optimizer: OptimizerSpec | None = None,
    order: str = "fast",
) -> nn.Module:
    """Shard ``module`` in place with ZeRO-3 over ``group`` and return it.

    Units: the submodules of ``shard_types``, or those for which ``auto_wrap(m)`` is
    true, or by default the elements of the outermost ``nn.ModuleList``s (a
    transformer's blocks). Each unit is gathered, computed and freed on its own; the
    rest of the model (embeddings, head) forms the root unit. Every rank must build
    the same model with the same initial values (seed it), and on one device.

    ``optimizer``: a factory such as ``functools.partial(torch.optim.AdamW, lr=3e-4)``
    (called with the sharded parameters) turns on the optimizer step inside backward;
    then do not call ``step()``/``zero_grad()`` yourself, and reach the optimizer (for
    an LR scheduler or a checkpoint) as ``sharding_info(model).optimizer``.

    ``order="canonical"``, on a group made with ``HFReduceConfig(order="canonical")`` of a
    power-of-two number of ranks, sums each step's gradients in the canonical order; steps
    then go through :func:`fsdp_accumulate`.
    """
    if not isinstance(module, nn.Module):
        raise UserTypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    config = FSDPConfig(reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                        overlap_reduce_scatter=overlap_reduce_scatter, mp_policy=mp_policy, order=order)
    types = _check_shard_types(shard_types)
    if types is not None and auto_wrap is not None:
        raise UserError("give shard_types or auto_wrap, not both")
    if auto_wrap is not None and not callable(auto_wrap):
        raise UserTypeError(f"auto_wrap must be a function module -> bool, got {type(auto_wrap).__name__}")
    if optimizer is not None and not (callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
        raise UserTypeError(f"optimizer must be a factory such as functools.partial(torch.optim.AdamW, lr=...), "
                        f"got {type(optimizer).__name__}")
    if next(module.parameters(), None) is None:
        raise UserError(f"{type(module).__name__} has no parameters: there is nothing to shard")
    if any(isinstance(m, FSDPModule) for m in module.modules()) or hasattr(module, _INFO_ATTR):
        raise UserError(f"{type(module).__name__} (or a submodule) is already sharded; call fully_shard once, on the "
                         "unsharded model")
    pg = _resolve_group(group)
    if config.order == "canonical":
        fsdp_canonical.check(pg, config.mp_policy, optimizer)
    device_type = _device_type(module)
    mesh = DeviceMesh.from_group(pg, device_type)
    units = _select_units(module, types, auto_wrap)
    if not units:
        warnings.warn(f"fully_shard found no units in {type(module).__name__}, so the whole model is one unit, "
                      "gathered in full for forward and backward with nothing to overlap; pass shard_types=(Block,)",
                      stacklevel=2)
    mp = config.mp_policy or MixedPrecisionPolicy()
    info = ShardingInfo(group=pg, mesh=mesh, config=config, units=units)
    claimed: set[int] = set()
    overlap = config.overlap_reduce_scatter and device_type == "cpu"
    if overlap and not (CUSTOM_REDUCE_SCATTER and hasattr(FSDPModule, "set_custom_reduce_scatter")):
        warnings.warn("this torch has no FSDP2 custom reduce-scatter hook; reduce-scatters run synchronously "
                      "(same results, less overlap)", stacklevel=2)
        overlap = False
    if config.order == "canonical":
        info.canonical = CanonicalAccumulation(pg, info.backlog, overlap)
    for unit in [*reversed(units), module]:
        _torch_fully_shard(unit, mesh=mesh, mp_policy=mp,
                           reshard_after_forward=config.reshard_after_forward if unit is not module else False)
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        if info.canonical is not None:
            info.canonical.adopt(unit, own)  # type: ignore[arg-type]
        elif overlap:
            unit.set_custom_reduce_scatter(OverlappedReduceScatter(info.backlog, own))  # type: ignore[operator]
    if info.canonical is not None:
        info.canonical.guard(module)
    _set_prefetch(module, units, config.prefetch, device_type)  # type: ignore[arg-type]
    setattr(module, _INFO_ATTR, info)
    if optimizer is not None:
        apply_optimizer_in_backward(module, optimizer)
    return module


def _set_prefetch(root: FSDPModule, units: list[FSDPModule], depth: int, device_type: str) -> None:
    """Forward runs root, units[0], units[1], ...; backward runs root, units[-1], ..., units[0]."""
    if depth == 0 or not units:
        return
    forward = [root, *units]
    backward = [root, *reversed(units)]
    for order, setter in ((forward, "set_modules_to_forward_prefetch"), (backward, "set_modules_to_backward_prefetch")):
        for i, unit in enumerate(order[:-1]):
            getattr(unit, setter)(order[i + 1 : i + 1 + depth])
    if device_type == "cpu":
        # On the CPU a synchronous allgather blocks this thread, prefetch or not; issued
        # async, it runs on the engine's threads and FSDP2 waits only before copying out.
        # (A private FSDP2 switch, the one its own docs point to for explicit prefetching.)
        async_unshard = getattr(root, "_set_unshard_async_op", None)
        if async_unshard is None:
            warnings.warn("this torch's FSDP2 cannot issue allgathers asynchronously; prefetch still orders "
                          "them, but they block the training thread", stacklevel=3)
        else:
            async_unshard(True)


def apply_optimizer_in_backward(module: nn.Module, optimizer: OptimizerSpec) -> torch.optim.Optimizer:
    """Step ``optimizer`` inside backward, each unit as soon as its gradients land; returns the optimizer.

    ``module`` must already be sharded by :func:`fully_shard`. ``optimizer`` is a
    factory called with the sharded parameters (or an optimizer built on them). The
    returned optimizer is an ordinary one: give it to an LR scheduler, save its
    ``state_dict()``, but do not call its ``step()``; backward does.
    """
    info = sharding_info(module)
    if info.stepper is not None:
        raise UserError("this model already steps an optimizer inside backward")
    if info.canonical is not None:
        fsdp_canonical.check(info.group, None, optimizer)
    target = module.module if isinstance(module, FullyShardedDataParallel) else module
    built = fsdp_optim.build_optimizer(optimizer, target)
    info.stepper = fsdp_optim.attach(built, target, info.backlog)
    return built


def fsdp_accumulate(module: nn.Module, micro_batches: Sequence[Any],
                    loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
    """One step's gradients from this rank's micro-batches; the global mean loss (detached, fp32).

    ``module`` was sharded by :func:`fully_shard` (or is a :class:`FullyShardedDataParallel`), and
    ``loss_fn(module, micro_batch)`` returns a micro-batch's scalar loss (a mean over its samples).
    When this returns, the sharded ``.grad``s hold (replacing what they held) the mean over every
    rank's micro-batches of their gradients, ready for ``optimizer.step()``. Every rank must pass
    the same number of micro-batches.

    With ``order="canonical"`` the ``j``-th micro-batch of shard rank ``r`` of ``R`` is global
    micro-batch ``j*R + r`` (:meth:`ShardingInfo.micro_batch_indices`), and the gradients' bits are
    those of one process summing all of them in the canonical tree
    (:mod:`fireflyer.haiscale.fsdp_canonical`). With ``order="fast"`` each loss is divided by the
    micro-batch count and FSDP2 adds each backward's averaged shards into ``.grad``.
    """
    info = sharding_info(module)
    if not callable(loss_fn):
        raise UserTypeError(f"loss_fn must be a function (model, micro_batch) -> loss, got {type(loss_fn).__name__}")
    if isinstance(micro_batches, (str, bytes)) or not hasattr(micro_batches, "__len__"):
        raise UserTypeError(f"micro_batches must be a sequence (a list of this rank's micro-batches), got "
                            f"{type(micro_batches).__name__}")
    if info.stepper is not None:
        raise UserError("this model steps its optimizer inside each backward, so it cannot accumulate micro-batches; "
                        "shard it without optimizer= to use fsdp_accumulate()")
    batches = list(micro_batches)
    _reshard(module)
    if info.canonical is not None:
        return info.canonical.run(module, batches, loss_fn)
    if not batches:
        raise UserError("fsdp_accumulate() needs at least one micro-batch")
    for p in module.parameters():
        p.grad = None
    total = torch.zeros((), dtype=torch.float32)
    for j, batch in enumerate(batches):
        loss = micro.micro_loss(loss_fn, module, batch, j)
        (loss / len(batches)).backward()
        total += loss.detach().float()
    total = (total / len(batches)).reshape(1)
    world = info.group.size()
    if world > 1:
        dist.all_reduce(total, group=info.group)
        total.div_(world)
    return total.reshape(())


def _reshard(module: nn.Module) -> None:
    """Free every unit's gathered parameters: the root unit keeps them after a forward (it does not reshard after
    forward), and a forward without backward (an evaluation) leaves them so; a step must start from the shards,
    whose ``.grad``s it zeroes and fills."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class FullyShardedDataParallel(nn.Module):
    """Class-style ZeRO-3 wrapper: ``model = FullyShardedDataParallel(net, shard_types=(Block,))``.

    The same as :func:`fully_shard` (same keyword arguments), for code that expects a
    wrapper module as with torch's FSDP1 and the paper's ``haiscale.fsdp``. The wrapped
    model is ``.module`` (state-dict keys gain the ``module.`` prefix).
    """

    def __init__(self, module: nn.Module, **options: Any) -> None:
        """``options``: :func:`fully_shard`'s keyword arguments, which it checks."""
        super().__init__()
        self.module = fully_shard(module, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer stepped inside backward, or None."""
        return sharding_info(self.module).optimizer

    @property
    def units(self) -> list[nn.Module]:
        return sharding_info(self.module).units

    def accumulate(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """:func:`fsdp_accumulate` on this wrapper (``loss_fn`` is called with it): the global mean loss."""
        return fsdp_accumulate(self, micro_batches, loss_fn)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped model's state dict (no ``module.`` prefix) gathered in full, on every rank.

        A collective: call it on every rank. The result loads into the unsharded model.
        """
        return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                for name, t in self.module.state_dict().items()}

    def tensor_bytes(self) -> TensorBytes:
        """Parameter, gradient and in-backward optimizer-state bytes on this rank (see fsdp_memory)."""
        return tensor_bytes(self.module, self.optimizer)
