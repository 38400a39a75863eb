"""One rank's part of the model on the run's layout: pipeline stages, experts, tensor and data parallel.

Every run is laid out by :func:`fireflyer.haiscale.layout`, the dense model on plain data
parallel too (``pp = ep = tp = 1``: one stage holding every block, on every rank):

* **pipeline** (``pp``): the blocks are cut into ``pp`` stages of consecutive blocks, one per
  node, a node's ranks in different pipelines. The first stage embeds, the last normalises and
  projects. The output projection is tied to the token embedding; across stages each holds a
  copy, initialised equal, whose gradients are summed over the pipeline before the step
  (Megatron's tied-embedding reduction), so the copies stay equal and the update is the tied
  model's.
* **experts** (``ep``): every MoE layer holds ``experts / ep`` routed experts; tokens go to
  them with an all-to-all inside the node (:class:`fireflyer.haiscale.MoE`).
* **data parallel** takes the rest. haiscale DDP averages dense gradients over the ranks
  holding the same stage (``dense_group``: dp x ep) and expert gradients over the ranks
  holding the same experts (``expert_group``: dp). The dense model on data parallel alone is
  *replicated*: a whole replica on every rank under DDP, or sharded over the dense group by
  FSDP (``fsdp``), its steps and clipping those of DDP and FSDP themselves.

Each pipeline is one data replica: it reads the batch of replica ``dp * ep + ep_rank``, so
with ``pp = 1`` replica ``r`` is rank ``r``. The gradient norm is clipped globally (dense parts
counted once, experts summed over EP, stages summed over the pipeline), and the state is saved
under *global* names: an expert's weights by their global expert index
(``blocks.0.moe.experts.5.w1``), so a state is one model whatever the layout, and rank 0 can
rebuild the whole model from it to write the sample. A replicated model is saved with
``kind="replicated"`` (every rank the same whole state), any other with ``kind="sharded"`` (each
rank its share).
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fireflyer.errors import UserError
from fireflyer.haiscale import DistributedDataParallel
from fireflyer.haiscale.expert import is_expert_param
from fireflyer.haiscale.layout_mesh import Layout
from fireflyer.haiscale.canonical_linear import TensorParallelLinear
from fireflyer.haiscale.moe import RoutedExperts
from fireflyer.haiscale.moe_steps import CanonicalSteps
from fireflyer.haiscale.env import pp_timeout_s
from fireflyer.haiscale.pipeline import DEFAULT_TIMEOUT_S, Pipeline, PipelineConfig, split_sizes
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, canonical_sum
from fireflyer.train.config import TrainConfig
from fireflyer.train.model import GPT, ModelShape, lm_loss, split_linears
from fireflyer.train.optim import clip_exact
from fireflyer.train.moe_model import MoEBlock, MoEGPT, MoEShape

if TYPE_CHECKING:
    from fireflyer.train.data import TrainingData


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (an FSDP shard). DTensors exist only once their module is loaded, so a run
    without FSDP never pays for importing it (about half a second of every rank's start)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)

TIED = "tok.weight"
"""The global name of the token embedding, which the last stage's output projection copies."""


