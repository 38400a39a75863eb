"""Pipeline parallelism (paper §V-B2): stage placement, model partitioning and schedules.

A pipeline cuts a model into ``pp_size`` stages of consecutive layers, one stage per rank.
A training batch is cut into micro-batches that flow through the stages: stage ``s``
receives a micro-batch's activations from stage ``s-1``, runs its layers and sends the
result on; backward runs the other way with gradients. A *schedule* decides the order in
which a rank runs forwards and backwards of different micro-batches:

* ``GPipe``: every forward, then every backward. Simple; each stage keeps the
  activations of all ``m`` micro-batches alive at once.
* ``1F1B`` (PipeDream-flush; ``PipeDream`` is accepted as an alias): after a warm-up of
  ``p - s`` forwards, stage ``s`` alternates one forward and one backward, so it keeps
  at most ``p - s`` micro-batches of activations. Same bubble as GPipe.
* ``Interleaved1F1B``: each rank holds ``v`` stages (``v * p`` in all, stage ``i`` on
  rank ``i % p``); smaller stages shrink the pipeline's fill and drain.

The *bubble* is the time a stage waits with nothing to do while the pipeline fills and
drains: ``(p - 1) / (m + p - 1)`` of a step for GPipe and 1F1B with even stages,
``(p - 1) / (v*m + p - 1)`` for the interleaved schedule. The schedules themselves are
torch's (:mod:`torch.distributed.pipelining`); this module places ranks, builds the
stages, checks input and runs one step.

**Backends.** A pipeline sends activations point-to-point. On a CPU host both the
pipeline and the data-parallel groups use the default backend (hfreduce, whose
send/recv go through the node's shared memory within a node and straight between the
two ranks across nodes); where CUDA and NCCL are available, :func:`make_subgroups`
gives the pipeline group ``cpu:gloo,cuda:nccl`` (each tensor goes by the backend of
its device), since hfreduce would stage GPU activations through host memory.

**Timeouts.** The pipeline group's timeout (``make_subgroups(timeout=...)``, default
60 s or ``FIREFLYER_PP_TIMEOUT`` seconds) bounds every send and receive: a stage whose
neighbour died or never arrives raises instead of hanging.

**With data parallelism.** Wrap each stage module in torch's
``DistributedDataParallel(stage, process_group=dp_group)`` before building the
:class:`Pipeline`: torch's stages skip the gradient allreduce for every micro-batch but
the last, so gradients are reduced once per step over the stage's DP group.

**In the canonical order.** Give the :class:`Pipeline` the bare stage module, ``scale_grads=False``
and :class:`MicroBatchHooks` that open and fold each micro-batch's gradients
(:class:`~fireflyer.haiscale.moe_steps.CanonicalSteps` does both): a stage runs its backwards in
micro-batch order, so its gradients are summed in the canonical tree over the micro-batches'
indices, and the stage's replicas sum their blocks in it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fireflyer.haiscale.env import pp_timeout_s
from fireflyer.haiscale.pipeline_placement import PipelinePlacement, plan_pipelines
from fireflyer.errors import UsageError, UserError, UserTypeError

__all__ = [
    "MicroBatchHooks",
    "Pipeline",
    "PipelineConfig",
    "PipelinePlacement",
    "PlacementWarning",
    "Schedule",
    "forward_backward",
    "make_subgroups",
    "partition",
    "plan_pipelines",
    "split_sizes",
    "stage_indices",
]

DEFAULT_TIMEOUT_S = 60.0
Inputs = torch.Tensor | tuple[torch.Tensor, ...]


class MicroBatchHooks(Protocol):
    """Called around each micro-batch's backward on a stage (in the order the schedule runs them: ascending
    micro-batch index for GPipe and 1F1B). ``index`` is the micro-batch's index in this pipeline's step;
    ``loss`` its loss on the last stage, None elsewhere."""

    def before_backward(self, index: int) -> None: ...

    def after_backward(self, index: int, loss: torch.Tensor | None) -> None: ...


class PlacementWarning(UserWarning):
    """The cluster's layout does not allow the paper's placement; a fallback is used."""


class Schedule(str, Enum):
    """A pipeline schedule; parse names with :meth:`Schedule.parse`."""

    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "Interleaved1F1B"

    @classmethod
    def parse(cls, name: str | Schedule) -> Schedule:
        """The schedule called ``name`` (any case; ``-`` and ``_`` ignored; ``PipeDream`` = 1F1B)."""
        if isinstance(name, Schedule):
            return name
        if not isinstance(name, str):
            raise UserTypeError(f"schedule must be a name (str) or Schedule, got {type(name).__name__}")
        key = name.replace("-", "").replace("_", "").strip().lower()
        aliases = {s.value.lower(): s for s in cls} | {"pipedream": cls.ONE_F_ONE_B}
        if key not in aliases:
            raise UserError(f"unknown pipeline schedule {name!r}; valid schedules: "
                             f"{', '.join(s.value for s in cls)} (PipeDream is an alias of 1F1B)")
        return aliases[key]

    def bubble_fraction(self, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
        """The idle share of a step in theory, for even stages and free communication."""
        v = stages_per_rank if self is Schedule.INTERLEAVED_1F1B else 1
        return (pp_size - 1) / (v * n_microbatches + pp_size - 1)


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How a :class:`Pipeline` runs a step."""

    n_microbatches: int
    """Micro-batches per step; the batch must split into this many equal parts."""
    schedule: Schedule | str = Schedule.ONE_F_ONE_B
    """GPipe, 1F1B (PipeDream) or Interleaved1F1B."""
    scale_grads: bool = True
    """Divide gradients by ``n_microbatches``: right for a loss that averages over its
    micro-batch, so the step's gradient is that of the whole batch's mean loss."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule.parse(self.schedule))
        if isinstance(self.n_microbatches, bool) or not isinstance(self.n_microbatches, int):
            raise UserTypeError(f"n_microbatches must be an int, got {type(self.n_microbatches).__name__}")
        if self.n_microbatches < 1:
            raise UserError(f"n_microbatches must be at least 1, got {self.n_microbatches}")


# -- groups ---------------------------------------------------------------------------


def default_pp_backend() -> str:
    """``cpu:gloo,cuda:nccl`` where CUDA and NCCL are available; else the default group's backend
    (``hfreduce`` under ``init_process_group("hfreduce")``), or ``gloo`` before torch.distributed starts."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return str(dist.get_backend()) if dist.is_initialized() else "gloo"


