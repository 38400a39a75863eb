"""A distributed sampler that resumes exactly where a checkpoint left it.

Each epoch is a seeded permutation of the sample ids (or the ids in order), cut to a
multiple of ``world_size * batch_size`` when ``drop_last`` (padded by wrapping
otherwise), and dealt to ranks round robin. Position is counted in *steps* (batches per
rank) across epochs, so ``set_step(step)`` with the step a checkpoint recorded puts every
rank at the first sample it had not yet trained on, in the right epoch's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    num_samples: int
    batch_size: int = 1
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise UserError(f"num_samples must be at least 1, got {self.num_samples}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {self.rank} must be in 0..world_size-1 (world_size {self.world_size})")
        if self.drop_last and self.num_samples < self.world_size * self.batch_size:
            raise UserError(f"{self.num_samples} samples cannot fill one batch of {self.batch_size} on each of "
                             f"{self.world_size} ranks; lower batch_size or set drop_last=False")


class ResumableSampler:
    """Yields this rank's sample ids from the current step on; a torch ``Sampler`` in all but name
    (it needs no torch), usable as ``DataLoader(..., sampler=s, batch_size=cfg.batch_size)``."""

    def __init__(self, num_samples: int, *, batch_size: int = 1, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        self.config = SamplerConfig(num_samples=num_samples, batch_size=batch_size, rank=rank, world_size=world_size,
                                    seed=seed, shuffle=shuffle, drop_last=drop_last)
        c = self.config
        per_rank = c.num_samples // c.world_size if c.drop_last else -(-c.num_samples // c.world_size)
        self.steps_per_epoch = per_rank // c.batch_size if c.drop_last else -(-per_rank // c.batch_size)
        self.samples_per_epoch = self.steps_per_epoch * c.batch_size if c.drop_last else per_rank
        self.step = 0
        self._epochs: dict[int, np.ndarray] = {}
        """The last two epochs' ids: a training loop asks for one batch at a time (and a prefetcher
        for the next few), and a permutation of millions of ids is worth drawing once."""

    def set_step(self, step: int) -> None:
        """Continue from global step ``step`` (batches this rank has already consumed)."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise UserError(f"step must be a non-negative int, got {step!r}")
        self.step = int(step)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def epoch_ids(self, epoch: int) -> np.ndarray:
        """This rank's ids for a whole epoch (a read-only array)."""
        ids = self._epochs.get(epoch)
        if ids is None:
            ids = self._draw_epoch(epoch)
            ids.flags.writeable = False
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = ids
        return ids

    def _draw_epoch(self, epoch: int) -> np.ndarray:
        c = self.config
        ids = np.random.default_rng([c.seed, epoch]).permutation(c.num_samples) if c.shuffle \
            else np.arange(c.num_samples)
        per_rank_total = self.samples_per_epoch * c.world_size if c.drop_last else \
            -(-c.num_samples // c.world_size) * c.world_size
        if per_rank_total > len(ids):
            ids = np.concatenate([ids, ids[:per_rank_total - len(ids)]])
        return ids[:per_rank_total][c.rank::c.world_size]

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch from ``step``; afterwards the position is the next epoch's start."""
        epoch, within = divmod(self.step, self.steps_per_epoch)
        ids = self.epoch_ids(epoch)[within * self.config.batch_size:]
        self.step = (epoch + 1) * self.steps_per_epoch
        return iter(int(i) for i in ids)

    def __len__(self) -> int:
        within = self.step % self.steps_per_epoch
        return self.samples_per_epoch - within * self.config.batch_size if self.config.drop_last else \
            max(0, self.samples_per_epoch - within * self.config.batch_size)

    def batch(self, step: int) -> list[int]:
        """The ids this rank trains on at global ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        b = self.config.batch_size
        return [int(i) for i in self.epoch_ids(epoch)[within * b:(within + 1) * b]]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records: the step and what the order depends on."""
        c = self.config
        return {"step": self.step, "seed": c.seed, "num_samples": c.num_samples, "batch_size": c.batch_size,
                "world_size": c.world_size, "shuffle": c.shuffle, "drop_last": c.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.config
        for key in ("seed", "num_samples", "batch_size", "world_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(c, key):
                raise UserError(f"the checkpoint's sampler had {key}={state[key]!r} but this one has "
                                 f"{getattr(c, key)!r}; resume with the same data settings")
        self.set_step(int(state["step"]))
