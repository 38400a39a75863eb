"""A named DeviceMesh of pipeline, data, expert and tensor parallel groups on hfreduce.

:func:`layout` is the collective half of :func:`~fireflyer.haiscale.layout_plan.plan_layout`:
it learns every rank's node, places the ranks (TP inside a node, EP inside a node or a zone,
a node's EP groups in different pipelines, DP the rest), creates every group on every rank
in the same order, and wraps them in a torch ``DeviceMesh`` with dims ``("pp", "dp", "ep",
"tp")`` that *reuses* those groups (``DeviceMesh.from_group``), so DTensor, FSDP2 and
``parallelize_module`` run on the very groups :class:`~fireflyer.haiscale.MoE` and
:class:`~fireflyer.haiscale.DistributedDataParallel` use.

Every group is a real process group, size 1 included, never ``None``: ``None`` means "the
whole job" to DDP, which a size-1 dense group is not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fireflyer.errors import UsageError, UserError
from fireflyer.haiscale.layout_plan import GROUP_KINDS, MESH_DIMS, LayoutPlan, check_degrees, plan_layout
from fireflyer.haiscale.pipeline import PlacementWarning, _timeout

__all__ = ["Layout", "LayoutPlan", "layout", "plan_layout"]


@dataclass(frozen=True, eq=False)
class Layout:
    """This rank's view of a layout: the plan, its coordinates, the mesh and its groups.

    ``mesh["tp"]`` (or ``mesh.get_group("tp")``) is the TP group as DTensor sees it;
    ``ep_group`` goes to ``MoE(config, ep_group=...)``; ``dense_group`` and ``expert_group``
    go to ``DistributedDataParallel(model, process_group=..., expert_process_group=...)``.
    """

    plan: LayoutPlan
    coords: dict[str, int]
    """This rank's index along each dim, e.g. ``{"pp": 0, "dp": 1, "ep": 0, "tp": 1}``."""
    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dense_group: dist.ProcessGroup
    """dp × ep: the ranks with this rank's stage and TP shard, which average dense gradients."""
    expert_group: dist.ProcessGroup
    """The dp group: the ranks holding this rank's experts, which average expert gradients."""

    def group(self, kind: str) -> dist.ProcessGroup:
        """This rank's group of ``kind`` (one of :data:`~fireflyer.haiscale.layout_plan.GROUP_KINDS`)."""
        if kind not in GROUP_KINDS:
            raise UserError(f"unknown group kind {kind!r}: choose from {', '.join(GROUP_KINDS)}")
        return getattr(self, f"{kind}_group")


def _device_type(device_type: str | None) -> str:
    if device_type is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise UserError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    return device_type


def layout(*, dp: int | None = None, pp: int = 1, tp: int = 1, ep: int = 1, backend: str | None = None,
           timeout: float | timedelta | None = None, device_type: str | None = None,
           pg_options: Any = None) -> Layout:
    """Place this job's ranks into a ``pp × dp × ep × tp`` mesh and create its groups.

    Collective: every rank must call it with the same arguments. The degrees are checked on
    every rank before any communication, so a bad one fails everywhere at once; then one
    ``all_gather_object`` learns each rank's node (``FIREFLYER_NODE_ID``, else the host) and
    :func:`plan_layout` places the ranks. ``dp=None`` takes the rest of the world.

    ``backend`` is the groups' backend (default: the default group's, ``hfreduce`` under
    ``init_process_group("hfreduce")``); ``timeout`` (seconds or a timedelta, default
    ``FIREFLYER_PP_TIMEOUT`` or 60 s) bounds every operation on them; ``device_type`` is the
    mesh's (default ``cuda`` where CUDA is available, else ``cpu``); ``pg_options`` go to every group
    (``HFReduceConfig(order="canonical")`` for groups that sum in the canonical order). Where the layout departs
    from the paper's placement, rank 0 warns with a :class:`PlacementWarning`.
    """
    if not dist.is_initialized():
        raise UsageError("layout needs torch.distributed: call dist.init_process_group('hfreduce') first "
                         "(torchrun sets the environment)")
    world = dist.get_world_size()
    check_degrees(world, dp=dp, pp=pp, tp=tp, ep=ep)
    deadline = _timeout(timeout)
    device = _device_type(device_type)
    backend = backend or str(dist.get_backend())

    from fireflyer.hfreduce.config import node_key

    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, node_key())
    plan = plan_layout(keys, dp=dp, pp=pp, tp=tp, ep=ep)  # the same keys everywhere: the same plan or error
    rank = dist.get_rank()
    if rank == 0:
        for note in plan.notes:
            warnings.warn(note, PlacementWarning, stacklevel=2)
    mine: dict[str, dist.ProcessGroup] = {}
    for kind in (*MESH_DIMS, "dense"):  # every group of every kind, in the same order on every rank
        for ranks in plan.groups(kind):
            group = dist.new_group(list(ranks), backend=backend, timeout=deadline, pg_options=pg_options)
            if rank in ranks:
                mine[kind] = group
    mine["expert"] = mine["dp"]
    mesh = DeviceMesh.from_group([mine[d] for d in MESH_DIMS], device, mesh=torch.tensor(plan.mesh),
                                 mesh_dim_names=MESH_DIMS)
    return Layout(plan=plan, coords=plan.coords(rank), mesh=mesh,
                  **{f"{kind}_group": mine[kind] for kind in GROUP_KINDS})
