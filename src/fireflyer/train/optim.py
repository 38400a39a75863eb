"""AdamW and its learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fireflyer.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``cfg.steps`` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


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
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), foreach=True,
    )
    return opt, WarmupCosine(opt, cfg)
