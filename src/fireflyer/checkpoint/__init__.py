"""Asynchronous, crash-consistent checkpoints (paper §VII-A).

:class:`CheckpointManager` snapshots a training state to host memory inside the step and
persists it in the background as safetensors shards plus a manifest, committed last.
"""

from fireflyer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from fireflyer.checkpoint.manager import CheckpointConfig, CheckpointManager, committed_steps
from fireflyer.checkpoint.state import load_into, rng_state, set_rng_state

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpoint",
    "NoCheckpoint",
    "committed_steps",
    "load_into",
    "rng_state",
    "set_rng_state",
]
