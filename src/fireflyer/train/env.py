"""The environment variables ``fireflyer train`` reads, beyond a rank's place (:func:`fireflyer.launch.this_rank`)
and the engine's settings (:mod:`fireflyer.hfreduce.env`); the functions here are their one reader."""

from __future__ import annotations

import os
from pathlib import Path

from fireflyer.errors import UserError

FAIL_AT = "FIREFLYER_TRAIN_FAIL_AT"
"""Fault injection: ``RANK:STEP`` makes that rank raise as it starts that step (tests use it)."""
DATA_CACHE = "FIREFLYER_DATA_CACHE"
"""Folder of the training records built from corpora (one subfolder per content hash), where the
config's ``data_cache`` is empty; unset: ``$XDG_CACHE_HOME/fireflyer/data`` (``~/.cache/fireflyer/data``)."""
TASK_DIR = "FIREFLYER_TASK_DIR"
"""Set by the platform in a task's ranks: ``fireflyer train`` then runs as that task's rank
(:func:`fireflyer.train.job.run_managed`) instead of launching emulated nodes."""


def injected_failure(rank: int) -> int | None:
    """The step at which this rank is to fail, from ``FIREFLYER_TRAIN_FAIL_AT``, or None."""
    raw = os.environ.get(FAIL_AT)
    if not raw:
        return None
    try:
        fail_rank, step = (int(part) for part in raw.split(":"))
    except ValueError:
        raise UserError(f"{FAIL_AT}={raw!r} must be RANK:STEP, e.g. 1:5") from None
    return step if fail_rank == rank else None


def in_platform_task() -> bool:
    """Whether this process is a rank of a platform task (the task's folder and a rank are in its environment)."""
    return bool(os.environ.get(TASK_DIR)) and "RANK" in os.environ


def data_cache_dir(configured: str = "") -> Path:
    """Where training records are cached: ``configured`` (the config's ``data_cache``), else
    ``FIREFLYER_DATA_CACHE``, else the user's cache folder (XDG: ``$XDG_CACHE_HOME``, or
    ``~/.cache`` where that is unset or not an absolute path), ``/fireflyer/data``."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(DATA_CACHE):
        return Path(os.environ[DATA_CACHE]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "fireflyer" / "data"
