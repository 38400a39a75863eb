"""Training step time: compute from FLOPs and a sustained rate, communication from the
collective model, overlapped the way each system overlaps it, plus the pipeline's bubble.

One step of a :class:`Job` is built from these pieces (constants: :mod:`fireflyer.fabric.constants`):

* **compute**: the step's training FLOPs per GPU over the GPU's sustained rate for the model's
  precision; a share ``backward_share`` of it is the backward pass.
* **DDP**: one allreduce of every gradient (FP32) per step, timed by :func:`~fireflyer.fabric.
  collectives.allreduce` on the job's network: HFReduce for HaiScale, NCCL's ring for Torch.
  HaiScale hides it behind the backward pass; Torch's NCCL hides ``nccl_overlap`` of it.
* **FSDP** (ZeRO-3): an allgather of the parameters in forward and again in backward and a
  reduce-scatter of the gradients, each half of a ring allreduce of the whole model. HaiScale
  overlaps the forward allgather with forward and the rest with backward and runs the
  optimizer inside backward; Torch's NCCL overlaps ``nccl_overlap`` of them.
* **pipeline** (1F1B): ``m`` micro-batches through ``pp`` stages take ``(m + pp - 1)`` micro-batch
  times (the bubble is ``pp - 1`` of them); a micro-batch's time is its compute plus, for an
  MoE, its expert all-to-all (dispatch and combine, forward and backward), which waits for its
  tokens. Activations cross stage boundaries through the node's NIC; with the paper's staggered
  placement (each node's GPUs are different DP ranks) the node's GPUs send at different times,
  without it they share the NIC at once. After the last backward, the stage's gradients are
  allreduced across its DP ranks (HFReduce: the staggered placement puts a node's 8 GPUs in one
  DP group, so it is HFReduce's intra-node reduce and a tree over dp/8 nodes); MoE experts are
  sharded over ``ep`` ranks and reduced over dp/ep.

Pure numpy-free arithmetic on top of the collective model; a 10,000-GPU step takes milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fireflyer.errors import UserError
from fireflyer.fabric.catalog import NodeSpec
from fireflyer.fabric.collectives import allreduce
from fireflyer.fabric.constants import CONSTANTS, StepConstants
from fireflyer.fabric.routing import Network
from fireflyer.fabric.workloads import ModelSpec

SYSTEMS = ("haiscale", "torch")
STRATEGIES = ("ddp", "fsdp", "pipeline")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job: a model, a parallel layout and the system that runs it."""

    model: ModelSpec
    gpus: int
    strategy: str = "pipeline"
    """"ddp", "fsdp" or "pipeline" (pipeline x data parallel, with expert parallel for an MoE)."""
    system: str = "haiscale"
    """"haiscale" (HFReduce, overlapped) or "torch" (NCCL)."""
    batch_per_gpu: int = 0
    """Samples per GPU per step (weak scaling: DDP and FSDP)."""
    global_batch: int = 0
    """Samples per step (strong scaling: pipeline)."""
    pp: int = 1
    ep: int = 0
    """Expert-parallel ranks of an MoE (0: the DP ranks on one node, at most a node's GPUs)."""
    stagger: bool = True
    """The paper's placement: a node's GPUs are different DP ranks of one stage (V-B2)."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise UserError(f"--gpus must be at least 1, got {self.gpus}")
        if self.strategy not in STRATEGIES:
            raise UserError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.system not in SYSTEMS:
            raise UserError(f"system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if self.pp < 1 or self.ep < 0:
            raise UserError("pp must be at least 1 and ep must not be negative")
        if self.strategy == "pipeline":
            if self.global_batch < 1:
                raise UserError("a pipeline job needs a global batch of at least 1 sample")
            if self.gpus % self.pp:
                raise UserError(f"{self.gpus} GPUs do not split into pipelines of {self.pp} stages; "
                                f"use a multiple of {self.pp}")
        elif self.batch_per_gpu < 1:
            raise UserError("a DDP or FSDP job needs a batch of at least 1 sample per GPU")

    @property
    def dp(self) -> int:
        return self.gpus // self.pp if self.strategy == "pipeline" else self.gpus


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """A step's time and where it goes (seconds)."""

    job: Job
    seconds: float
    compute: float
    """Arithmetic on the busiest GPU, bubble excluded."""
    parts: dict[str, float] = field(default_factory=dict)
    """Exposed (not hidden) time by cause: communication, bubble."""
    notes: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        j = self.job
        samples = j.global_batch if j.strategy == "pipeline" else j.batch_per_gpu * j.gpus
        return samples * max(j.model.seq, 1) / self.seconds

    def to_dict(self) -> dict:
        j = self.job
        return {"model": j.model.name, "gpus": j.gpus, "strategy": j.strategy, "system": j.system, "pp": j.pp,
                "dp": j.dp, "seconds": self.seconds, "compute": self.compute,
                "parts": {k: round(v, 6) for k, v in self.parts.items()}, "notes": list(self.notes)}


def _ar_seconds(algo: str, gpus: int, nbytes: float, node: NodeSpec, network: Network | None) -> float:
    if gpus < 2 or nbytes <= 0:
        return 0.0
    if gpus > node.gpus and gpus % node.gpus:
        raise UserError(f"a data-parallel group of {gpus} GPUs is not a whole number of {node.gpus}-GPU nodes")
    return allreduce(algo, gpus, int(nbytes), node, network=network).seconds


