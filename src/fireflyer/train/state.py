"""The saved training state that ``--resume`` continues from.

Rank 0 writes ``OUT/state/stepNNNNNN.pt`` every ``save_every`` steps and at the end, with
plain ``torch.save`` (a checkpoint manager will take this over). A state holds all that
the next step depends on: model and optimizer, the scheduler's position, the step, the
RNG states, the config it ran under, and the loss history so far. Batches are a pure
function of (seed, rank, step) (see :mod:`fireflyer.train.data`), so a run resumed from
step k produces bit for bit the losses of a run that never stopped.

Writes are atomic: the state goes to a temporary file in the same directory, is fsynced,
then renamed over the final name, so a crash mid-write leaves the previous state intact.
The two newest states are kept.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from fireflyer.errors import UserError

FORMAT = 1
KEEP = 2
_NAME = re.compile(r"^step(\d{6,})\.pt$")


def state_dir(out: str | Path) -> Path:
    return Path(out) / "state"


def state_path(out: str | Path, step: int) -> Path:
    return state_dir(out) / f"step{step:06d}.pt"


def saved_states(out: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete state under ``out``, oldest first."""
    d = state_dir(out)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_state(out: str | Path) -> Path | None:
    """The newest state under ``out``, or None."""
    states = saved_states(out)
    return states[-1][1] if states else None


def save_state(out: str | Path, step: int, payload: dict[str, Any], *, keep: int = KEEP) -> Path:
    """Write ``payload`` as the state of ``step`` atomically, then drop all but the ``keep`` newest."""
    path = state_path(out, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "step": step, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    for _, old in saved_states(out)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by :func:`save_state` (tensors land on the CPU)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"saved state {str(path)!r} not found") from None
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file, whatever the unpickler says
        raise UserError(f"{path} is not a readable training state ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a training state of format {FORMAT}")
    return state


def clear_states(out: str | Path) -> int:
    """Remove every saved state under ``out`` (a fresh run starts); returns how many there were."""
    states = saved_states(out)
    for _, path in states:
        path.unlink(missing_ok=True)
    return len(states)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
