"""Asynchronous, crash-consistent checkpoints (paper §VII-A).

:class:`CheckpointManager` snapshots a training state to host memory inside the step and
persists it in the background as safetensors shards plus a manifest, committed last.
Loading one runs no code from it: the non-tensor part is JSON data, and the only pickle
it reads is an object whose class you allowlisted (:func:`allow`).
"""

from fireflyer.checkpoint.allowlist import AllowlistUnpickler, allow, disallow
from fireflyer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, UnsafeCheckpoint
from fireflyer.checkpoint.manager import CheckpointConfig, CheckpointManager, committed_steps
from fireflyer.checkpoint.state import load_into, rng_state, set_rng_state

__all__ = [
    "AllowlistUnpickler",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpoint",
    "NoCheckpoint",
    "UnsafeCheckpoint",
    "allow",
    "committed_steps",
    "disallow",
    "load_into",
    "rng_state",
    "set_rng_state",
]
