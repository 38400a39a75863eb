"""A run's out directory: its config resolved against what an earlier run saved there.

Both sides of ``fireflyer train`` use it: the launcher (:mod:`~fireflyer.train.cli`)
before it starts the ranks, and rank 0 of a platform task
(:func:`fireflyer.train.job.run_managed`), where nothing launches the ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from fireflyer.errors import UserError
from fireflyer.fsutil import make_dirs
from fireflyer.train.config import TrainConfig, builtin_config, check_resumable, read_toml


def resolve(config: str | None, overrides: dict[str, Any], *, resume: bool) -> tuple[TrainConfig, int | None]:
    """The run's config and, with ``resume``, the committed step to continue from; readies the out directory.

    A fresh run clears an earlier run's state and results in the out directory. With
    ``resume`` and no CONFIG, the saved run's own config is the base (its ``stop_at`` dropped).
    """
    base = read_toml(config) if config else None
    out_flag = overrides.get("out") or (base or {}).get("out")
    if out_flag and Path(out_flag).exists() and not Path(out_flag).is_dir():
        raise UserError(f"out {out_flag} is a file; give a folder for the run's results")
    if not resume:
        cfg = TrainConfig.from_dict({**(base or read_toml(builtin_config("demo"))), **overrides},
                                    source=config or "demo.toml")
        start_afresh(cfg.out_dir)
        return cfg, None
    from fireflyer.train import state as saved  # imports torch

    out = overrides.get("out") or (base or {}).get("out") or TrainConfig.from_toml(builtin_config("demo")).out
    if saved.latest_step(out) is None:
        raise UserError(f"--resume: no saved state in {saved.ckpt_dir(out)}/; run without --resume first")
    state = saved.load_state(out)  # the newest intact one (a damaged newest one falls back, with a warning)
    step = int(state["step"])
    where = f"{saved.ckpt_dir(out)} (step {step})"
    if base is None:
        base = {k: v for k, v in state["config"].items() if k != "stop_at"}
    cfg = TrainConfig.from_dict({**base, "out": str(out), **overrides}, source=config or where)
    changed = check_resumable(state["config"], cfg, state=where)
    if step >= (cfg.stop_at or cfg.steps):
        raise UserError(f"{where} is already at step {step}; raise --steps (or --stop-at) to train further")
    if changed:
        print(f"note: resuming with changed {', '.join(changed)}")
    for name in ("run.json", "loss.png"):
        (cfg.out_dir / name).unlink(missing_ok=True)
    return cfg, step


def start_afresh(out: Path) -> None:
    """Clear an earlier run's saved state and results from ``out`` and make sure it exists."""
    from fireflyer.train import state as saved

    if saved.clear_states(out):
        print(f"note: starting afresh in {out}/; the earlier run's saved state there was removed "
              "(--resume continues a run instead)")
    shutil.rmtree(out / "state", ignore_errors=True)  # states of the format before the checkpoint manager
    for name in ("run.json", "loss.png"):
        (out / name).unlink(missing_ok=True)
    make_dirs(out)
