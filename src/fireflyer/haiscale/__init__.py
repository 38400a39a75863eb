"""HaiScale: data, sharded, pipeline, tensor and expert parallel training on the hfreduce backend (paper §V).

* :class:`DistributedDataParallel` starts each gradient bucket's allreduce as soon as
  backward fills it, on the hfreduce engine, so communication overlaps the rest of backward.
* :func:`fully_shard` is ZeRO-3 (torch FSDP2) over hfreduce's reduce_scatter and allgather,
  optionally with the optimizer step run inside backward; :func:`fsdp_accumulate` runs a step of
  micro-batches, in the canonical order with ``order="canonical"``.
* :func:`make_subgroups` places pipeline stages so a node's ranks go to different
  data-parallel groups, and :func:`forward_backward` runs a pipeline schedule.
* :class:`MoE` is a DeepSeekMoE layer whose routed experts are sharded over an expert-parallel
  group, tokens dispatched and combined with uneven ``all_to_all_single``.
* :func:`layout` places ranks as the paper does (TP innermost in a node, EP inside a node, a
  pipeline's stages on different nodes, DP the rest) on a named DeviceMesh of hfreduce groups;
  :mod:`fireflyer.haiscale.tensor_parallel` runs torch's DTensor TP on its TP group.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistributedDataParallel": "fireflyer.haiscale.ddp",
    "fully_shard": "fireflyer.haiscale.fsdp",
    "fsdp_accumulate": "fireflyer.haiscale.fsdp",
    "FullyShardedDataParallel": "fireflyer.haiscale.fsdp",
    "apply_optimizer_in_backward": "fireflyer.haiscale.fsdp",
    "sharding_info": "fireflyer.haiscale.fsdp",
    "make_subgroups": "fireflyer.haiscale.pipeline",
    "forward_backward": "fireflyer.haiscale.pipeline",
    "Pipeline": "fireflyer.haiscale.pipeline",
    "PipelineConfig": "fireflyer.haiscale.pipeline",
    "Schedule": "fireflyer.haiscale.pipeline",
    "partition": "fireflyer.haiscale.pipeline",
    "MoE": "fireflyer.haiscale.moe",
    "MoEConfig": "fireflyer.haiscale.moe",
    "CanonicalMoE": "fireflyer.haiscale.moe_steps",
    "CanonicalSteps": "fireflyer.haiscale.moe_steps",
    "MicroBatchHooks": "fireflyer.haiscale.pipeline",
    "is_expert_param": "fireflyer.haiscale.expert",
    "mark_expert": "fireflyer.haiscale.expert",
    "layout": "fireflyer.haiscale.layout_mesh",
    "Layout": "fireflyer.haiscale.layout_mesh",
    "LayoutPlan": "fireflyer.haiscale.layout_plan",
    "plan_layout": "fireflyer.haiscale.layout_plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fireflyer.haiscale' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
