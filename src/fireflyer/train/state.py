"""The saved training state that ``--resume`` continues from, kept by the checkpoint manager.

Every ``save_every`` steps and at the end, all ranks hand the state to
:class:`fireflyer.checkpoint.CheckpointManager` under ``OUT/ckpt/``: the step waits
only for the snapshot to host memory, the ranks write disjoint shares of it in the
background (the state is the same on every rank under DDP or FSDP), and rank 0 commits it. A run
whose ranks hold different shares (MoE experts, pipeline stages, TP) saves with ``kind="sharded"``:
each rank hands in its share under global names (:mod:`fireflyer.train.parallel`), and a load
returns the whole model.
A state holds all that the next step depends on: model and optimizer, the scheduler's
position, the step, the RNG states, the config it ran under, and the loss history so
far, and the hash of the training records. Batches are a pure function of (records, seed,
rank, step) (see :mod:`fireflyer.train.data`), so a run resumed from step k produces bit
for bit the losses of a run that never stopped.

Only committed checkpoints count, every byte is verified on load, and a damaged newest
checkpoint falls back to the one before it with a warning. The two newest are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fireflyer.checkpoint import CheckpointError, CheckpointManager, committed_steps
from fireflyer.errors import UserError

FORMAT = 2
KEEP = 2


def ckpt_dir(out: str | Path) -> Path:
    return Path(out) / "ckpt"


def manager(out: str | Path, *, rank: int, world_size: int, every: int = 1 << 30,
            kind: str = "replicated") -> CheckpointManager:
    """This rank's checkpoint manager for the run in ``out``: ``replicated`` (the dense model on data parallel,
    every rank hands in the same whole state) or ``sharded`` (experts, stages or TP shares: each rank its share,
    under global names)."""
    return CheckpointManager(ckpt_dir(out), every=every, keep_last=KEEP, kind=kind, rank=rank,
                             world_size=world_size)


def latest_step(out: str | Path) -> int | None:
    """The newest committed step under ``out``, or None."""
    steps = committed_steps(str(ckpt_dir(out)))
    return steps[-1] if steps else None


def load_state(out: str | Path, step: int | None = None) -> dict[str, Any]:
    """The state of ``step`` (default: the newest intact one), on the CPU; any world size can read it."""
    try:
        state = manager(out, rank=0, world_size=1).load(step)
    except CheckpointError as exc:
        raise UserError(f"cannot resume from {ckpt_dir(out)}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{ckpt_dir(out)} does not hold training states of format {FORMAT}")
    return state


def payload(step: int, **parts: Any) -> dict[str, Any]:
    return {"format": FORMAT, "step": step, **parts}
