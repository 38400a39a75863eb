"""Fault-tolerant training of the MoE model (``fireflyer train --preset moe --fault-tolerant``).

Each node is a replica that holds the whole model: its ranks split the routed experts
(``ep`` divides ``ranks_per_node``) and exchange tokens with an all-to-all inside the node,
and haiscale DDP reduces the node's gradients, as in a plain run on one node. Across nodes
torchft's Manager sums every rank's gradients with those of the same rank on the other live
replicas (the rank that holds the same experts), and each MoE layer's expert load, so every
replica steps alike and moves its router biases alike. A heal moves each rank's share (its
experts, their optimizer state, the biases) from the same rank of a live replica.

Expert parallel has no canonical order yet, so the run goes on as torchft's data parallel
does: a lost replica's micro-batches are dropped from the steps it misses, and counted. With
every replica present a step is the plain run's step: dense gradients averaged over every
rank, expert gradients as haiscale's DDP gives them, the bias moved by the load of every rank.
"""

from __future__ import annotations

import time
import torch
import torch.distributed as dist

from fireflyer.train.fault_tolerant import StepPlan
from fireflyer.train.ft_trainer import FaultTolerantTrainer


class FaultTolerantMoETrainer(FaultTolerantTrainer):
    """A :class:`FaultTolerantTrainer` for ``model = "moe"`` (no pipeline): the layout over this node's ranks, its
    stage the whole model."""

    def _train_step_ft(self, plan: StepPlan) -> tuple[float, float] | None:
        net = self.net
        R, n = self.where.world_size, len(plan.replicas)
        self.optimizer.zero_grad(set_to_none=False)
        # this rank's own micro-batches (in the fast order it keeps them); the node's gradients, inside the node only
        loss = net.replica_loss(self.data.train(step=plan.step))
        loads = net.take_loads()
        node = torch.cat([loss.detach().double().reshape(1), *loads])
        if R > 1:
            dist.all_reduce(node)  # the node's loss and expert loads
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [node.float()])  # loads are counts: exact in float32
        ok = self.replica.sum_over_replicas(flat)
        if not self.replica.commit() or not ok:
            return None
        self.replica.record.dropped_micro_batches += plan.dropped
        width = flat.numel() - node.numel()
        with torch.no_grad():
            offset = 0
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p)).div_(n)
                offset += p.numel()
        total = flat[width:].double()
        if self.cfg.optimizer.grad_clip:
            net.clip(self.cfg.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        sizes = [load.numel() for load in loads]
        layers = net.apply_loads(list(total[1:].split(sizes)))
        self.history.loss.append(total[0].item() / (n * R))
        self.history.lr.append(lr)
        self.history.experts.append(self._expert_record(layers))
        return self.history.loss[-1], lr

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """The validation loss over every configured rank's validation batches, computed by this replica alone
        (rank ``r`` of the node takes the batches of ranks ``r``, ``r + R``, ...): the same on every replica."""
        t0 = time.perf_counter()
        net = self.net
        R, M = self.where.world_size, self.cfg.global_micro_batches
        total = torch.zeros(1, dtype=torch.float64)
        for i in range(self.cfg.data.eval_batches):
            for g in range(self.where.rank, M, R):  # the same count on every rank: the all-to-alls pair up
                loss = net.eval_loss(*self.data.micro_batch("val", g, at=i))
                total += loss.double()
        if R > 1:
            dist.all_reduce(total)
        self.history.val.append([step, total.item() / (self.cfg.data.eval_batches * M)])
        self.timing["eval_s"] += time.perf_counter() - t0
        return self.history.val[-1][1]