def _dp_algo(system: str, node: NodeSpec) -> str:
    if system == "torch":
        return "ring"
    return "hfreduce-nvlink" if node.nvlink != "none" else "hfreduce"


def step_time(job: Job, node: NodeSpec, *, network: Network | None = None,
              constants: StepConstants = CONSTANTS) -> StepTime:
    """Model one training step of ``job`` on ``node``s (on ``network`` if given, else non-blocking)."""
    if job.strategy == "pipeline":
        return _pipeline(job, node, network, constants)
    return _data_parallel(job, node, network, constants)


def _data_parallel(job: Job, node: NodeSpec, network: Network | None, c: StepConstants) -> StepTime:
    m = job.model
    compute = job.batch_per_gpu * m.training_flops_per_sample / c.rate_flops(m.precision)
    bwd = compute * c.backward_share
    fwd = compute - bwd
    overlap = c.haiscale_overlap if job.system == "haiscale" else c.nccl_overlap
    nbytes = m.params * c.grad_bytes
    parts: dict[str, float] = {}
    if job.strategy == "ddp":
        ar = _ar_seconds(_dp_algo(job.system, node), job.gpus, nbytes, node, network)
        parts["gradient allreduce"] = max(0.0, ar - overlap * bwd)
        notes = (f"allreduce {ar:.3f} s ({_dp_algo(job.system, node)})",)
    else:
        # an allgather, like a reduce-scatter, is half of a ring allreduce
        half = 0.5 * _ar_seconds("ring", job.gpus, nbytes, node, network)
        parts["forward allgather"] = max(0.0, half - overlap * fwd)
        parts["backward allgather + reduce-scatter"] = max(0.0, 2 * half - overlap * bwd)
        notes = (f"allgather {half:.3f} s, reduce-scatter {half:.3f} s (ring)",
                 "optimizer: inside backward (HaiScale) or sharded and negligible (Torch)")
    return StepTime(job=job, seconds=compute + sum(parts.values()), compute=compute, parts=parts, notes=notes)


def _a2a_seconds(job: Job, node: NodeSpec, ep: int, tokens: float, c: StepConstants) -> float:
    """An MoE stage's all-to-all for ``tokens`` tokens: dispatch and combine, forward and backward."""
    m = job.model
    if not m.moe or ep < 2:
        return 0.0
    layers = m.moe_layers / job.pp
    sent = tokens * m.top_k * m.hidden * c.activation_bytes * 4 * layers * (ep - 1) / ep
    local = min(ep, node.gpus)
    nvlink_peers = {"pairs": 1, "nvswitch": local - 1}.get(node.nvlink, 0) if local > 1 else 0
    remote = sent * (ep - local) / (ep - 1)
    over_nvlink = sent * nvlink_peers / (ep - 1)
    per_gpu_nic = min(node.gpu_nic_p2p_gb_s, node.nics * node.nic_gb_s / node.gpus)
    return max((sent - over_nvlink) / node.pcie_gb_s, remote / per_gpu_nic, over_nvlink / node.nvlink_gb_s) / 1e9


def _pipeline(job: Job, node: NodeSpec, network: Network | None, c: StepConstants) -> StepTime:
    m = job.model
    dp, pp = job.dp, job.pp
    mb = c.micro_batch
    micro = math.ceil(job.global_batch / (dp * mb))
    t_comp = mb * m.training_flops_per_sample / pp / c.rate_flops(m.precision)
    ep = job.ep or (min(node.gpus, dp) if m.moe else 1)
    if m.moe and dp % ep:
        raise UserError(f"expert parallel of {ep} does not divide the {dp} data-parallel ranks")
    t_a2a = _a2a_seconds(job, node, ep, mb * m.seq, c)
    act = mb * m.seq * m.hidden * c.activation_bytes
    sharing = 1 if job.stagger else min(node.gpus, dp)
    p2p_rate = min(node.gpu_nic_p2p_gb_s, node.nics * node.nic_gb_s / sharing)
    t_p2p = act / p2p_rate / 1e9 if pp > 1 else 0.0
    t_mb = t_comp + t_a2a + max(0.0, 2 * t_p2p - t_comp)  # sends overlap the next micro-batch's compute
    parts = {"pipeline bubble": (pp - 1) * t_mb}
    if m.moe:
        parts["expert all-to-all"] = micro * t_a2a
    parts["stage sends (fill and drain)"] = 2 * (pp - 1) * t_p2p + micro * max(0.0, 2 * t_p2p - t_comp)
    routed = (m.params - m.active_params) / (1 - m.top_k / m.experts) if m.moe else 0.0
    dense_bytes = (m.params - routed) / pp * c.grad_bytes
    expert_bytes = routed / pp / max(ep, 1) * c.grad_bytes
    algo = _dp_algo(job.system, node)
    ar = _ar_seconds(algo, dp, dense_bytes, node, network)
    if expert_bytes:
        ar += _ar_seconds(algo, dp // ep, expert_bytes, node, network)
    parts["gradient allreduce"] = max(0.0, ar - c.haiscale_overlap * t_comp * c.backward_share)
    compute = micro * t_comp
    seconds = micro * t_mb + parts["pipeline bubble"] + parts["gradient allreduce"] + 2 * (pp - 1) * t_p2p
    notes = (f"dp={dp}, {micro} micro-batches of {mb}" + (f", ep={ep}" if m.moe else ""),)
    return StepTime(job=job, seconds=seconds, compute=compute, parts=parts, notes=notes)
