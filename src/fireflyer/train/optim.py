"""AdamW and its learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``cfg.run.steps`` steps."""
    if step < cfg.optimizer.warmup_steps:
        return cfg.optimizer.lr * (step + 1) / cfg.optimizer.warmup_steps
    decay_steps = max(1, cfg.run.steps - cfg.optimizer.warmup_steps)
    progress = min(1.0, (step - cfg.optimizer.warmup_steps) / decay_steps)
    return cfg.optimizer.min_lr + 0.5 * (cfg.optimizer.lr - cfg.optimizer.min_lr) * (1 + math.cos(math.pi * progress))


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """:func:`lr_at` as a torch scheduler, so its position is saved and restored with the run."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
        self.cfg = cfg
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [lr_at(self.last_epoch, self.cfg) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "cfg"}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, WarmupCosine]:
    """AdamW with weight decay on weight matrices only, and the warm-up/cosine schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optimizer.lr, betas=(0.9, 0.95), foreach=True,
    )
    return opt, WarmupCosine(opt, cfg)


def clip_exact(params: Iterable[nn.Parameter], owned: Iterable[nn.Parameter], max_norm: float,
               group: dist.ProcessGroup | None = None) -> float:
    """Scale the gradients of ``params`` so the model's norm is at most ``max_norm``; return the norm.

    The norm is exact before its one rounding (:func:`fireflyer.hfreduce.plans.exact.exact_norm`): each rank adds
    the squares of the gradients it ``owned`` (every element of the model counted once over ``group``, whose
    ranks all call this; an FSDP parameter's local shard), so the norm, and with it every clipped gradient, has
    the same bits on every layout.
    """
    from fireflyer.hfreduce.plans.exact import exact_norm

    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    grads = [p.grad.detach() for p in owned if p.grad is not None]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        g = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((g.dtype, g.device), []).append(g.reshape(-1))
    # one flat tensor per dtype: the exact sum's fixed cost is paid once, not once per parameter
    norm = exact_norm([torch.cat(gs) for gs in by_kind.values()], group, device=params[0].device if params else None)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
    return norm