def _timeout(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        timeout = pp_timeout_s(DEFAULT_TIMEOUT_S)
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise UserError(f"timeout must be positive seconds or a positive timedelta, got {timeout!r}")
    return timeout


def _check_pp_backend(backend: str) -> None:
    parts = [p.split(":", 1)[-1].strip().lower() for p in backend.split(",")]
    if "nccl" in parts and not dist.is_nccl_available():
        raise UserError(f"pp_backend={backend!r} needs NCCL, which this torch build lacks; use 'hfreduce' or 'gloo'")


def make_subgroups(pp_size: int, *, pp_backend: str | None = None, dp_backend: str | None = None,
                   timeout: float | timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Split the world into pipelines of ``pp_size`` stages; return ``(dp_group, pp_group)``.

    Collective: every rank must call it, with the same arguments. It learns each rank's
    node (``FIREFLYER_NODE_ID``, else the host) with one ``all_gather_object``, places
    ranks with :func:`plan_pipelines` (a node's ranks in different pipelines, one node
    per stage), and creates every group on every rank in the same order. This rank's
    stage is ``dist.get_rank(pp_group)``; its data-parallel rank is
    ``dist.get_rank(dp_group)``.

    ``pp_backend`` defaults to :func:`default_pp_backend` (the default group's, on CPU hosts);
    ``dp_backend`` defaults to the default group's backend. ``timeout`` (seconds or a
    timedelta; default ``FIREFLYER_PP_TIMEOUT`` or 60 s) bounds every operation on both
    groups. Layouts that cannot take the paper's placement get a fallback and a
    :class:`PlacementWarning` on rank 0; impossible ones raise ``ValueError``.
    """
    if not dist.is_initialized():
        raise UsageError("make_subgroups needs torch.distributed: call "
                           "dist.init_process_group('hfreduce') first (torchrun sets the environment)")
    pp_backend = pp_backend or default_pp_backend()
    _check_pp_backend(pp_backend)
    deadline = _timeout(timeout)
    world = dist.get_world_size()
    plan_pipelines([0] * world, pp_size)  # bad pp_size fails here on every rank, before any communication

    from fireflyer.hfreduce.config import node_key

    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, node_key())
    placement = plan_pipelines(keys, pp_size)
    rank = dist.get_rank()
    if rank == 0:
        for note in placement.notes:
            warnings.warn(note, PlacementWarning, stacklevel=2)
    pp_group = dp_group = None
    for ranks in placement.pipelines:
        group = dist.new_group(list(ranks), backend=pp_backend, timeout=deadline)
        if rank in ranks:
            pp_group = group
    for ranks in placement.dp_groups:
        group = dist.new_group(list(ranks), backend=dp_backend, timeout=deadline)
        if rank in ranks:
            dp_group = group
    assert pp_group is not None and dp_group is not None, "placement left a rank out"
    return dp_group, pp_group


# -- stages ---------------------------------------------------------------------------


def split_sizes(n_layers: int, num_stages: int, balance: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: ``balance`` checked, else as even as possible (earlier stages get the extra)."""
    if num_stages < 1:
        raise UserError(f"num_stages must be at least 1, got {num_stages}")
    if balance is not None:
        sizes = list(balance)
        if len(sizes) != num_stages or any(not isinstance(b, int) or b < 1 for b in sizes) or sum(sizes) != n_layers:
            raise UserError(f"balance={sizes} must give {num_stages} positive layer counts summing to the "
                             f"model's {n_layers} layers")
        return sizes
    if n_layers < num_stages:
        raise UserError(f"cannot split {n_layers} layers into {num_stages} stages: every stage needs at least one "
                         f"layer. Use fewer stages or a deeper model")
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def partition(model: nn.Module, stage_index: int, num_stages: int, *,
              balance: Sequence[int] | None = None) -> nn.Sequential:
    """The layers of ``model`` (an ``nn.Sequential`` or ``nn.ModuleList``) that form stage ``stage_index``.

    The stage shares the model's layer objects (no copy), so building the whole model on
    every rank and keeping a stage costs memory only until the rest is dropped; for large
    models build each stage's layers directly.
    """
    if not isinstance(model, (nn.Sequential, nn.ModuleList)):
        raise UserTypeError(f"partition needs an nn.Sequential or nn.ModuleList, got {type(model).__name__}; "
                        f"write the model as a sequence of layers or build the stages yourself")
    if not 0 <= stage_index < num_stages:
        raise UserError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    sizes = split_sizes(len(model), num_stages, balance)
    start = sum(sizes[:stage_index])
    layers = model[start:start + sizes[stage_index]]
    return layers if isinstance(layers, nn.Sequential) else nn.Sequential(*layers)


def stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` of a pipeline holds: ``pp_rank``, ``pp_rank + pp_size``, ...

    This is torch's "loop" order, which the interleaved schedule expects.
    """
    if not 0 <= pp_rank < pp_size or stages_per_rank < 1:
        raise UserError(f"need 0 <= pp_rank < pp_size and stages_per_rank >= 1, got {pp_rank}, {pp_size}, "
                         f"{stages_per_rank}")
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


# -- running a step ---------------------------------------------------------------


def _stage_class() -> type:
    """torch's ``PipelineStage``, made safe for a stage module wrapped in torch DDP or haiscale DDP.

    On its first step a stage infers tensor shapes by running its module once, outside
    any ``no_sync``; with DDP that forward arms DDP's reducer, which then counts the
    first real micro-batch's gradients as well as the last one's and fails on the next
    step ("rebuilt parameter indices size is not same"). Running the shape inference
    inside ``no_sync`` leaves the reducer untouched, so DDP reduces once per step, after
    the last micro-batch's backward, as torch's schedules intend. haiscale DDP gets the
    same: sync is off for every micro-batch's backward but the last. The shape inference's
    forward is also kept out of any MoE layer's load (:func:`fireflyer.haiscale.moe.uncounted`),
    so it does not move the balancing bias.
    """
    from contextlib import nullcontext

    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel

    from fireflyer.haiscale.ddp import DistributedDataParallel as HaiScaleDDP
    from fireflyer.haiscale.moe import uncounted

    class _Stage(PipelineStage):
        hooks: MicroBatchHooks | None = None

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> Any:
            if self.hooks is None:
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)
            if not full_backward:
                raise UsageError("micro-batch hooks need the full backward of a micro-batch at once (a schedule "
                                 "that splits weight gradients from input gradients cannot keep their order)")
            self.hooks.before_backward(bwd_chunk_id)
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
            self.hooks.after_backward(bwd_chunk_id, loss.detach() if loss is not None else None)
            return out

        def _no_sync(self) -> Any:
            if isinstance(self.submod, (DistributedDataParallel, HaiScaleDDP)):
                return self.submod.no_sync()
            return nullcontext()

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            if not isinstance(self.submod, HaiScaleDDP):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            # haiscale DDP: accumulate over the micro-batches, reduce once with the last backward.
            self.submod.set_requires_gradient_sync(last_backward)
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            finally:
                self.submod.set_requires_gradient_sync(True)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            with self._no_sync(), uncounted(self.submod):
                return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            with self._no_sync(), uncounted(self.submod):
                return super()._prepare_backward_infra(*args, **kwargs)

    return _Stage


class Pipeline:
    """This rank's part of one pipeline: its stage module(s) and a schedule, built once.

    ``modules`` is one stage module (GPipe, 1F1B) or a list of ``v`` modules for
    Interleaved1F1B: module ``k`` is stage ``pp_rank + k * pp_size`` (see
    :func:`stage_indices`), and every rank passes the same number. Reuse the object
    across steps; building it again repeats the shape exchange with the neighbours. ``hooks``
    are called around each micro-batch's backward (:class:`MicroBatchHooks`; GPipe and 1F1B).
    """

    def __init__(self, modules: nn.Module | Sequence[nn.Module], pp_group: dist.ProcessGroup, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], config: PipelineConfig,
                 device: torch.device | str | None = None, hooks: MicroBatchHooks | None = None) -> None:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        mods = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise UserTypeError("modules must be an nn.Module or a non-empty list of nn.Modules (this rank's stages)")
        if not callable(loss_fn):
            raise UserTypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
        if not isinstance(config, PipelineConfig):
            raise UserTypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
        self.config = config
        schedule = config.schedule
        assert isinstance(schedule, Schedule)
        if schedule is not Schedule.INTERLEAVED_1F1B and len(mods) != 1:
            raise UserError(f"schedule {schedule.value} runs one stage per rank but got {len(mods)} modules; "
                             f"use schedule='Interleaved1F1B' for several stages per rank, or join them in one "
                             f"nn.Sequential")
        self.pp_size = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        if self.pp_rank < 0:
            raise UserError("this rank is not a member of pp_group; pass the pp_group make_subgroups returned")
        m, p = config.n_microbatches, self.pp_size
        if schedule is Schedule.ONE_F_ONE_B and m < p:
            raise UserError(f"1F1B needs n_microbatches >= pp_size, got {m} < {p}; raise n_microbatches "
                             f"(more also means a smaller bubble) or use GPipe")
        if schedule is Schedule.INTERLEAVED_1F1B and m % max(1, m // p):
            raise UserError(f"Interleaved1F1B needs n_microbatches to be a multiple of its rounds "
                             f"(n_microbatches // pp_size = {m // p}), got {m}; use a multiple of pp_size={p}")
        if hooks is not None and schedule is Schedule.INTERLEAVED_1F1B:
            raise UserError("micro-batch hooks run with GPipe or 1F1B: the interleaved schedule runs several stages' "
                            "backwards on a rank, out of one micro-batch order")
        if hooks is not None and not (callable(getattr(hooks, "before_backward", None))
                                      and callable(getattr(hooks, "after_backward", None))):
            raise UserTypeError(f"hooks must have before_backward(index) and after_backward(index, loss), got "
                                f"{type(hooks).__name__}")
        self.stages_per_rank = len(mods)
        self.num_stages = p * len(mods)
        self.stage_indices = stage_indices(self.pp_rank, p, len(mods))
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        if device is None:
            param = next((t for m_ in mods for t in m_.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        stage_cls = _stage_class()
        self.stages = [stage_cls(mod, idx, self.num_stages, self.device, group=pp_group)
                       for mod, idx in zip(mods, self.stage_indices)]
        for stage in self.stages:
            stage.hooks = hooks
        if schedule is Schedule.INTERLEAVED_1F1B:
            self.schedule: Any = ScheduleInterleaved1F1B(self.stages, m, loss_fn=loss_fn,
                                                         scale_grads=config.scale_grads)
        else:
            cls = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B
            self.schedule = cls(self.stages[0], m, loss_fn=loss_fn, scale_grads=config.scale_grads)

    def _check_batch(self, what: str, value: Any) -> None:
        tensors = value if isinstance(value, tuple) else (value,)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise UserTypeError(f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}")
        m = self.config.n_microbatches
        for t in tensors:
            if t.dim() == 0 or t.shape[0] % m:
                raise UserError(f"{what} has a batch dimension of {tuple(t.shape)[:1] or 'none'}, which does not "
                                 f"split into n_microbatches={m} equal micro-batches; use a batch size that is a "
                                 f"multiple of {m}")

    def forward_backward(self, inputs: Inputs | None = None, targets: torch.Tensor | None = None
                         ) -> list[torch.Tensor] | None:
        """Run one step's forwards and backwards; gradients accumulate in ``.grad``.

        ``inputs`` (the model's positional input, or a tuple of them) is needed on the rank
        holding the first stage and ``targets`` on the rank holding the last; elsewhere
        they are ignored, so every rank may pass the same batch. Returns the detached
        per-micro-batch losses on the last stage's rank, ``None`` on the others. The
        optimizer step (and ``zero_grad``) stays with the caller.
        """
        if not torch.is_grad_enabled():
            raise UsageError("forward_backward needs autograd: it was called under torch.no_grad()")
        if self.is_first:
            if inputs is None:
                raise UserError(f"pp rank {self.pp_rank} holds the first stage: pass the batch's inputs")
            self._check_batch("inputs", inputs)
        if self.is_last:
            if targets is None:
                raise UserError(f"pp rank {self.pp_rank} holds the last stage: pass the batch's targets")
            self._check_batch("targets", targets)
        args = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.is_first else ()
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=targets if self.is_last else None,
                           losses=losses if self.is_last else None, return_outputs=False)
        return [loss.detach() for loss in losses] if self.is_last else None


def forward_backward(modules: nn.Module | Sequence[nn.Module], pp_group: dist.ProcessGroup, *,
                     n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     inputs: Inputs | None = None, targets: torch.Tensor | None = None,
                     schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                     scale_grads: bool = True) -> list[torch.Tensor] | None:
    """One pipeline step in one call: build a :class:`Pipeline` and run :meth:`Pipeline.forward_backward`.

    Handy for a single step or a test; a training loop should build the ``Pipeline`` once.
    """
    config = PipelineConfig(n_microbatches=n_microbatches, schedule=schedule, scale_grads=scale_grads)
    return Pipeline(modules, pp_group, loss_fn=loss_fn, config=config).forward_backward(inputs, targets)
