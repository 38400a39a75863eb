"""Tensor parallel on hfreduce groups with torch's own DTensor styles, plus what they lack.

Torch's ``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel`` and
``SequenceParallel`` already does Megatron-style TP: a column-parallel linear splits its
output features, a row-parallel one its input features and allreduces (or, with sequence
parallel, reduce-scatters) the result. They run unchanged on an hfreduce TP group: DTensor's
redistributions are ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_reduce``, which the backend implements, and the mesh comes from the layout's own group
(:func:`tp_mesh`).

What the styles lack is a *fused* projection: an attention ``qkv`` linear of ``3·d`` output
rows ``[q; k; v]``. ``ColwiseParallel`` cuts its rows into ``tp`` contiguous pieces, so with
``tp = 2`` rank 0 would get all of q and half of k. :class:`FusedColwiseParallel` first
reorders the rows so each rank's contiguous piece is *its heads'* q, then k, then v
(:func:`fused_rows_order`), then shards as ColwiseParallel does; the local output
``chunk(3)`` is then this rank's q, k and v. The DTensor's full tensor is in that reordered
row order; :func:`restore_fused` puts a full weight, bias or gradient back in the model's
own ``[q; k; v]`` order (to compare, or to save a checkpoint an unsharded model can load).

:func:`block_plan` writes the plan of one pre-norm transformer block from its module names,
so a model package (``fireflyer.train``) states only its names and head count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from fireflyer.errors import UserError, UserTypeError

__all__ = ["BlockNames", "FusedColwiseParallel", "block_plan", "check_divides", "fused_rows_order", "restore_fused",
           "sequence_parallel_ends", "tensor_parallel", "tp_mesh"]


def check_divides(what: str, count: int, tp: int) -> None:
    """Raise :class:`UserError` unless ``tp`` divides ``count`` (``what``: heads, d_model, ...)."""
    if count % tp:
        raise UserError(f"tensor parallel degree tp={tp} does not divide the {what} ({count}): each TP rank must hold "
                        f"an equal share of them. Choose a tp that divides {count}, or change the model's {what}")


def fused_rows_order(rows: int, chunks: int, tp: int) -> torch.Tensor:
    """The row permutation that makes ``tp`` contiguous shards of a fused ``[c_0; c_1; ...]`` weight.

    ``rows = chunks × n``; shard ``r`` of the result holds rows ``r·n/tp .. (r+1)·n/tp`` of every
    chunk, chunk after chunk. ``weight[order]`` is the reordered weight.
    """
    if rows % (chunks * tp):
        raise UserError(f"a fused weight of {rows} rows cannot be cut into {chunks} chunks of {tp} shards each")
    return torch.arange(rows).view(chunks, tp, rows // (chunks * tp)).transpose(0, 1).reshape(-1)


def restore_fused(tensor: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """Undo :func:`fused_rows_order` on dim 0 of a full tensor (a gathered weight, bias or gradient)."""
    order = fused_rows_order(tensor.shape[0], chunks, tp)
    out = torch.empty_like(tensor)
    out[order] = tensor
    return out


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a linear whose output is ``chunks`` fused projections (q, k, v).

    Each rank gets its share of every chunk (with ``heads`` given: its ``heads / tp`` heads of
    each, checked), so the local output splits into ``chunks`` equal parts. The parameters'
    full tensors are in :func:`fused_rows_order`; :func:`restore_fused` undoes it.
    """

    def __init__(self, *, chunks: int = 3, heads: int | None = None, use_local_output: bool = True) -> None:
        super().__init__(use_local_output=use_local_output)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise UserTypeError(f"chunks must be a positive int, got {chunks!r}")
        self.chunks = chunks
        self.heads = heads

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        tp = device_mesh.size()
        if self.heads is not None:
            check_divides("attention heads", self.heads, tp)
        for pname, param in list(module.named_parameters(recurse=False)):
            check_divides(f"rows of each of the {self.chunks} fused chunks of {name or 'the module'}.{pname}",
                          param.shape[0] // self.chunks, tp)
            with torch.no_grad():
                local = param.detach()[fused_rows_order(param.shape[0], self.chunks, tp)]
            dist_param = nn.Parameter(distribute_tensor(local, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                                      requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chunks={self.chunks}, heads={self.heads})"


def tp_mesh(tp: DeviceMesh | dist.ProcessGroup, device_type: str | None = None) -> DeviceMesh:
    """A 1-D DeviceMesh for tensor parallel: ``tp`` itself, or one over an existing process group
    (``layout.tp_group``) that reuses it rather than creating a new one."""
    if isinstance(tp, DeviceMesh):
        if tp.ndim != 1:
            raise UserError(f"the TP mesh must be 1-D, got dims {tp.mesh_dim_names or tp.shape}: pass mesh['tp']")
        return tp
    if isinstance(tp, dist.ProcessGroup):
        device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return DeviceMesh.from_group(tp, device, mesh_dim_names=("tp",))
    raise UserTypeError(f"tensor parallel needs a DeviceMesh or a ProcessGroup, got {type(tp).__name__}")


@dataclass(frozen=True, kw_only=True)
class BlockNames:
    """Where a pre-norm transformer block keeps its parts (submodule paths inside the block)."""

    attn_norm: str = "ln1"
    attn: str = "attn"
    qkv: str = "attn.qkv"
    """The fused q/k/v projection (``d → 3d``)."""
    proj: str = "attn.proj"
    mlp_norm: str = "ln2"
    mlp: str = "mlp"
    mlp_in: str = "mlp.0"
    mlp_out: str = "mlp.2"


def block_plan(prefix: str, *, heads: int, names: BlockNames = BlockNames(),
               sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of one block at ``prefix`` (e.g. ``"blocks.0"``).

    qkv and the MLP's first linear are column-parallel, the attention output and the MLP's
    second linear row-parallel: one allreduce per branch forward, one backward. With
    ``sequence_parallel`` the norms run on sequence shards (``SequenceParallel``), each branch
    all-gathers its input and reduce-scatters its output instead, and the residual stream
    between blocks stays a local sequence shard (see :func:`sequence_parallel_ends`).
    """
    p = f"{prefix}." if prefix else ""
    plan: dict[str, ParallelStyle] = {p + names.qkv: FusedColwiseParallel(chunks=3, heads=heads),
                                      p + names.mlp_in: ColwiseParallel()}
    if not sequence_parallel:
        plan[p + names.proj] = RowwiseParallel()
        plan[p + names.mlp_out] = RowwiseParallel()
        return plan
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan.update({
        p + names.attn_norm: SequenceParallel(),
        p + names.attn: gather,
        p + names.proj: RowwiseParallel(output_layouts=Shard(1)),
        p + names.mlp_norm: SequenceParallel(),
        p + names.mlp: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        p + names.mlp_out: RowwiseParallel(output_layouts=Shard(1)),
    })
    return plan


def sequence_parallel_ends(*, first_block: str, final_norm: str, head: str) -> dict[str, ParallelStyle]:
    """Enter and leave sequence parallel around the blocks when the embeddings stay replicated.

    The first block takes a full (replicated) residual stream and keeps this rank's sequence
    shard (no communication; backward all-gathers its gradient); the final norm runs on shards;
    the head gets the full sequence back (an all-gather), so logits and loss are whole on every rank.
    """
    return {
        first_block: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                        use_local_output=True),
        final_norm: SequenceParallel(),
        head: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
    }


def tensor_parallel(module: nn.Module, tp: DeviceMesh | dist.ProcessGroup, plan: Mapping[str, ParallelStyle],
                    *, src_data_rank: int | None = 0) -> nn.Module:
    """Apply ``plan`` (module path → style) to ``module`` over the TP mesh or group ``tp``, in place.

    ``src_data_rank`` (torch's): the TP rank whose weights every rank takes (``None``: each rank
    keeps its own, for models built alike with one seed, which skips the scatter).
    """
    if not plan:
        raise UserError("the tensor parallel plan is empty: name the modules to shard")
    paths = {name for name, _ in module.named_modules()}
    missing = sorted(set(plan) - paths)
    if missing:
        raise UserError(f"the tensor parallel plan names modules this model lacks: {', '.join(missing)}")
    return parallelize_module(module, tp_mesh(tp), dict(plan), src_data_rank=src_data_rank)
