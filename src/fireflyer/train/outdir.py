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
from fireflyer.train.config import TrainConfig, builtin_config, check_resumable, read_toml, upgrade_saved


def resolve(config: str | None, overrides: dict[str, Any], *, resume: bool, overwrite: bool = False,
            replace_same: bool = False) -> tuple[TrainConfig, int | None]:
    """The run's config and, with ``resume``, the committed step to continue from; readies the out directory.

    A fresh run never deletes another: an out directory that holds an earlier run is refused,
    unless ``overwrite`` (``--overwrite``) says to delete it, or ``replace_same`` (``fireflyer
    demo``) and the earlier run had exactly this config. With ``resume`` and no CONFIG, the
    saved run's own config is the base (its ``stop_at`` dropped).
    """
    base = read_toml(config) if config else None
    out_flag = overrides.get("out") or (base or {}).get("out")
    if out_flag and Path(out_flag).exists() and not Path(out_flag).is_dir():
        raise UserError(f"out {out_flag} is a file; give a folder for the run's results")
    if not resume:
        cfg = TrainConfig.from_dict({**(base or read_toml(builtin_config("demo"))), **overrides},
                                    source=config or "demo.toml")
        earlier = earlier_run(cfg.out_dir)
        if earlier and not overwrite and not (replace_same and _same_config(cfg)):
            raise UserError(f"{cfg.out_dir}/ holds an earlier run ({', '.join(earlier)}); continue it with --resume, "
                            "delete it and start afresh with --overwrite, or give another --out")
        start_afresh(cfg.out_dir, earlier)
        return cfg, None
    from fireflyer.train import state as saved  # imports torch

    out = overrides.get("out") or (base or {}).get("out") or TrainConfig.from_toml(builtin_config("demo")).run.out
    if saved.latest_step(out) is None:
        raise UserError(f"--resume: no saved state in {saved.ckpt_dir(out)}/; run without --resume first")
    state = saved.load_state(out)  # the newest intact one (a damaged newest one falls back, with a warning)
    step = int(state["step"])
    where = f"{saved.ckpt_dir(out)} (step {step})"
    if base is None:
        base = {k: v for k, v in upgrade_saved(state["config"]).items() if k != "stop_at"}
    cfg = TrainConfig.from_dict({**base, "out": str(out), **overrides}, source=config or where)
    changed = check_resumable(state["config"], cfg, state=where)
    if step >= (cfg.run.stop_at or cfg.run.steps):
        raise UserError(f"{where} is already at step {step}; raise --steps (or --stop-at) to train further")
    if changed:
        print(f"note: resuming with changed {', '.join(changed)}")
    set_aside_newer(out, step)
    for name in ("run.json", "loss.png"):
        (cfg.out_dir / name).unlink(missing_ok=True)
    return cfg, step


def set_aside_newer(out: str | Path, step: int) -> list[str]:
    """Rename the committed step folders newer than ``step`` (the newest intact one, resumed from) to ``NAME.damaged``.

    They were damaged (load fell back past them), so the resumed run will save those steps
    again; renamed, not deleted: what they hold is kept for a look, and the new saves do not
    find a step already committed.
    """
    from fireflyer.checkpoint.manager import committed_steps, step_dir
    from fireflyer.train import state as saved

    root = str(saved.ckpt_dir(out))
    moved = []
    for newer in (s for s in committed_steps(root) if s > step):  # uncommitted ones are written over when saved again
        path = Path(step_dir(root, newer))
        aside, n = path.with_name(path.name + ".damaged"), 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.damaged{n}"), n + 1
        path.rename(aside)
        moved.append(aside.name)
    if moved:
        print(f"note: resuming from step {step}; the newer step folders were set aside as {', '.join(moved)}")
    return moved


RUN_FILES = ("ckpt", "state", "config.json", "run.json", "loss.png", "logs")
"""What a run leaves in its out directory (``state`` is the saved-state folder of an older format)."""


def earlier_run(out: Path) -> list[str]:
    """What of an earlier run ``out`` holds, for a message (``ckpt/ (step 200)``, ``run.json``); empty if none."""
    found = []
    for name in RUN_FILES:
        path = out / name
        if name == "ckpt" and path.is_dir() and any(path.iterdir()):
            from fireflyer.train import state as saved  # imports torch: only where there is a checkpoint to read

            step = saved.latest_step(out)
            found.append(f"ckpt/ (step {step})" if step is not None else "ckpt/ (no committed step)")
        elif name != "ckpt" and (path.is_file() or (path.is_dir() and any(path.iterdir()))):
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def _same_config(cfg: TrainConfig) -> bool:
    """Whether the run in ``cfg.out_dir`` was started with exactly ``cfg`` (its ``config.json``)."""
    try:
        return TrainConfig.from_json(str(cfg.out_dir / "config.json")).to_dict() == cfg.to_dict()
    except (OSError, ValueError):
        return False


def start_afresh(out: Path, earlier: list[str] | None = None) -> None:
    """Delete an earlier run's saved state, results and logs from ``out`` (saying what went) and make sure it exists."""
    earlier = earlier_run(out) if earlier is None else earlier
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if earlier:
        print(f"note: starting afresh in {out}/; the earlier run's {', '.join(earlier)} were deleted")
    make_dirs(out)