def build_full(cfg: TrainConfig, vocab_size: int, ep_group: dist.ProcessGroup | None) -> nn.Module:
    """The whole model of ``cfg`` (its experts sharded over ``ep_group``), the same on every rank for a seed."""
    if cfg.model.kind == "moe":
        shape = MoEShape(vocab_size=vocab_size, context=cfg.model.context, layers=cfg.model.layers, d_model=cfg.model.d_model,
                         heads=cfg.model.heads, n_routed=cfg.model.experts, n_shared=cfg.model.shared_experts,
                         expert_hidden=cfg.model.expert_hidden, top_k=cfg.model.top_k,
                         bias_update_speed=cfg.model.bias_update_speed)
        return MoEGPT(shape, ep_group=ep_group, seed=cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    return GPT(ModelShape(vocab_size=vocab_size, context=cfg.model.context, layers=cfg.model.layers, d_model=cfg.model.d_model,
                          heads=cfg.model.heads))


class Stage(nn.Module):
    """Blocks ``[start, stop)`` of a :class:`GPT` or :class:`MoEGPT`: the first stage embeds the
    tokens, the last normalises and projects to logits (with the model's own head, tied to the
    embedding, when it is also the first; with its own copy of the tied embedding otherwise)."""

    def __init__(self, full: nn.Module, start: int, stop: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = full.tok, full.pos
        self.blocks = nn.ModuleList(full.blocks[start:stop])
        if last:
            self.ln_f = full.ln_f
            if first:
                self.head = full.head
            else:
                self.head = nn.Linear(full.shape.d_model, full.shape.vocab_size, bias=False)
                self.head.weight = nn.Parameter(full.tok.weight.detach().clone())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's output (the last stage's: logits); with ``targets``, the last stage's mean next-token
        cross-entropy instead (as :meth:`GPT.forward` gives it, so :func:`~fireflyer.train.model.lm_loss` takes a
        stage)."""
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x))
        return logits if targets is None else _cross_entropy(logits, targets)


def expert_name(name: str, g: int) -> str:
    """``blocks.0.moe.experts.w1`` for global expert ``g``: ``blocks.0.moe.experts.<g>.w1``."""
    head, _, leaf = name.rpartition(".")
    return f"{head}.{g}.{leaf}"


_EXPERT_NAME = re.compile(r"^(.*)\.(\d+)\.(w[123])$")


@dataclass(frozen=True)
class Named:
    """A parameter of this rank under its global name; an expert stack with the global index of its first row."""

    name: str
    param: nn.Parameter
    first_expert: int | None = None
    saved: bool = True
    """False for the last stage's copy of the tied embedding (the first stage saves it)."""
    split: Any = None
    """The tensor-parallel linear whose parameter is cut over the TP group, this rank holding a share (None: held
    whole)."""
    leaf: str = ""
    """The parameter's name in ``split`` (``weight`` or ``bias``)."""

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which ``local`` (the value, or an optimizer state) is this rank's share
        (a collective over the TP group where the parameter is split, over the shards where FSDP holds it)."""
        if is_dtensor(local):
            return local.full_tensor()
        return local if self.split is None else self.split.gather(self.leaf, local)

    def share(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a whole tensor shaped like the parameter (no communication)."""
        if is_dtensor(self.param):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(full.to(self.param.device), self.param.device_mesh, self.param.placements,
                                     src_data_rank=None)
        return full if self.split is None else self.split.shard(self.leaf, full)


@dataclass(frozen=True)
class LayerStep:
    """What one MoE layer did in a step."""

    layer: int
    """The block's index in the whole model."""
    tokens: list[int]
    """Assignments per global expert, over every replica of the stage."""
    imbalance: float
    """The busiest expert's tokens over the mean."""
    bytes_sent: int
    """This rank's all-to-all bytes to other ranks (forward and backward)."""
    seconds: float
    """This rank's seconds inside those all-to-alls."""


def describe(laid: Layout) -> dict[str, Any]:
    """A layout for run.json: its degrees, the ranks of each node, and the mesh ``(pp, dp, ep, tp)``."""
    p = laid.plan
    return {"pp": p.pp, "dp": p.dp, "ep": p.ep, "tp": p.tp, "nodes": [list(n) for n in p.nodes],
            "mesh": p.mesh, "notes": list(p.notes)}


def replica_of(laid: Layout, cfg: TrainConfig) -> int:
    """The data replica a rank reads for: its pipeline's index, ``dp * ep + ep_rank`` (rank r when pp = 1)."""
    return laid.coords["dp"] * cfg.parallelism.ep + laid.coords["ep"]


class RankModel:
    """This rank's part of the model on the run's layout: its stage (the whole model where ``pp = 1``), how the
    stage is held (a DDP, FSDP's shards, a pipeline, canonical MoE steps), the layout's groups, and the step,
    evaluation, clipping and saved state that go with them.

    Every run has one: the dense model on plain data parallel is the layout ``pp = ep = tp = 1``, replicated
    (:attr:`replicated`). Collective to build (every rank of the job, the same config). Methods that run
    collectives say so; every rank calls them in the same order.
    """

    def __init__(self, cfg: TrainConfig, laid: Layout, vocab_size: int, device: torch.device) -> None:
        par = cfg.parallelism
        self.cfg = cfg
        self.layout = laid
        self.device = device
        self.stage = laid.coords["pp"]
        self.replicated = cfg.model.kind == "dense" and par.pp == 1 and par.tp == 1
        """The dense model on data parallel alone: every rank holds it whole (or, with ``fsdp``, its shard of every
        parameter), steps as DDP or FSDP accumulate, clips as a plain data-parallel run does, and saves the same
        whole state as every other rank."""
        self.full = build_full(cfg, vocab_size, laid.ep_group if par.ep > 1 else None).to(device)
        if par.tp > 1:  # Megatron over the TP group; in the canonical order in the run's blocks, not the layout's
            split_linears(self.full, blocks=par.linear_blocks, tp_group=laid.tp_group, order=par.order)
        elif par.order == "canonical" and par.linear_blocks > 1:  # the blocks one process computes, on one rank
            split_linears(self.full, blocks=par.linear_blocks)
        sizes = split_sizes(cfg.model.layers, par.pp)
        start = sum(sizes[:self.stage])
        self.is_first, self.is_last = self.stage == 0, self.stage == par.pp - 1
        self.module = Stage(self.full, start, start + sizes[self.stage], first=self.is_first, last=self.is_last)
        expert_group = laid.expert_group if cfg.model.kind == "moe" else None
        self.ddp: DistributedDataParallel | None = None
        """The DDP over the dense group, unless FSDP or canonical steps sum the gradients, or the fault-tolerant
        trainer does (over torchft's replicas, the dense model held bare)."""
        self.sharded = par.fsdp
        """The module is sharded by FSDP over the dense group: steps go through ``fsdp_accumulate``."""
        self.steps: CanonicalSteps | None = None
        """MoE or a pipeline in the canonical order: steps that sum the dense gradients (and each expert's
        per-source streams) micro-batch by micro-batch; DDP (its own canonical round) otherwise."""
        if self.sharded:  # each rank one shard of the weights, gradients and AdamW's state
            from fireflyer.haiscale import fully_shard  # torch's FSDP: imported only by the runs that use it

            fully_shard(self.module, group=laid.dense_group, order=par.order)
        elif par.order == "canonical" and (cfg.model.kind == "moe" or par.pp > 1):
            self.steps = CanonicalSteps(self.module, dense_group=_unless_alone(laid.dense_group),
                                        expert_group=_unless_alone(laid.expert_group) if expert_group else None)
            _check_replica_order(laid, cfg)
        elif not (cfg.run.fault_tolerant and cfg.model.kind == "dense"):  # a fault-tolerant dense model: held bare
            self.ddp = DistributedDataParallel(self.module, process_group=laid.dense_group,
                                               expert_process_group=expert_group, bucket_cap_mb=par.bucket_cap_mb,
                                               order=par.order)
        self.named = self._name_params()  # after FSDP, whose shards replace the parameters
        self.pipeline = None
        self.tied: TiedStages | None = None
        if par.pp > 1:
            if self.steps is not None:
                self.tied = TiedStages(self, self.steps)
            self.pipeline = Pipeline(self.module if self.steps is not None else self.ddp, laid.pp_group,
                                     loss_fn=_cross_entropy, device=device, hooks=self.tied,
                                     config=PipelineConfig(n_microbatches=cfg.micro_batches, schedule="1F1B",
                                                           scale_grads=self.steps is None))
        self.moe_layers = [(i, b.moe) for i, b in enumerate(self.full.blocks) if isinstance(b, MoEBlock)
                           and start <= i < start + sizes[self.stage]]

    # ------------------------------------------------------------------ names
    def _name_params(self) -> list[Named]:
        names = {id(p): n for n, p in self.full.named_parameters()}
        firsts = {id(w): m.first for m in self.full.modules() if isinstance(m, RoutedExperts)
                  for w in (m.w1, m.w2, m.w3)}
        splits = {id(p): (m, leaf) for m in self.full.modules() if isinstance(m, TensorParallelLinear)
                  for leaf, p in m.named_parameters(recurse=False) if m.splits(leaf)}
        named = []
        for p in self.module.parameters():
            if id(p) in names:
                split, leaf = splits.get(id(p), (None, ""))
                named.append(Named(names[id(p)], p, firsts.get(id(p)), split=split, leaf=leaf))
            else:  # the last stage's own copy of the tied embedding
                named.append(Named(TIED, p, saved=False))
        return named

    # ------------------------------------------------------------------ a step
    def train_loss(self, data: TrainingData, step: int) -> float:
        """Forward and backward of this rank's micro-batches of ``data`` at ``step``; the gradients are reduced
        when it returns. Returns the global batch's mean loss, on every rank (collective).

        A pipeline runs the micro-batches as the slots of its 1F1B schedule; without one they are accumulated
        (each its own forward and backward), by DDP, FSDP (which deals them to the shards in turn) or the
        canonical steps.
        """
        if self.sharded:
            from fireflyer.haiscale import fsdp_accumulate, sharding_info

            mine = sharding_info(self.module).micro_batch_indices(self.cfg.micro_batches)
            return fsdp_accumulate(self.module, [data.micro_batch("train", g, at=step) for g in mine], lm_loss).item()
        micro_batches = data.train(step=step)
        if self.tied is not None:  # a pipeline in the canonical order: its schedule runs the micro-batches
            assert self.steps is not None and self.pipeline is not None
            self.steps.begin(len(micro_batches))
            x, y = (torch.cat(parts) for parts in zip(*micro_batches, strict=True))
            self.pipeline.forward_backward(x, y)
            return self.from_last_stage(self.tied.finish()).item()
        if self.steps is not None:  # the canonical tree over the global micro-batches
            return self.steps.accumulate(micro_batches, lm_loss).item()
        if self.cfg.parallelism.order == "canonical" or self.replicated:  # DDP's accumulation: the global mean
            assert self.ddp is not None
            return self.ddp.accumulate(micro_batches, lm_loss).item()
        return self._replica_mean(self.replica_loss(micro_batches))

    def replica_loss(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """:meth:`train_loss` in the fast order on this replica's ``micro_batches``, before the mean over replicas:
        through the pipeline, or accumulated under DDP's ``no_sync`` (the gradients reduced with the last). Returns
        this replica's mean loss on ranks holding the last stage, None on the others (collective)."""
        assert self.ddp is not None
        if self.pipeline is None:
            total = torch.zeros((), device=self.device)
            for j, (x, y) in enumerate(micro_batches):
                with self.ddp.no_sync() if j < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss = _cross_entropy(self.ddp(x), y)
                    (loss / len(micro_batches)).backward()
                total += loss.detach()
            return total / len(micro_batches)
        x, y = (torch.cat(parts) for parts in zip(*micro_batches, strict=True))
        losses = self.pipeline.forward_backward(x, y)
        self._reduce_tied()
        return torch.stack(losses).mean() if losses is not None else None

    def _replica_mean(self, value: torch.Tensor | None) -> float:
        """The mean over data replicas of a value the last stage holds, on every rank of its TP group (collective
        over the world: TP rank 0 counts it)."""
        buf = torch.zeros(1, dtype=torch.float64, device=self.device)
        if value is not None and self.layout.coords["tp"] == 0:
            buf += value.double()
        dist.all_reduce(buf)
        return buf.item() / self.cfg.replicas

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the pipeline's last stage holds it, on every stage (a broadcast over the pipeline; ``value``
        itself without one). Every rank passes a tensor of the same shape."""
        if self.pipeline is None:
            return value
        buf = value.detach().clone().contiguous()
        dist.broadcast(buf, src=self.layout.plan.group_of("pp", dist.get_rank())[-1], group=self.layout.pp_group)
        return buf

    def _reduce_tied(self) -> None:
        """Sum the tied embedding's gradient over its two holders in each pipeline (zeros in between)."""
        grad = next((n.param.grad for n in self.named if n.name == TIED), None)
        buf = grad if grad is not None else torch.zeros(self.full.tok.weight.shape, device=self.device)
        dist.all_reduce(buf, group=self.layout.pp_group)

    def clip(self, max_norm: float) -> None:
        """Scale every gradient so the model's global norm is at most ``max_norm`` (collective).

        A replicated model clips as plain data parallel does: in the fast order by torch's norm, in the canonical
        order by the exact norm (:func:`~fireflyer.train.optim.clip_exact`) of the gradients every rank holds (FSDP:
        each rank adding its shards). Any other layout takes the exact norm, so it has the same bits on every
        layout: each element of the model counts once, on the rank of data-parallel index 0 that holds it (a
        TP-split parameter on every TP rank, a replicated one on TP rank 0; an expert on its EP rank, a dense
        parameter on EP rank 0; each stage its own; the last stage's copy of the tied embedding not at all).
        """
        params = list(self.module.parameters())
        if self.replicated and self.cfg.parallelism.order == "fast":
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        elif self.replicated:
            clip_exact(params, params, max_norm, self.layout.dense_group if self.sharded else None)
        else:
            c = self.layout.coords
            owned = [n.param for n in self.named if n.saved and c["dp"] == 0
                     and (n.split is not None or c["tp"] == 0)
                     and (is_expert_param(n.param) or c["ep"] == 0)]
            clip_exact(params, owned, max_norm, dist.group.WORLD)

    @torch.no_grad()
    def after_step(self) -> list[LayerStep]:
        """The balancing step of every MoE layer (collective on the stage's dense group); each layer's
        load of the step (tokens per global expert, over every replica), imbalance and all-to-all."""
        return self._layer_steps([m.update_bias(self.layout.dense_group) for _, m in self.moe_layers])

    def take_loads(self) -> list[torch.Tensor]:
        """Each MoE layer's expert choices on this rank since the last step (float64), for a caller that sums them
        over replicas itself (fault-tolerant training), then :meth:`apply_loads`."""
        return [m.take_step_load() for _, m in self.moe_layers]

    @torch.no_grad()
    def apply_loads(self, loads: list[torch.Tensor]) -> list[LayerStep]:
        """:meth:`after_step` for loads already summed over every replica (not a collective)."""
        return self._layer_steps([m.apply_load(load) for (_, m), load in zip(self.moe_layers, loads, strict=True)])

    def _layer_steps(self, loads: list[torch.Tensor]) -> list[LayerStep]:
        out = []
        for (i, m), counts in zip(self.moe_layers, loads, strict=True):
            load = counts.tolist()
            a2a = m.take_exchange_totals()
            total = sum(load)
            out.append(LayerStep(i, load, max(load) * len(load) / total if total else 1.0, a2a.bytes_sent,
                                 a2a.seconds))
        return out

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def val_loss(self, data: TrainingData) -> float:
        """The mean loss over every replica's validation batches of ``data`` (collective).

        A replicated model, and every layout in the canonical order, sums batch i's losses pairwise over this
        replica's micro-batches, then over the replicas (in the dense group's order), then over i in the canonical
        tree: layout-independent bits in the canonical order. Other layouts in the fast order add them up and
        take the mean over replicas.
        """
        batches = self.cfg.data.eval_batches
        if self.cfg.parallelism.order == "fast" and not self.replicated:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for i in range(batches):
                for x, y in data.eval(index=i):
                    loss = self.eval_loss(x, y)
                    if loss is not None:
                        total += loss.double()
            return self._replica_mean(total / (batches * self.cfg.micro_batches))
        sums = torch.zeros(batches, device=self.device)
        for i in range(batches):
            acc = PairwiseAccumulator()
            for x, y in data.eval(index=i):
                loss = self.eval_loss(x, y)
                if loss is not None:  # None on a pipeline's earlier stages, which only pass activations on
                    acc.add(loss.float())
            if acc.count:
                sums[i] = acc.result()
        dist.all_reduce(sums, group=self.layout.dense_group)
        mean = canonical_sum(list(sums.unbind())) / (batches * self.cfg.global_micro_batches)
        return self.from_last_stage(mean).item()  # a pipeline's last stage holds it

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The loss of a forward alone, through the pipeline by point-to-point sends; None off the last stage."""
        self.module.eval()
        try:
            if self.pipeline is None:
                return self.module(x, y)
            mine = self.layout.plan.group_of("pp", dist.get_rank())
            act = x
            if not self.is_first:
                act = torch.empty(x.shape[0], x.shape[1], self.cfg.model.d_model, device=self.device)
                dist.recv(act, src=mine[self.stage - 1], group=self.layout.pp_group)
            out = self.module(act)
            if not self.is_last:
                dist.send(out.contiguous(), dst=mine[self.stage + 1], group=self.layout.pp_group)
                return None
            return _cross_entropy(out, y)
        finally:
            self.module.train()

    def whole(self) -> nn.Module | None:
        """The whole model as one module that generates text on this rank alone, where this rank holds it so (the
        replicated model without FSDP); None where its parts are spread over ranks."""
        return self.full if self.replicated and not self.sharded else None

    # ------------------------------------------------------------------ state
    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights and buffers under global names (each expert on its own; TP shares and FSDP shards
        gathered: a collective over their groups)."""
        out: dict[str, torch.Tensor] = {}
        for n in self.named:
            if not n.saved:
                continue
            if n.first_expert is None:
                out[n.name] = n.full(n.param.detach())
            else:
                for e, row in enumerate(n.param.detach()):
                    out[expert_name(n.name, n.first_expert + e)] = row
        mine = {id(b) for b in self.module.buffers()}
        out.update({name: b for name, b in self.full.named_buffers() if id(b) in mine})
        return out

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """AdamW's state per global name (experts split as the weights are, TP shares and FSDP shards gathered)
        and its hyper-parameters (a collective over the TP or FSDP group)."""
        return optimizer_state(self.named, optimizer)

    def load(self, model: dict[str, torch.Tensor], optim: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Take this rank's share of a state saved on any layout: weights, buffers and AdamW's state."""
        with torch.no_grad():
            for n in self.named:
                n.param.copy_(n.share(_whole(model, n)))
            mine = {id(b) for b in self.module.buffers()}
            for name, b in self.full.named_buffers():
                if id(b) in mine:
                    b.copy_(model[name])
        load_optimizer(self.named, optim, optimizer)

    # ------------------------------------------------------------------ reporting
    def num_parameters(self) -> int:
        """Parameters this rank holds (its stage, its experts, its FSDP shards; the tied copy not counted)."""
        return sum((n.param.to_local() if is_dtensor(n.param) else n.param).numel() for n in self.named if n.saved)

    def close(self) -> None:
        """Remove DDP's hooks and switch the canonical steps' layers back to the fast order."""
        if self.ddp is not None:
            self.ddp.close()
        if self.steps is not None:
            self.steps.close()


class TiedStages:
    """A pipeline's stages in the canonical order: each micro-batch's gradients opened and folded around its
    backward (:class:`~fireflyer.haiscale.pipeline.MicroBatchHooks`), and the tied embedding's two halves met
    as one process meets them.

    One process adds, for each micro-batch, the output projection's gradient of the token embedding and the
    embedding's own (autograd's sum of a tied weight's two uses), and sums those in the canonical tree. Here the
    halves sit on the first and the last stage: after each micro-batch's backward the last stage sends its half
    to the first (and keeps zero), which adds it before folding, so the first stage's tree is the one process's.
    After the step the first stage's gradient goes back to the last stage's copy. The cost is one
    ``vocab x d_model`` message per micro-batch from the last stage to the first.

    Collective to build: every rank makes the pipelines' (first, last) groups in the same order.
    """

    def __init__(self, net: RankModel, steps: CanonicalSteps) -> None:
        self.steps = steps
        self.group: dist.ProcessGroup | None = None
        self.role = "first" if net.is_first else "last" if net.is_last else ""
        rank = dist.get_rank()
        for ranks in net.layout.plan.groups("pp"):  # one (first, last) group per pipeline, on every rank alike
            group = dist.new_group([ranks[0], ranks[-1]], timeout=timedelta(seconds=pp_timeout_s(DEFAULT_TIMEOUT_S)))
            if rank in (ranks[0], ranks[-1]):
                self.group, self.first, self.last = group, ranks[0], ranks[-1]
        self.param = next((n.param for n in net.named if n.name == TIED), None) if self.role else None
        self.sends: list[tuple[torch.Tensor, Any]] = []

    def before_backward(self, index: int) -> None:
        self.steps.begin_micro_batch()

    @torch.no_grad()
    def after_backward(self, index: int, loss: torch.Tensor | None) -> None:
        if self.param is not None:
            grad = self.param.grad
            assert grad is not None
            if self.role == "last":  # the projection's half goes to the first stage; this copy keeps zero
                half = grad.detach().clone()
                grad.zero_()
                self.sends.append((half, dist.isend(half, dst=self.first, group=self.group)))
            else:
                half = torch.empty_like(grad)
                dist.recv(half, src=self.last, group=self.group)
                grad.add_(half)
        self.steps.end_micro_batch(loss)

    def finish(self) -> torch.Tensor:
        """End the step: the gradients in the canonical order, the last stage's copy of the tied embedding given
        the first stage's; the global mean loss on the last stage (collective)."""
        for _, work in self.sends:
            work.wait()
        self.sends = []
        mean = self.steps.finish()
        if self.param is not None:
            assert self.param.grad is not None
            dist.broadcast(self.param.grad, src=self.first, group=self.group)
        return mean


def _check_replica_order(laid: Layout, cfg: TrainConfig) -> None:
    """The canonical tree needs the dense group numbered by data replica (rank ``r`` sums the block of replica
    ``r``); a layout that numbers it otherwise is refused rather than giving other bits."""
    here, replica = dist.get_rank(laid.dense_group), replica_of(laid, cfg)
    if here != replica:
        raise UserError(f"this rank is rank {here} of its dense group but reads data replica {replica}: the "
                        "canonical order needs the dense group numbered by replica")


def _unless_alone(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """``group``, or None when this rank is all of it (nothing to sum over)."""
    return group if dist.get_world_size(group) > 1 else None


def optimizer_state(named: list[Named], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state per global name, whole (experts one by one, TP shares gathered: a collective over
    the TP group), and its groups' hyper-parameters: the same on every layout."""
    state: dict[str, Any] = {}
    for n in named:
        if not n.saved or n.param not in optimizer.state:
            continue
        s = optimizer.state[n.param]
        if n.first_expert is None:
            state[n.name] = {k: (n.full(v) if torch.is_tensor(v) and v.dim() else v) for k, v in s.items()}
        else:
            for e in range(n.param.shape[0]):
                state[expert_name(n.name, n.first_expert + e)] = {
                    k: (v[e] if torch.is_tensor(v) and v.dim() and v.shape[0] == n.param.shape[0] else v)
                    for k, v in s.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "groups": groups}


def load_optimizer(named: list[Named], optim: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` this rank's share of a state :func:`optimizer_state` saved (on any layout)."""
    sd = optimizer.state_dict()
    if not any(isinstance(k, str) for k in optim["state"]) and "param_groups" in optim:  # by index: one layout's
        optimizer.load_state_dict(optim)
        return
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for n in named:
        if n.first_expert is None:
            saved = optim["state"].get(n.name)
            if saved is not None:
                saved = {k: (n.share(v) if torch.is_tensor(v) and v.dim() else v) for k, v in saved.items()}
        else:
            parts = [optim["state"].get(expert_name(n.name, n.first_expert + e)) for e in range(n.param.shape[0])]
            saved = None if any(p is None for p in parts) else {
                k: (torch.stack([p[k] for p in parts]) if torch.is_tensor(v) and v.dim() else v)
                for k, v in parts[0].items()}
        if saved is not None:
            state[index[id(n.param)]] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in saved.items()}
    groups = [{**saved_g, "params": g["params"]} for saved_g, g in zip(optim["groups"], sd["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _whole(model: dict[str, torch.Tensor], n: Named) -> torch.Tensor:
    """A saved state's whole tensor for ``n`` (an expert stack rebuilt from its experts)."""
    if n.first_expert is None:
        return model[n.name]
    return torch.stack([model[expert_name(n.name, n.first_expert + e)] for e in range(n.param.shape[0])])


def whole_model(cfg: TrainConfig, vocab_size: int, model: dict[str, torch.Tensor]) -> nn.Module:
    """The unsharded model of a saved global state (every expert on this rank), for sampling or export."""
    full = build_full(cfg, vocab_size, None)
    merged: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in model.items():
        m = _EXPERT_NAME.match(name)
        if m and ".experts." in name:
            stacks.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        else:
            merged[name] = t
    for name, rows in stacks.items():
        merged[name] = torch.stack([rows[g] for g in sorted(rows)])
    merged["head.weight"] = merged[TIED]
    full.load_state_dict(merged)
    return full


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
